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
