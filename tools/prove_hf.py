"""HF transformers' assisted generation end to end, certified black-box (tools/prove.py).

Where tests/test_prove_hf.py feeds `_speculative_sampling` explicit p and q, this drives the
whole `generate(assistant_model=..., do_sample=True)` path, which also computes the candidate
and target logits and applies the logits processors to them: two tiny random HF Llamas
(vocabulary 4, target 3 layers, assistant 1 layer). The target law is computed from the
target's own full forwards through the same processors (engine.sampling.Sampler: temperature,
then top-k, then top-p, HF's LogitsProcessorList order). One generate() per sample (batch 1 is
all assisted generation takes), ~10-30 ms each.

The default run: two new tokens at one temperature, no top-k or top-p. HF drafts
min(num_assistant_tokens, max_length - cur_len - 1) tokens a step, and it reads those knobs
from the assistant's own generation_config (20, and a confidence threshold of 0.4), not the
call's, so with two new tokens the first step drafts one token and the second none. `--grid`
drafts two on its first step: three new tokens (the two drafts and the bonus are all checked),
the assistant set to 2 drafts and no threshold, over temperature x top-k x top-p, one verdict
row each. `--plant` certifies, on the same grid and through the same generate() path, a lossy
assistant that draws its drafts from the processed law but declares its raw logits as q; its
exact law (`assisted_law`) gives the TV it plants.

    python -m tools.prove_hf --samples 20000 [--temperature 0.8] [--json]
    python -m tools.prove_hf --grid --samples 5000 [--plant] [--json]
"""
from __future__ import annotations

import json
import sys
import warnings
from dataclasses import asdict

import torch

from engine.sampling import Sampler
from tools.cli import Parser, first
from tools.exact_law import reference_law
from tools.prove import certify_samples, detects, table

V, PROMPT = 4, [1, 3, 0]
# the grid: what people run (HF's default top-k is 50), and top-k 2 and 3, which bite on V = 4
TEMPERATURES, TOP_KS, TOP_PS = (1.0, 0.8), (0, 2, 3, 50), (1.0, 0.9)
GRID = tuple(Sampler(t, k, p) for t in TEMPERATURES for k in TOP_KS for p in TOP_PS)
GRID_TOKENS, GRID_DRAFTS = 3, 2      # a first step of 2 drafts + its bonus; then what is left


def tiny_hf_llama(seed: int, layers: int, cls=None):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = (cls or LlamaForCausalLM)(cfg).eval()
    with torch.no_grad():   # HF's init (std 0.02) gives a near-uniform law; sharpen the logits
        model.lm_head.weight.mul_(10)
    return model


def planted_assistant(seed: int = 6, layers: int = 1):
    """The assistant with the bug class "declared q != sampled q": each draft is drawn from the
    processed law (the call's logits processors, applied once to a full forward's logits), but
    the candidate logits it hands back, which HF's acceptance reads as q, are the raw ones. The
    same weights as the honest assistant; lossless only where the processors change nothing."""
    from types import SimpleNamespace

    from transformers import LlamaForCausalLM

    class DeclaresRawQ(LlamaForCausalLM):
        def generate(self, input_ids=None, max_new_tokens=1, logits_processor=(), **_):
            ids, raw = input_ids, []
            for _ in range(max_new_tokens):
                logits = self(ids).logits[:, -1].float()                               # (1, V)
                drawn = logits.clone()
                for process in logits_processor:                   # temperature, top-k, top-p
                    drawn = process(ids, drawn)
                x = torch.multinomial(torch.softmax(drawn, -1), 1)                      # (1, 1)
                raw.append(logits)
                ids = torch.cat([ids, x], -1)
            # the candidate generator reads the drafts, q (from .scores) and the draft's cache
            return SimpleNamespace(sequences=ids, scores=tuple(raw), cache=None)

    return tiny_hf_llama(seed, layers, DeclaresRawQ)


def logits_of(model):
    """prefix -> (V,) float64 logits after PROMPT + prefix, from a full forward (memoized)."""
    memo = {}

    def at(prefix: tuple) -> torch.Tensor:
        if prefix not in memo:
            with torch.no_grad():
                memo[prefix] = model(torch.tensor([PROMPT + list(prefix)])).logits[0, -1].double()
        return memo[prefix]
    return at


