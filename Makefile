# The two commands the README promises: `make demo` and `make test`.
# Both create .venv when it is missing and install slipstream with the pinned
# versions of constraints.txt (torch named with its pin, so pip takes the CPU
# build from local disk instead of a multi-GB CUDA download).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.slipstream-installed
# the suite runs in this many pytest-xdist workers, one torch thread each (tests/conftest.py)
TEST_WORKERS ?= 2

.PHONY: demo test test-slow test-avx2 test-busy test-floor test-vllm test-gguf compat compile-check lint setup clean bench-packing

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt "torch==2.13.0" -e ".[dev,trl,qlora]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/slipstream ab

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks docs examples
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

# What `make test` leaves out (tests marked slow, multiprocess or realmodel: tens of seconds each),
# the whole-registry sweep and the compile checks among them.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --runslow -m "slow or multiprocess or realmodel"

# The default suite as on an AVX2-only, fp32-only CPU: slipstream's CPU probe overridden
# (SLIPSTREAM_CPU_CLASS, so `dtype: auto` is fp32) and torch's fp32 GEMMs held to AVX2 (MKL). On a CPU
# whose own probe says avx2, `make test` has just run exactly that: said, and not run twice.
test-avx2: $(STAMP)
	@if [ "$$($(BIN)/python -c 'from slipstream.hardware import probed_cpu_class; print(probed_cpu_class())')" = avx2 ]; \
	then echo "make test-avx2: this CPU is AVX2-only (slipstream.hardware's probe): make test ran the suite as on one"; \
	else SLIPSTREAM_CPU_CLASS=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 $(BIN)/python -m pytest -q -n $(TEST_WORKERS); fi

# The default suite on a busy machine, as users run it beside other work: two CPU-bound processes
# beside it for its whole length (.ci/busy.sh: stopped when it ends, however it ends). No test's
# outcome may depend on the machine's load (tests/conftest.py fakes the load probe for every test).
test-busy: $(STAMP)
	.ci/busy.sh $(BIN)/python -m pytest -q -n $(TEST_WORKERS)

# The default suite against the lowest versions pyproject.toml declares (constraints-floor.txt:
# transformers 5.17, the lent GPU's; peft, accelerate, datasets, trl, bitsandbytes at their floors),
# in a venv of its own; then the whole-registry sweep there (architectures that version lacks are
# listed as not installed, never failed).
FLOOR_VENV := .venv-floor
FLOOR_STAMP := $(FLOOR_VENV)/.slipstream-installed

$(FLOOR_STAMP): pyproject.toml constraints-floor.txt
	test -x $(FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install -q --upgrade pip
	$(FLOOR_VENV)/bin/python -m pip install -q -c constraints-floor.txt "torch==2.13.0" -e ".[dev,trl,qlora]"
	touch $(FLOOR_STAMP)

test-floor: $(FLOOR_STAMP)
	$(FLOOR_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS)
	$(FLOOR_VENV)/bin/python -m pytest -q --runslow tests/compat/test_compat.py -k whole_registry

# grpo.engine vllm against the real engine: vLLM's CPU build in a venv of its own, made once (minutes)
# and kept outside the checkout, so a fresh clone reuses it (SLIPSTREAM_VLLM_VENV to put it elsewhere)
VLLM_VENV ?= $(HOME)/.cache/slipstream-vllm

test-vllm: $(STAMP)
	bash src/slipstream/engines/make_vllm_venv.sh $(VLLM_VENV)
	SLIPSTREAM_VLLM_VENV=$(VLLM_VENV) $(BIN)/python -m pytest -q --runslow -m vllm tests/engines

# slipstream export --gguf read back by llama.cpp itself: llama-cpp-python built from its source once (several
# minutes; portable: no -march=native) and its wheel kept in ~/.cache/slipstream-wheels, like vLLM's venv; the
# source is kept too: its models/ggml-vocab-*.gguf are real tokenizers with llama.cpp's own expected tokens, and its
# convert_hf_to_gguf.py makes the reference files the export is judged against (export --llama-cpp-source)
LLAMA_CPP_WHEELS ?= $(HOME)/.cache/slipstream-wheels
LLAMA_CPP_SDIST = $(LLAMA_CPP_WHEELS)/llama_cpp_python-0.3.36.tar.gz
test-gguf: $(STAMP)
	ls $(LLAMA_CPP_SDIST) >/dev/null 2>&1 || $(BIN)/python -m pip download -q --no-deps --no-binary :all: \
		llama-cpp-python==0.3.36 -d $(LLAMA_CPP_WHEELS)
	ls $(LLAMA_CPP_WHEELS)/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1 || CMAKE_ARGS="-DGGML_NATIVE=OFF" \
		$(BIN)/python -m pip wheel -q --no-deps $(LLAMA_CPP_SDIST) -w $(LLAMA_CPP_WHEELS)
	$(BIN)/python -m pip install -q $(LLAMA_CPP_WHEELS)/llama_cpp_python-0.3.36-*.whl sentencepiece==0.2.3  # the converter's
	SLIPSTREAM_LLAMA_CPP_SDIST=$(LLAMA_CPP_SDIST) $(BIN)/python -m pytest -q --runslow -m llamacpp tests/export

# Every causal LM transformers registers, packed vs each document alone (~2 min on 2 cores).
compat: $(STAMP)
	$(BIN)/python -m pytest -q --runslow tests/compat/test_compat.py -k whole_registry

compile-check: $(STAMP)  # inductor builds: the regional compile's and the fused kernels' parity (slow)
	$(BIN)/python -m pytest -q --runslow tests/compile/test_regional.py -k compile_once
	$(BIN)/python -m pytest -q --runslow tests/fused/test_compiled.py -k inductor

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks docs examples
	$(BIN)/ruff format --check src tests benchmarks

bench-packing: $(STAMP)
	$(BIN)/python benchmarks/packing.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
