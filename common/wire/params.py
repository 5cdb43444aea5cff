"""A request's generation parameters: ONE type (``Params``), ONE table of bounds (``FIELDS``), ONE check.

Every side of the fleet uses this type, so a bound is written once and a value passes everywhere or
nowhere: the clients' keyword arguments become a Params (producer/ask.py), the gateway's request bodies
convert to one (gateway/openai/chat/request.py), the wire Request and the engine's GenRequest embed one
(common/wire/protocol.py, worker/engine/base.py). A request's Params is made (checked) once, where the
request is first read, and passed as that object to the wire: never a keyword dict made into a Params again.
docs/PROTOCOL.md's parameter table is the rows ``doc_rows`` writes (tests/test_params.py checks it). A new
option: a row in FIELDS, a field of Params, its use in the sampler (worker/engine/sampling.py), its row in the
docs; the clients' keywords, the wire and the gateway (a request field of the same name:
gateway/openai/chat/request.py FROM_TABLE) take it from the table. Pure: no I/O.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, fields
from typing import Any

from batchfleet.common.errors import PROMPT_TOO_LONG, InvalidRequest, PromptTooLong, ProtocolError
from batchfleet.common.wire.codec import MAX_TOKENS
from batchfleet.common.wire.guided import Guide, GuideError

MAX_NEW_TOKENS = MAX_TOKENS  # the wire's cap on any token list
MAX_TOP_K = 1 << 20
MAX_REPETITION_PENALTY = 10.0
MIN_TEMPERATURE = 1e-3  # below it logits / t overflow; 0 means greedy
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs
MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_PENALTY = 2.0  # presence / frequency penalties: OpenAI's range, [-2, 2]
MAX_LOGIT_BIAS = 100.0  # a bias is in [-100, 100] (OpenAI's: -100 bans a token, 100 all but forces it)
MAX_BIASED = 300  # token ids one logit_bias may name (OpenAI's limit)
MAX_TOKEN_ID = 2**31 - 1  # the wire's bound on any token id (the worker checks its vocabulary)


class ParamError(InvalidRequest, ProtocolError):
    """A parameter the fleet cannot accept; ``field`` names it. An InvalidRequest to a client's caller and
    a ProtocolError (code ``invalid_request``) to a worker decoding the wire."""

    def __init__(self, field: str, message: str) -> None:
        ProtocolError.__init__(self, message[:300])
        self.field = field


class TooLong(ParamError, PromptTooLong):
    """``max_new_tokens`` past the longest sequence the wire carries: what a request too long for the fleet
    always was (a PromptTooLong to a client's caller, ``context_length_exceeded`` at the gateway,
    ``prompt_too_long`` on the wire)."""

    def __init__(self, field: str, message: str) -> None:
        ParamError.__init__(self, field, message)
        self.code = PROMPT_TOO_LONG


@dataclass(frozen=True)
class Bound:
    """One parameter's row: its kind, default, accepted values and meaning."""

    kind: str  # "int", "number", "bool", "stop" (list of strings), "bias" ((token id, bias) pairs) or "guide"
    default: Any
    doc: str
    lo: float | None = None  # numbers and ints: the accepted range [lo, hi] ...
    hi: float | None = None
    lo_open: bool = False  # ... or (lo, hi]
    zero: bool = False  # 0 accepted besides the range (temperature: 0 = greedy)
    nullable: bool = False  # None (msgpack nil) accepted: off / not given
    required: bool = False  # on the wire (the clients default it)

    def accepts(self) -> str:
        """The accepted values, as errors and the docs say them."""
        if self.kind == "stop":
            return f"at most {MAX_STOP} strings of 1-{MAX_STOP_CHARS} characters"
        if self.kind == "bool":
            return "a boolean"
        if self.kind == "guide":
            return "a map `{\"kind\": <str>, \"spec\": <str>}` (below) or nil"
        if self.kind == "bias":
            return (f"at most {MAX_BIASED} `[token id, bias]` pairs, ids distinct in [0, 2^31 - 1], biases in "
                    f"[{_num(self.lo)}, {_num(self.hi)}]")
        lo, hi = _num(self.lo), _num(self.hi)
        span = f"{'(' if self.lo_open else '['}{lo}, {hi}]"
        text = ("an integer" if self.kind == "int" else "a number") + f" in {span}"
        return ("0 or " + text if self.zero else text) + (" or nil" if self.nullable else "")

    def check(self, name: str, value: Any) -> None:
        if value is None and self.nullable:
            return
        if self.kind == "bool":
            ok = type(value) is bool
        elif self.kind == "stop":
            ok = (isinstance(value, tuple) and len(value) <= MAX_STOP
                  and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS and has_utf8(s) for s in value))
        elif self.kind == "guide":
            ok = isinstance(value, Guide)
        elif self.kind == "bias":
            ok = isinstance(value, tuple) and len(value) <= MAX_BIASED and all(
                isinstance(p, tuple) and len(p) == 2 and type(p[0]) is int and 0 <= p[0] <= MAX_TOKEN_ID
                and type(p[1]) in (int, float) and math.isfinite(p[1]) and self.lo <= p[1] <= self.hi
                for p in value) and len({p[0] for p in value}) == len(value)
        else:  # bool is an int subclass: refused on purpose; NaN fails every comparison
            typed = type(value) is int if self.kind == "int" else type(value) in (int, float) and math.isfinite(value)
            ok = typed and ((self.zero and value == 0) or (
                (self.lo < value if self.lo_open else self.lo <= value) and value <= self.hi))
        if not ok:
            too_long = name == "max_new_tokens" and type(value) is int and self.hi is not None and value > self.hi
            error = TooLong if too_long else ParamError
            raise error(name, f"{name} must be {self.accepts()}, got {value!r}"[:300])


