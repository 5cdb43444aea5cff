"""What the HTTP routes do, over one AsyncClient: authenticate, name the model, run a job (whole or
streamed) and give it up when the client goes away, report health. No model, no sync Redis: every
Redis call is the AsyncClient's, awaited."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from batchfleet.common.errors import GUIDE_FAILED, FleetUnavailable, JobFailed, PromptTooLong
from batchfleet.common.wire.guided import GuideError
from batchfleet.common.wire.params import Params
from batchfleet.common.wire.protocol import Result
from batchfleet.gateway.config import GatewayConfig
from batchfleet.gateway.errors import APIError, api_error, invalid
from batchfleet.gateway.openai.chat.format import Shape
from batchfleet.gateway.openai.chat.request import Job
from batchfleet.gateway.openai.tools.parsers import Family, pick
from batchfleet.gateway.sse import EventStream, job_events, wait_disconnect
from batchfleet.producer import AsyncClient
from batchfleet.producer.ask import Ask

log = logging.getLogger(__name__)
HEALTH_TIMEOUT_S = 2.0  # /health answers "unavailable" rather than hang on a frozen Redis
CANCEL_TIMEOUT_S = 5.0
CLIENT_CLOSED = 499  # nginx's status for "client closed request": never seen by anyone, only logged


class Gateway:
    """The app's state: its config and its one AsyncClient (made at startup, closed at shutdown)."""

    def __init__(self, config: GatewayConfig, client: AsyncClient) -> None:
        self.config = config
        self.client = client
        self._keys = [k.encode() for k in config.api_keys]
        self._operator_keys = [k.encode() for k in config.operator_keys]
        self._tenants = config.key_tenants

    def rate_headers(self, request: Request) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers of a successful answer: the request's tenant's limits as this
        gateway's latest admission for it left them (none for a tenant without limits)."""
        window = self.client.limits.last(tenant_of(request))
        return window.headers() if window is not None else {}

    def authorize(self, request: Request) -> None:
        """401 unless keys are configured off or the request carries one (``Authorization: Bearer <key>``);
        403 for an operator key (read-only: the dashboard's data only). Sets the request's tenant (``tenant_of``):
        its key's label (``--tenant-key``), else the default tenant."""
        request.state.tenant = ""
        if not self._keys:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise _unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        given = key.strip().encode()
        # compare with every key, whatever matches, so the time taken says nothing about the keys
        if not sum(hmac.compare_digest(given, k) for k in self._keys):
            if sum(hmac.compare_digest(given, k) for k in self._operator_keys):
                raise APIError(403, "this is a read-only operator key: it sees /dashboard and `batchfleet status "
                               "--gateway`, it cannot call the model (use an API key)", "permission_error",
                               "operator_key_read_only")
            raise _unauthorized("incorrect API key provided")
        request.state.tenant = self._tenants.get(key.strip(), "")

    async def model_names(self) -> tuple[str, ...]:
        """--served-model-name, else the name the fleet publishes (FleetUnavailable -> 503 before any
        worker). Answers report the first."""
        return self.config.served_model_names or ((await self.client.fleet()).info.model,)

    async def check_model(self, model: str | None, param: str | None = "model") -> str:
        """The name answers report; 404 when ``model`` is given and is none of the served names."""
        names = await self.model_names()
        error = unknown_model(model, names, param, self.config.model_alias_any)
        if error is not None:
            raise error
        return names[0]

    async def tool_family(self) -> Family:
        """The served model's tool-call format: --tool-call-parser, or the fleet's chat template's."""
        return pick(self.config.tool_call_parser, (await self.client.fleet()).info.chat_template)

    async def complete(self, request: Request, job: Job, chat: bool) -> Response:
        """Run one request: its ``n`` jobs (choice i seeded ``seed + i``), whole or as an event stream."""
        model = await self.check_model(job.model)
        fleet = await self.client.fleet()
        family = pick(self.config.tool_call_parser, fleet.info.chat_template)
        job_id = uuid.uuid4().hex
        shape = Shape(chat=chat, job_id=job_id, model=model, created=int(time.time()),
                      fingerprint=fleet.info.fingerprint or None, include_usage=job.include_usage,
                      token_text=None if job.logprobs is None else token_texts(fleet.tokenizer),
                      guide_param=job.guide_param, tools=job.tools, family=family)
        headers = {"x-request-id": job_id}
        if job.stream:
            streams = await self.streams(job, job_id, family, tenant_of(request))  # prompt checked: echo can be written
            return EventStream(job_events(streams, echoed(shape, job, fleet.tokenizer)),
                               headers={**headers, **self.rate_headers(request)})
        results = await self.results(request, job, job_id, family)
        return JSONResponse(echoed(shape, job, fleet.tokenizer).response(results),
                            headers={**headers, **self.rate_headers(request)})

    async def streams(self, job: Job, job_id: str, family: Family | None = None, tenant: str = "") -> list[Any]:
        """Submit the job's ``n`` choices as streamed jobs (AsyncTokenStreams, one per choice) on ``tenant``'s
        account. Submission errors (QueueFull, PromptTooLong, NoWorkers, RateLimited...) raise here, before any
        byte of the answer is sent; the choices already submitted are cancelled."""
        asks = await job_asks(job, family, tenant=tenant)
        streams: list[Any] = []
        try:
            for jid, ask in zip(choice_ids(job, job_id), asks):
                streams.append(await self.client.stream(job.prompt, timeout=job.timeout, job_id=jid, ask=ask))
        except BaseException as exc:
            await asyncio.shield(asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True))
            if isinstance(exc, PromptTooLong):
                raise too_long(exc, job) from None
            raise
        return streams

    async def results(self, request: Request, job: Job, job_id: str, family: Family | None = None) -> list[Result]:
        """Submit the job's ``n`` choices and wait for their results (as ``streams``: a submission error
        raises before anything runs; a guide the fleet failed is a 400 naming the request's guide field)."""
        asks = await job_asks(job, family)
        jobs = [(jid, job.prompt, ask) for jid, ask in zip(choice_ids(job, job_id), asks)]
        try:
            return await self.run(request, jobs, job.timeout)
        except PromptTooLong as exc:
            raise too_long(exc, job) from None
        except JobFailed as exc:
            if exc.code == GUIDE_FAILED:  # the 400 names the request's guide field
                raise api_error(exc, job.guide_param) from None
            raise

    async def run(self, request: Request, jobs: list[tuple[str, Any, Ask]], timeout: float,
                  together: bool = False) -> list[Result]:
        """Submit ``jobs`` (job id, prompt, what it asks) and wait for their results, in order,
        within ``timeout`` s. A submission error raises before anything runs, the jobs already submitted
        cancelled; then as ``_wait``. ``together``: the jobs are one request's (an embeddings request's
        inputs, up to 2,048) and, when they ask the same, go in one ``AsyncClient.submit_many``: validated
        together, enqueued at once, not one round trip each, and counted once against the tenant's limits
        (docs/TENANTS.md); otherwise (a request's choices) each is submitted, and counted, on its own."""
        start = time.monotonic()
        submitted: list[str] = []
        tenant = tenant_of(request)  # on the account of the request's key (an Ask naming one keeps its own)
        jobs = [(jid, prompt, ask if ask.tenant else replace(ask, tenant=tenant)) for jid, prompt, ask in jobs]
        try:
            if together and len(jobs) > 1 and all(ask == jobs[0][2] for _, _, ask in jobs):
                submitted = await self.client.submit_many([prompt for _, prompt, _ in jobs],
                                                          job_ids=[jid for jid, _, _ in jobs], timeout=timeout,
                                                          ask=jobs[0][2])
            else:
                for jid, prompt, ask in jobs:
                    await self.client.submit(prompt, timeout=timeout, job_id=jid, ask=ask)
                    submitted.append(jid)
        except BaseException:
            await asyncio.shield(asyncio.gather(*(self.cancel(j) for j in submitted)))
            raise
        return await self._wait(request, submitted, max(0.0, timeout - (time.monotonic() - start)))

    async def _wait(self, request: Request, job_ids: list[str], timeout: float) -> list[Result]:
        """The jobs' results, unless the client goes away, the request's timeout passes or one job fails
        first: then the jobs still running are cancelled and their answers dropped (a web page closed
        mid-answer, or a 504, must not keep batch slots busy, nor leave answers in the inbox)."""
        waiting = [asyncio.ensure_future(self.client.result(j, timeout=timeout, give_up=True)) for j in job_ids]
        gone = asyncio.ensure_future(wait_disconnect(request.receive))
        try:
            pending = set(waiting)
            while pending and not gone.done():
                done, pending = await asyncio.wait(pending | {gone}, return_when=asyncio.FIRST_COMPLETED)
                pending.discard(gone)
                if any(not t.cancelled() and t.exception() is not None for t in done if t is not gone):
                    break
        finally:  # also when this handler is cancelled (server shutdown)
            gone.cancel()
            unfinished = [j for j, t in zip(job_ids, waiting) if not t.done()]
            for t in waiting:
                t.cancel()
            # shielded: when this handler is cancelled, the waits must still end and the cancels go out
            await asyncio.shield(asyncio.gather(*waiting, *(self.cancel(j) for j in unfinished),
                                                return_exceptions=True))
        for t in waiting:  # the first failure, in choice order
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()
        if any(t.cancelled() for t in waiting):
            raise APIError(CLIENT_CLOSED, "client closed the request", "invalid_request_error", "client_closed")
        return [t.result() for t in waiting]

    async def cancel(self, job_id: str) -> None:
        """Best effort: a cancel that cannot reach Redis is logged (the job's deadline still bounds it)."""
        try:
            await asyncio.wait_for(self.client.cancel(job_id), CANCEL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - nobody is left to tell
            log.warning("could not cancel job %s: %s", job_id, exc)

    async def health(self) -> tuple[int, dict[str, Any]]:
        """(status, body): 200 when Redis answers and at least one worker has a fresh heartbeat, or none
        does but the fleet scales to zero (``scaled_to_zero``: requests are taken and wake a worker); else
        503."""
        try:
            workers = await asyncio.wait_for(self.client.live_workers(HEALTH_TIMEOUT_S), HEALTH_TIMEOUT_S + 0.5)
            idle = not workers and await asyncio.wait_for(self._scales_to_zero(), HEALTH_TIMEOUT_S + 0.5)
        except Exception as exc:  # noqa: BLE001 - any failure to reach Redis is "unavailable"
            return 503, {"status": "unavailable", "redis": False, "workers": 0,
                         "error": f"{type(exc).__name__}: {exc}"[:300]}
        status = "ok" if workers else "scaled_to_zero" if idle else "no_workers"
        return (200 if workers or idle else 503), {"status": status, "redis": True, "workers": workers}

    async def _scales_to_zero(self) -> bool:
        try:
            return (await self.client.fleet(HEALTH_TIMEOUT_S)).scales_to_zero
        except FleetUnavailable:  # no description published (NoWorkers)
            return False


def tenant_of(request: Request) -> str:
    """The tenant a request runs for (set by ``Gateway.authorize``: its API key's label; "" the default)."""
    return getattr(request.state, "tenant", "")


async def job_asks(job: Job, family: Family | None = None, priority: str | None = None,
                   tenant: str = "") -> list[Ask]:
    """What the client is asked for each of the job's ``n`` choices: the job's own Params (checked once, when
    the body was validated), choice i seeded ``seed + i`` when seeded; its structured-output guide compiled
    here, off the event loop (a 400 naming the field when it does not compile). A forced tool call's guide is
    made here, in ``family``'s format (gateway/openai/tools/calling.py; default: Hermes'). ``priority``, when
    given, overrides the body's (an OpenAI batch job's lines run at background priority)."""
    params = job.params
    if job.tools is not None and job.tools.constrained:  # a 400 naming the schema llguidance cannot compile
        params = params.changed(guide=await asyncio.to_thread(job.tools.guide, family or pick("auto", "")))
    elif params.guide is not None:
        try:  # compiling a large schema takes a while: not on the event loop
            await asyncio.to_thread(params.guide.check)
        except GuideError as exc:
            raise invalid(str(exc), job.guide_param) from None
    priority = priority or job.priority
    return [Ask(choice_params(params, i), priority, tenant=tenant) for i in range(job.n)]


def too_long(exc: PromptTooLong, job: Job) -> APIError:
    """The 400 for a prompt too long for the fleet, naming the request's own field: prompt / messages,
    max_tokens / max_completion_tokens."""
    param = job.max_tokens_field if exc.field == "max_new_tokens" else job.prompt_field
    return invalid(str(exc).replace("max_new_tokens", param), param, "context_length_exceeded")


def unknown_model(model: str | None, names: tuple[str, ...], param: str | None = "model",
                  any_name: bool = False) -> APIError | None:
    """The 404 for a request naming a model this gateway does not serve (None: ``model`` unset or served,
    or ``any_name``: every name maps to the served model, --model-alias-any). The message says how to serve
    the name."""
    if model is None or model in names or any_name:
        return None
    served = ", ".join(repr(n) for n in names)
    return APIError(404, f"the model {model[:200]!r} does not exist here; this gateway serves {served} (serve "
                    "this name with --served-model-name, or answer any name with --model-alias-any)",
                    "invalid_request_error", "model_not_found", param)


def choice_ids(job: Job, job_id: str) -> list[str]:
    """The fleet's job ids of a request's choices: ``job_id``, or ``job_id-i`` for each of ``n`` > 1."""
    return [job_id] if job.n == 1 else [f"{job_id}-{i}" for i in range(job.n)]


def choice_params(params: Params, index: int) -> Params:
    """Choice ``index``'s parameters: its own sampling stream, seeded ``seed + index`` when seeded (else the
    same object)."""
    if index == 0 or params.seed is None:
        return params
    return params.changed(seed=(params.seed + index) % 2**63)


def token_texts(tokenizer: Any) -> Callable[[int], str]:
    """token id -> its text (special tokens included; a byte of an unfinished character decodes to U+FFFD),
    as vLLM shows tokens in logprobs."""
    cache: dict[int, str] = {}

    def text(token_id: int) -> str:
        if token_id not in cache:
            if len(cache) > 65536:
                cache.clear()
            cache[token_id] = tokenizer.decode([token_id], skip_special_tokens=False)
        return cache[token_id]

    return text


def echoed(shape: Shape, job: Job, tokenizer: Any) -> Shape:
    """``shape`` with the prompt's text to echo, when the completion asked for it (``echo``): the prompt as
    given, token ids decoded (special tokens kept: the text of what ran). Called once the prompt was
    checked (its token ids in the vocabulary)."""
    if not job.echo:
        return shape
    prompt = job.prompt
    text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt, skip_special_tokens=False)
    return replace(shape, echo=text)


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, "invalid_request_error", "invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})
