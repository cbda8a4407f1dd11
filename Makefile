# The README's commands. `make test` is what CI runs (.ci/run).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test bench lint clean chromium

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# LLAMASWAP_ADMIN_PASSWORD=... make run creates (or updates) the admin account
# LLAMASWAP_ADMIN_USER (default admin); without it, ensure-admin says whether one exists
# and how to make one. `llamaswap` is the console script `make install` puts in .venv/bin.
run: install
	$(BIN)/llamaswap migrate --noinput
	$(BIN)/llamaswap ensure-admin
	$(BIN)/llamaswap serve --config config.example.yaml --listen 127.0.0.1:8080

# The browser test drives Debian's chromium with Playwright; never a downloaded browser.
chromium:
	@test -x /usr/bin/chromium || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }

test: install chromium
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: install
	$(BIN)/python -m bench

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# The end-to-end suite against llama.cpp's real llama-server (scripts/real-llama/README.md).
# Not part of `make test`: the first run compiles llama-server (~10 min on 2 cores, cached
# in ~/.cache/llamaswap-e2e, or LLAMASWAP_E2E_CACHE); later runs reuse it.
.PHONY: e2e
e2e: install
	@out="$$(scripts/real-llama/build.sh)" && eval "$$(printf '%s\n' "$$out" | tail -n 2)" && \
	export LLAMASWAP_E2E_LLAMA_SERVER LLAMASWAP_E2E_MODELS && \
	echo "llama-server: $$LLAMASWAP_E2E_LLAMA_SERVER  models: $$LLAMASWAP_E2E_MODELS" && \
	$(BIN)/python -m pytest -q e2e/ $(PYTEST_ARGS)
