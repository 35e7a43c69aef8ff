"""Probe: a translator variant of one direction, judged where the relay serves it (recompute at 4096).

    python scripts/translator_variants_probe.py SENDER RECEIVER TAG [key=value ...]
    e.g. python scripts/translator_variants_probe.py smollm2-135m gemma3-270m nat15 e2e_native=0.15

TAG "shipped" judges the packaged artifact; any other TAG calibrates one (heterofold.calibrate with
store_rank=128 and the given calibration or data options, cached work reused) into
<cache>/heterofold/variants/TAG.safetensors, without the faithful stages `ctxrelay calibrate` adds. Each is
then judged by the recompute stage at 4096 tokens without hiding, on the 16 essays and 8 conversations
`ctxrelay calibrate ... --set stage=recompute --set recompute_tokens=4096 --set recompute_essays=16 --set
recompute_convs=8 --set hide_layers=0` uses (options st_KEY=VALUE change it, e.g. st_fractions=0.1,0.2;
default fractions 0.12,0.15). Prints and appends to <cache>/heterofold/variants/results.jsonl one line:
plain held-out quality, and top-1 agreement per f over all texts, essays and conversations. Per-text
rows stay in the variant's artifact: vs=OTHER (a tag judged before) adds the paired difference per f (mean,
its standard error, texts up / down). Not a timing run.
"""

import json
import statistics
import sys
import time

import torch

from ctxrelay import paths, zoo
from ctxrelay.artifact import Artifact
from ctxrelay.bench.heterofold_frontier import _artifact as installed_artifact
from ctxrelay.cli import _parse_sets
from ctxrelay.transports import heterofold
from ctxrelay.transports.heterofold import calib_data


def paired(art: Artifact, other_path) -> dict:
    """Per f: mean difference of top-1 agreement per text (this variant minus the other), its standard
    error, and how many texts went up and down."""
    other = Artifact.load(other_path, transport=heterofold.TRANSPORT, version=heterofold.ARTIFACT_VERSION)
    base = {(x["f"], x["text"]): x["top1_agreement"] for x in other.params["recompute_stage"]["rows"]}
    rows = art.params["recompute_stage"]["rows"]
    out = {}
    for f in sorted({x["f"] for x in rows}):
        d = [x["top1_agreement"] - base[(f, x["text"])] for x in rows if x["f"] == f and (f, x["text"]) in base]
        if len(d) > 1:
            se = statistics.stdev(d) / len(d) ** 0.5
            out[str(f)] = {
                "mean": statistics.mean(d),
                "se": se,
                "up": sum(v > 0 for v in d),
                "down": sum(v < 0 for v in d),
            }
    return out


def main() -> None:
    torch.set_num_threads(2)
    sender, receiver, tag, *sets = sys.argv[1:]
    opts = _parse_sets(sets)  # as `ctxrelay calibrate --set` reads them
    stage_opts = {k[3:]: opts.pop(k) for k in list(opts) if k.startswith("st_")}
    against = opts.pop("vs", None)
    data_opts, cal_opts = calib_data._split_options(opts)
    folder = paths.work_dir("heterofold", "variants")
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{tag}.safetensors"
    s, r = zoo.load(sender), zoo.load(receiver)
    t0 = time.time()
    if tag == "shipped":
        art = installed_artifact(sender, receiver)
        art.params.pop("recompute_stage", None)
        art.quality.pop("recompute", None)
    else:
        train, held = calib_data.calibration_texts(data_opts)
        command = f"python scripts/translator_variants_probe.py {sender} {receiver} {tag} {' '.join(sets)}"
        art = heterofold.calibrate(s, r, train, held, {"store_rank": 128, **cal_opts}, command, resume=True)
    train_info = art.params.get("train", {})
    plain = {"top1_agreement": art.quality.get("top1_agreement"), "ppl128": art.quality.get("ppl", {}).get("128"),
             "validation": {k: v["top1_agreement"] for k, v in train_info.get("validation", {}).items()}}  # fmt: skip
    t1 = time.time()
    so = {**calib_data.RECOMPUTE_DEFAULTS, "recompute_tokens": 4096, "recompute_essays": 16, "recompute_convs": 8,
          "fractions": "0.12,0.15", "hide_layers": 0, **stage_opts}  # fmt: skip
    calib_data._add_recompute_stage(s, r, art, so, "translator_variants_probe")
    art.save(out)
    essays = int(so["recompute_essays"])
    rows = art.params["recompute_stage"]["rows"]
    stage = {}
    for f in sorted({x["f"] for x in rows}):
        part = [x for x in rows if x["f"] == f]
        kinds = {"essays": [x for x in part if x["text"] < essays], "convs": [x for x in part if x["text"] >= essays]}
        stage[str(f)] = {k: statistics.mean(x["top1_agreement"] for x in v) for k, v in {"all": part, **kinds}.items()}
    line = {"tag": tag, "sender": sender, "receiver": receiver, "sets": sets, "plain": plain, "stage": stage,
            "calibrate_s": round(t1 - t0), "stage_s": round(time.time() - t1)}  # fmt: skip
    if against:
        line["paired_vs_" + str(against)] = paired(art, folder / f"{against}.safetensors")
    print(json.dumps(line))
    with open(folder / "results.jsonl", "a") as fh:
        fh.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
