"""`edited_history_prompt_tokens_equal`: a resent history with one character edited in an earlier message is
counted as the same history sent fresh.

A conversation of two turns is built by resending its whole history (no id, as OpenAI clients do). Its
second user message then gets one character changed and the history is resent with a new question: the
server reuses the stored state of the common prefix (the first question and reply) and prefills the rest
once. Its `usage.prompt_tokens` must equal that of the same messages sent fresh with `store: false`
(nothing looked up): the edited history is never read, or counted, twice. The row's value is the
difference (0 passes); the details say what the edited request reused.
"""

from __future__ import annotations

OPENING = "Name three rivers in Europe."
FOLLOW_UP = "Which of them is the longest?"
QUESTION = "Answer in one word: which sea does it reach?"


def edited(text: str) -> str:
    """`text` with one character changed: its last letter replaced."""
    i = max(k for k, ch in enumerate(text) if ch.isalpha())
    return text[:i] + ("x" if text[i] != "x" else "y") + text[i + 1 :]


def _chat(url: str, model: str, auth: dict, messages: list[dict], max_tokens: int, **extra) -> dict:
    import httpx

    body = {"model": model, "messages": messages, "max_tokens": max_tokens, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=auth, timeout=600)
    r.raise_for_status()
    return r.json()


def _reply(body: dict) -> dict:
    return {"role": "assistant", "content": body["choices"][0]["message"]["content"]}


def edited_history_check(url: str, model: str, auth: dict, max_tokens: int = 16) -> tuple[dict, dict]:
    history = [{"role": "user", "content": OPENING}]
    history.append(_reply(_chat(url, model, auth, history, max_tokens)))
    history.append({"role": "user", "content": FOLLOW_UP})
    history.append(_reply(_chat(url, model, auth, history, max_tokens)))  # resent whole: the stored state grows
    changed = [*history[:2], {"role": "user", "content": edited(FOLLOW_UP)}, history[3]]
    ask = [*changed, {"role": "user", "content": QUESTION}]
    resent = _chat(url, model, auth, ask, max_tokens)
    fresh = _chat(url, model, auth, ask, max_tokens, store=False)
    counted, fresh_counted = resent["usage"]["prompt_tokens"], fresh["usage"]["prompt_tokens"]
    diff = counted - fresh_counted
    report = resent["ctxrelay"]
    row = {"check": "edited_history_prompt_tokens_equal", "value": diff, "passed": diff == 0}
    detail = {
        "edited_prompt_tokens": counted, "fresh_prompt_tokens": fresh_counted,
        "edited_message": 3, "reuse": report.get("reuse"), "reused_messages": report.get("reused_messages"),
        "transport": report.get("transport"), "prefilled_tokens": report.get("prefilled_tokens"),
        "fresh_reuse": fresh["ctxrelay"].get("reuse"),
    }  # fmt: skip
    return row, detail
