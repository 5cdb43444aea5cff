"""Structured outputs and logprobs inside the engines (no Redis): both engines and both native modes run
batches mixing constrained and free requests on a random-weight model. Every constrained output parses
and validates against its schema (regex, choice) and closes well within max_new_tokens; free rows are
untouched by their batchmates' masks; logprobs equal a direct torch log-softmax of the model's logits."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from batchfleet.common.config import DynamicBatchingConfig
from batchfleet.common.wire.guided import Guide, dump_schema
from batchfleet.worker.engine.hf import HFEngine
from tests.helpers.native import build_model, make_engine, prompt, request

BUCKETS = (16, 32, 64, 128)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2}"
CHOICES = ["yes", "no", "maybe not"]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return build_model("llama", tmp_path_factory.mktemp("guided"))


MODES = ("hf", "dynamic", "continuous")


def engine_for(loaded, mode: str):
    if mode == "hf":
        return HFEngine(loaded, DynamicBatchingConfig(max_batch_size=16, max_seq_len=256, buckets=BUCKETS))
    return make_engine(loaded, mode=mode, max_batch_size=16, buckets=BUCKETS)


def run(engine, reqs) -> dict:
    engine.add(reqs)
    done = {}
    while engine.has_work():
        done.update({c.id: c for c in engine.step()})
    return done


def mixed_batch() -> list:
    """Constrained and free requests, greedy and sampled, all in bucket 16."""
    schema = Guide("json_schema", dump_schema(SCHEMA))
    specs = [
        ("schema-greedy", dict(guide=schema)),
        ("schema-t1", dict(guide=schema, temperature=1.0, seed=5)),
        ("schema-t2", dict(guide=schema, temperature=1.5, seed=6, logprobs=3)),
        ("regex", dict(guide=Guide("regex", REGEX), temperature=1.0, seed=7)),
        ("choice", dict(guide=Guide("choice", json.dumps(CHOICES)), temperature=1.0, seed=8)),
        ("free-greedy", dict()),
        ("free-lp", dict(temperature=0.8, seed=10, logprobs=5)),
    ]
    out = []
    for i, (name, kw) in enumerate(specs):
        r = request(i, prompt(50 + i, 9), 100 if kw.get("guide") else 12, BUCKETS, **kw)
        r.id = name
        out.append(r)
    return out


def reference_logprobs(loaded, prompt_ids: list[int], generated: list[int]) -> torch.Tensor:
    """log-softmax of the model's logits at each generated position, straight from transformers: [N, V]."""
    ids = torch.tensor([prompt_ids + generated])
    with torch.no_grad():
        logits = loaded.model(ids).logits[0].float()
    return torch.log_softmax(logits[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(generated)], dim=-1)


@pytest.mark.parametrize("mode", MODES)
def test_mixed_batch_outputs_validate_free_rows_untouched_logprobs_exact(loaded, mode):
    """One batch of constrained and free rows: constrained outputs validate and close early (finish
    "stop"), free rows give what they give alone, logprobs match torch (raw logits, also under a mask)."""
    engine = engine_for(loaded, mode)
    reqs = mixed_batch()
    done = run(engine, reqs)
    assert set(done) == {r.id for r in reqs}
    for r in reqs:
        c = done[r.id]
        assert c.error is None, (r.id, c.error)
        if r.params.guide is None:
            continue
        assert c.finish_reason == "stop", (r.id, c.finish_reason, c.text)  # closed before max_new_tokens
        if r.params.guide.kind == "json_schema":
            jsonschema.validate(json.loads(c.text), SCHEMA)
            assert " " not in c.text.replace(json.loads(c.text)["name"], "")  # no free whitespace
        elif r.params.guide.kind == "regex":
            assert re.fullmatch(REGEX, c.text), c.text
        else:
            assert c.text in CHOICES, c.text
        assert loaded.tokenizer.decode(c.token_ids, skip_special_tokens=True) == c.text
    # the free requests alone give exactly what they gave next to constrained batchmates
    alone = run(engine, [r for r in mixed_batch() if r.params.guide is None])
    for rid, c in alone.items():
        assert c.token_ids == done[rid].token_ids, rid
    assert done["free-greedy"].logprobs is None
    for r in reqs:
        if r.params.logprobs is None:
            continue
        c, k = done[r.id], r.params.logprobs
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids), r.id
        ref = reference_logprobs(loaded, r.prompt, c.token_ids)
        for step, (tok, (lp, ids, lps)) in enumerate(zip(c.token_ids, c.logprobs)):
            assert lp == pytest.approx(ref[step, tok].item(), abs=2e-4), (r.id, step)
            assert len(ids) == len(lps) == k
            assert list(lps) == pytest.approx(ref[step].topk(k).values.tolist(), abs=2e-4), (r.id, step)
            assert all(ref[step, i].item() == pytest.approx(x, abs=2e-4) for i, x in zip(ids, lps))


def test_an_invalid_guide_fails_only_its_own_request(loaded):
    for name in MODES:
        engine = engine_for(loaded, name)
        bad = request(0, prompt(1, 5), 8, BUCKETS, guide=Guide("regex", "[a-"))
        bad.id = "bad"
        good = request(1, prompt(2, 5), 8, BUCKETS)
        good.id = "good"
        done = run(engine, [bad, good])
        assert done["bad"].error and "regex" in done["bad"].error, name
        assert done["good"].error is None and len(done["good"].token_ids) >= 1
