"""POST /v1/embeddings (OpenAI's embeddings API), behind the API key, on the same fleet as generation.

Each input (a string, a list of strings, token ids, or a list of token-id lists: up to 2048, as OpenAI;
token ids are the served model's own: another vocabulary's, tiktoken's from LangChain's
``OpenAIEmbeddings``, is a 400 naming ``input`` and the fix) is one embed job (common/wire/protocol.py
``Request.kind``): the worker runs its prompt's prefill, pools the final hidden states (the worker's
``--pooling``: last token or mean), L2-normalises and answers with the vector; it keeps no KV for it.
``encoding_format``: ``float`` (JSON numbers) or ``base64`` (little-endian float32 bytes, what the openai
client asks for by default and decodes). ``dimensions``: the fleet's
models are not trained for shortened embeddings (Matryoshka), so any value is a 400 naming it, as vLLM
answers for such a model. Extensions as on the other routes: ``timeout`` (s), ``service_tier`` /
``priority`` (which pick the priority).
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse

from batchfleet.common.errors import PromptTooLong
from batchfleet.gateway.deps import KEY_CHECKED, Service
from batchfleet.gateway.openai.embeddings.request import (
    check_vocabulary,
    embed_job,
    embedding_response,
    too_long,
)
from batchfleet.gateway.strict import read_json

router = APIRouter(dependencies=KEY_CHECKED)


@router.post("/v1/embeddings")
async def embeddings(request: Request, gateway: Service) -> Any:
    job = embed_job(await read_json(request, gateway.config.max_body_bytes), gateway.config.request_timeout_s)
    model = await gateway.check_model(job.model)
    check_vocabulary(job.inputs, (await gateway.client.fleet()).info.vocab_size)
    job_id = uuid.uuid4().hex
    ids = [job_id] if len(job.inputs) == 1 else [f"{job_id}-{i}" for i in range(len(job.inputs))]
    try:
        results = await gateway.run(request, [(jid, x, job.ask) for jid, x in zip(ids, job.inputs)], job.timeout,
                                    together=True)
    except PromptTooLong as exc:
        raise too_long(exc) from None
    return JSONResponse(embedding_response(results, model, job.encoding_format),
                        headers={"x-request-id": job_id, **gateway.rate_headers(request)})
