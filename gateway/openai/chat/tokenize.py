"""vLLM's tokenizer routes, behind the API key (vLLM serves them beside ``/v1``; same request and answer shapes):

    POST /tokenize    {"model"?, "prompt", "add_special_tokens"?, "return_token_strs"?}, or chat messages:
                      {"model"?, "messages", "add_generation_prompt"?, "add_special_tokens"?, "tools"?, ...}
                      -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"model"?, "tokens"} -> {"prompt"}

With the fleet's tokenizer and chat template (the fleet description workers publish), through the one
tokenization every request takes (producer/core.py ``FleetView.tokenize``): a chat completion's messages
count here exactly the tokens it runs (its ``usage.prompt_tokens``). Messages and tools are validated as the
chat route's (gateway/openai/chat/messages.py, gateway/openai/tools/calling.py). As every prompt, a text is
tokenized a prefix at a time: one past ``max_model_len`` tokens is a 400 ``context_length_exceeded`` once a
bounded prefix was (vLLM counts any length; here a 2 MiB body must not cost seconds of CPU:
docs/SECURITY.md).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field, StrictBool, StrictStr
from starlette.requests import Request

from batchfleet.common.errors import InvalidRequest, PromptTooLong
from batchfleet.gateway.deps import KEY_CHECKED, Service
from batchfleet.gateway.errors import invalid
from batchfleet.gateway.openai.chat.messages import Message, conversation
from batchfleet.gateway.openai.chat.request import STRICT, TokenIds, parse
from batchfleet.gateway.openai.tools.calling import Tool, plan
from batchfleet.gateway.strict import NEUTRAL_TOKENIZE_CHAT, read_json, refuse_non_neutral
from batchfleet.producer.chat import Chat
from batchfleet.producer.core import INLINE_PROMPT_CHARS, FleetView, prompt_size

router = APIRouter(dependencies=KEY_CHECKED)


class TokenizeCompletionRequest(BaseModel):
    model_config = STRICT
    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool | None = None  # default true: the tokenizer's special tokens (BOS)
    return_token_strs: StrictBool | None = None


class TokenizeChatRequest(BaseModel):
    model_config = STRICT
    model: StrictStr | None = None
    messages: list[Message] = Field(min_length=1)
    add_generation_prompt: StrictBool | None = None  # default true: ending with the assistant's header
    # default: as the chat route tokenizes (special tokens unless the template wrote the BOS itself)
    add_special_tokens: StrictBool | None = None
    return_token_strs: StrictBool | None = None
    tools: list[Tool] | None = None  # rendered by the template, as on the chat route
    # neutral only (gateway/strict.py NEUTRAL_TOKENIZE_CHAT)
    continue_final_message: StrictBool | None = None
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: StrictStr | None = None
    tokens: TokenIds


@dataclass(frozen=True)
class Tokenize:
    """A validated /tokenize request: what to tokenize, how, and the field a refusal names."""

    prompt: str | list[dict[str, Any]] | Chat
    field: str  # "prompt" or "messages"
    model: str | None
    add_special_tokens: bool | None  # None: the fleet's rule (FleetView.tokenize)
    add_generation_prompt: bool
    token_strs: bool


def tokenize_request(body: Any) -> Tokenize:
    """A decoded /tokenize body (vLLM's two shapes: ``prompt`` or ``messages``), checked: a 400 naming the
    field otherwise."""
    if isinstance(body, dict) and "messages" in body:
        if "prompt" in body:
            raise invalid("give prompt (a text) or messages (a chat), not both", "prompt")
        chat: TokenizeChatRequest = parse(TokenizeChatRequest, body)
        refuse_non_neutral({k: getattr(chat, k) for k in chat.model_fields_set}, NEUTRAL_TOKENIZE_CHAT)
        tools = plan(chat.tools, None, None)
        messages = conversation(chat.messages)
        return Tokenize(messages if tools is None else Chat(messages, tools.tools), "messages", chat.model,
                        chat.add_special_tokens, chat.add_generation_prompt is not False, bool(chat.return_token_strs))
    if isinstance(body, dict) and "prompt" not in body:
        raise invalid("prompt is required: a text to tokenize (or messages: a chat)", "prompt")
    text: TokenizeCompletionRequest = parse(TokenizeCompletionRequest, body)
    return Tokenize(text.prompt, "prompt", text.model, text.add_special_tokens is not False, True,
                    bool(text.return_token_strs))


def token_ids(fleet: FleetView, job: Tokenize) -> list[int]:
    """The request's token ids, at most the served model's max_model_len (a 400 past it, naming the field)."""
    assert fleet.info is not None
    most = fleet.info.max_seq_len
    try:
        ids = fleet.tokenize(job.prompt, add_special_tokens=job.add_special_tokens,
                             add_generation_prompt=job.add_generation_prompt, most=most)
    except PromptTooLong:
        ids = None
    except InvalidRequest as exc:  # a lone surrogate, a template that refuses the conversation
        raise invalid(str(exc), job.field) from None
    if ids is None or len(ids) > most:
        raise invalid(f"{job.field} has more than {most} tokens, the served model's max_model_len: /tokenize "
                      "counts texts up to it", job.field, "context_length_exceeded")
    return ids


@router.post("/tokenize")
async def tokenize(request: Request, gateway: Service) -> Any:
    job = tokenize_request(await read_json(request, gateway.config.max_body_bytes))
    await gateway.check_model(job.model)
    fleet = await gateway.client.fleet()
    assert fleet.info is not None and fleet.tokenizer is not None
    if prompt_size(job.prompt) <= INLINE_PROMPT_CHARS:  # small: a thread hop would cost more than it saves
        ids = token_ids(fleet, job)
    else:
        ids = await asyncio.to_thread(token_ids, fleet, job)
    token = fleet.tokenizer.id_to_token
    return {"count": len(ids), "max_model_len": fleet.info.max_seq_len, "tokens": ids,
            "token_strs": [token(i) or "" for i in ids] if job.token_strs else None}


@router.post("/detokenize")
async def detokenize(request: Request, gateway: Service) -> Any:
    req: DetokenizeRequest = parse(DetokenizeRequest, await read_json(request, gateway.config.max_body_bytes))
    await gateway.check_model(req.model)
    fleet = await gateway.client.fleet()
    assert fleet.info is not None and fleet.tokenizer is not None
    vocab = fleet.info.vocab_size
    bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise invalid(f"tokens[{bad}] is {str(req.tokens[bad])[:40]}, outside the served model's vocabulary of "
                      f"{vocab} tokens (ids 0 to {vocab - 1})", "tokens")
    decode = fleet.tokenizer.decode  # special tokens kept, as vLLM's (the text of exactly these tokens)
    if len(req.tokens) <= INLINE_PROMPT_CHARS:
        return {"prompt": decode(req.tokens, skip_special_tokens=False)}
    return {"prompt": await asyncio.to_thread(decode, req.tokens, skip_special_tokens=False)}
