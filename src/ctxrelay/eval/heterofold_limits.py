"""What limits a heterofold direction: held-out quality with one part of the translated cache
replaced by the receiver's own (an oracle), so the gap to native can be put where it comes from.

  translated      the artifact as shipped (what the relay serves)
  native-K        receiver's own keys, translated values
  native-V        translated keys, receiver's own values
  native-early    receiver's own K/V in the first half of the layers, translated in the rest
  native-late     translated in the first half, receiver's own in the second half

    python -m ctxrelay.eval.heterofold_limits --sender S --receiver R [--texts 8] [--threads 2]
writes benchmarks/results/heterofold-limits-S-to-R.json.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import torch
from tqdm import tqdm

from ctxrelay.artifact import Artifact
from ctxrelay.heterofold import quality
from ctxrelay.heterofold.transfer import TRANSPORT, assemble_cache, check_bindings
from ctxrelay.models import runner
from ctxrelay.models.runner import KVCache
from ctxrelay.models.spec import LoadedModel
from ctxrelay.state import ContextState, tokenize_with_offsets

VARIANTS = ("translated", "native-K", "native-V", "native-early", "native-late")


@torch.inference_mode()
def translated_cache(receiver: LoadedModel, state: ContextState, artifact: Artifact) -> tuple[KVCache, torch.Tensor]:
    """The receiver cache relay_prefill assembles for the whole context (no suffix run)."""
    check_bindings(receiver, state, artifact)
    ids, offsets = tokenize_with_offsets(receiver, state.text)
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
    acc: dict[str, dict[str, list]] = {v: {"agree": [], "kl": [], "nll": []} for v in VARIANTS}
    native_nll = []
    for it in tqdm(items, desc="limits", unit="text"):
        trans, ids = translated_cache(receiver, it.state, artifact)
        native = runner.forward(receiver, ids, logits="none").cache
        targets = it.suffix[1:]
        native_nll.append(-it.native_logprobs.double().gather(1, targets[:, None]).squeeze(1))
        for v in VARIANTS:
            out = runner.forward(receiver, it.suffix, mix(trans, native, v), logits="all")
            lp = torch.log_softmax(out.logits[:-1].float(), -1)
            a = acc[v]
            a["agree"].append((lp.argmax(-1) == it.native_logprobs.argmax(-1)).float())
            a["kl"].append((it.native_logprobs.exp() * (it.native_logprobs - lp)).sum(-1).clamp_min(0))
            a["nll"].append(-lp.double().gather(1, targets[:, None]).squeeze(1))
    native_ppl = quality.ppl(native_nll)
    return {
        v: {
            "top1_agreement": float(torch.cat(a["agree"]).mean()),
            "kl": float(torch.cat(a["kl"]).mean()),
            "ppl": quality.ppl(a["nll"]),
            "native_ppl": native_ppl,
        }
        for v, a in acc.items()
    }


def main(argv: list[str] | None = None) -> None:
    from ctxrelay import zoo
    from ctxrelay.eval.heterofold_jobs import DATA_DEFAULTS, calibration_texts, find_artifact
    from ctxrelay.eval.results import write_results

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sender", required=True)
    ap.add_argument("--receiver", required=True)
    ap.add_argument("--texts", type=int, default=8, help="held-out texts (the calibration's held-out set)")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads or int(os.environ.get("CTXRELAY_THREADS", 0)) or os.cpu_count() or 1)
    path = find_artifact(args.sender, args.receiver)
    if not path.exists():
        sys.exit(f"no heterofold artifact for {args.sender} -> {args.receiver} at {path}: run ctxrelay calibrate first")
    art = Artifact.load(path, transport=TRANSPORT)
    held = calibration_texts(DATA_DEFAULTS)[1][: args.texts]
    s, r = zoo.load(args.sender), zoo.load(args.receiver)
    items = [quality.make_item(s, r, t) for t in tqdm(held, desc="held-out items")]
    res = limits(r, art, items)
    rows = [
        {"transport": "heterofold", "variant": v, "sender": s.name, "receiver": r.name, **q} for v, q in res.items()
    ]
    name = f"heterofold-limits-{s.name}-to-{r.name}"
    cmd = "python -m ctxrelay.eval.heterofold_limits " + " ".join(
        map(shlex.quote, sys.argv[1:] if argv is None else argv)
    )
    out = write_results(name, rows, cmd, {"artifact": path.name, "heldout_texts": len(items)})
    for row in rows:
        h = max(row["ppl"], key=int)
        ratio = row["ppl"][h] / row["native_ppl"][h]
        print(
            f"{row['variant']:13s} top-1 {row['top1_agreement']:.3f}  KL {row['kl']:.3f}  ppl@{h} / native {ratio:.2f}"
        )
    print(f"written: {out}")


if __name__ == "__main__":
    main()
