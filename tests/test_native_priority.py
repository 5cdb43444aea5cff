"""Priorities in the native engine (tiny Llama, fp32): an interactive request that finds the engine
full of background sequences preempts them and finishes first, and every output stays token-identical to
transformers ``generate`` run alone (the preempted ones are recomputed)."""

from __future__ import annotations

import pytest

from tests.helpers.native import build_model, hf_greedy, make_engine, prompt, request


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return build_model("llama", tmp_path_factory.mktemp("llama"))


def test_interactive_preempts_batch_and_everything_stays_token_exact(loaded):
    engine = make_engine(loaded, max_batch_size=4, max_running=4)  # background_min_share 0.1: a reserve of 1
    batch = [request(i, prompt(i, 12 + i), 40, priority=1) for i in range(4)]
    engine.add(batch)
    order: list[str] = []
    done = {}
    for _ in range(6):  # every slot held by a background sequence, decoding
        for c in engine.step():
            order.append(c.id)
            done[c.id] = c
    assert engine.room(1) == 0 and engine.room(0) == 3
    urgent = request(9, prompt(9, 10), 8, priority=0)
    engine.add([urgent])
    while engine.has_work():
        for c in engine.step():
            order.append(c.id)
            done[c.id] = c
    stats = engine.stats()
    assert order[0] == "r9", order  # the interactive request never waited for a background sequence to finish
    assert stats["priority_preemptions"] == 1 and done["r3"].extra["preemptions"] == 1
    for req in [*batch, urgent]:
        assert done[req.id].token_ids == hf_greedy(loaded, req.prompt, req.params.max_new_tokens), req.id
