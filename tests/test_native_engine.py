"""Native engine greedy outputs are token-identical to transformers' generate (fp32, one at a time)
for Llama (MHA), Qwen2 (GQA + qkv bias) and Mistral (GQA 4:1), over 4 buckets, both padding
strategies and packed prefill, both decode attention paths (C kernel, gather + SDPA) and both modes."""

from __future__ import annotations

import pytest

from tests.helpers.native import FAMILIES, build_model, hf_greedy, make_engine, prompt, request, run_all

BUCKETS = (16, 32, 64, 128)
# (prompt length, max_new_tokens): every bucket, bucket edges, mixed lengths
SHAPES = [(3, 12), (16, 20), (9, 5), (17, 16), (31, 9), (40, 24), (64, 7), (65, 18), (100, 12), (128, 10)]


@pytest.fixture(scope="module", params=list(FAMILIES))
def case(request, tmp_path_factory):
    """(loaded model, requests, reference outputs) for one family."""
    loaded = build_model(request.param, tmp_path_factory.mktemp(request.param))
    reqs = [request_for(i, n, m) for i, (n, m) in enumerate(SHAPES)]
    refs = {r.id: hf_greedy(loaded, r.prompt, r.params.max_new_tokens) for r in reqs}
    return loaded, reqs, refs


def request_for(i: int, n: int, max_new: int):
    return request(i, prompt(100 + i, n), max_new, BUCKETS)


def by_bucket(reqs):
    groups: dict[int, list] = {}
    for r in reqs:
        groups.setdefault(r.bucket, []).append(r)
    return list(groups.values())


@pytest.mark.parametrize("decode", ["kernel", "gather"])
@pytest.mark.parametrize("padding", ["bucket", "longest", "packed"])
@pytest.mark.parametrize("mode", ["dynamic", "continuous"])
def test_greedy_matches_transformers(case, padding, mode, decode):
    loaded, reqs, refs = case
    prefill = "packed" if padding == "packed" else "padded"
    engine = make_engine(loaded, padding="longest" if padding == "packed" else padding, mode=mode,
                         max_batch_size=4, buckets=BUCKETS, prefill=prefill, decode=decode)
    assert (engine.runner.prefill_mode, engine.runner.decode_mode) == (prefill, decode)
    groups = by_bucket(reqs)
    if mode == "continuous":  # split buckets so same-bucket requests also join mid-run
        groups = [g[i : i + 2] for g in groups for i in range(0, len(g), 2)]
    done = run_all(engine, groups, join_every=3 if mode == "continuous" else 0)
    assert set(done) == set(refs)
    for r in reqs:
        c = done[r.id]
        assert c.error is None
        assert c.token_ids == refs[r.id], f"{r.id} (prompt {len(r.prompt)})"
        assert c.finish_reason in ("eos", "length")
        assert c.started_at <= c.first_token_at and 1 <= c.batch_size <= 4
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["running"] == 0
    assert stats["kv_slots_wasted_peak_per_seq"] <= 16 - 1


def test_all_at_once_bigger_batch(case):
    """Every request queued at once with a batch limit of 8 (mixed buckets in one prefill)."""
    loaded, reqs, refs = case
    engine = make_engine(loaded, padding="bucket", max_batch_size=8, buckets=BUCKETS, prefill="padded")
    done = run_all(engine, [reqs])
    assert {k: v.token_ids for k, v in done.items()} == refs


@pytest.mark.parametrize("padding", ["bucket", "packed"])
def test_chunked_prefill_and_cross_bucket_decode_match_transformers(case, padding):
    """Continuous mode with a 24-token prefill budget: prompts of 31..128 tokens are prefilled in chunks
    (attending to their cached prefix), every bucket decodes in the same steps, outputs unchanged."""
    loaded, reqs, refs = case
    engine = make_engine(loaded, padding="longest" if padding == "packed" else padding,
                         prefill="packed" if padding == "packed" else "padded", max_prefill_tokens=24,
                         max_running=16, max_batch_size=4)
    engine.add(reqs)  # all buckets at once: prefills stay per bucket, decodes mix them
    done = {}
    while engine.has_work():
        for c in engine.step():
            done[c.id] = c
    assert {k: v.token_ids for k, v in done.items()} == refs
    prefills = [step for is_prefill, step in engine.step_log if is_prefill]
    assert all(len({bucket for _, bucket in step}) == 1 for step in prefills)  # never two buckets
    assert all(sum(1 for st in prefills if rid in {i for i, _ in st}) >= 2 for rid in ("r8", "r9"))  # chunked
    mixed = [step for is_prefill, step in engine.step_log if not is_prefill and len({b for _, b in step}) >= 3]
    assert mixed, "no decode step held three buckets"


def test_static_decode_shapes_pad_rows_and_tables_without_changing_outputs(case):
    """Decode buckets (CUDA/NPU default): rows and table widths rounded up to powers of two; padding rows
    read and write only the trash block, so outputs are unchanged and few shapes are ever seen."""
    loaded, reqs, refs = case
    engine = make_engine(loaded, max_running=16)
    engine.runner.static_decode = True
    done = run_all(engine, by_bucket(reqs), join_every=3)
    assert {k: v.token_ids for k, v in done.items()} == refs
    shapes = engine.stats()["decode_shapes"]
    rows, widths = zip(*(tuple(map(int, s.split("x"))) for s in shapes))
    assert all(r & (r - 1) == 0 for r in rows) and all(w & (w - 1) == 0 for w in widths)
    assert len(shapes) <= 5 * 4  # rows in 1..16, widths in 1..8
