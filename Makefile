# The two commands a new user runs (each sets itself up first):
#   make run    install, then generate text with the default model (SmolLM2-135M-Instruct)
#   make test   install with the test tools, then run the whole test suite
PROMPT ?= Write a haiku about paged memory.

.PHONY: run test setup setup-test bench-cpu

setup:
	@scripts/setup.sh run

setup-test:
	@scripts/setup.sh test

run: setup
	.venv/bin/lmserve generate --chat "$(PROMPT)" --max-tokens 64

test: setup-test
	.venv/bin/python -m pytest -q -rs --durations=25 -n 2 --dist loadfile tests  # two workers, a module each (tests/conftest.py splits the cores)

bench-cpu: setup-test
	scripts/bench_cpu.sh
