"""Native engine behaviour: continuous joins, KV waste, pool exhaustion, seeded sampling, stops,
errors, abort/reset and recovery from a failing step (tiny Llama, fp32)."""

from __future__ import annotations

import pytest

from batchfleet.common.wire.params import Params
from batchfleet.worker.engine.base import GenRequest
from batchfleet.worker.engine.native.engine import contiguous_waste
from tests.helpers.native import build_model, hf_greedy, make_engine, prompt, request, run_all


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return build_model("llama", tmp_path_factory.mktemp("llama"))


def drain(engine) -> dict:
    done = {}
    while engine.has_work():
        for c in engine.step():
            done[c.id] = c
    return done


def test_short_requests_overtake_a_long_one(loaded):
    engine = make_engine(loaded, max_batch_size=4)
    engine.add([request(0, prompt(1, 20), 60)])
    order = []
    for _ in range(3):
        order += [c.id for c in engine.step()]
    engine.add([request(i, prompt(i, 20 + i), 5) for i in (1, 2)])  # join mid-run
    done = {}
    while engine.has_work():
        for c in engine.step():
            order.append(c.id)
            done[c.id] = c
    long_, short = done["r0"], done["r1"]
    assert order.index("r1") < order.index("r0") and order.index("r2") < order.index("r0")
    assert long_.started_at < short.started_at and len(long_.token_ids) == 60
    assert short.batch_size == 3 and long_.batch_size == 1


def test_kv_waste_stays_below_one_block_per_sequence(loaded):
    engine = make_engine(loaded, max_batch_size=8, block_size=16)
    engine.add([request(i, prompt(i, 5 + 13 * i), 3 + 7 * i) for i in range(10)])  # 2 must wait
    worst, most = 0.0, 0
    while engine.has_work():
        engine.step()
        s = engine.stats()
        most = max(most, s["running"])
        if s["running"]:
            worst = max(worst, s["kv_slots_wasted"] / s["running"])
    assert most == 8
    stats = engine.stats()
    assert worst <= 15 and stats["kv_slots_wasted_peak_per_seq"] <= 15
    assert stats["kv_slots_wasted_contiguous_peak"] > 10 * stats["kv_slots_wasted_peak"]
    assert stats["kv_blocks_used"] == 0


def test_contiguous_waste_helper():
    assert contiguous_waste([10, 100, 255], 256) == 246 + 156 + 1


@pytest.mark.parametrize("prefill", ["packed", "padded"])
def test_pool_exhaustion_preempts_and_still_matches(loaded, prefill):
    shapes = [(40, 40), (35, 45), (50, 30), (20, 60), (45, 35), (30, 50)]
    reqs = [request(i, prompt(200 + i, n), m, buckets=(16, 32, 64)) for i, (n, m) in enumerate(shapes)]
    refs = {r.id: hf_greedy(loaded, r.prompt, r.params.max_new_tokens) for r in reqs}
    # 6 concurrent requests need up to 30 blocks; the pool has 10 (a third)
    # bucket padding: recomputed sequences outgrow every bucket; max_seq_len is not a block multiple
    engine = make_engine(loaded, max_batch_size=6, num_blocks=10, padding="bucket", prefill=prefill,
                         max_seq_len=90, buckets=(16, 32, 64))
    done = run_all(engine, [reqs[:3], reqs[3:]], join_every=4)
    assert all(c.error is None for c in done.values())
    assert {k: v.token_ids for k, v in done.items()} == refs
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["kv_blocks_peak"] <= 10 and stats["kv_blocks_used"] == 0


def sampled(i: int, n: int, seed: int, **kw) -> GenRequest:
    return request(i, prompt(300 + i, n), 24, temperature=0.9, top_k=40, top_p=0.9, seed=seed, **kw)


def test_seeded_sampling_is_batch_independent(loaded):
    alone = drain(_with(make_engine(loaded), [sampled(0, 20, seed=7)]))["r0"].token_ids
    others = [sampled(i, 10 + 9 * i, seed=i) for i in range(1, 5)] + [request(9, prompt(9, 33), 30)]
    groups = [others[:2], [sampled(0, 20, seed=7)], others[2:]]
    batched = run_all(make_engine(loaded, max_batch_size=8), groups, join_every=2)
    assert batched["r0"].token_ids == alone
    tiny_pool = make_engine(loaded, max_batch_size=6, num_blocks=6)  # with preemptions too
    squeezed = run_all(tiny_pool, [others, [sampled(0, 20, seed=7)]], join_every=1)
    assert squeezed["r0"].token_ids == alone
    assert alone != drain(_with(make_engine(loaded), [sampled(0, 20, seed=8)]))["r0"].token_ids


