# Two user-facing targets:
#   make demo   train the bundled character-level GPT on 2 CPU processes
#   make test   run the test suite
# Both create .venv (if missing) and install the package with pinned constraints.

PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-torch lint clean

demo: $(STAMP)
	$(VPY) examples/train_gpt.py

test: $(STAMP)
	OMP_NUM_THREADS=1 $(VPY) -m pytest -q

# For developers: the TORCH_TESTS subset against another torch in its own environment, e.g.
#   make test-torch TORCH=2.7.1
# builds .venv-torch-2.7.1 once (that torch from the package index, the other pins from constraints.txt) and runs
# the subset there. See CONTRIBUTING.md.
TORCH       ?= 2.14.1
TORCH_VENV  := .venv-torch-$(TORCH)
TORCH_TESTS ?= tests/test_parity.py tests/test_tensor_parallel_engine.py tests/test_engine_api.py \
	tests/test_checkpoint.py tests/test_strategy.py tests/test_fabric.py tests/test_startup.py

test-torch: $(TORCH_VENV)/.installed
	OMP_NUM_THREADS=1 $(TORCH_VENV)/bin/python -m pytest -q $(TORCH_TESTS)

$(TORCH_VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/python -m pip install "torch==$(TORCH)"
	sed 's/^torch==.*/torch==$(TORCH)/' constraints.txt > $(TORCH_VENV)/constraints.txt
	$(TORCH_VENV)/bin/python -m pip install -c $(TORCH_VENV)/constraints.txt -e ".[test]"
	touch $@

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
