# What CI runs, piece by piece. `make ci` is exactly .ci/run.
.PHONY: install test fast lint ci slurm-up slurm-down

install:
	pip install -e ".[test]"

test:
	python -m pytest

fast:  # no multi-process runs, no Slurm
	python -m pytest -m "not slow and not slurm"

lint:
	ruff check src tests examples && ruff format --check src tests examples

ci:
	bash .ci/run

slurm-up:
	bash tests/slurm/cluster.sh start

slurm-down:
	bash tests/slurm/cluster.sh stop
