"""generate() is the only code that knows the budget and EOS: it must cut exactly."""
from engine.generate import Stats, Step, generate, plain
from engine.sampling import Random, Sampler
from cases import CASES, case
from conftest import DEVICE, tiny_llama


def steps(*lists):
    for tokens in lists:
        yield Step(list(tokens), drafted=3, accepted=len(tokens) - 1)


def test_budget_ends_inside_a_multi_token_step():
    assert list(generate(steps([1, 2, 3], [4, 5, 6]), max_new_tokens=4)) == [1, 2, 3, 4]


def test_eos_inside_a_step_is_emitted_and_ends_generation():
    stats = Stats()
    out = list(generate(steps([1, 2], [3, 9, 4], [5]), max_new_tokens=10, eos_ids={9}, stats=stats))
    assert out == [1, 2, 3, 9]
    assert (stats.n_tokens, stats.n_forwards, dict(stats.step_lengths)) == (4, 2, {2: 2})


def test_stop_inside_a_step_is_emitted_and_ends_generation():
    # a stop string can complete on any token of a multi-token step, as an EOS can; the
    # predicate sees every new token so far, so a stop spanning two steps is caught too
    seen = []
    def stop(ids):
        seen.append(list(ids))
        return ids[-2:] == [3, 4]
    out = list(generate(steps([1, 3], [4, 5], [6]), max_new_tokens=10, stop=stop))
    assert out == [1, 3, 4]
    assert seen == [[1], [1, 3], [1, 3, 4]]


def test_stats_count_forwards_drafts_and_step_lengths():
    stats = Stats()
    list(generate(steps([1], [2, 3, 4], [5, 6]), max_new_tokens=6, stats=stats))
    assert (stats.n_tokens, stats.n_forwards, stats.tokens_per_forward) == (6, 3, 2.0)
    assert (stats.drafted, stats.accepted, stats.first_step_tokens) == (9, 3, 1)
    assert dict(stats.step_lengths) == {1: 1, 3: 1, 2: 1}


def test_zero_budget_runs_nothing():
    def boom():
        raise AssertionError("the decoder must not even start")
        yield
    assert list(generate(boom(), max_new_tokens=0)) == []


def test_plain_greedy_is_the_argmax_of_full_forwards():
    # Why: plain is the baseline of every exactness claim; check it against the model alone.
    import torch
    model, prompt = tiny_llama(1), [3, 1, 4, 1, 5]
    got = list(generate(plain(model, prompt, sampler=Sampler(), rng=Random(0), max_new_tokens=8),
                        max_new_tokens=8))
    seq = list(prompt)
    for _ in range(8):
        seq.append(int(model(torch.tensor([seq], device=DEVICE), torch.arange(len(seq), device=DEVICE))[0, -1].argmax()))
    assert got == seq[len(prompt):]


def test_hits_and_acceptance_are_counted_after_the_cut_like_step_lengths():
    # Why: the stats line must agree with itself: a step cut to one token by the EOS kept no
    # accepted draft, so it is not a hit, and tokens = steps + accepted always holds.
    stats = Stats()
    out = list(generate(steps([1, 2, 3], [9, 4, 5]), max_new_tokens=10, eos_ids={9}, stats=stats))
    assert out == [1, 2, 3, 9] and dict(stats.step_lengths) == {3: 1, 1: 1}
    assert (stats.drafted, stats.accepted, stats.hits, stats.verify_steps) == (6, 2, 1, 2)
    assert stats.n_tokens == stats.n_forwards + stats.accepted
    assert (stats.acceptance, stats.hit_rate) == (2 / 6, 1 / 2)


def test_hit_rate_counts_only_steps_that_verified_a_draft():
    # Why: adaptive K = 0 steps (plain steps) verify nothing; they cannot miss, so they are not
    # in the hit rate's denominator; the draft model's forwards are counted apart.
    stats = Stats()
    log = [Step([1], drafted=0, accepted=0), Step([2, 3], drafted=2, accepted=1, draft_forwards=2),
           Step([4], drafted=0, accepted=0)]
    list(generate(iter(log), max_new_tokens=10, stats=stats))
    assert (stats.hits, stats.verify_steps, stats.hit_rate, stats.draft_forwards) == (1, 1, 1.0, 2)
    assert Stats().acceptance is None and Stats().hit_rate is None


def test_every_decoders_first_forward_is_its_prompt_alone_as_plains():
    # Why: on the exact path a prompt is one SDPA call (engine/fast/invariant.py), whose rows round by
    # the call's shape; a decoder whose first forward also sent guesses or drafts would round
    # its prompt apart from plain's. So every decoder's first step is plain's prefill: each
    # pass through the target's layers before the first yield sees the prompt alone, causal,
    # from an empty cache, no row frozen. The prompt repeats itself, so lookup and lookahead have guesses.
    from engine.decoders import DECODERS
    assert {name for name, _ in CASES.values()} == set(DECODERS)   # a new decoder needs its row there
    for name, second, knobs, target, calls in hooked():
        first = next(DECODERS[name].decode(target, *second, PROMPT, sampler=Sampler(), rng=Random(0),
                                           max_new_tokens=8, **knobs))
        assert calls and all(c == (len(PROMPT), 0, None, 0) for c in calls), (name, knobs, calls)
        assert len(first.tokens) == 1 and first.drafted == 0, (name, knobs)


def test_a_decoder_sends_k_row_forwards_exactly_where_its_registry_line_says():
    # Why: a registry line's one_row tells the stats line that a decoder has no k-row rounding to
    # disclaim (run.promise); that must be what the decoder does: after its prompt, only one-row
    # forwards through the target's layers where one_row(knobs); and where it says k rows, a row
    # of that decoder with those knobs sends some (one priced as a CPU's policy may choose none)
    from engine.decoders import DECODERS
    said, sent = set(), set()
    for name, second, knobs, target, calls in hooked():
        list(generate(DECODERS[name].decode(target, *second, PROMPT, sampler=Sampler(), rng=Random(0),
                                            max_new_tokens=8, **knobs), max_new_tokens=8))
        rows = [T for T, cached, *_ in calls if cached > 0]   # after the prompt's forwards
        assert rows and (max(rows) == 1 or not DECODERS[name].one_row(knobs)), (name, knobs, calls)
        kind = (name, frozenset(knobs))
        said |= set() if DECODERS[name].one_row(knobs) else {kind}
        sent |= {kind} if max(rows) > 1 else set()
    assert sent == said


PROMPT = [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4, 5]   # it repeats itself: lookup and lookahead have guesses


def hooked():
    """Each row of tests/cases.py's table with a fresh target whose layer stack logs (rows,
    cached slots, mask, trimmed layers) for every pass through it."""
    for label in CASES:
        target = tiny_llama(0)
        name, second, knobs = case(label, target, tiny_llama(1))
        calls, blocks = [], target.blocks
        target.blocks = lambda x, positions, cache=None, mask=None, blocks=blocks, calls=calls, **kw: (
            calls.append((x.shape[1], cache.length, mask, kw.get("trim_layers", 0))),
            blocks(x, positions, cache, mask, **kw))[1]
        yield name, second, knobs, target, calls