def law(model, sampler: Sampler, n: int) -> dict:
    """The plain sampler's law of n new tokens: prod_t sampler.probs(logits(x_<t))."""
    at = logits_of(model)
    return reference_law(lambda prefix: sampler.probs(at(prefix)), n)


def target_law(target, t: float) -> dict:
    return law(target, Sampler(t), 2)


def assisted_law(target, assistant, sampler: Sampler, n: int, drafts: int, declared: str = "processed") -> dict:
    """The exact law of n new tokens under HF's assisted sampling with the planted assistant, as
    a model: each step drafts K = min(drafts, n - emitted - 1) tokens from q, then
        accept x_i with prob min(1, p_i(x_i) / q'_i(x_i)); on the first rejection emit
        y ~ norm(max(0, p_i - q'_i)); if all K pass, a bonus y ~ p_K;  K = 0: y ~ p
    (Leviathan et al.'s chain, as transformers' _speculative_sampling does it). p is the target's
    processed law, q the assistant's (the plant draws from it), q' the declared law: q itself
    ("processed", lossless: this is then the target's law) or softmax(raw logits) ("raw")."""
    p_at, q_at, out = logits_of(target), logits_of(assistant), {}
    p = lambda c: sampler.probs(p_at(c))                                    # noqa: E731
    q = lambda c: sampler.probs(q_at(c))                                    # noqa: E731
    q_declared = q if declared == "processed" else lambda c: torch.softmax(q_at(c), -1)

    def emit(seq: tuple, mass: float):
        if len(seq) == n:
            out[seq] = out.get(seq, 0.0) + mass
            return
        K = min(drafts, n - len(seq) - 1)
        if K == 0:
            for y, py in enumerate(p(seq).tolist()):
                if py > 0:
                    emit(seq + (y,), mass * py)
            return
        draft(seq, mass, K)

    def draft(ctx: tuple, mass: float, left: int):
        """The step's drafts so far all accepted (they end ctx); `left` still to draft and check."""
        if left == 0:                                                      # all passed: the bonus
            for y, py in enumerate(p(ctx).tolist()):
                if py > 0:
                    emit(ctx + (y,), mass * py)
            return
        pc, qc, dc = p(ctx), q(ctx), q_declared(ctx)
        residual = (pc - dc).clamp(min=0)
        for x, qx in enumerate(qc.tolist()):
            if qx == 0:
                continue
            accept = min(1.0, float(pc[x] / dc[x]))
            if accept > 0:
                draft(ctx + (x,), mass * qx * accept, left - 1)
            if accept < 1:                                                 # rejected: the residual
                for y, ry in enumerate((residual / residual.sum()).tolist()):
                    if ry > 0:
                        emit(ctx + (y,), mass * qx * (1 - accept) * ry)

    emit((), 1.0)
    return out


def tv(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(s, 0.0) - b.get(s, 0.0)) for s in set(a) | set(b))


def label(s: Sampler) -> str:
    bite = "" if not s.top_k else " (bites)" if s.top_k < V else f" (>= V = {V}: no-op)"
    return f"t={s.temperature:g} top-k={s.top_k}{bite} top-p={s.top_p:g}"


def config(s: Sampler, n: int):
    from transformers import GenerationConfig
    return GenerationConfig(do_sample=True, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                            max_new_tokens=n, min_new_tokens=n, pad_token_id=0, eos_token_id=None)


def draws(target, assistant, gc, N: int, seed: int) -> torch.Tensor:
    """N runs of generate(assistant_model=...) -> (N, n) new tokens, torch's RNG seeded once."""
    torch.manual_seed(seed)
    rows, prompt = [], torch.tensor([PROMPT])
    # subtle: without an explicit mask generate() infers one from pad_token_id, masking the
    # prompt's token 0, and then samples another law than the target's (our first run failed so)
    mask = torch.ones_like(prompt)
    with torch.no_grad():
        for _ in range(N):
            out = target.generate(prompt, attention_mask=mask, assistant_model=assistant, generation_config=gc)
            rows.append(out[0, len(PROMPT):].tolist())
    return torch.tensor(rows)


