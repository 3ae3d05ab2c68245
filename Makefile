# The two set-up commands. Both create (or reuse) .venv and install what they need.
#   make quickstart   a real GRPO run on a tiny model built locally, on CPU
#   make test         the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: venv quickstart test
venv:
	@bash scripts/setup_env.sh

quickstart: venv
	@$(PY) -m megarl.quickstart $(ARGS)

test: venv
	@bash scripts/run_tests.sh $(ARGS)
