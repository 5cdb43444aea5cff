"""One request object from the edge to the wire: a request body (or a client call's keyword arguments) is
checked once into the fleet's one parameter type (common/wire/params.py ``Params``), handed to the client
inside an ``Ask`` (producer/ask.py) as that very object, and the wire ``Request`` encodes it. These tests
count what used to happen several times: Params made (checked), guides compiled, guides serialised. Pure:
no Redis (the client's own ``submit(ask=)`` path: tests/test_client_errors.py)."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from batchfleet.common.errors import InvalidRequest
from batchfleet.common.keys import Keys
from batchfleet.common.wire import guided
from batchfleet.common.wire.guided import Guide, GuideError
from batchfleet.common.wire.params import Params
from batchfleet.common.wire.protocol import FleetInfo, Request
from batchfleet.gateway.batches.format import OpenAIFormat
from batchfleet.gateway.batches.lines import Limits
from batchfleet.gateway.openai.chat.request import request_job
from batchfleet.gateway.openai.embeddings.request import embed_job
from batchfleet.gateway.service import job_asks
from batchfleet.producer.ask import Ask
from batchfleet.producer.bulk.lines import PromptFormat
from batchfleet.producer.core import FleetView

pytestmark = pytest.mark.unit

WORDS = ["[UNK]", "hi", "there", "a", "b"]
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture
def counts(monkeypatch) -> dict[str, int]:
    """How many Params were made (each is checked when made), guides compiled and guides serialised."""
    seen = {"params": 0, "compiled": 0, "serialised": 0}
    post_init, verdict, to_wire = Params.__post_init__, guided._verdict, Guide.to_wire

    def made(self):
        seen["params"] += 1
        post_init(self)

    def compiled(kind, spec):
        seen["compiled"] += 1
        return verdict(kind, spec)

    def serialised(self):
        seen["serialised"] += 1
        return to_wire(self)

    monkeypatch.setattr(Params, "__post_init__", made)
    monkeypatch.setattr(guided, "_verdict", compiled)
    monkeypatch.setattr(Guide, "to_wire", serialised)
    return seen


def fleet() -> FleetView:
    """A fleet description with a tiny word-level tokenizer and a chat template, as workers publish one."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    view = FleetView()
    view.update(FleetInfo(model="m", tokenizer_json=tok.to_str(), buckets=(32,), max_seq_len=64, max_batch_size=4,
                          vocab_size=len(WORDS), eos_token_ids=(0,), chat_template=TEMPLATE).encode())
    return view


def fresh_schema() -> dict:
    """A schema no earlier test compiled (the verdict cache would hide a compile)."""
    return {"type": "object", "properties": {f"k{uuid.uuid4().hex}": {"type": "integer"}}}


def test_a_chat_body_is_one_params_from_the_edge_to_the_wire(counts):
    body = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3, "temperature": 0.5, "seed": 5,
            "stop": ["b"], "service_tier": "flex",
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": fresh_schema()}}}
    job = request_job(True, body, 60, 16)
    assert type(job.params) is Params and job.params.guide is not None and counts["params"] == 1
    (ask,) = asyncio.run(job_asks(job))
    assert ask.params is job.params and ask.priority == "background" and Ask.called(ask, {}) is ask  # kept
    out = fleet().build(Keys("t"), "t:inbox:x", job.prompt, ask, 30.0, "j1")
    assert out.request.params is job.params
    payload = out.request.encode()
    assert counts == {"params": 1, "compiled": 1, "serialised": 1}  # checked, compiled and serialised once
    assert Request.decode(payload).params == job.params  # what a worker reads


