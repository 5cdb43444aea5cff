"""With the prefix cache on, the native engine's greedy output stays token-identical to transformers'
generate run one request at a time (fp32), for every model family: prompts sharing whole and partial
blocks, identical prompts, a prompt that is a prefix of another (its every block cached), after eviction,
under preemption, with chunked prefill and in both modes."""

from __future__ import annotations

import pytest

from tests.helpers.native import FAMILIES, build_model, hf_greedy, make_engine, prompt, request, run_all

BUCKETS = (16, 32, 64, 128)
SHARED = prompt(7, 40)  # 2.5 blocks of 16: two whole blocks shared, the third partly


def prompts() -> dict[str, list[int]]:
    """name -> prompt: shared prefixes of several kinds, plus unrelated fillers."""
    own = {f"s{i}": SHARED + prompt(20 + i, 2 + 3 * i)[1:] for i in range(5)}  # 41..53 tokens
    return {
        **own,
        "same": list(own["s2"]),  # identical to another prompt
        "head": SHARED[:32],  # exactly two blocks, both cached by the others: the last one is recomputed
        "longer": SHARED[:32] + prompt(40, 30)[1:],  # the head's prompt is a prefix of this one
        "cut": SHARED[:21],  # one whole block shared, the rest of its second block differs in length
        **{f"f{i}": prompt(60 + i, 60 + 12 * i) for i in range(4)},  # unrelated, long: they evict
    }


@pytest.fixture(scope="module", params=list(FAMILIES))
def case(request, tmp_path_factory):
    loaded = build_model(request.param, tmp_path_factory.mktemp(request.param))
    ps = prompts()
    refs = {name: hf_greedy(loaded, toks, 8) for name, toks in ps.items()}
    return loaded, ps, refs


def reqs(ps: dict[str, list[int]], names: list[str], tag: str):
    out = []
    for i, name in enumerate(names):
        r = request(i, ps[name], 8, BUCKETS)
        r.id = f"{tag}:{name}"
        out.append(r)
    return out


def check(done: dict, refs: dict) -> None:
    for rid, c in done.items():
        assert c.error is None
        assert c.token_ids == refs[rid.split(":")[1]], rid


SHARERS = ["s0", "s1", "s2", "same", "head", "longer", "cut", "s3", "s4"]


@pytest.mark.parametrize("mode", ["continuous", "dynamic"])
def test_shared_prefixes_then_eviction_match_transformers(case, mode):
    """Round 1 shares prefixes within steps and across steps; round 2 (unrelated prompts) evicts from a
    small pool; round 3 repeats round 1 over what is left of the cache."""
    loaded, ps, refs = case
    engine = make_engine(loaded, mode=mode, num_blocks=20, max_batch_size=4, max_running=4, buckets=BUCKETS)
    first = run_all(engine, [reqs(ps, SHARERS[:4], "a"), reqs(ps, SHARERS[4:], "a")], join_every=2)
    stats = engine.stats()
    assert stats["prefix_cache_hits"] >= 32 * 5 and stats["prefix_cache_queries"] >= sum(len(ps[n]) for n in SHARERS)
    fill = run_all(engine, [reqs(ps, ["f0", "f1", "f2", "f3"], "b")])
    assert engine.stats()["prefix_cache_evictions"] > 0
    again = run_all(engine, [reqs(ps, SHARERS, "c")])
    for done in (first, fill, again):
        check(done, refs)
    assert len(first) == len(again) == len(SHARERS) and engine.stats()["kv_blocks_used"] == 0


def test_chunked_prefill_and_preemption_with_cache_match_transformers(case):
    """A 12-token prefill budget chunks every prompt (hits included); 40 new tokens each from a 10-block
    pool preempt, and the preempted sequences come back through the cache."""
    loaded, ps, _ = case
    names = ["s0", "s1", "s3", "head"]
    refs = {n: hf_greedy(loaded, ps[n], 40) for n in names}
    engine = make_engine(loaded, num_blocks=10, max_prefill_tokens=12, max_batch_size=8, max_running=8)
    engine.add([request(i, ps[n], 40, BUCKETS) for i, n in enumerate(names)])
    done = {}
    while engine.has_work():
        for c in engine.step():
            done[c.id] = c
    assert {names[int(k[1:])]: c.token_ids for k, c in done.items()} == refs
    stats = engine.stats()
    assert stats["prefix_cache_hits"] > 32 * 3 and stats["preemptions"] > 0
    assert any(c.extra["preemptions"] and c.extra["resumed_cached_tokens"] for c in done.values())  # from cache
    assert all(c.extra["cached_tokens"] <= len(ps[names[int(k[1:])]]) for k, c in done.items())  # prompt only


def test_cache_off_computes_everything_and_agrees(case):
    loaded, ps, refs = case
    engine = make_engine(loaded, buckets=BUCKETS)
    engine.blocks.enable_caching = False
    done = run_all(engine, [reqs(ps, SHARERS, "e")])
    check(done, refs)
    stats = engine.stats()
    assert (stats["prefix_cache_hits"], stats["prefix_cache_queries"], stats["kv_blocks_cached"]) == (0, 0, 0)
