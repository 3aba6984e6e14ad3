# FreshRec services image: one image, the command picks the service.
FROM python:3.11-slim
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
WORKDIR /app
# Same pin as pyproject.toml; on x86_64 PyPI serves the CUDA build of torch 2.13.0, and a
# CPU-only image can add --index-url for the CPU wheel at build time.
COPY pyproject.toml README.md ./
COPY freshrec ./freshrec
COPY freshcore ./freshcore
COPY schemas ./schemas
COPY streams ./streams
COPY inference ./inference
COPY param_server ./param_server
COPY evaluation ./evaluation
RUN pip install --no-cache-dir .
# The CUDA caching allocator, where a worker runs on a GPU (seed B: cap the size of blocks it
# splits, so that a long-running process does not fragment the device's memory; collect
# cached blocks before the device fills). docs/operations.md, "GPUs".
ENV PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128,garbage_collection_threshold:0.8
RUN useradd --create-home freshrec
USER freshrec
ENTRYPOINT ["freshrec"]
CMD ["--help"]
