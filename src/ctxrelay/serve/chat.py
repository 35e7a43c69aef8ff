"""Chat messages -> prompt text: each tokenizer's own chat template, and the shared transcript.

A turn's prompt is `context + suffix`. The context is the conversation so far in the TRANSCRIPT
form: each message's content under its role, `"{role}: {content}\\n\\n"`, the same text for every
model, so one model's state of it can be relayed to another (chat templates differ per model and
would not survive the move). The suffix, the new turn, is rendered with the receiver's own chat
template and prefilled natively. Tokenizers without a chat template (the tiny test models) use the
transcript form for the new turn too, with `"assistant:"` as the generation prompt.
"""

from __future__ import annotations

from typing import Any

from ctxrelay.models.spec import LoadedModel
from ctxrelay.models.tokens import context_ids
from ctxrelay.serve.errors import ApiError
from ctxrelay.text import checked_text

ROLES = ("system", "developer", "user", "assistant", "tool")
GENERATION_PROMPT = "assistant:"


def content_text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (what the openai client may send)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return checked_text(content, where, allow_empty=True)
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}: only text content parts are supported", param=where)
            texts.append(checked_text(part["text"], where, allow_empty=True))
        return "".join(texts)
    raise ApiError(400, f"{where}: content must be a string or a list of text parts", param=where)


def normalise(messages: list[dict]) -> list[dict[str, str]]:
    """[{"role", "content"}] with the content as text; clear 400s for what is not a chat message."""
    if not messages:
        raise ApiError(400, "messages must hold at least one message", param="messages")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}", param=f"messages[{i}].role")
        out.append({"role": role, "content": content_text(m.get("content"), f"messages[{i}].content")})
    return out


def transcript(messages: list[dict[str, str]]) -> str:
    """The model-independent form of a conversation: what is relayed between models."""
    return "".join(f"{m['role']}: {m['content'].strip()}\n\n" for m in messages)


def render(
    m: LoadedModel, messages: list[dict[str, str]], *, after_context: bool, generation_prompt: bool = True
) -> str:
    """The new turn in the receiver's own chat template, ending with its generation prompt.

    A BOS the template writes is dropped where it would be read twice or mid-sequence: after a
    context, or where the tokenizer adds BOS itself (models/tokens.py reads contexts that way)."""
    tok = m.tokenizer
    if not getattr(tok, "chat_template", None):
        return transcript(messages) + (GENERATION_PROMPT if generation_prompt else "")
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:  # a template's own checks (roles must alternate, ...) are the request's fault
        msg = f"the chat template of {m.spec.name} refused these messages: {e}"
        raise ApiError(400, msg, param="messages") from None
    bos = tok.bos_token or ""
    if bos and text.startswith(bos) and (after_context or _adds_bos(tok)):
        text = text[len(bos) :]
    return text


def render_turn(m: LoadedModel, history: list[dict[str, str]], new: list[dict[str, str]]) -> str:
    """The new turn after the conversation so far: what the receiver's chat template writes for the whole
    conversation past what it writes for the history. A template that opens with a default system prompt
    where the messages have none (SmolLM2's, Qwen2.5's) writes it once, at the start, not again before every
    new turn. Where the whole render does not begin with the history's, the new messages are rendered alone."""
    tok = m.tokenizer
    if history and getattr(tok, "chat_template", None):
        try:
            before = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=False)
            whole = tok.apply_chat_template([*history, *new], tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - the template's own checks: render() below says what it refused
            before = whole = ""
        if before and whole.startswith(before) and len(whole) > len(before):
            return whole[len(before) :]
    return render(m, new, after_context=bool(history))


def prompt_ids(m: LoadedModel, messages: list[dict[str, str]], *, generation_prompt: bool = True) -> list[int]:
    """The receiver's own tokens of a whole conversation (its chat template over every message, read as a
    context): what a native prefill reads, what `usage.prompt_tokens` and /tokenize count whatever the
    transport (a relayed turn reads the history in transcript form, which has other tokens)."""
    return context_ids(m, render(m, messages, after_context=False, generation_prompt=generation_prompt)).tolist()


def _adds_bos(tok) -> bool:
    return tok.bos_token_id is not None and tok("", add_special_tokens=True)["input_ids"][:1] == [tok.bos_token_id]
