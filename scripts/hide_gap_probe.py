"""Probe: does the gap between a relay's predictions with the translated entries visible and hidden
(hide_translated 0 vs k vs every layer) rank requests by their top-1 agreement with native prefill?

A candidate per-request estimate (issue 11): it needs no native run, only the suffix run again under another
hiding. Per text at one f: top-1 agreement of the relay at hide k over a 129-token continuation, and the total
variation / argmax disagreement between the variants over the first m continuation rows; Spearman over texts.

    python scripts/hide_gap_probe.py smollm2-135m gemma3-270m 2048 0.2 12 12 6 heterofold-hide-gap-probe
    (sender, receiver, context tokens, f, k, essays, conversations, results name)
"""

import json
import sys

import torch
from scipy.stats import spearmanr

from ctxrelay import zoo
from ctxrelay.artifact import Artifact
from ctxrelay.bench.results import write_results
from ctxrelay.data.datasets import conversation_haystack, essay_haystack
from ctxrelay.metrics import position_agreement
from ctxrelay.paths import find_artifact
from ctxrelay.transports.heterofold import quality as heldout
from ctxrelay.transports.heterofold.transfer import relay_prefill

ROWS = (1, 2, 4, 8, 16, 128)


def main(sender: str, receiver: str, tokens: int, f: float, k: int, essays: int, convs: int, out: str) -> None:
    torch.set_num_threads(2)
    art = Artifact.load(find_artifact("heterofold", sender, receiver))
    s, r = zoo.load(sender), zoo.load(receiver)
    # training-split texts, seeds apart from the calibration's (essays 3i, conversations i)
    texts = [essay_haystack(r.tokenizer, tokens + 200, split="train", seed=3 * i + 100) for i in range(essays)]
    texts += [conversation_haystack(r.tokenizer, tokens + 200, "train", seed=i + 50) for i in range(convs)]
    hides = sorted({0, k, r.spec.num_layers})
    rows = []
    for i, text in enumerate(texts):
        it = heldout.make_item(s, r, text, 129)
        lp = {}
        for h in hides:
            o = relay_prefill(r, it.state, art, it.suffix, logits="all", recompute=f, selection="mix", query="",
                              hide_translated=h)  # fmt: skip
            lp[h] = torch.log_softmax(o.logits[:-1].float(), -1)
        top1 = float(position_agreement(it.native_logprobs, lp[k]).mean())
        row = {"transport": "heterofold", "text": i, "top1": top1}
        row.update({f"top1_h{h}": float(position_agreement(it.native_logprobs, x).mean()) for h, x in lp.items()})
        for m in ROWS:
            for a, b in ((0, k), (k, r.spec.num_layers), (0, r.spec.num_layers)):
                pa, pb = lp[a][:m], lp[b][:m]
                row[f"tv{m}_{a}_{b}"] = float(0.5 * (pa.exp() - pb.exp()).abs().sum(-1).mean())
                row[f"dis{m}_{a}_{b}"] = 1.0 - float(position_agreement(pa, pb).mean())
        rows.append(row)
        print(json.dumps({key: round(v, 4) if isinstance(v, float) else v for key, v in row.items()}), flush=True)
    y = [x["top1"] for x in rows]
    rho = {key: float(spearmanr([x[key] for x in rows], y).statistic)
           for key in rows[0] if key.startswith(("tv", "dis")) and len({x[key] for x in rows}) > 1}  # fmt: skip
    for key, v in rho.items():
        print(f"{key}: Spearman with top-1 {v:.3f}")
    command = "python scripts/hide_gap_probe.py " + " ".join(sys.argv[1:])
    extra = {"sender": sender, "receiver": receiver, "tokens": tokens, "f": f, "hide": k, "texts": len(rows),
             "spearman": rho}  # fmt: skip
    print(write_results(out, rows, command, extra))


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], int(a[2]), float(a[3]), int(a[4]), int(a[5]), int(a[6]), a[7])
