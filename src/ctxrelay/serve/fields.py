"""The OpenAI request fields past the prompt: the Sampling they ask for, those refused, logprobs in OpenAI's shapes.

Refused (400 naming the field) are the fields a stock client may send whose meaning this server does not
implement, so that ignoring them would return something the client did not ask for: tool and function
calling, a response format other than text, audio, web search, `n`/`best_of` above 1, `echo`, `suffix`,
and vLLM's own sampling extras not implemented here. Each is refused only where its value asks for
something (a default value, e.g. `tool_choice: "none"` or `response_format: {"type": "text"}`, passes).
Ignored because they cannot change the answer: `user`, `metadata`, `service_tier`,
`prompt_cache_key`, `safety_identifier`, `parallel_tool_calls` (no tools), `prediction` (a predicted
output only speeds OpenAI's decode up), `reasoning_effort` and `verbosity` (no served model reasons; vLLM
accepts them for such models too), and any other vendor field. `store` is read by openai_api.py (a chat
turn with `store: false` leaves no state).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from ctxrelay.errors import UsageError
from ctxrelay.models.sampling import Sampling, TokenLogprob
from ctxrelay.serve.errors import ApiError


def _set(v: Any) -> bool:
    return v is not None


def _true(v: Any) -> bool:
    return bool(v)


# field -> whether its value asks for something this server does not do
REFUSED: dict[str, Callable[[Any], bool]] = {
    "tools": _true,
    "tool_choice": lambda v: v not in (None, "none"),
    "functions": _true,
    "function_call": lambda v: v not in (None, "none"),
    "response_format": lambda v: v not in (None, {"type": "text"}),
    "audio": _set,
    "modalities": lambda v: v not in (None, ["text"]),
    "web_search_options": _set,
    "best_of": lambda v: v not in (None, 1),
    "echo": _true,
    "suffix": _true,
    # vLLM's sampling extras (vllm.SamplingParams) that ctxrelay's decode does not implement
    "repetition_penalty": lambda v: v not in (None, 1, 1.0),
    "min_p": lambda v: v not in (None, 0, 0.0),
    "use_beam_search": _true,
    "prompt_logprobs": _set,
    "stop_token_ids": _true,
    "include_stop_str_in_output": _true,
    "ignore_eos": _true,
    "allowed_token_ids": _set,
    "bad_words": _true,
    "skip_special_tokens": lambda v: v is False,
    "guided_json": _set,
    "guided_regex": _set,
    "guided_choice": _set,
    "guided_grammar": _set,
    "structured_outputs": _set,
}


def refuse_unsupported(extra: dict[str, Any] | None) -> None:
    """400 naming the first field of the request's undeclared ones that asks for what is not implemented."""
    for name, value in (extra or {}).items():
        asks = REFUSED.get(name)
        if asks is not None and asks(value):
            raise ApiError(400, f"{name} is not supported by this server (value {value!r})", param=name)


def sampling_of(req: Any, logprobs: int | None, vocab_size: int) -> Sampling:
    """The Sampling a chat or completion request asks for. No seed: a fresh one per request (OpenAI's
    meaning: only a seed makes sampling repeatable); temperature 0 stays greedy whatever the seed."""
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stop) > 16 or any(not s for s in stop):
        raise ApiError(400, "stop must be at most 16 non-empty strings", param="stop")
    bias = []
    for key, value in (req.logit_bias or {}).items():
        if not str(key).isdigit():
            raise ApiError(400, f"logit_bias keys must be token ids, not {key!r}", param="logit_bias")
        if int(key) >= vocab_size:
            raise ApiError(400, f"logit_bias names token {key}, outside the vocabulary (0..{vocab_size - 1})",
                           param="logit_bias")  # fmt: skip
        bias.append((int(key), float(value)))
    try:
        return Sampling(
            temperature=req.temperature or 0.0, top_p=1.0 if req.top_p is None else req.top_p,
            top_k=max(req.top_k or 0, 0), seed=secrets.randbits(63) if req.seed is None else req.seed,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            min_tokens=req.min_tokens, logit_bias=tuple(bias), stop=stop, logprobs=logprobs,
        )  # fmt: skip
    except UsageError as e:  # past the request model's own bounds; the record's messages start with the field
        raise ApiError(400, str(e), param=str(e).split()[0]) from None


def _piece(tok: Any, token: int) -> str:
    # one token's text as vLLM reports it (a byte-level piece of a multi-byte character shows as U+FFFD)
    return tok.decode([token])


def _entry(tok: Any, token: int, logprob: float) -> dict:
    text = _piece(tok, token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(tok: Any, lps: list[TokenLogprob] | None) -> dict | None:
    """choices[].logprobs of a chat completion: content[] of {token, logprob, bytes, top_logprobs}."""
    if lps is None:
        return None
    content = [
        {**_entry(tok, lp.token, lp.logprob), "top_logprobs": [_entry(tok, t, v) for t, v in lp.top]} for lp in lps
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(tok: Any, lps: list[TokenLogprob] | None) -> dict | None:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs ({token: logprob}) and
    text_offset (each token's first character in the generated text)."""
    if lps is None:
        return None
    ids = [lp.token for lp in lps]
    offsets = [len(tok.decode(ids[:i], skip_special_tokens=True)) for i in range(len(ids))]
    return {
        "tokens": [_piece(tok, t) for t in ids],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{_piece(tok, t): v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }
