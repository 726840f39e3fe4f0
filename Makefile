# Thin wrappers: each target does its own set-up (scripts/setup.sh is idempotent).
PY := .venv/bin/python
PROMPT ?= What is the largest ocean on Earth?

.PHONY: setup chat serve test test-slow lint docs bench

setup:
	@bash scripts/setup.sh

chat: setup
	.venv/bin/tokenmill chat "$(PROMPT)"

serve: setup
	.venv/bin/tokenmill serve

test: setup
	$(PY) -m pytest -q -m "not slow and not gpu"

test-slow: setup
	$(PY) -m pytest -q -m "slow and not gpu" || [ $$? -eq 5 ]

lint: setup
	.venv/bin/ruff check . && .venv/bin/ruff format --check . && .venv/bin/mypy

docs: setup
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict

bench: setup
	.venv/bin/tokenmill bench batching
