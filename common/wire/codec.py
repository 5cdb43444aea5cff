"""The wire's codec: bounded msgpack decoding of one payload and the field checks every wire type uses
(common/wire/protocol.py; a Request's generation parameters have their own, common/wire/params.py). A payload is
size-checked before unpacking and every container length is capped, so a hostile entry cannot make a
worker allocate without bound; every field is type- and range-checked (booleans are not integers here).
No pickle anywhere.
"""

from __future__ import annotations

from typing import Any

import msgpack

from batchfleet.common.errors import UNSUPPORTED_SCHEMA, ProtocolError

# 2: per-client inbox streams, timeouts on Redis' clock
# 3: priorities, vLLM's sampling extensions (ignore_eos, min_tokens, repetition_penalty,
# min_p), structured outputs (guide) and logprobs (logprobs, Result/Delta.logprobs; common/wire/params.py): a v2
# worker would ignore them and answer something else than asked, so it refuses v3 (unsupported_schema)
# 4: OpenAI's presence_penalty, frequency_penalty and logit_bias (a v3 worker would ignore them)
# 5: a final reply is stored under <inbox>:done:<job id> and rung for in the inbox (a v4 client reads no answer)
SCHEMA_VERSION = 5
MAX_PAYLOAD_BYTES = 1 << 20  # 1 MiB: far above 4096 token ids + stop strings
MAX_TOKENS = 1 << 16  # prompt or completion length cap at decode time (the worker checks its own limits)
MAX_TEXT_CHARS = 1 << 20
MAX_BIN_BYTES = 1 << 18  # binary fields: an embedding's float32 bytes (65536 dimensions at most)


def unpack(data: bytes) -> dict[str, Any]:
    """One payload as a map of this schema version; ProtocolError (``unsupported_schema`` for another
    version) for anything else."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError("payload must be bytes")
    if len(data) > MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"payload of {len(data)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    try:
        obj = msgpack.unpackb(
            bytes(data),
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_TEXT_CHARS,
            max_bin_len=MAX_BIN_BYTES,
            max_array_len=MAX_TOKENS,
            max_map_len=64,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises a zoo of types (ExtraData, ValueError, UnicodeDecodeError...)
        raise ProtocolError(f"undecodable payload: {type(exc).__name__}: {exc}"[:300]) from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"payload must be a map, got {type(obj).__name__}")
    version = obj.get("v")
    if type(version) is not int or version != SCHEMA_VERSION:  # 1.0 and True == 1 in Python
        raise ProtocolError(f"unsupported schema version {version!r} (this side speaks {SCHEMA_VERSION})",
                            code=UNSUPPORTED_SCHEMA)
    return obj


def pack(obj: dict[str, Any]) -> bytes:
    """A map as one payload, stamped with this schema version."""
    return msgpack.packb({"v": SCHEMA_VERSION, **obj}, use_bin_type=True)


def int_field(obj: dict, key: str, lo: int, hi: int, default: int | None = None) -> int:
    value = obj.get(key, default)
    if type(value) is not int or not lo <= value <= hi:  # bool is an int subclass: rejected on purpose
        raise ProtocolError(f"{key} must be an integer in [{lo}, {hi}], got {value!r}"[:200])
    return value


def str_field(obj: dict, key: str, max_len: int = 256) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or len(value) > max_len:
        raise ProtocolError(f"{key} must be a string of at most {max_len} chars")
    return value


def tokens_field(obj: dict, key: str, min_len: int) -> list[int]:
    value = obj.get(key)
    if not isinstance(value, list) or len(value) < min_len:
        raise ProtocolError(f"{key} must be a list of at least {min_len} token ids")
    for tok in value:
        if type(tok) is not int or not 0 <= tok < 2**31:
            raise ProtocolError(f"{key} holds an invalid token id {tok!r}"[:200])
    return value
