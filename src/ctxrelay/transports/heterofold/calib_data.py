"""heterofold's calibration data and job (`ctxrelay calibrate --transport heterofold`).

Calibration texts (prompts only, no answers): chunks of the training essays and of training-split
ShareGPT conversations; held-out: chunks of the held-out essays and held-out conversations.
The fitting itself (calibrate.py) never loads data: it gets the texts from here.
"""

from __future__ import annotations

import gc
from pathlib import Path

from ctxrelay import paths
from ctxrelay.data.datasets import conversation_text, essays, sharegpt_conversations
from ctxrelay.errors import UsageError

# data options (`--set key=value`), the rest goes to ctxrelay.transports.heterofold.calibrate.CalibConfig
DATA_DEFAULTS = {"chunk_chars": 2200, "essay_chunks": 40, "conversations": 24, "heldout_essays": 4, "heldout_convs": 4}


def chunk(text: str, chars: int) -> list[str]:
    """Pieces of about `chars` characters cut at a paragraph, else sentence, line or word boundary."""
    out, start = [], 0
    while len(text) - start >= chars:
        window = text[start : start + chars]
        cut = chars
        for sep in ("\n\n", ". ", "\n", " "):
            i = window.rfind(sep)
            if i >= chars // 2:
                cut = i + len(sep)
                break
        if window[:cut].strip():
            out.append(window[:cut].strip())
        start += cut
    return out


def essay_chunks(split: str, n: int, chars: int) -> list[str]:
    """`n` chunks taken round-robin over the essays of `split` (diverse topics, not one long essay)."""
    per = [chunk(e.text, chars) for e in essays(split)]
    out, i = [], 0
    while len(out) < n and any(i < len(p) for p in per):
        out.extend(p[i] for p in per if i < len(p) and len(out) < n)
        i += 1
    return out


def conversation_chunks(split: str, n: int, chars: int) -> list[str]:
    convs = sharegpt_conversations(limit=4 * n, split=split, min_chars=chars + 200)
    out = []
    for c in convs:
        pieces = chunk(conversation_text(c), chars)
        if pieces:
            out.append(pieces[0])
        if len(out) == n:
            break
    return out


def calibration_texts(opts: dict) -> tuple[list[str], list[str]]:
    chars = int(opts["chunk_chars"])
    train = essay_chunks("train", int(opts["essay_chunks"]), chars)
    train += conversation_chunks("train", int(opts["conversations"]), chars)
    held = essay_chunks("heldout", int(opts["heldout_essays"]), chars)
    held += conversation_chunks("heldout", int(opts["heldout_convs"]), chars)
    return train, held


def find_artifact(sender: str, receiver: str, method: str = "heterofold") -> Path:
    """The packaged artifact of a direction if the package ships one, else the default path."""
    if method == "heterofold":
        return paths.find_artifact("heterofold", sender, receiver)
    return default_artifact_path(sender, receiver, method)


def default_artifact_path(sender: str, receiver: str, method: str = "heterofold") -> Path:
    """Full heterofold artifacts go where the relay layer looks (<cache>/artifacts); baselines do not
    (they would become competing relay edges)."""
    if method == "heterofold":
        return paths.user_artifacts() / paths.artifact_name("heterofold", sender, receiver)
    return paths.variant_artifact("heterofold", sender, receiver, method)


def _split_options(options: dict | None) -> tuple[dict, dict]:
    opts = dict(DATA_DEFAULTS)
    rest = {}
    for k, v in (options or {}).items():
        (opts if k in DATA_DEFAULTS else rest)[k] = v
    return opts, rest


def calibrate_job(sender: str, receiver: str, out=None, resume: bool = True, options=None, command: str = "") -> Path:
    """`ctxrelay calibrate --transport heterofold --sender S --receiver R [--set method=...]`.

    method=all (or a comma list) calibrates the three baselines and heterofold in one process (shared
    data, shared held-out items); baselines go to their default paths, heterofold to --out (or its default
    path); the returned path is heterofold's.
    """
    from ctxrelay import zoo
    from ctxrelay.transports import heterofold

    data_opts, cal_opts = _split_options(options)
    if sender == receiver:
        raise UsageError("heterofold transfers between two different models; sender and receiver are the same")
    method = cal_opts.pop("method", "heterofold")
    methods = list(heterofold.METHODS) if method == "all" else str(method).split(",")
    bad = [m for m in methods if m not in heterofold.METHODS]
    if bad:
        known = ", ".join(heterofold.METHODS)
        raise UsageError(f"unknown heterofold method(s) {bad}: use all, or a comma list of {known}")
    command = command or _command(sender, receiver, options)
    train, held = calibration_texts(data_opts)
    s, r = zoo.load(sender), zoo.load(receiver)
    path = None
    for m in methods:
        try:
            art = heterofold.calibrate(s, r, train, held, {**cal_opts, "method": m}, command, resume=resume)
        except ValueError as e:
            raise UsageError(str(e)) from None
        art.params["data"] = data_opts
        path = Path(out) if out and m == "heterofold" else default_artifact_path(sender, receiver, m)
        art.save(path)
    del s, r
    gc.collect()
    return path


def _command(sender: str, receiver: str, options: dict | None) -> str:
    sets = " ".join(f"--set {k}={v}" for k, v in (options or {}).items())
    return f"ctxrelay calibrate --transport heterofold --sender {sender} --receiver {receiver} {sets}".strip()
