"""What limits a heterofold direction: held-out quality with one part of the translated cache
replaced by the receiver's own (an oracle), so the gap to native can be put where it comes from.

  translated      the artifact as shipped (what the relay serves)
  native-K        receiver's own keys, translated values
  native-V        translated keys, receiver's own values
  native-early    receiver's own K/V in the first half of the layers, translated in the rest
  native-late     translated in the first half, receiver's own in the second half

    ctxrelay bench heterofold-limits --sender S --receiver R [--set texts=8] [--threads 2]
writes benchmarks/results/heterofold-limits-S-to-R.json.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from ctxrelay.artifact import Artifact
from ctxrelay.errors import UsageError
from ctxrelay.metrics import PooledQuality
from ctxrelay.models import runner
from ctxrelay.models.runner import KVCache
from ctxrelay.models.spec import LoadedModel
from ctxrelay.models.tokens import tokenize_context
from ctxrelay.state import ContextState
from ctxrelay.transports.base import keys_from
from ctxrelay.transports.heterofold.calibration import heldout as quality
from ctxrelay.transports.heterofold.transfer import TRANSPORT, assemble_cache, check_state

VARIANTS = ("translated", "native-K", "native-V", "native-early", "native-late")


@torch.inference_mode()
def translated_cache(receiver: LoadedModel, state: ContextState, artifact: Artifact) -> tuple[KVCache, torch.Tensor]:
    """The receiver cache relay_prefill assembles for the whole context (no suffix run), with the receiver's
    own K/V in as many first layers as the artifact serves (params["own_layers"])."""
    check_state(receiver, state, artifact)
    ids, offsets = tokenize_context(receiver, state.text)
    return assemble_cache(receiver, state, artifact, ids, offsets)[0], ids


def mix(translated: KVCache, native: KVCache, variant: str) -> KVCache:
    n = len(translated.keys)
    half = n // 2
    own_k = own_v = set()
    if variant == "native-K":
        own_k = set(range(n))
    elif variant == "native-V":
        own_v = set(range(n))
    elif variant == "native-early":
        own_k = own_v = set(range(half))
    elif variant == "native-late":
        own_k = own_v = set(range(half, n))
    elif variant != "translated":
        raise ValueError(f"unknown variant {variant!r}; use one of {', '.join(VARIANTS)}")
    keys = [(native if i in own_k else translated).keys[i].clone() for i in range(n)]
    values = [(native if i in own_v else translated).values[i].clone() for i in range(n)]
    return KVCache(keys, values)


@torch.inference_mode()
def limits(receiver: LoadedModel, artifact: Artifact, items: list[quality.HeldoutItem]) -> dict[str, dict]:
    """top-1 agreement, KL and ppl per horizon of every variant over the held-out items."""
    acc = {v: PooledQuality() for v in VARIANTS}
    for it in tqdm(items, desc="limits", unit="text"):
        trans, ids = translated_cache(receiver, it.state, artifact)
        native = runner.forward(receiver, ids, logits="none").cache
        for v in VARIANTS:
            out = runner.forward(receiver, it.suffix, mix(trans, native, v), logits="all")
            acc[v].add(it.native_logprobs, torch.log_softmax(out.logits[:-1].float(), -1), it.suffix[1:])
    results = {v: a.result(quality.HORIZONS) for v, a in acc.items()}
    return {v: {k: r[k] for k in ("top1_agreement", "kl", "ppl", "native_ppl")} for v, r in results.items()}


OPTIONS = {"texts": 8}  # held-out texts (the calibration's held-out set)
# `ctxrelay bench heterofold-limits --keys`: each `--set` key, its default and meaning
TUNING_KEYS = keys_from(
    OPTIONS,
    {
        "texts": "held-out texts (the calibration's held-out set)",
    },
)


def bench(model="", sender="", receiver="", lengths=(), repeats=1, out="", options=None, command="") -> Path:
    """`ctxrelay bench heterofold-limits --sender S --receiver R [--set texts=8]` (lengths/repeats unused:
    the calibration's held-out texts are the cases) -> benchmarks/results/heterofold-limits-S-to-R.json."""
    from ctxrelay import zoo
    from ctxrelay.results import write_results
    from ctxrelay.transports.heterofold.calibration.job import DATA_DEFAULTS, calibration_texts, find_artifact

    unknown = sorted(set(options or {}) - set(OPTIONS))
    if unknown:
        raise UsageError(f"unknown heterofold-limits option(s) {unknown}; known: {sorted(OPTIONS)}")
    if model or not sender or not receiver or "," in sender + receiver:
        raise UsageError("bench heterofold-limits diagnoses one direction: pass --sender S --receiver R")
    n_texts = int({**OPTIONS, **(options or {})}["texts"])
    path = find_artifact(sender, receiver)
    if not path.exists():
        raise UsageError(f"no heterofold artifact for {sender} -> {receiver} at {path}: run ctxrelay calibrate first")
    art = Artifact.load(path, transport=TRANSPORT)
    held = calibration_texts(DATA_DEFAULTS)[1][:n_texts]
    s, r = zoo.load(sender), zoo.load(receiver)
    items = [quality.make_item(s, r, t) for t in tqdm(held, desc="held-out items")]
    res = limits(r, art, items)
    rows = [
        {"transport": "heterofold", "variant": v, "sender": s.name, "receiver": r.name, **q} for v, q in res.items()
    ]
    name = out if out and out != "heterofold-limits" else f"heterofold-limits-{s.name}-to-{r.name}"
    cmd = command or f"ctxrelay bench heterofold-limits --sender {sender} --receiver {receiver}"
    written = write_results(name, rows, cmd, {"artifact": path.name, "heldout_texts": len(items)})
    for row in rows:
        h = max(row["ppl"], key=int)
        ratio = row["ppl"][h] / row["native_ppl"][h]
        print(
            f"{row['variant']:13s} top-1 {row['top1_agreement']:.3f}  KL {row['kl']:.3f}  ppl@{h} / native {ratio:.2f}"
        )
    return written