def _with(engine, reqs):
    engine.add(reqs)
    return engine


def test_stop_string_and_eos_and_length(loaded):
    r = request(0, prompt(5, 12), 40)
    free_run = drain(_with(make_engine(loaded), [r]))["r0"]
    text = free_run.text
    assert len(text) > 6, "need some printable output to pick a stop string"
    stop = text[3:6]
    cut = text.index(stop)
    c = drain(_with(make_engine(loaded), [request(0, prompt(5, 12), 40, stop=(stop,))]))["r0"]
    assert c.finish_reason == "stop" and c.text == text[:cut]
    assert c.token_ids == free_run.token_ids[: len(c.token_ids)] and len(c.token_ids) < 40
    assert free_run.finish_reason in ("length", "eos")


def test_invalid_requests_come_back_as_errors(loaded):
    engine = make_engine(loaded, max_seq_len=256)
    bad = GenRequest(id="bad", prompt=prompt(1, 100), bucket=128, params=Params(max_new_tokens=200))
    empty = GenRequest(id="empty", prompt=[], bucket=16, params=Params(max_new_tokens=4))
    engine.add([bad, empty, request(1, prompt(1, 10), 4)])
    assert engine.num_active() == 3
    done = drain(engine)
    assert done["bad"].error and done["empty"].error and done["r1"].error is None
    assert len(done["r1"].token_ids) == 4


def test_abort_and_reset_free_blocks(loaded):
    engine = make_engine(loaded, max_batch_size=1)
    engine.add([request(i, prompt(i, 30), 50) for i in range(3)])
    engine.step()
    running = [s.id for s in engine.scheduler.running]
    waiting = [s.id for s in engine.scheduler.waiting]
    assert running and waiting and engine.stats()["kv_blocks_used"] > 0
    before = engine.stats()["kv_blocks_used"]
    assert engine.abort([running[0], waiting[0], "nope"]) == [running[0], waiting[0]]
    assert engine.num_active() == len(running) + len(waiting) - 2
    assert engine.stats()["kv_blocks_used"] < before
    engine.reset()
    assert not engine.has_work() and engine.stats()["kv_blocks_used"] == 0
    assert engine.step() == []


def test_failing_step_leaves_engine_consistent(loaded, monkeypatch):
    reqs = [request(i, prompt(50 + i, 12 + i), 12) for i in range(3)]  # one bucket: one prefill step
    refs = {r.id: hf_greedy(loaded, r.prompt, r.params.max_new_tokens) for r in reqs}
    engine = make_engine(loaded)
    real_run = engine.runner.run
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] in (1, 4):  # the first prefill and a later decode fail
            raise RuntimeError("boom")
        return real_run(batch)

    monkeypatch.setattr(engine.runner, "run", flaky)
    engine.add(reqs)
    done, errors = {}, 0
    while engine.has_work():
        try:
            for c in engine.step():
                done[c.id] = c
        except RuntimeError:
            errors += 1
            assert sorted(engine.last_step_ids) == ["r0", "r1", "r2"]
    assert errors == 2 and {k: v.token_ids for k, v in done.items()} == refs


def test_padded_length_per_strategy(loaded):
    bucket = make_engine(loaded, padding="bucket", prefill="padded", max_seq_len=90, buckets=(16, 32, 64)).runner
    assert [bucket.padded_len(n) for n in (1, 16, 17, 64, 65, 84)] == [16, 16, 32, 64, 80, 90]
    longest = make_engine(loaded, padding="longest", prefill="padded", buckets=(16, 32, 64)).runner
    assert [longest.padded_len(n) for n in (1, 17, 84)] == [1, 17, 84]


def test_reset_drops_a_sequence_in_the_middle_of_a_chunked_prefill(loaded):
    engine = make_engine(loaded, max_prefill_tokens=16, max_running=4)
    engine.add([request(0, prompt(1, 10), 30), request(1, prompt(2, 101), 8)])
    while not engine.scheduler.prefilling:
        engine.step()
    engine.reset()
    assert not engine.has_work() and engine.stats()["kv_blocks_used"] == 0 and engine.num_active() == 0
