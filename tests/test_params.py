"""The one generation-parameter type (common/wire/params.py): its table is docs/PROTOCOL.md's, and the client,
the gateway and the worker accept and refuse the same values: each field's boundaries, driven from the
table. Pure: no Redis, no model."""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path

import msgpack
import pytest

from batchfleet.common.errors import InvalidRequest, ProtocolError
from batchfleet.common.wire.guided import Guide
from batchfleet.common.wire.params import FIELDS, ParamError, Params, doc_rows
from batchfleet.common.wire.protocol import SCHEMA_VERSION, Request
from batchfleet.gateway.errors import APIError
from batchfleet.gateway.openai.chat.request import OPENAI_MAX_TEMPERATURE, request_job
from batchfleet.producer.ask import Ask

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[1] / "docs" / "PROTOCOL.md"
GATEWAY_NAMES = {"max_new_tokens": "max_tokens"}  # the fleet's name -> the completions endpoint's


def test_the_documents_parameter_table_is_the_code_table():
    lines = DOC.read_text().splitlines()
    rows = doc_rows()
    start = lines.index(rows[0])
    assert lines[start:start + len(rows)] == rows, "docs/PROTOCOL.md's parameter table: paste doc_rows()"
    assert [line.split("`")[1] for line in rows[2:]] == list(FIELDS)


def test_the_type_and_the_table_list_the_same_fields_and_defaults():
    assert [f.name for f in fields(Params)] == list(FIELDS)
    assert {f.name: f.default for f in fields(Params)} == {k: b.default for k, b in FIELDS.items()}


def boundaries() -> list[tuple[str, object, bool]]:
    """(field, value, accepted) at and just past each numeric field's bounds, from the table alone."""
    out: list[tuple[str, object, bool]] = []
    for name, b in FIELDS.items():
        if b.kind == "int":
            out += [(name, int(b.lo) - 1, False), (name, int(b.lo), True), (name, int(b.hi), True),
                    (name, int(b.hi) + 1, False), (name, float(b.lo), False), (name, True, False)]
        elif b.kind == "number":
            out += [(name, b.lo, not b.lo_open or (b.zero and b.lo == 0)), (name, b.lo + 1e-7, True),
                    (name, b.hi, True), (name, b.hi * 1.001 + 1e-6, False), (name, math.nan, False),
                    (name, math.inf, False), (name, "1", False)]
            if b.zero:
                out += [(name, 0, True), (name, b.lo / 2, False)]
        elif b.kind == "bool":
            out += [(name, True, True), (name, False, True), (name, 1, False)]
        if b.nullable:
            out.append((name, None, True))
    return out


def companions(name: str, value: object) -> dict:
    """What must come with ``value`` to test it alone (min_tokens <= max_new_tokens)."""
    if name == "min_tokens" and type(value) is int:
        return {"max_new_tokens": min(max(value, 1), FIELDS["max_new_tokens"].hi)}
    return {"max_new_tokens": 4} if name != "max_new_tokens" else {}


def client_accepts(name: str, value: object) -> bool:
    try:
        Ask.of({name: value, **companions(name, value)})
    except InvalidRequest:
        return False
    return True


def worker_accepts(name: str, value: object) -> bool:
    obj = {"v": SCHEMA_VERSION, "id": "j", "prompt": [1], "reply_key": "k", name: value, **companions(name, value)}
    try:
        payload = msgpack.packb(obj, use_bin_type=True)
    except (OverflowError, TypeError):
        return False  # msgpack cannot carry it: nothing to accept
    try:
        Request.decode(payload)
    except ProtocolError:
        return False
    return True


def gateway_accepts(name: str, value: object) -> bool | None:
    """None where the OpenAI surface has rules of its own (docs/GATEWAY.md's strictness table): temperature in
    [0, 2] with t < 0.001 meaning greedy, top_k -1 = off."""
    if ((name == "temperature" and type(value) in (int, float) and (value > OPENAI_MAX_TEMPERATURE or 0 < value < 1))
            or (name == "top_k" and value == -1) or name == "guide"):  # guide: spelled response_format etc.
        return None
    fields = {GATEWAY_NAMES.get(k, k): v for k, v in {name: value, **companions(name, value)}.items()}
    try:
        request_job(False, {"prompt": "x", **fields}, 60.0, 16)
    except APIError as exc:
        assert exc.status == 400 and exc.param == GATEWAY_NAMES.get(name, name), (name, value, exc.param)
        return False
    return True


@pytest.mark.parametrize(("name", "value", "accepted"), boundaries())
def test_client_gateway_and_worker_agree_on_every_boundary(name, value, accepted):
    assert client_accepts(name, value) is accepted
    assert worker_accepts(name, value) is accepted
    assert gateway_accepts(name, value) in (accepted, None)


def test_a_tiny_top_p_passes_everywhere_the_drift_that_was():
    # top_p 1e-7 passed the gateway and the client and was then refused by workers (their bound was 1e-6)
    assert client_accepts("top_p", 1e-7) and worker_accepts("top_p", 1e-7) and gateway_accepts("top_p", 1e-7)


def test_the_check_names_the_field_and_is_both_error_kinds():
    with pytest.raises(ParamError) as exc:
        Params(top_k=-1)
    assert exc.value.field == "top_k" and isinstance(exc.value, InvalidRequest)
    assert isinstance(exc.value, ProtocolError) and exc.value.code == "invalid_request"
    with pytest.raises(ParamError, match="min_tokens") as exc:
        Params(max_new_tokens=2, min_tokens=3)
    assert exc.value.field == "min_tokens"
    with pytest.raises(InvalidRequest, match="unknown generation parameter"):
        Ask.of({"max_tokens": 5})
    long_stop = "x" * 257  # the wire's limit is the client's too
    assert not client_accepts("stop", [long_stop]) and not worker_accepts("stop", [long_stop])


def test_params_normalise_and_travel_flat_on_the_wire():
    p = Params(temperature=1, stop="\n", guide=Guide("regex", "a+"), logprobs=2)
    assert p.temperature == 1.0 and type(p.temperature) is float and p.stop == ("\n",)
    assert Params(**p.keywords()) == p
    req = Request(id="j", prompt=[1], params=p, reply_key="k")
    wire = msgpack.unpackb(req.encode())
    assert wire["temperature"] == 1.0 and wire["stop"] == ["\n"] and wire["guide"] == {"kind": "regex", "spec": "a+"}
    assert "params" not in wire and "priority" not in wire and Request.decode(req.encode()) == req


def test_the_gateway_names_its_own_fields():
    for body, param in (({"max_tokens": 0}, "max_tokens"), ({"logprobs": 21}, "logprobs"),
                        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"), ({"stop": [""]}, "stop")):
        with pytest.raises(APIError) as exc:
            request_job(False, {"prompt": "x", **body}, 60.0, 16)
        assert exc.value.param == param
    chat = {"messages": [{"role": "user", "content": "x"}]}
    for body, param in (({"max_completion_tokens": 0}, "max_completion_tokens"),
                        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")):
        with pytest.raises(APIError) as exc:
            request_job(True, {**chat, **body}, 60.0, 16)
        assert exc.value.param == param and param in exc.value.message
