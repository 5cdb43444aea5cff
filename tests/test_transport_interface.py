"""The worker's queue interface stays narrow (issue 53): ``Transport`` declares a handful of verbs, every other
verb lives on exactly one named part, the stream consumer passes nothing through to its parts, and a reply
reaches its pipeline in three hops (worker/transport/base.py's docstring). Read from the source and the
protocol classes: no Redis."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from batchfleet.worker.benchmark.memqueue import MemQueue
from batchfleet.worker.transport import base
from batchfleet.worker.transport.cancels import CancelWatch
from batchfleet.worker.transport.consumer import StreamConsumer
from batchfleet.worker.transport.pending import PendingList
from batchfleet.worker.transport.presence import Presence
from batchfleet.worker.transport.settle import Settler
from batchfleet.worker.transport.sharded import (
    ShardedCancels,
    ShardedConsumer,
    ShardedPending,
    ShardedPresence,
    ShardedSettler,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
MAX_TRANSPORT_METHODS = 6  # setup, recover, read, log_batch, ping, close
# the part attribute of ``Transport`` -> its protocol, and the classes that implement it
PARTS = {
    "settler": (base.Settling, [Settler, ShardedSettler, MemQueue]),
    "pending": (base.Leases, [PendingList, ShardedPending, MemQueue]),
    "presence": (base.Membership, [Presence, ShardedPresence, MemQueue]),
    "cancel_watch": (base.Cancelling, [CancelWatch, ShardedCancels, MemQueue]),
}


def declared(cls: type) -> set[str]:
    """The public methods ``cls`` itself declares (not inherited, not Protocol machinery)."""
    return {name for name, value in vars(cls).items() if inspect.isfunction(value) and not name.startswith("_")}


def class_node(rel: str, name: str) -> ast.ClassDef:
    tree = ast.parse((ROOT / rel).read_text())
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def methods(node: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}


def statements(fn: ast.FunctionDef) -> list[ast.stmt]:
    """The body without its docstring."""
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return body


def test_transport_declares_a_handful_of_verbs():
    verbs = declared(base.Transport)
    assert len(verbs) <= MAX_TRANSPORT_METHODS, sorted(verbs)
    assert {"read", "setup", "close"} <= verbs


def test_every_part_is_declared_on_the_transport_and_no_verb_twice():
    hints = base.Transport.__annotations__
    for attr, (protocol, _) in PARTS.items():
        assert hints.get(attr) == protocol.__name__, attr
    assert hints.get("flush") == "FlushWatch"
    seen = declared(base.Transport)
    for protocol, _ in PARTS.values():
        verbs = declared(protocol)
        assert verbs and not verbs & seen, f"{protocol.__name__} re-declares {sorted(verbs & seen)}"
        seen |= verbs


def test_every_implementation_plays_every_part():
    for transport in (StreamConsumer, ShardedConsumer, MemQueue):
        assert base.Transport in transport.__mro__  # subclassed explicitly: a missing verb fails at construction
        assert not declared(base.Transport) - set(dir(transport)), transport
    for protocol, implementations in PARTS.values():
        for cls in implementations:
            assert protocol in cls.__mro__, (cls, protocol)
            assert not getattr(cls, "__abstractmethods__", frozenset()), (cls, cls.__abstractmethods__)


def test_the_stream_consumer_passes_nothing_through_to_its_parts():
    """No method of StreamConsumer is one call on one of its parts (``self.<part>.<verb>(...)``): callers reach
    the part itself. ``self.r`` is the Redis client: a call on it is a command, not a delegation."""
    for name, fn in methods(class_node("worker/transport/consumer.py", "StreamConsumer")).items():
        body = statements(fn)
        if len(body) != 1 or not isinstance(body[0], ast.Return | ast.Expr):
            continue
        call = body[0].value
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute):
            continue
        owner = call.func.value
        is_part = (isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name)
                   and owner.value.id == "self" and owner.attr != "r")
        assert not is_part, f"StreamConsumer.{name} passes through to self.{owner.attr}.{call.func.attr}"


def test_a_reply_reaches_its_pipeline_in_three_hops():
    """Dispatcher._answer -> Outbox.send (1) -> Outbox.flush (2) -> Settler.write_replies (3): no hop between,
    and no decorator wrapping the write (refusals are translated inline)."""
    answer = methods(class_node("worker/dispatch.py", "Dispatcher"))["_answer"]
    assert "self.outbox.send(" in ast.unparse(answer)
    outbox = methods(class_node("worker/requests/outbox.py", "Outbox"))
    assert "self.flush()" in ast.unparse(outbox["send"])
    assert "self.transport.settler.write_replies(" in ast.unparse(outbox["flush"])
    write = methods(class_node("worker/transport/settle.py", "Settler"))["write_replies"]
    assert not write.decorator_list
    assert "pipe.execute(" in ast.unparse(write)