# the one table: field -> kind, default, meaning and bounds (docs/PROTOCOL.md's rows are written from it)
FIELDS: dict[str, Bound] = {
    "max_new_tokens": Bound("int", 64, "tokens to generate at most", 1, MAX_NEW_TOKENS, required=True),
    "temperature": Bound("number", 0.0, "0 = greedy (the most likely token)", MIN_TEMPERATURE, 100.0, zero=True),
    "top_p": Bound("number", 1.0, "nucleus sampling: keep the most likely tokens up to this mass", 0.0, 1.0,
                   lo_open=True),
    "top_k": Bound("int", 0, "keep the k most likely tokens; 0 = disabled", 0, MAX_TOP_K),
    "seed": Bound("int", None, "sampling seed; nil = not reproducible", 0, 2**63 - 1, nullable=True),
    "stop": Bound("stop", (), "generation ends before the first one found (`finish_reason` = `stop`)"),
    "ignore_eos": Bound("bool", False, "an end-of-sequence token does not end the request (it stays in "
                                       "`token_ids`)"),
    "min_tokens": Bound("int", 0, "at most `max_new_tokens`; EOS ids are masked and stop strings not matched "
                                  "before this many tokens", 0, MAX_NEW_TOKENS),
    "repetition_penalty": Bound("number", 1.0, "the logit of each token in the prompt or the output so far is "
                                               "divided by it when positive, multiplied when negative (before "
                                               "temperature)", 0.0, MAX_REPETITION_PENALTY, lo_open=True),
    "min_p": Bound("number", 0.0, "after temperature, tokens whose probability is below `min_p` times the top "
                                  "one's are dropped", 0.0, 1.0),
    "presence_penalty": Bound("number", 0.0, "subtracted from the logit of every token already in the output "
                                             "(OpenAI's; after repetition_penalty, before temperature)",
                              -MAX_PENALTY, MAX_PENALTY),
    "frequency_penalty": Bound("number", 0.0, "subtracted from a token's logit once per time it is already in the "
                                              "output (OpenAI's; with presence_penalty)", -MAX_PENALTY, MAX_PENALTY),
    "logit_bias": Bound("bias", (), "added to these tokens' logits before every other adjustment (OpenAI's "
                                    "`logit_bias`, a JSON map of id strings there)", -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS),
    "guide": Bound("guide", None, "structured output: the generated tokens always match it", nullable=True),
    "logprobs": Bound("int", None, "nil = none; k: each generated token's logprob and its k most likely "
                                   "alternatives, in the `Result` (and `Delta`s)", 0, MAX_LOGPROBS, nullable=True),
}


def bias_pairs(value: Any) -> Any:
    """``logit_bias`` as sorted (token id, bias) pairs: from a map (OpenAI's JSON has the ids as decimal
    strings) or a sequence of pairs (the wire's lists); None: none. Anything else is returned for ``check``
    to refuse."""
    if value is None:
        return ()
    if isinstance(value, dict):
        value = [(int(k) if isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 10 else k, b)
                 for k, b in value.items()]
    if not isinstance(value, (list, tuple)) or len(value) > MAX_BIASED:
        return value
    pairs = tuple(tuple(p) if isinstance(p, (list, tuple)) else p for p in value)
    if all(isinstance(p, tuple) and len(p) == 2 and type(p[0]) is int for p in pairs):
        pairs = tuple(sorted(pairs, key=lambda p: p[0]))
    return pairs


