# The two set-up commands. Both create (or reuse) .venv and install what they need.
#   make quickstart   a real GRPO run on a tiny model built locally, on CPU
#   make test         the whole test suite but the long learning curves (CI runs it)
#   make test-all     the whole test suite with the long learning curves (marker "curve")
#   make docs         serve the docs site (mkdocs.yml, docs/) on http://127.0.0.1:$(DOCS_PORT)
VENV ?= .venv
DOCS_PORT ?= 8000
PY := $(VENV)/bin/python

.PHONY: venv quickstart test test-all docs
venv:
	@bash scripts/setup_env.sh

quickstart: venv
	@$(PY) -m megarl.run.quickstart $(ARGS)

test: venv
	@bash scripts/run_tests.sh -m "not curve" $(ARGS)

test-all: venv
	@bash scripts/run_tests.sh $(ARGS)

docs: venv
	@$(VENV)/bin/mkdocs serve -a 127.0.0.1:$(DOCS_PORT)