def pair(plant: bool = False):
    """The grid's target and assistant (or the plant), the assistant set to draft GRID_DRAFTS
    a step with no early stop: HF reads both from the assistant's config, not the call's."""
    target = tiny_hf_llama(5, 3)
    assistant = planted_assistant() if plant else tiny_hf_llama(6, 1)
    assistant.generation_config.num_assistant_tokens = GRID_DRAFTS
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0
    return target, assistant


def setting(target, assistant, s: Sampler, N: int, seed: int, plant: bool = False):
    """(verdict, samples (N, GRID_TOKENS)) at one processor setting: generate()'s tokens against
    the target's processed law; for the plant, its exact TV from that law in the note."""
    from transformers import __version__
    want = law(target, s, GRID_TOKENS)
    samples = draws(target, assistant, config(s, GRID_TOKENS), N, seed)
    who = "planted raw-q assistant" if plant else f"HF {__version__}"
    v = certify_samples(f"{who}, K={GRID_DRAFTS}, {label(s)}", samples, want, V)
    if plant:
        planted = assisted_law(target, assistant, s, GRID_TOKENS, GRID_DRAFTS, "raw")
        v.note = f"planted TV {tv(planted, want):.3f} (exact)"
    return v, samples


def grid(N: int, seed: int = 0, plant: bool = False, samplers=GRID) -> list:
    """One verdict per processor setting (setting i seeded seed + i)."""
    target, assistant = pair(plant)
    return [setting(target, assistant, s, N, seed + i, plant)[0] for i, s in enumerate(samplers)]


def main(argv=None) -> int:
    ap = Parser(prog="python -m tools.prove_hf", description=first(__doc__, "\n\n"))
    ap.add_argument("--samples", type=int, default=None, help="N per setting (default 20,000; --grid 5,000)")
    ap.add_argument("--temperature", type=float, default=None, help="default 1 (--grid sets its own)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grid", action="store_true", help=f"certify over temperature {TEMPERATURES} x top-k "
                    f"{TOP_KS} x top-p {TOP_PS}: {GRID_TOKENS} new tokens, the first step's "
                    f"{GRID_DRAFTS} drafts and its bonus")
    ap.add_argument("--plant", action="store_true", help="with --grid: certify the planted lossy assistant "
                    "(drafts from the processed law, declares the raw-logit q) instead of HF's")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    a.samples = a.samples if a.samples is not None else 5_000 if a.grid else 20_000
    if a.grid and a.temperature is not None or a.plant and not a.grid:
        print("error: --grid runs its own temperatures, and --plant needs --grid", file=sys.stderr)
        return 2
    a.temperature = 1.0 if a.temperature is None else a.temperature
    if a.samples < 1 or not a.temperature > 0:
        print("error: need --samples >= 1 and --temperature > 0", file=sys.stderr)
        return 2
    try:
        from transformers import GenerationConfig, __version__
        from transformers.utils import logging
    except ImportError:
        print("error: transformers is not installed (pip install -r requirements-test.txt)", file=sys.stderr)
        return 2
    logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if a.grid:
        verdicts = grid(a.samples, a.seed, a.plant)
        print(json.dumps([asdict(v) for v in verdicts], indent=1) if a.json else table(verdicts))
        if not a.json:
            print(f"\n{GRID_TOKENS} new tokens, V = {V}: top-k >= {V} keeps every token; at N = {a.samples:,} each "
                  f"row detects TV >= {detects(a.samples, V ** GRID_TOKENS):.4f} (all {V ** GRID_TOKENS} outcomes "
                  "possible; fewer where top-k or top-p cut, see the detects column)")
        return 0 if all(v.passed for v in verdicts) else 1
    target, assistant = tiny_hf_llama(5, 3), tiny_hf_llama(6, 1)
    gc = GenerationConfig(do_sample=True, temperature=a.temperature, top_k=0, top_p=1.0, max_new_tokens=2,
                          min_new_tokens=2, num_assistant_tokens=2, num_assistant_tokens_schedule="constant",
                          assistant_confidence_threshold=0.0, pad_token_id=0, eos_token_id=None)
    v = certify_samples(f"HF {__version__} generate(assistant_model=..., do_sample=True)",
                        draws(target, assistant, gc, a.samples, a.seed), target_law(target, a.temperature), V)
    print(json.dumps([asdict(v)], indent=1) if a.json else table([v]))
    return 0 if v.passed else 1


if __name__ == "__main__":
    sys.exit(main())
