"""Runs OpenAI batches. Any gateway (``--batch-runner``, the default) or a dedicated ``batchfleet batches``
process may run any batch; a lease in Redis (a random token under ``keys.batch_lease``, renewed every third
of ``--batch-lease``) makes exactly one run each at a time. A runner that dies (kill -9) stops renewing; once
its lease expires another process takes the batch over and resumes it from its output files (the
producer's bulk runner, producer/bulk/runner.py, runs the lines and says why every request then appears
exactly once and nothing written is computed again).

A batch's life, as OpenAI's: ``validating`` (the whole input is read once, streamed: a line that is not a
batch request for the batch's endpoint, or a repeated custom_id, fails the batch with the lines' errors) ->
``in_progress`` (lines run at background priority) -> ``finalizing`` (output and error files registered) ->
``completed``. A cancel (``cancelling``) stops submitting, cancels what is in flight and writes what still
completes: ``cancelled``. Past ``expires_at``: the same, ``expired``; unanswered requests get error lines
``batch_cancelled`` / ``batch_expired``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from dataclasses import replace
from typing import Any

import redis.asyncio

from batchfleet.common.errors import FleetUnavailable
from batchfleet.common.keys import Keys
from batchfleet.gateway.batches.expiry import SWEEP_S, sweep
from batchfleet.gateway.batches.format import OpenAIFormat
from batchfleet.gateway.batches.lines import MAX_LINE_ERRORS, Limits, LineError, parse_line
from batchfleet.gateway.batches.report import summarize
from batchfleet.gateway.batches.store import BatchStore, FileStore
from batchfleet.gateway.config import GatewayConfig
from batchfleet.gateway.connections import producer_client
from batchfleet.producer.bulk.files import FileSink, read_back
from batchfleet.producer.bulk.lines import numbered
from batchfleet.producer.bulk.runner import run_lines
from batchfleet.producer.bulk.work import Spec, Summary

log = logging.getLogger(__name__)
POLL_S = 1.0
RETRY_S = 5.0  # a batch that stopped on a fleet-wide failure (no live worker, Redis) is tried again after this
EXPIRY_GRACE_S = 30.0
MAX_BATCHES = 4  # batches one process runs at once
FILE_GONE = {"code": "file_not_found", "message": "the input file was deleted", "param": "input_file_id",
             "line": None}
CANCELLED = ("batch_cancelled", "the batch was cancelled before this request completed")
EXPIRED = ("batch_expired", "this request could not be executed before the completion window expired")


def validate(path: str, endpoint: str, limits: Limits) -> tuple[int, list[dict[str, Any]]]:
    """(requests in the input, the first MAX_LINE_ERRORS malformed lines as OpenAI's error objects)."""
    seen: set[str] = set()
    total, errors = 0, []
    with open(path, "rb") as f:
        for index, raw in numbered(f):
            total += 1
            try:
                parse_line(raw, index, limits, endpoint, seen)
            except LineError as exc:
                if len(errors) < MAX_LINE_ERRORS:
                    errors.append(exc.as_dict())
    return total, errors


class BatchRunner:
    """Takes due batches whose lease it wins and runs them, at most MAX_BATCHES at once."""

    def __init__(self, config: GatewayConfig, files: FileStore, batches: BatchStore) -> None:
        self.config, self.files, self.batches = config, files, batches
        self.r: redis.asyncio.Redis = batches.r
        self.keys: Keys = batches.keys
        self.running: dict[str, asyncio.Task] = {}
        self.retry_at: dict[str, float] = {}

    async def serve(self) -> None:
        """Poll for due batches until cancelled; sweep what expired every SWEEP_S."""
        swept = 0.0
        while True:
            try:
                await self.poll()
                if time.monotonic() - swept >= SWEEP_S:
                    swept = time.monotonic()
                    await sweep(self.files, self.batches)
            except Exception as exc:  # noqa: BLE001 - Redis away: try again next poll
                log.warning("batch runner: %r", exc)
            await asyncio.sleep(POLL_S)

    async def poll(self) -> None:
        now = time.monotonic()
        for batch_id in await self.batches.due():
            if len(self.running) >= MAX_BATCHES:
                return
            if batch_id in self.running or self.retry_at.get(batch_id, 0) > now:
                continue
            token = secrets.token_hex(16)
            if await self.batches.take_lease(batch_id, token, int(self.config.batch_lease_s * 1000)):
                task = asyncio.ensure_future(self._run(batch_id, token))
                self.running[batch_id] = task
                task.add_done_callback(lambda _, b=batch_id: self.running.pop(b, None))

    async def close(self) -> None:
        """Stop every batch this process runs (their leases are released; another process resumes them)."""
        for task in list(self.running.values()):
            task.cancel()
        await asyncio.gather(*self.running.values(), return_exceptions=True)

    async def _run(self, batch_id: str, token: str) -> None:
        stop, lost = asyncio.Event(), asyncio.Event()
        keeper = asyncio.ensure_future(self._keep(batch_id, token, stop, lost))
        try:
            retry = await BatchJob(self, batch_id, stop, lost).run()
            if retry:
                self.retry_at[batch_id] = time.monotonic() + RETRY_S
        except Exception:
            log.exception("batch %s failed to run; it is tried again", batch_id)
            self.retry_at[batch_id] = time.monotonic() + RETRY_S
        finally:
            keeper.cancel()
            try:
                await asyncio.shield(self.batches.release_lease(batch_id, token))
            except Exception:  # noqa: BLE001 - the lease then expires by itself
                pass

    async def _keep(self, batch_id: str, token: str, stop: asyncio.Event, lost: asyncio.Event) -> None:
        """Renew the lease; lose it (Redis away too long, or taken over) and the run stops at once."""
        ttl_ms = int(self.config.batch_lease_s * 1000)
        renewed = time.monotonic()
        while True:
            await asyncio.sleep(self.config.batch_lease_s / 3)
            try:
                held = await self.batches.renew_lease(batch_id, token, ttl_ms)
            except Exception as exc:  # noqa: BLE001 - retried while the lease surely still holds
                log.warning("batch %s: could not renew its lease: %r", batch_id, exc)
                # stop well before it can expire: another process may take the batch only after that, so
                # two never append to its files at once
                held = time.monotonic() - renewed < self.config.batch_lease_s * 2 / 3
                if held:
                    continue
            if not held:
                log.warning("batch %s: lease lost; another process runs it now", batch_id)
                lost.set()
                stop.set()
                return
            renewed = time.monotonic()


class BatchJob:
    """One turn at running one batch, from wherever it stands."""

    def __init__(self, runner: BatchRunner, batch_id: str, stop: asyncio.Event, lost: asyncio.Event) -> None:
        self.runner, self.id, self.stop, self.lost = runner, batch_id, stop, lost
        self.config = runner.config

    async def save(self, doc: dict[str, Any]) -> None:
        if not self.lost.is_set():
            await self.runner.batches.save(doc)

    async def run(self) -> bool:
        """Run the batch until it ends or stops; True: stopped by a fleet-wide failure, try again later."""
        loaded = await self.runner.batches.load(self.id)
        if loaded is None:
            await self.runner.r.zrem(self.runner.keys.openai_batches_due, self.id)
            return False
        doc, run, cancel_at = loaded
        now = int(time.time())
        if cancel_at is not None:
            doc["cancelling_at"] = cancel_at
        if doc["status"] == "validating":
            if cancel_at is not None:
                return await self.finish(doc, "cancelled", run)
            limits = Limits(max(1.0, doc["expires_at"] - now), self.config.chat_max_tokens)
            try:
                total, errors = await asyncio.to_thread(validate, self.runner.files.path(doc["input_file_id"]),
                                                        doc["endpoint"], limits)
            except FileNotFoundError:
                total, errors = 0, [FILE_GONE]
            if not errors and total == 0:
                errors = [{"code": "empty_file", "message": "the input file holds no request", "param": None,
                           "line": None}]
            if errors:
                doc.update(status="failed", failed_at=int(time.time()), errors={"object": "list", "data": errors})
                await self.save(doc)
                return False
            doc.update(status="in_progress", in_progress_at=int(time.time()),
                       request_counts={"total": total, "completed": 0, "failed": 0})
            await self.save(doc)
            log.info("batch %s started: %d requests to %s", self.id, total, doc["endpoint"])
        else:
            log.info("batch %s taken over (%s): resumed from its output files", self.id, doc["status"])
        return await self.execute(doc, run, cancel_at is not None)

    async def execute(self, doc: dict[str, Any], run: dict[str, Any], cancelled: bool) -> bool:
        files = self.runner.files
        out_path, err_path = files.path(run["output"]), files.path(run["errors"])
        # a job's deadline: past the window by a grace, so expiry ends the batch (batch_expired lines), not the
        # fleet's deadline (a 504 per line)
        fmt = OpenAIFormat(run["prefix"], Limits(max(1.0, doc["expires_at"] - time.time()) + EXPIRY_GRACE_S,
                                                 self.config.chat_max_tokens), endpoint=doc["endpoint"], strict=True)
        kept = read_back(err_path, fmt, read_back(out_path, fmt))
        counts = doc["request_counts"]
        counts.update(completed=kept.lines - kept.failed, failed=kept.failed)
        if not os.path.exists(files.path(doc["input_file_id"])):  # deleted since: what was written is kept
            doc["errors"] = {"object": "list", "data": [FILE_GONE]}
            return await self.finish(doc, "failed", run)
        # the lines run on the account of the key that created the batch (older batches: the default tenant)
        client = producer_client(self.config, inbox=run["inbox"], tenant=run.get("tenant", ""))
        spec = Spec(self.config.batch_window, kept.done)
        if cancelled or time.time() >= doc["expires_at"]:  # stopped before this turn began: only finish it
            spec.abandon = CANCELLED if cancelled else EXPIRED
            self.stop.set()
        watcher = asyncio.ensure_future(self.watch(doc, spec))
        try:
            fleet = await client.fleet()  # the format that runs lines knows the fleet and the names it serves
            fmt = replace(fmt, fleet=fleet, model_names=self.config.served_model_names or (fleet.info.model,),
                          alias_any=self.config.model_alias_any)
            doc["model"] = fmt.model_names[0]

            def count(s: Summary) -> None:  # the batch's request_counts, published by watch()
                counts.update(completed=kept.lines - kept.failed + s.written - s.failed, failed=kept.failed + s.failed)
            with (open(out_path, "a", encoding="utf-8") as out, open(err_path, "a", encoding="utf-8") as err,
                  open(files.path(doc["input_file_id"]), "rb") as lines):
                outcome = await run_lines(client, numbered(lines), fmt, FileSink(out, err), spec, self.stop,
                                          progress=count)
        except FleetUnavailable:
            return True
        finally:
            watcher.cancel()
            await client.aclose()
        if self.lost.is_set() or (outcome.interrupted and spec.abandon is None):
            return outcome.error is not None  # shut down, or taken over: the next holder resumes it
        if spec.abandon == CANCELLED:
            return await self.finish(doc, "cancelled", run)
        if spec.abandon == EXPIRED:
            return await self.finish(doc, "expired", run)
        doc.update(status="finalizing", finalizing_at=int(time.time()))
        await self.save(doc)
        return await self.finish(doc, "completed", run)

    async def watch(self, doc: dict[str, Any], spec: Spec) -> None:
        """Every POLL_S: publish progress, and stop the run on a cancel or past the completion window."""
        shown = None
        while not self.stop.is_set():
            await asyncio.sleep(POLL_S)
            try:
                loaded = await self.runner.batches.load(self.id)
                if loaded is not None and loaded[2] is not None:
                    spec.abandon = CANCELLED
                    doc["cancelling_at"] = loaded[2]
                    log.info("batch %s: cancel asked; cancelling what is in flight", self.id)
                elif time.time() >= doc["expires_at"]:
                    spec.abandon = EXPIRED
                    log.info("batch %s: past its completion window; expiring what is not answered", self.id)
                if spec.abandon is not None:
                    self.stop.set()
                elif shown != doc["request_counts"]:
                    shown = dict(doc["request_counts"])
                    await self.save(doc)
            except Exception as exc:  # noqa: BLE001 - progress is best effort; the lease guards the rest
                log.warning("batch %s: %r", self.id, exc)

    async def finish(self, doc: dict[str, Any], status: str, run: dict[str, Any]) -> bool:
        """Register the output and error files (those holding lines) and end the batch as ``status``."""
        owner, files = doc["_owner"], self.runner.files
        counts = doc.get("request_counts") or {"total": 0, "completed": 0, "failed": 0}
        if status != "failed" or doc.get("in_progress_at"):  # it ran: what it used, why requests failed
            used, errors = await asyncio.to_thread(summarize, files.path(run["output"]), files.path(run["errors"]))
            doc["usage"] = used
            doc["errors"] = doc.get("errors") or errors
        expires_s = run.get("output_expires_s")
        for key, field, kind in (("output", "output_file_id", "output"), ("errors", "error_file_id", "error")):
            path = files.path(run[key])
            has_lines = counts["completed" if key == "output" else "failed"] > 0
            if has_lines and not self.lost.is_set():
                await files.register(owner, run[key], f"{self.id}_{kind}.jsonl", "batch_output", None, expires_s)
                doc[field] = run[key]
            elif not has_lines and os.path.exists(path):
                os.unlink(path)
        doc.update(status=status, **{f"{status}_at": int(time.time())})
        if expires_s is not None:  # the record goes with its output files
            doc["_expires_at"] = int(time.time()) + expires_s
        await self.save(doc)
        log.info("batch %s %s: %d of %d requests completed, %d failed%s", self.id, status, counts["completed"],
                 counts["total"], counts["failed"], "".join(f"; {e['message']}" for e in
                                                           (doc.get("errors") or {}).get("data", [])[:3]))
        return False
