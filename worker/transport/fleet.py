"""Fleet membership: the fingerprint of what a worker serves, joining a namespace and leaving it.

All workers of one namespace must serve the same model, tokenizer and buckets: producers tokenize and
route with the one published fleet description. ``fingerprint`` hashes what must agree; ``join`` (a
script, so two workers starting at once cannot both win) publishes this worker's description only when
no live worker serves a different fingerprint (or when told to replace the fleet), and registers the
worker in the live set; ``leave`` removes it and deletes the description when no live worker remains,
so producers get ``NoWorkers`` / ``FleetUnavailable`` instead of enqueueing into streams nobody reads --
unless the fleet scales to zero (``FleetInfo.scale_to_zero``, ``--scale-to-zero``): then the description
has no TTL and stays when the last worker leaves, producers enqueue anyway, and the next worker (started
by KEDA on the streams' lag) answers.

The description is published with a TTL (``FLEET_TTL_MS``) that live workers' heartbeats refresh: a
fleet whose workers all died expires by itself.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from batchfleet.common.keys import Keys
from batchfleet.common.redis.functions import LIVE_WORKER_MS
from batchfleet.common.wire.protocol import FleetInfo
from batchfleet.worker.transport.scripts import WorkerScripts

FLEET_TTL_MS = 3 * LIVE_WORKER_MS  # the fleet key outlives its last heartbeat by this much


class FleetConflict(RuntimeError):
    """Live workers of this namespace serve another model, tokenizer or buckets: refusing to join."""


def fingerprint(info: FleetInfo) -> str:
    """Hash of everything every worker of a fleet must agree on: model name, tokenizer, chat template and
    special tokens, buckets, vocabulary size, max_seq_len, EOS ids, embeddings' pooling, shards. Tuning that may
    differ per worker (max_batch_size, queue limit) is left out."""
    what = [info.model, info.tokenizer_json, list(info.buckets), info.vocab_size, info.max_seq_len,
            sorted(info.eos_token_ids), info.chat_template, info.bos_token, info.eos_token]
    if info.pooling != "last":  # the default leaves a fleet's fingerprint as it was before embeddings
        what.append(info.pooling)
    if info.shards != 1:  # workers of one fleet read the same shards (else some streams go unread)
        what.append(["shards", info.shards])
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def with_fingerprint(info: FleetInfo) -> FleetInfo:
    """``info`` with its fingerprint filled in."""
    return dataclasses.replace(info, fingerprint=fingerprint(info))


def describe(info: FleetInfo) -> str:
    """A short human description for error messages."""
    return (f"model {info.model}, buckets {','.join(map(str, info.buckets))}, max_seq_len {info.max_seq_len}, "
            f"vocab {info.vocab_size}, fingerprint {info.fingerprint or '(none)'}")


def join(r, scripts: WorkerScripts, keys: Keys, info: FleetInfo, name: str, replace: bool = False) -> None:
    """Publish ``info`` (with a TTL) and mark this worker live, unless live workers serve another
    fingerprint: then raise FleetConflict (``replace`` publishes anyway: the operator is replacing the
    fleet). ``r`` is the redis-py client ``scripts`` are registered on."""
    res = scripts.join(keys=[keys.fleet, keys.workers], args=[
        info.encode(), info.fingerprint, name, LIVE_WORKER_MS, fleet_ttl_ms(info), "1" if replace else "0"])
    if int(res[0]) == 1:
        return
    raw = r.get(keys.fleet)
    try:
        current = describe(FleetInfo.decode(raw)) if raw else "(gone)"
    except Exception:  # an older or foreign description: say what we can
        current = f"fingerprint {res[1].decode() if isinstance(res[1], bytes) else res[1]}"
    raise FleetConflict(
        f"refusing to join namespace {keys.namespace!r}: {int(res[2])} live worker(s) serve [{current}], this "
        f"worker [{describe(info)}]; stop them first or start with --replace-fleet")


def fleet_ttl_ms(info: FleetInfo) -> int:
    """How long the description outlives its last heartbeat: FLEET_TTL_MS, or 0 (for ever) for a fleet
    that scales to zero."""
    return 0 if info.scale_to_zero else FLEET_TTL_MS


def leave(scripts: WorkerScripts, keys: Keys, name: str, keep: bool = False) -> bool:
    """Drop this worker from the live set; delete the fleet description when no live worker remains,
    unless ``keep`` (a fleet that scales to zero). Returns whether it was deleted."""
    return bool(scripts.leave(keys=[keys.fleet, keys.workers], args=[name, LIVE_WORKER_MS, "1" if keep else "0"]))

