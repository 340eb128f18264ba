# The two commands a newcomer runs: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q "torch==2.13.0" || $(PY) -m pip install -q "torch>=2.11,<2.15" --index-url https://download.pytorch.org/whl/cpu
	$(PY) -m pip install -q -e ".[test,lora,qlora]"
	# The C++ kernels, compiled once into ~/.cache/meshlab (else on first use); a machine
	# without a compiler runs each op's PyTorch reference, and `meshlab check` says so.
	$(VENV)/bin/meshlab build || echo "meshlab build failed (above): the ops run their references"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/meshlab demo

test: install
	$(PY) -m pytest -q -x --timeout=600 --durations=20 --doctest-modules meshlab tests
	# One kernel at a time: kernels started side by side can draw the same port and die at
	# start ("Kernel died before replying to kernel_info"); in series they take as long.
	$(PY) -m pytest -q --nbmake --nbmake-timeout=600 notebooks

# The fast tier, for edits: every test recorded under half a second in tests/durations.json
# that starts no processes (about 1,200 of the suite's 1,700 tests; 85 s on 2 cores).
test-fast: install
	$(PY) -m pytest -q -x --timeout=300 -m "not slow and not gpu" --doctest-modules meshlab tests

# Refresh tests/durations.json (commit it) after adding tests.
durations: install
	$(PY) -m pytest -q --timeout=600 --doctest-modules --record-durations meshlab tests

.PHONY: install demo test test-fast durations
