#!/bin/bash
# The GPU checks of docs/cuda.md, in two timed parts (a lent GPU takes the 98 MB GGUF in two
# calls, so the first part needs no checkpoint):
#
#   bash tools/cuda_check.sh tests OUT [PYTHON]        # the decoders' property tests on the GPU
#                                                      # (make test-cuda's), the attention kernels'
#                                                      # step cost (tools.cuda_attention): ~1.5 min
#   bash tools/cuda_check.sh CHECKPOINT OUT [PYTHON]   # every decoder through the CLI against plain,
#                                                      # every decoder against plain on the bench
#                                                      # prompts (tools.exact), the speed tables: about 8 min
#
# Each part has its own time limit, so a slow part costs its limit, not the run. Results:
# OUT/log.txt, OUT/pytest.txt, OUT/attention/, OUT/exact/, OUT/bench-*/.
set -u
CK=$1; OUT=$2; PY=${3:-python3}; N=32; L=$OUT/log.txt
$PY -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null || { echo "error: no CUDA device here" >&2; exit 2; }
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/engine-cuda-check}
{ date; nvidia-smi -L; $PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"; } >> "$L" 2>&1
if [ "$CK" = tests ]; then
  ENGINE_TEST_DEVICE=cuda timeout 150 $PY -m pytest -q -p no:cacheprovider -rf tests/test_lookahead.py \
    tests/test_lookup.py tests/test_speculative.py tests/test_contrastive.py tests/test_generate.py \
    tests/test_llama.py::test_every_layer_attends_inside_the_kernel_choice_for_the_forwards_device \
    tests/test_invariant.py::test_batch_invariant_verify_rows_get_plains_one_row_logits_on_the_tests_device \
    tests/test_packed.py::test_padded_matmuls_round_a_row_alike_at_every_row_count \
    tests/test_packed.py::test_batch_invariant_pads_every_matmul_on_cuda_and_is_refused_elsewhere_off_the_cpu \
    > "$OUT/pytest.txt" 2>&1
  echo "pytest rc=$?" >> "$L"
  timeout 150 $PY -m tools.cuda_attention --out "$OUT/attention" >> "$L" 2>&1
  echo "attention rc=$?" >> "$L"; date >> "$L"
  exit 0
fi
P="Explain in two sentences why the sky is blue."
{
  date +"%T the CLI"
  for a in "--decoder plain" "--decoder lookahead" "--decoder lookahead --window 5 --ngram 4 --guesses 5" \
           "--decoder lookup" "--decoder speculative --num-draft 4" "--decoder contrastive --beta 0 --speculative" \
           "--decoder plain --dtype bfloat16" "--decoder lookahead --dtype bfloat16" \
           "--decoder speculative --dtype bfloat16 --num-draft 4" \
           "--decoder plain --temperature 0.8 --seed 3" "--decoder lookahead --temperature 0.8 --seed 3" \
           "--decoder speculative --verify coupled --temperature 0.8 --seed 3"; do
    timeout 60 $PY -m engine.run --device cuda --checkpoint "$CK" --max-new-tokens $N --prompt "$P" --json $a \
      > "$OUT/run.json" 2> "$OUT/run.err"
    echo "rc=$? $a"; tail -1 "$OUT/run.err"
    $PY -c "import json, sys; r = json.load(open(sys.argv[1])); print(' ', r['decode_tokens_per_second'], r['tokens'])" \
      "$OUT/run.json" 2>&1 | tail -1
  done
  rm -f "$OUT/run.json" "$OUT/run.err"
} >> "$L" 2>&1
date +"%T tools.exact" >> "$L"
timeout 320 $PY -m tools.exact --device cuda --checkpoint "$CK" --paths bf16,fp32 --quick \
  --max-new-tokens $N --out "$OUT/exact" >> "$L" 2>&1
echo "exact rc=$?" >> "$L"
for dt in float32 bfloat16; do
  date +"%T bench $dt" >> "$L"
  timeout 100 $PY -m tools.bench --device cuda --checkpoint "$CK" --dtype $dt --quick --rounds 1 \
    --configs "lookahead W15 N5 G15,lookahead auto,lookup,plain again" --out "$OUT/bench-$dt" >> "$L" 2>&1
  echo "bench $dt rc=$?" >> "$L"
done
date >> "$L"
