# FreshRec services image: one image, the command picks the service.
FROM python:3.11-slim
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
WORKDIR /app
# Same pin as pyproject.toml; on x86_64 PyPI serves the CUDA build of torch 2.13.0, and a
# CPU-only image can add --index-url for the CPU wheel at build time.
COPY pyproject.toml README.md ./
COPY freshrec ./freshrec
COPY schemas ./schemas
COPY streams ./streams
COPY inference ./inference
COPY param_server ./param_server
COPY evaluation ./evaluation
COPY tools ./tools
RUN pip install --no-cache-dir .
RUN useradd --create-home freshrec
USER freshrec
ENTRYPOINT ["freshrec"]
CMD ["--help"]
