"""mapflow's calibration data and job (`ctxrelay calibrate --transport mapflow`).

Calibration texts: training essays (continuations), training-split ShareGPT conversations, and
essay needle QA (context with a fact, then question + answer as the appended span) at the short
training length; longer essay haystacks and needle QA at the evaluation length for the mode choice;
held-out: essay haystacks and needle QA from the held-out essays at the evaluation length.
The fitting (fit.py) never loads data: it gets the texts from here.
"""

from __future__ import annotations

import gc
from pathlib import Path

from ctxrelay import paths
from ctxrelay.data.datasets import conversation_text, essay_haystack, essays, sharegpt_conversations
from ctxrelay.data.needle import make_needle_case
from ctxrelay.errors import UsageError
from ctxrelay.transports.base import TuningKey, keys_from

DEFAULT_SENDER, DEFAULT_RECEIVER = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"

# data options (`--set key=value`); the rest goes to ctxrelay.transports.mapflow.calibration.fit.CalibOptions
DATA_DEFAULTS = {
    "essay_texts": 8,  # training essays (cut at ctx_tokens)
    "conversations": 4,  # training ShareGPT conversations
    "needle_texts": 4,  # training needle QA at ctx_tokens
    "long_texts": 3,  # training essay haystacks at eval_tokens (mode choice)
    "long_needles": 2,  # training needle QA at eval_tokens (mode choice)
    "heldout_texts": 4,  # held-out essay haystacks at eval_tokens
    "heldout_needles": 2,  # held-out needle QA at eval_tokens
}
DATA_HELP = {
    "essay_texts": "training essays (cut at ctx_tokens)",
    "conversations": "training ShareGPT conversations",
    "needle_texts": "training needle QA at ctx_tokens",
    "long_texts": "training essay haystacks at eval_tokens (mode choice)",
    "long_needles": "training needle QA at eval_tokens (mode choice)",
    "heldout_texts": "held-out essay haystacks at eval_tokens",
    "heldout_needles": "held-out needle QA at eval_tokens",
}


def tuning_keys() -> list[TuningKey]:
    """Every `--set` key of `ctxrelay calibrate --transport mapflow`: its data's and the fit's (CalibOptions)."""
    from dataclasses import fields

    from ctxrelay.transports.mapflow.calibration.fit import OPTION_HELP, CalibOptions

    # a fit field a data key shadows (heldout_texts) never reaches the fit from `--set`: listed once
    fit = {f.name: f.default for f in fields(CalibOptions) if f.name not in DATA_DEFAULTS}
    modes = {"modes": ("mixed", "replace", "guided", "hybrid")}
    return [*keys_from(DATA_DEFAULTS, DATA_HELP), *keys_from(fit, OPTION_HELP, modes)]


def default_artifact_path(sender: str, receiver: str) -> Path:
    """Where the relay layer looks for calibrated edges: the user's <cache>/artifacts."""
    return paths.user_artifacts() / paths.artifact_name("mapflow", sender, receiver)


def _essay_texts(split: str, n: int, chars: int) -> list[str]:
    """Up to `n` essays of `split` long enough (as whole texts: calibration cuts them at token counts)."""
    return [e.text for e in essays(split) if len(e.text) >= chars][:n]


def _conversations(split: str, n: int, chars: int) -> list[str]:
    return [conversation_text(c) for c in sharegpt_conversations(limit=n, split=split, min_chars=chars)]


def _needles(tokenizer, split: str, n: int, ctx_tokens: int, seed: int) -> list[tuple[str, str]]:
    """(context with a fact, question + answer) pairs: the answer tokens are what the loss scores."""
    out = []
    for i in range(n):
        haystack = essay_haystack(tokenizer, ctx_tokens - 24, split=split, seed=seed + 11 * i)
        case = make_needle_case(haystack, depth=(0.2, 0.5, 0.8)[i % 3], seed=seed + i)
        out.append((case.context, f"{case.question} {case.answer}"))
    return out


def calibration_texts(
    tokenizer, opts: dict, ctx_tokens: int, suffix_tokens: int, eval_tokens: int, cost_tokens: int = 0, seed: int = 0
):
    """(train, held-out) texts: strings are cut at a token count, (context, suffix) pairs keep their split."""
    chars = 5 * (ctx_tokens + suffix_tokens)  # essays and chats run at ~4 characters per token
    long_n = eval_tokens + suffix_tokens + 16
    train = _essay_texts("train", int(opts["essay_texts"]), chars)
    train += _conversations("train", int(opts["conversations"]), chars)
    train += _needles(tokenizer, "train", int(opts["needle_texts"]), ctx_tokens, seed)
    long = [essay_haystack(tokenizer, long_n, "train", seed=seed + 5 * i) for i in range(int(opts["long_texts"]))]
    long += _needles(tokenizer, "train", int(opts["long_needles"]), eval_tokens, seed + 100)
    held = [essay_haystack(tokenizer, long_n, "heldout", seed=seed + 3 * i) for i in range(int(opts["heldout_texts"]))]
    held += _needles(tokenizer, "heldout", int(opts["heldout_needles"]), eval_tokens, seed + 1000)
    cost = [essay_haystack(tokenizer, cost_tokens + suffix_tokens + 16, "train", seed=seed + 99)] if cost_tokens else []
    return _interleave(train) + _interleave(long) + cost, _interleave(held)


def _interleave(texts: list) -> list:
    """Mix kinds so any prefix (selection texts, diagnosis texts) holds essays, chats and QA."""
    essays_, rest = [t for t in texts if isinstance(t, str)], [t for t in texts if not isinstance(t, str)]
    out = []
    while essays_ or rest:
        for pool in (essays_, essays_, rest):
            if pool:
                out.append(pool.pop(0))
    return out


def _split_options(options: dict | None) -> tuple[dict, dict]:
    data, rest = dict(DATA_DEFAULTS), {}
    for k, v in (options or {}).items():
        (data if k in DATA_DEFAULTS else rest)[k] = v
    return data, rest


def calibrate_job(sender: str, receiver: str, out=None, resume: bool = True, options=None, command: str = "") -> Path:
    """`ctxrelay calibrate --transport mapflow --sender S --receiver R [--out PATH] [--set k=v ...]`."""
    from ctxrelay import zoo
    from ctxrelay.transports import mapflow
    from ctxrelay.transports.mapflow.calibration.fit import CalibOptions, Refused

    sender = sender or DEFAULT_SENDER
    receiver = receiver or DEFAULT_RECEIVER
    data_opts, cal_opts = _split_options(options)
    cal_opts.setdefault("cache_dir", str(paths.cache_dir()))
    try:
        copts = CalibOptions.from_dict(cal_opts)
    except ValueError as e:
        raise UsageError(str(e)) from None
    path = Path(out) if out else default_artifact_path(sender, receiver)
    r = zoo.load(receiver)
    eval_tokens = copts.eval_tokens or copts.ctx_tokens
    train, held = calibration_texts(
        r.tokenizer, data_opts, copts.ctx_tokens, copts.suffix_tokens, eval_tokens, copts.seed
    )
    s = zoo.load(sender)
    try:
        art = mapflow.calibrate(s, r, train, held, cal_opts, command, path, resume)
    except (ValueError, Refused) as e:
        raise UsageError(str(e)) from None
    art.params["data"] = data_opts
    art.save(path)
    del s, r
    gc.collect()
    return path
