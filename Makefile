# The two set-up commands. Both create (or reuse) .venv and install what they need.
#   make quickstart   a real GRPO run on a tiny model built locally, on CPU
#   make test         the whole test suite but the long learning curves (CI runs it)
#   make test-all     the whole test suite with the long learning curves (marker "curve")
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: venv quickstart test test-all
venv:
	@bash scripts/setup_env.sh

quickstart: venv
	@$(PY) -m megarl.run.quickstart $(ARGS)

test: venv
	@bash scripts/run_tests.sh -m "not curve" $(ARGS)

test-all: venv
	@bash scripts/run_tests.sh $(ARGS)
