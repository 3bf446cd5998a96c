"""Does --batch-invariant make CUDA an exact path, and what does it cost? (a probe, run on the GPU)

A random SmolLM2-135M-shaped model (tools.bench.random_model), fp32 and bf16, with and without
batch_invariant (every matmul padded to 32 rows, attention row by row: engine/fast/packed.py):
- rows_round_alike: the CLI's probe of a machine's kernels;
- margin: plain's one-row logits against the same tokens' logits from 8-row forwards (0 = exact);
- every decoder's tokens against plain's, greedy and seeded at T=0.8 (contrastive greedy only:
  sampled, it keeps its own law, p_CD) (a random model's logits are near-uniform, so
  near-ties are common: a hard test of exactness);
- decode tok/s of plain and lookahead W5 N4 G5, each configuration in interleaved rounds.
"""
import json, sys, time
import torch
sys.path.insert(0, ".")
from tools.bench import random_model
from tools.exact import margin
from engine.decoders import DECODERS
from engine.draft import SelfDraft
from engine.generate import Stats, generate
from engine.fast.invariant import rows_round_alike
from engine.fast.packed import prepack
from engine.sampling import Random, Sampler

RUNS = {"plain": ("plain", (), {}), "lookahead W5 N4 G5": ("lookahead", (), dict(window=5, ngram=4, guesses=5)),
        "lookup K8": ("lookup", (), {}), "speculative layers:20 K4 coupled": ("speculative", (SelfDraft(20),), dict(num_draft=4, verify="coupled")),
        "contrastive beta0 spec K3": ("contrastive", (8,), dict(beta=0.0, speculative=True, num_draft=3))}


def run(model, name, prompt, n, temperature=0.0):
    dec, second, knobs = RUNS[name]
    stats = Stats()
    steps = DECODERS[dec].decode(model, *second, prompt, sampler=Sampler(temperature), rng=Random(1),
                                 max_new_tokens=n, **knobs)
    out = list(generate(steps, max_new_tokens=n, eos_ids=set(), stats=stats))
    return out, stats


out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": []}
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, 49152, (100,), generator=g).tolist() for _ in range(2)]
for dtype in (torch.float32, torch.bfloat16):
    for bi in (True, False):
        m = prepack(random_model(device="cuda", dtype=dtype), batch_invariant=bi)
        r = {"dtype": str(dtype), "batch_invariant": bi, "rows_round_alike": rows_round_alike(m)}
        r["margin"] = margin(m, {f"p{i}#0": p[:60] for i, p in enumerate(prompts)}, 24, rows=8)
        for temp in (0.0, 0.8):
            base = [run(m, "plain", p, 32, temp)[0] for p in prompts]
            r[f"same_as_plain_T{temp}"] = {name: sum(run(m, name, p, 32, temp)[0] == b for p, b in zip(prompts, base))
                                          for name in RUNS if name != "plain" and (temp == 0 or "contr" not in name)}
        print(json.dumps(r), flush=True)
        out["results"].append(r)
# speed: interleaved rounds, 64 greedy tokens after a 100-token prompt
speed = {}
models = {(str(dt), bi): prepack(random_model(device="cuda", dtype=dt), batch_invariant=bi)
          for dt in (torch.float32, torch.bfloat16) for bi in (True, False)}
for rnd in range(2):
    for (dt, bi), m in models.items():
        for name in ("plain", "lookahead W5 N4 G5"):
            torch.cuda.synchronize()
            _, st = run(m, name, prompts[0], 64)
            speed.setdefault(f"{dt} bi={bi} {name}", []).append(round(st.decode_tokens_per_second, 1))
print(json.dumps(speed, indent=1))
out["decode_tok_s_rounds"] = speed
json.dump(out, open(sys.argv[1], "w"), indent=1)
