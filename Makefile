# The two commands: `make run` and `make test`. Both create or update .venv, install, then work.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARGS   ?=
# The suite runs on this many pytest-xdist workers, each with its own embedded broker and Redis:
# most of a test is waiting on a broker or a child process, so two keep two cores busy.
TEST_WORKERS ?= 2

.PHONY: run test lint format clean stack-down kafka-jars chromium prometheus

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

run: $(STAMP) kafka-jars
	$(BIN)/freshrec run $(ARGS)

test: $(STAMP) kafka-jars chromium prometheus
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) $(ARGS)

# The broker of `make run` and `make test`: Apache Kafka where Java 17+ and Maven are found, its
# pinned jars fetched here once into ~/.cache/freshrec/kafka (Maven, checksums verified; no
# test downloads anything), else Tansu. The first line printed says which broker runs and why.
# FRESHREC_BROKER=tansu (or kafka) picks one.
kafka-jars: $(STAMP)
	@$(BIN)/freshrec stack fetch

# The dashboard test renders the page in Debian's headless Chromium. Installed with apt when
# missing and this user may (root, or sudo without a password); otherwise the test says how.
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else \
	    echo "chromium missing and apt needs root: the dashboard test will fail (apt-get install chromium)"; exit 0; fi; \
	  echo "installing Debian's chromium for the dashboard test"; \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; }; }

# The alerting tests run Debian's promtool and a real Prometheus. Without them on PATH, the
# package is fetched (apt-get download: no root, no service started) and unpacked into the
# virtualenv; where that fails the tests are skipped and say why.
PROM_DIR := $(VENV)/prometheus
prometheus:
	@command -v promtool >/dev/null 2>&1 || test -x $(PROM_DIR)/usr/bin/promtool || { \
	  echo "fetching Debian's prometheus package into $(PROM_DIR) for the alerting tests"; \
	  tmp=$$(mktemp -d); chmod 755 $$tmp; \
	  ( cd $$tmp && { apt-get download prometheus >/dev/null 2>&1 || \
	    { [ "$$(id -u)" = 0 ] && apt-get update -q >/dev/null && apt-get download prometheus >/dev/null 2>&1; }; } ) && \
	  dpkg -x $$tmp/prometheus_*.deb $(PROM_DIR); rm -rf $$tmp; \
	  test -x $(PROM_DIR)/usr/bin/promtool || echo "WARNING: could not fetch prometheus (apt-get download prometheus): the alerting tests will be skipped"; }

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

stack-down: $(STAMP)
	$(BIN)/freshrec stack down

clean:
	rm -rf $(VENV) .freshrec *.egg-info