def test_completion_choices_share_the_params_or_reseed_them(counts):
    job = request_job(False, {"prompt": "hi", "n": 3, "max_tokens": 2}, 60, 16)
    asks = asyncio.run(job_asks(job))
    assert [a.params for a in asks] == [job.params] * 3 and all(a.params is job.params for a in asks)
    seeded = request_job(False, {"prompt": "hi", "n": 3, "max_tokens": 2, "seed": 2**63 - 2}, 60, 16)
    asks = asyncio.run(job_asks(seeded))
    assert asks[0].params is seeded.params and [a.params.seed for a in asks] == [2**63 - 2, 2**63 - 1, 0]
    assert asks[1].params == Params(max_new_tokens=2, temperature=1.0, seed=2**63 - 1)
    assert counts["params"] == 3  # one per body (and the comparison's): a choice's seed is checked alone


def test_a_forced_tool_call_changes_the_guide_alone(counts):
    tools = [{"type": "function", "function": {"name": "f", "parameters": fresh_schema()}}]
    job = request_job(True, {"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                             "tool_choice": "required", "temperature": 0.2}, 60, 16)
    (ask,) = asyncio.run(job_asks(job))
    assert job.params.guide is None and ask.params.guide is not None and ask.params.guide.kind == "grammar"
    assert ask.params.temperature == 0.2 and ask.params.max_new_tokens == 16 and counts["params"] == 1


def test_an_embeddings_body_and_batch_lines_hand_over_asks(counts):
    job = embed_job({"input": ["a", "b"], "service_tier": "flex"}, 60)
    assert job.ask == Ask.embed("background") and job.ask.kind == "embed"
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "seed": 1}}
    fmt = OpenAIFormat("p", Limits(60.0, 16), model_names=("m",))
    work = fmt.parse(0, json.dumps(line).encode())
    (ask,) = asyncio.run(fmt.asks(work))
    assert ask.params is work.line.job.params and ask.priority == "background"  # whatever the body says
    prompts = PromptFormat("q")
    work = prompts.parse(0, json.dumps({"prompt": "hi", "max_new_tokens": 2, "guided_regex": "[ab]"}).encode())
    (ask,) = asyncio.run(prompts.asks(work))
    assert ask.params.guide == Guide("regex", "[ab]") and ask.priority == "background"


def test_the_clients_keywords_are_checked_once_and_a_guide_kept_as_given(counts):
    guide = Guide("json_schema", json.dumps(fresh_schema()))
    ask = Ask.of({"guide": guide, "max_new_tokens": 3, "priority": "background"})
    assert ask.params.guide is guide and ask.priority == "background"
    assert counts == {"params": 1, "compiled": 1, "serialised": 0}  # no guide re-serialised and re-parsed
    with pytest.raises(InvalidRequest, match="not both"):
        Ask.called(ask, {"temperature": 1.0})
    with pytest.raises(InvalidRequest, match="must be an Ask"):
        Ask.called({"temperature": 1.0}, {})  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="no generation parameters"):
        Ask(Params(max_new_tokens=2), kind="embed")
    with pytest.raises(InvalidRequest, match="priority"):
        Ask(Params(), priority="urgent")


def test_every_guide_has_the_wires_shape_when_made():
    for kind, spec in (("nope", "x"), ("regex", ""), ("regex", 3), ("choice", "x" * (guided.MAX_GUIDE_CHARS + 1))):
        with pytest.raises(GuideError):
            Guide(kind, spec)  # type: ignore[arg-type]
    assert Guide.from_wire({"kind": "json_object"}) == Guide("json_object")


def test_changed_checks_what_it_changes():
    p = Params(max_new_tokens=4, temperature=1, stop="x")
    assert p.changed(seed=3) == Params(max_new_tokens=4, temperature=1.0, stop=("x",), seed=3)
    assert p.changed(temperature=2).temperature == 2.0 and type(p.changed(temperature=2).temperature) is float
    for bad in ({"seed": -1}, {"min_tokens": 5}, {"guide": "a+"}):
        with pytest.raises(InvalidRequest):
            p.changed(**bad)
    with pytest.raises(TypeError):
        p.changed(bogus=1)
