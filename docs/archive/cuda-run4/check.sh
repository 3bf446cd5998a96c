#!/bin/bash
# Second call of the fourth GPU session: the real weights (the GGUF's two pieces, the first left
# in /root/w by the first call), then --batch-invariant through the CLI and tools.exact on CUDA.
set -u; OUT=$1; export PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/ec
cat /root/w/part.aa .gpu/b/part.ab > /root/w/g.gguf
sha256sum /root/w/g.gguf | grep -q b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 || { echo bad sha; exit 1; }
PYTHONPATH=.gpu/b/site timeout 120 python3 -m tools.convert convert /root/w/g.gguf /root/w/ck > "$OUT/convert.log" 2>&1
echo "convert rc=$?"
P="Explain in two sentences why the sky is blue."
for run in "float32|" "bfloat16|" "float32|--temperature 0.8 --seed 3" "bfloat16|--no-batch-invariant"; do
  dt=${run%%|*}; extra=${run#*|}
  for a in "--decoder plain" "--decoder lookahead" "--decoder lookahead --window 5 --ngram 4 --guesses 5" \
           "--decoder lookup" "--decoder speculative --num-draft 4 --verify coupled" "--decoder contrastive --beta 0 --speculative"; do
    [ -n "$extra" ] && [ "$a" = "--decoder contrastive --beta 0 --speculative" ] && continue
    bi=--batch-invariant; [ "$extra" = "--no-batch-invariant" ] && bi=
    timeout 60 python3 -m engine.run --device cuda --checkpoint /root/w/ck --dtype $dt $bi $extra \
      --max-new-tokens 32 --prompt "$P" --json $a > "$OUT/r.json" 2> "$OUT/r.err"
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], '| exact_path', r['exact_path'], '| tokens', hash(tuple(r['tokens'])), '| decode tok/s', round(r['decode_tokens_per_second'], 1), '|', r['tokens_per_forward'])" "$OUT/r.json" "$dt $bi $extra $a" || tail -2 "$OUT/r.err"
  done
done 2>&1 | tee "$OUT/cli.txt"
timeout 200 python3 -m tools.exact --device cuda --checkpoint /root/w/ck --paths bf16,fp32 --quick --max-new-tokens 32 \
  --out "$OUT" > "$OUT/exact.log" 2>&1
echo "exact rc=$?"; tail -30 "$OUT/exact.log"
