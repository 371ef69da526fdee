# The two commands of README.md. Both do all set-up first (scripts/setup.sh, idempotent).
.PHONY: setup demo test docs

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/kvobs demo --out $(or $(OUT),out/demo)

test: setup
	bash scripts/test.sh

docs:
	.venv/bin/python -m kvobs.catalogue docs
