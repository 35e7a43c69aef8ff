"""Model alternation as a stock OpenAI client does it: the official `openai` package sends the whole history
on every turn and names no conversation, and each turn asks the other of two models.

Each conversation opens with a document (`doc_tokens` tokens of training-split essays, in the first
model's tokenizer) and a question; later turns ask short questions about it. Turns stream; the TTFT is
the client's, from sending to the first content chunk. What the server did comes from the `ctxrelay`
field of each stream's last chunk: a turn on the second model after the first model's turn relays the
stored state through the gate where an edge passes it (smollm2-135m -> gemma3-270m has a shipped
heterofold artifact), else prefills natively with the reason.
"""

from __future__ import annotations

import time

QUESTIONS = (
    "What is this document about? One sentence.",
    "Name one person, place or thing it mentions.",
    "Say your last answer in fewer words.",
    "What is its tone? One word.",
)


def opening(doc: str) -> str:
    return f"Here is a document.\n\n{doc}\n\n{QUESTIONS[0]}"


def one_turn(client, model: str, messages: list[dict], max_tokens: int) -> tuple[str, float, dict | None]:
    """(answer, TTFT in ms, the server's report) of one streamed turn."""
    t0 = time.perf_counter()
    first: float | None = None
    text, report = "", None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text += chunk.choices[0].delta.content
        extra = getattr(chunk, "model_extra", None) or {}
        report = extra.get("ctxrelay", report)
    end = first or time.perf_counter()
    return text, (end - t0) * 1000.0, report


def alternate(
    url: str, api_key: str, models: list[str], conversations: int, turns: int, doc_tokens: int, max_tokens: int,
    seed: int,
) -> list[dict]:  # fmt: skip
    """Run the conversations; returns each turn as recorded (model, messages sent, status, report, ttft_ms)."""
    import openai

    from ctxrelay import zoo
    from ctxrelay.data.datasets import essay_haystack

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=900)
    tok = zoo.tokenizer(models[0])
    recorded: list[dict] = []
    for c in range(conversations):
        doc = essay_haystack(tok, doc_tokens, split="train", seed=seed + c)
        history: list[dict] = []
        for t in range(turns):
            model = models[t % len(models)]
            ask = opening(doc) if t == 0 else QUESTIONS[t % len(QUESTIONS)]
            history.append({"role": "user", "content": ask})
            sent = [dict(m) for m in history]
            try:
                answer, ttft_ms, report = one_turn(client, model, history, max_tokens)
                status = 200
            except openai.APIStatusError as e:
                answer, ttft_ms, report, status = "", None, None, e.status_code
            recorded.append({"conversation": c, "model": model, "messages": sent, "status": status,
                             "report": report, "ttft_ms": ttft_ms})  # fmt: skip
            if status != 200:
                break
            history.append({"role": "assistant", "content": answer})
    client.close()
    return recorded
