# The README's commands. `make test` is what CI runs (.ci/run).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
UV := $(VENV)/.uv/bin/uv
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run
LISTEN ?= 127.0.0.1:8080

.PHONY: install install-run run test test-services bench lint clean chromium

# uv (from PyPI, kept inside the venv) installs in seconds what pip takes half a minute
# for; no bytecode is compiled at install: each module is compiled when first imported and
# cached (`run` lets Python write the cache even where PYTHONDONTWRITEBYTECODE is set).
# pip is installed into the venv as well, for whoever wants `.venv/bin/pip`.
UV_PIP := install -q --disable-pip-version-check --no-deps --no-compile --target $(VENV)/.uv uv

$(UV):
	$(PY) -m pip $(UV_PIP) || { $(PY) -m venv $(VENV)/.uv-pip && $(VENV)/.uv-pip/bin/pip $(UV_PIP); }

$(BIN)/python: | $(UV)
	$(PY) -m venv --without-pip $(VENV)

# `make run` needs only the runtime dependencies; `make test` (and bench, lint, e2e) the
# dev extras as well.
$(RUN_STAMP): $(BIN)/python pyproject.toml
	$(UV) pip install -q --python $(BIN)/python -e . pip
	touch $(RUN_STAMP)

# The test install compiles bytecode: the suite starts hundreds of server and model
# subprocesses, and where PYTHONDONTWRITEBYTECODE is set (this workplace, CI) each would
# otherwise compile Django and the rest from source at every start (13-14 min against 9).
$(STAMP): $(BIN)/python pyproject.toml
	$(UV) pip install -q --compile-bytecode --python $(BIN)/python -e '.[dev]' pip
	touch $(STAMP)

install: $(STAMP)

install-run: $(RUN_STAMP)

# LLAMASWAP_ADMIN_PASSWORD=... make run creates (or updates) the admin account
# LLAMASWAP_ADMIN_USER (default admin); without it, ensure-admin says whether one exists
# and how to make one. `llamaswap` is the console script `make install` puts in .venv/bin.
run: export PYTHONDONTWRITEBYTECODE :=
run: install-run
	$(BIN)/llamaswap migrate --noinput
	$(BIN)/llamaswap ensure-admin
	$(BIN)/llamaswap serve --config config.example.yaml --listen $(LISTEN)

# The browser test drives Debian's chromium with Playwright; never a downloaded browser.
chromium:
	@test -x /usr/bin/chromium || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }

PACKAGES := fakellm scheduler activity control web fleet proxy dashboard llamaswap_site tests

test: install chromium
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m compileall -q -j 2 $(PACKAGES)
	$(BIN)/python -m pytest -q -m "not services" $(PYTEST_ARGS)

# The end-to-end suites against other programs: the differential test against llama-swap's
# own binary, and fleets of nodes on the machine's PostgreSQL and Redis (each skips, saying
# why, where its program is absent). CI (.ci/run) runs them after `make test`.
test-services: install
	$(BIN)/python -m compileall -q -j 2 $(PACKAGES)
	$(BIN)/python -m pytest -q -m services $(PYTEST_ARGS)

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