@dataclass(frozen=True)
class Params:
    """What to generate: length, sampling (vLLM's names and meanings), stop strings, structured output and
    logprobs. Checked when made (each field against its row of FIELDS, then the rules between fields): every
    Params is valid, and is passed as is from where a request is first read to the wire (``changed`` checks
    what it changes). Numbers are stored as floats and ``stop`` as a tuple (a single string is one stop
    string)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    guide: Guide | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        for name in FIELDS:
            object.__setattr__(self, name, _checked(name, getattr(self, name)))
        _check_between(self)

    def changed(self, **changes: Any) -> Params:
        """A copy with ``changes`` (a choice's seed, a guide made later), each checked against its row as the
        constructor checks it, and the rules between fields; the fields kept were checked when this one was
        made and are not checked again. A name that is no field is a TypeError, as the constructor's."""
        unknown = set(changes) - set(FIELDS)
        if unknown:
            raise TypeError(f"Params has no field(s) {', '.join(sorted(unknown))}")
        out = copy.copy(self)
        for name, value in changes.items():
            object.__setattr__(out, name, _checked(name, value))
        _check_between(out)
        return out

    def keywords(self) -> dict[str, Any]:
        """The fields as keyword arguments (``Params(**p.keywords()) == p``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_wire(self) -> dict[str, Any]:
        """The Request map's parameter entries (flat, as they always were)."""
        wire = self.keywords()
        wire["stop"] = list(self.stop)
        wire["logit_bias"] = [list(pair) for pair in self.logit_bias]  # a list: msgpack map keys are strings
        wire["guide"] = None if self.guide is None else self.guide.to_wire()
        return wire

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> Params:
        """The parameters of a decoded Request map; a ParamError (a ProtocolError) names a bad one."""
        values: dict[str, Any] = {}
        for name, bound in FIELDS.items():
            if name not in obj:
                if bound.required:
                    raise ParamError(name, f"{name} is required")
                continue
            value = obj[name]
            if bound.kind in ("stop", "bias"):
                if not isinstance(value, list):
                    raise ParamError(name, f"{name} must be {bound.accepts()}")
                value = tuple(value)
            elif bound.kind == "guide" and value is not None:
                try:
                    value = Guide.from_wire(value)
                except GuideError as exc:
                    raise ParamError(name, str(exc)) from None
            values[name] = value
        return cls(**values)


def _checked(name: str, value: Any) -> Any:
    """One field as Params stores it: shaped (a single stop string is one stop string, ``logit_bias`` sorted
    pairs), checked against its row of FIELDS (a ParamError naming it), then ints given for numbers made
    floats, so the wire and == agree. The one path of every field, in the constructor and ``changed``."""
    bound = FIELDS[name]
    if bound.kind == "stop":
        value = () if value is None else (value,) if isinstance(value, str) else (
            tuple(value) if isinstance(value, list) else value)
    elif bound.kind == "bias":
        value = bias_pairs(value)
    bound.check(name, value)
    if bound.kind == "number" and value is not None:
        return float(value)
    if bound.kind == "bias":
        return tuple((i, float(b)) for i, b in value)
    return value


def _check_between(params: Params) -> None:
    """The rules between fields (each field was checked alone first). Raises a ParamError naming one."""
    if params.min_tokens > params.max_new_tokens:
        raise ParamError("min_tokens", f"min_tokens ({params.min_tokens}) must be <= max_new_tokens "
                                       f"({params.max_new_tokens})")


DEFAULT = Params()


def doc_rows() -> list[str]:
    """docs/PROTOCOL.md's parameter table (under "### Request"), row by row."""
    kinds = {"int": "int", "number": "number", "bool": "bool", "stop": "array of str", "guide": "map",
             "bias": "array of [int, number]"}
    rows = ["| field | type | default | accepted | meaning |", "|---|---|---|---|---|"]
    for name, b in FIELDS.items():
        kind = kinds[b.kind] + (" or nil" if b.nullable else "")
        listed = b.kind in ("stop", "bias")
        default = "required" if b.required else "nil" if b.default is None else "`[]`" if listed else (
            str(b.default).lower() if b.kind == "bool" else str(b.default))
        rows.append(f"| `{name}` | {kind} | {default} | {b.accepts()} | {b.doc} |")
    return rows


def _num(x: float | None) -> str:
    if x == 2**63 - 1:
        return "2^63 - 1"
    return str(int(x)) if x == int(x) else f"{x:g}"  # type: ignore[arg-type]


def has_utf8(text: str) -> bool:
    """Whether ``text`` has a UTF-8 form (a lone surrogate, which JSON's \\ud800 escape can carry, has none)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
