"""Chat messages -> prompt text with the fleet's chat template (Jinja2, Hugging Face semantics).

Rendered producer-side, like tokenization, so a prompt is routed to its bucket by its real token length.
The template comes from the fleet description (workers publish their tokenizer's template), runs in
Jinja2's sandbox (a template is data, never trusted code) and is compiled once per template text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache

from batchfleet.common.errors import InvalidRequest

MAX_MESSAGES = 1024
ROLES = ("system", "user", "assistant", "tool")


def is_messages(prompt: object) -> bool:
    """Whether a prompt is a list of chat messages (dicts) rather than text or token ids."""
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and bool(prompt) and all(
        isinstance(m, Mapping) for m in prompt)


def check_messages(messages: Sequence[Mapping]) -> list[dict[str, str]]:
    """Validated copies: each message has a known role and string content."""
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest(f"at most {MAX_MESSAGES} messages")
    out = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {ROLES}, got {role!r}"[:200])
        if not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string")
        out.append({"role": role, "content": content})
    return out


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:  # templates call it to reject a conversation
        raise InvalidRequest(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template)
    except TemplateError as exc:
        raise InvalidRequest(f"the fleet's chat template does not compile: {exc}") from None


def render(template: str, messages: Sequence[Mapping], bos_token: str = "", eos_token: str = "") -> str:
    """The prompt text for ``messages``, ending with the assistant turn's header (add_generation_prompt)."""
    if not template:
        raise InvalidRequest("the fleet's model has no chat template: send a text prompt instead")
    from jinja2.exceptions import TemplateError

    try:
        return _compile(template).render(messages=check_messages(messages), add_generation_prompt=True,
                                         bos_token=bos_token, eos_token=eos_token)
    except TemplateError as exc:
        raise InvalidRequest(f"chat template failed: {exc}") from None
