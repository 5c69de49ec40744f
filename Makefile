# Two user-facing targets:
#   make demo   train the bundled character-level GPT on 2 CPU processes
#   make test   run the test suite
# Both create .venv (if missing) and install the package with pinned constraints.

PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint clean

demo: $(STAMP)
	$(VPY) examples/train_gpt.py

test: $(STAMP)
	OMP_NUM_THREADS=1 $(VPY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check lightning_shard tests examples

# Create the virtual environment once.
$(VPY):
	$(PYTHON) -m venv $(VENV)

# (Re)install only when the packaging metadata or the pins change.
$(STAMP): pyproject.toml constraints.txt | $(VPY)
	$(VPY) -m pip install -c constraints.txt -e ".[test]"
	touch $@

clean:
	rm -rf build dist *.egg-info lightning_logs checkpoints .pytest_cache .ruff_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +
