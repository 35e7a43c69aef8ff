"""Probe: does a heterofold artifact's recompute stage read its quality high because its texts hold the
translator's own training text?

    python scripts/calibration_split_probe.py SENDER RECEIVER TOKENS F [TEXTS]   # benchmarks/results/NAME.json

The stage (`calib_data.recompute_texts`) relays train-split essay haystacks, each starting at an essay's first
chunk, and the translator was fitted on those first chunks (`calib_data.essay_chunks`: 40 chunks of 2200
characters round-robin over the 39 train essays). Three sets of TEXTS essay texts of TOKENS tokens (+ 200 for
the continuation) are relayed at recompute fraction F with the shipped artifact and the stage's own code
(`faithful.calibrate_recompute`, rule mix): the stage's haystacks; train essays with their first 4400
characters cut (text the translator never saw); held-out haystacks. Pooled and per-text top-1 agreement with
native go to benchmarks/results/calibration-split-SENDER-RECEIVER-TOKENS.json. Not a timing run.
"""

import statistics
import sys

import torch

from ctxrelay import zoo
from ctxrelay.artifact import Artifact
from ctxrelay.bench.results import write_results
from ctxrelay.data.datasets import essay_haystack, essays, rotation_seeds
from ctxrelay.transports.heterofold.calib_data import find_artifact
from ctxrelay.transports.heterofold.faithful import calibrate_recompute

SKIP = 4400  # chunk_chars 2200 x 2: the translator saw each train essay's first chunk (and essay 0's second)


def unseen_train_text(tokenizer, seed: int, n_tokens: int) -> str:
    """Train essays past their first SKIP characters, rotated by `seed`, joined and cut to about n_tokens."""
    pool = [e.text[SKIP:] for e in essays("train") if len(e.text) > SKIP + 500]
    order = pool[seed % len(pool) :] + pool[: seed % len(pool)]
    text = ""
    for part in order:
        text = part if not text else text + "\n\n" + part
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if len(enc["input_ids"]) > n_tokens:
            return text[: enc["offset_mapping"][n_tokens - 1][1]]
    return text


def main() -> None:
    sender, receiver, tokens, f = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    k = int(sys.argv[5]) if len(sys.argv) > 5 else 8
    torch.set_num_threads(2)
    s, r = zoo.load(sender), zoo.load(receiver)
    art = Artifact.load(find_artifact(sender, receiver))
    n, tok = tokens + 200, r.tokenizer
    sets = {
        "stage (train haystacks)": [essay_haystack(tok, n, split="train", seed=i) for i in rotation_seeds(k, "train")],
        "train, unseen by the translator": [unseen_train_text(tok, 3 * i, n) for i in range(k)],
        "held-out haystacks": [essay_haystack(tok, n, split="heldout", seed=i) for i in range(k)],
    }
    rows = []
    for name, texts in sets.items():
        res = calibrate_recompute(s, r, art, texts, [f], tokens=tokens)
        per = [row["top1_agreement"] for row in res["recompute_rows"]]
        rows.append({"transport": "heterofold", "sender": sender, "receiver": receiver, "texts_from": name,
                     "context_tokens": tokens, "f": f, "top1_agreement": res["recompute"][0]["top1_agreement"],
                     "per_text_top1": per, "per_text_sd": statistics.stdev(per), "texts": len(per)})  # fmt: skip
        print(name, round(rows[-1]["top1_agreement"], 4), "sd", round(rows[-1]["per_text_sd"], 4), flush=True)
    command = f"python scripts/calibration_split_probe.py {sender} {receiver} {tokens} {f} {k}"
    write_results(f"calibration-split-{sender}-{receiver}-{tokens}", rows, command)


if __name__ == "__main__":
    main()
