"""heterofold's calibration data and job (`ctxrelay calibrate --transport heterofold`).

Calibration texts (prompts only, no answers): chunks of the training essays and of training-split
ShareGPT conversations; held-out: chunks of the held-out essays and held-out conversations.
The fitting itself (fit.py) never loads data: it gets the texts from here.
"""

from __future__ import annotations

import gc
from pathlib import Path

from ctxrelay import paths
from ctxrelay.artifact import Artifact
from ctxrelay.data.datasets import (
    conversation_haystack,
    conversation_text,
    essay_haystack,
    essays,
    rotation_seeds,
    sharegpt_conversations,
)
from ctxrelay.errors import UsageError
from ctxrelay.transports.base import TuningKey, keys_from
from ctxrelay.transports.heterofold.hiding import Hide, hide_code, hide_last, hide_order

# data options (`--set key=value`), the rest goes to ctxrelay.transports.heterofold.calibration.fit.CalibConfig
DATA_DEFAULTS = {"chunk_chars": 2200, "essay_chunks": 40, "conversations": 24, "heldout_essays": 4, "heldout_convs": 4}
# the faithful mode's stage (quality per recompute fraction, the per-request estimate): training-split
# essays and conversations of about the length the relay serves
# hide_layers = k: the question and the answer skip translated entries in the receiver's first k layers
# ("global": in its full-attention layers only, hiding.py)
RECOMPUTE_DEFAULTS = {"recompute_tokens": 2048, "recompute_essays": 8, "recompute_convs": 4,
                      "fractions": "0.05,0.1,0.2,0.3", "rule": "mix", "hide_layers": 0}  # fmt: skip
# the fact-recall stage (facts.py): calibration-only needle cases, answered natively and at every fraction
FACTS_DEFAULTS = {"facts_cases": 24, "facts_tokens": 2048, "facts_new_tokens": 32}
# what the job runs (`--set stage=`, or `ctxrelay calibrate heterofold STAGE`); the fit's keys are CalibConfig's
STAGES = ("all", "recompute", "facts", "refit", "keep", "drop")
JOB_KEYS = (
    TuningKey("stage", "all", "all: fit + stages; recompute, facts: rerun that stage on the existing artifact; refit: "
              "the estimate from stored rows; keep: only --set fractions stay; drop: --set drop's points go", STAGES),
    TuningKey("drop", "", "with stage=drop: the settings whose points go (comma list: 4096, 2048+hide12, ...)"),
)  # fmt: skip
DATA_HELP = {
    "chunk_chars": "characters per calibration text (cut at a paragraph, sentence or word)",
    "essay_chunks": "training essay chunks the maps are fitted on",
    "conversations": "training ShareGPT conversation chunks the maps are fitted on",
    "heldout_essays": "held-out essay chunks of the quality report",
    "heldout_convs": "held-out conversation chunks of the quality report",
    "recompute_tokens": "context length (tokens) the recompute stage measures its points at",
    "recompute_essays": "training essay haystacks of the recompute stage",
    "recompute_convs": "training conversation histories of the recompute stage",
    "fractions": "recompute fractions measured as operating points (comma list; stage=keep: those kept)",
    "rule": "how the recompute stage picks the tokens it recomputes (the selection rule)",
    "hide_layers": "the question and answer skip translated entries in the receiver's first k layers (global: "
    "its full-attention layers only)",
    "facts_cases": "calibration-only needle cases of the fact stage",
    "facts_tokens": "context length (tokens) of the fact stage",
    "facts_new_tokens": "answer tokens generated per fact case",
}


def tuning_keys() -> list[TuningKey]:
    """Every `--set` key of `ctxrelay calibrate --transport heterofold`: the job's, its data's, the fit's."""
    import dataclasses

    from ctxrelay.transports.heterofold.calibration.fit import CALIB_HELP, CalibConfig

    fit_defaults = {f.name: f.default for f in dataclasses.fields(CalibConfig)}
    data_defaults = {**DATA_DEFAULTS, **RECOMPUTE_DEFAULTS, **FACTS_DEFAULTS}
    return [*JOB_KEYS, *keys_from(data_defaults, DATA_HELP), *keys_from(fit_defaults, CALIB_HELP)]


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


def recompute_texts(tokenizer, opts: dict) -> list[str]:
    """Training-split essay haystacks and conversation histories of recompute_tokens + a continuation."""
    n = int(opts["recompute_tokens"]) + 200
    seeds = rotation_seeds(int(opts["recompute_essays"]), "train")  # each text starts at another essay
    texts = [essay_haystack(tokenizer, n, split="train", seed=i) for i in seeds]
    texts += [conversation_haystack(tokenizer, n, "train", seed=i) for i in range(int(opts["recompute_convs"]))]
    return texts


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
    opts = {**DATA_DEFAULTS, **RECOMPUTE_DEFAULTS, **FACTS_DEFAULTS}
    rest = {}
    for k, v in (options or {}).items():
        (opts if k in opts else rest)[k] = v
    return opts, rest


def calibrate_job(sender: str, receiver: str, out=None, resume: bool = True, options=None, command: str = "") -> Path:
    """`ctxrelay calibrate --transport heterofold --sender S --receiver R [--set method=...]`.

    method=all (or a comma list) calibrates the three baselines and heterofold in one process (shared
    data, shared held-out items); baselines go to their default paths, heterofold to --out (or its default
    path); the returned path is heterofold's. heterofold's artifact then gets the faithful mode's stage
    (quality per recompute fraction, the per-request estimate) and the fact-recall stage (facts.py);
    stage=recompute or stage=facts runs only that stage on the direction's existing artifact (--out,
    else the packaged or user artifact) and rewrites it (a run at another length or hide_layers adds
    its measurements beside the others', a run at the same replaces them); stage=refit refits the
    estimate from the stored rows, stage=keep --set fractions=... keeps only those fractions as
    operating points and stage=drop --set drop=4096,... drops the points of those settings (no model
    runs). own_layers=k (default 1 for new artifacts; artifacts without it
    serve 0): the receiver's own K/V in its first k layers; given with stage=recompute or facts on an
    artifact served with another k, it drops both stages' measurements first.
    """
    from ctxrelay import zoo
    from ctxrelay.transports import heterofold
    from ctxrelay.transports.heterofold.calibration import fit

    data_opts, cal_opts = _split_options(options)
    if sender == receiver:
        raise UsageError("heterofold transfers between two different models; sender and receiver are the same")
    method = cal_opts.pop("method", "heterofold")
    methods = list(fit.METHODS) if method == "all" else str(method).split(",")
    bad = [m for m in methods if m not in fit.METHODS]
    if bad:
        known = ", ".join(fit.METHODS)
        raise UsageError(f"unknown heterofold method(s) {bad}: use all, or a comma list of {known}")
    stage = cal_opts.pop("stage", "all")
    if stage not in ("all", "recompute", "facts", "refit", "keep", "drop"):
        raise UsageError(
            f"unknown heterofold calibration stage {stage!r}: use all, recompute, facts, refit, keep or drop"
        )
    command = command or _command(sender, receiver, options)
    if "own_layers" in cal_opts and stage in ("refit", "keep"):
        raise UsageError("own_layers changes what the relay serves: set it with stage=recompute (or all), not " + stage)
    if stage == "refit":  # the estimate again from the recompute stage's stored rows (no model runs)
        return _refit(Path(out) if out else find_artifact(sender, receiver), command)
    if stage == "keep":  # only the listed fractions stay operating points (no model runs)
        if "fractions" not in (options or {}):
            raise UsageError("stage=keep needs --set fractions=F1,F2,...: the fractions to keep as operating points")
        fracs = [float(f) for f in str(data_opts["fractions"]).split(",") if f]
        return _refit(Path(out) if out else find_artifact(sender, receiver), command, keep=fracs)
    if stage == "drop":  # the points of these settings stop being operating points (no model runs)
        keys = [k for k in str(cal_opts.get("drop", "")).split(",") if k]
        if not keys:
            raise UsageError("stage=drop needs --set drop=SETTING,...: settings such as 4096, 2048+hide12")
        return _refit(Path(out) if out else find_artifact(sender, receiver), command, drop=keys)
    s, r = zoo.load(sender), zoo.load(receiver)
    path = None
    if stage in ("recompute", "facts"):
        path = Path(out) if out else find_artifact(sender, receiver)
        if not path.exists():
            raise UsageError(f"no heterofold artifact at {path} to add the {stage} stage to: calibrate it first")
        art = Artifact.load(path, transport=heterofold.TRANSPORT, version=heterofold.ARTIFACT_VERSION)
        if "own_layers" in cal_opts:
            _set_own_layers(art, int(cal_opts["own_layers"]), r.spec.num_layers)
        if stage == "recompute":
            _add_recompute_stage(s, r, art, data_opts, command)
        else:  # hiding as the recompute stage's last run unless --set hide_layers says (0 included)
            given = hide_code(options["hide_layers"]) if "hide_layers" in (options or {}) else None
            _add_facts_stage(s, r, art, data_opts, command, hide=given)
        art.save(path)
        return path
    train, held = calibration_texts(data_opts)
    for m in methods:
        try:
            art = fit.calibrate(s, r, train, held, {**cal_opts, "method": m}, command, resume=resume)
        except ValueError as e:
            raise UsageError(str(e)) from None
        art.params["data"] = data_opts
        if m == "heterofold":
            _add_recompute_stage(s, r, art, data_opts, command)
            _add_facts_stage(s, r, art, data_opts, command)
        path = Path(out) if out and m == "heterofold" else default_artifact_path(sender, receiver, m)
        art.save(path)
    del s, r
    gc.collect()
    return path


def _set_own_layers(art: Artifact, k: int, receiver_layers: int) -> None:
    """Serve the artifact with the receiver's own K/V in its first k layers. What the recompute and fact
    stages measured with another k described another relay: dropped (rerun them at each length)."""
    from ctxrelay.transports.heterofold.transfer import check_own_layers

    k = check_own_layers(k, receiver_layers)
    if k == int(art.params.get("own_layers", 0)):
        return
    # the plain-translation report (quality's top level) stays as measured: say with which K/V
    art.params.setdefault("report_own_layers", int(art.params.get("own_layers", 0)))
    dropped = [name for name in ("recompute_stage", "facts_stage") if art.params.pop(name, None)]
    for key in ("recompute", "facts", "estimate"):
        art.quality.pop(key, None)
    art.params["own_layers"] = k
    if dropped:
        print(f"own_layers={k}: dropped the {' and '.join(dropped)} measured with other K/V; rerun each at its lengths")


def _refit(path: Path, command: str, keep: list[float] | None = None, drop: list[str] | None = None) -> Path:
    """The estimate refitted from the recompute stage's stored rows (no model runs); with `keep`, first
    drop every recompute fraction but those (stage=keep, `_drop_fractions`); with `drop`, every point of
    those settings (stage=drop, `_drop_settings`)."""
    from ctxrelay.transports import heterofold
    from ctxrelay.transports.heterofold.calibration.fractions import estimate_entry

    art = Artifact.load(path, transport=heterofold.TRANSPORT, version=heterofold.ARTIFACT_VERSION)
    stage = art.params.get("recompute_stage")
    if not stage:
        what = "refit" if keep is None and drop is None else "keep or drop points of"
        raise UsageError(f"{path} has no recompute stage to {what}: run --set stage=recompute first")
    if keep is not None:
        _drop_fractions(art, stage, keep)
    if drop is not None:
        _drop_settings(art, stage, drop)
    art.quality["estimate"] = estimate_entry(stage["rows"], stage.get("rule", "mix"))
    stage["keep_command" if keep is not None else "drop_command" if drop is not None else "refit_command"] = command
    art.save(path)
    return path


def _drop_fractions(art: Artifact, stage: dict, fractions: list[float]) -> None:
    """Drop every recompute fraction but `fractions` from the table, the stored rows and the fact
    stage (f = 0, plain translation, stays): the gate can no longer serve a dropped point (e.g. one
    that failed a held-out check the calibration texts did not catch)."""
    have = sorted({round(float(q["f"]), 6) for q in art.quality.get("recompute", [])})
    want = {round(f, 6) for f in fractions}
    if not want or want - set(have):
        raise UsageError(f"--set fractions= must list fractions the recompute stage measured: it has {have}")

    def kept(x: dict) -> bool:
        return round(float(x["f"]), 6) in want

    art.quality["recompute"] = [q for q in art.quality["recompute"] if kept(q)]
    stage["rows"] = [x for x in stage["rows"] if kept(x)]
    if "facts" in art.quality:
        art.quality["facts"] = [q for q in art.quality["facts"] if q["f"] == 0 or kept(q)]
        facts_stage = art.params.get("facts_stage") or {}
        facts_stage["rows"] = [x for x in facts_stage.get("rows", []) if x["f"] == 0 or kept(x)]


def _drop_settings(art: Artifact, stage: dict, keys: list[str]) -> None:
    """Drop the points measured at these settings (Setting.key: "4096", "2048+hide12", "4096+hideglobal")
    from the recompute table, its rows and runs, and the fact entries, rows and runs at those settings
    (f = 0 stays): e.g. the unhidden points at 4096 once points hiding the full-attention layers replace
    them there. A point measured at other settings too keeps those."""
    from ctxrelay.transports.heterofold.recompute.settings import (
        Setting,
        stage_setting,
        with_setting,
    )

    table = with_setting(art.quality.get("recompute", []), *stage_setting(stage))
    have = {(q["tokens"], q["hide_translated"]) for q in table if q["f"]}
    drop = {Setting.parse(k) for k in keys}
    if drop - have:
        known = ", ".join(Setting(*h).key for h in sorted(have, key=hide_last))
        raise UsageError(f"--set drop= must list settings the recompute stage measured: it has {known}")

    def gone(x: dict) -> bool:
        return bool(x["f"]) and (x["tokens"], x["hide_translated"]) in drop

    art.quality["recompute"] = [q for q in table if not gone(q)]
    stage["rows"] = [x for x in with_setting(stage.get("rows", []), *stage_setting(stage)) if not gone(x)]
    stage["lengths"] = {k: v for k, v in (stage.get("lengths") or {}).items() if Setting.parse(k) not in drop}
    facts_stage = art.params.get("facts_stage")
    if facts_stage:
        at = stage_setting(facts_stage, "facts_tokens")
        runs = _facts_runs(facts_stage, art.quality.get("facts", []))
        art.quality["facts"] = [e for e in with_setting(art.quality.get("facts", []), *at) if not gone(e)]
        facts_stage["rows"] = [x for x in with_setting(facts_stage.get("rows", []), *at) if not gone(x)]
        facts_stage["runs"] = [v for v in runs if _run_setting(v) not in drop]


def _run_setting(run: dict) -> tuple:
    """(tokens, hiding) a fact-stage run measured at."""
    return int(run.get("facts_tokens", FACTS_DEFAULTS["facts_tokens"])), hide_code(run.get("hide_layers", 0))


def _add_recompute_stage(s, r, art: Artifact, opts: dict, command: str) -> None:
    """The faithful stage at opts["recompute_tokens"] with opts["hide_layers"]. It replaces what the
    stage measured at that length with that hiding and keeps the rest measured with the same rule (each
    run's command is kept): `--set recompute_tokens=4096` after the default 2048 calibrates the gate at
    both lengths, and `--set hide_layers=12 --set recompute_tokens=4096` adds points that hide beside
    points that do not (each is an operating point of its own, served where it was measured)."""
    from ctxrelay.transports.heterofold.calibration.fractions import calibrate_recompute, estimate_entry
    from ctxrelay.transports.heterofold.recompute.settings import stage_setting, with_setting

    n, rule, hide = int(opts["recompute_tokens"]), str(opts["rule"]), hide_code(opts["hide_layers"])
    fracs = [float(f) for f in str(opts["fractions"]).split(",") if f]
    old = art.params.get("recompute_stage") or {}
    same_rule = old.get("rule", "mix") == rule

    def keep(x: dict) -> bool:
        return same_rule and (x["tokens"], x["hide_translated"]) != (n, hide)

    rows = [x for x in with_setting(old.get("rows", []), *stage_setting(old)) if keep(x)]
    table = [q for q in with_setting(art.quality.get("recompute", []), *stage_setting(old)) if keep(q)]
    runs = [v for v in _recompute_runs(old) if same_rule and _run_key(v) != _run_key(opts)]
    res = calibrate_recompute(s, r, art, recompute_texts(r.tokenizer, opts), fracs, rule, tokens=n, hide=hide,
                              cache=paths.work_dir("heterofold", "items"))  # fmt: skip
    rows += res["recompute_rows"]
    table = sorted(table + res["recompute"], key=_by_setting)
    art.quality.update(recompute=table, estimate=estimate_entry(rows, rule))
    runs.append({"command": command, **{k: opts[k] for k in RECOMPUTE_DEFAULTS}})
    runs.sort(key=lambda v: (hide_order(v["hide_layers"]), int(v["recompute_tokens"])))
    art.params["recompute_stage"] = {"command": command, "rows": rows, **{k: opts[k] for k in RECOMPUTE_DEFAULTS},
                                     "lengths": {_run_key(v): v for v in runs}}  # fmt: skip


def _by_setting(entry: dict) -> tuple:
    """Table order: by hiding, then length, then f."""
    return hide_order(entry.get("hide_translated", 0)), entry["tokens"], entry["f"]


def _recompute_runs(stage: dict) -> list[dict]:
    """Each run of the recompute stage with its length and hiding (older stages kept one per length)."""
    if not stage:
        return []
    n, hide = stage.get("recompute_tokens", RECOMPUTE_DEFAULTS["recompute_tokens"]), stage.get("hide_layers", 0)
    runs = stage.get("lengths") or {str(n): {"command": stage.get("command")}}
    return [{**v, "recompute_tokens": int(v.get("recompute_tokens", k.split("+")[0])),
             "hide_layers": hide_code(v.get("hide_layers", hide))}
            for k, v in runs.items() if v.get("command")]  # fmt: skip


def _run_key(run: dict) -> str:
    from ctxrelay.transports.heterofold.recompute.settings import Setting

    return Setting(run["recompute_tokens"], run["hide_layers"]).key


def _add_facts_stage(s, r, art: Artifact, opts: dict, command: str, hide: Hide | None = None) -> None:
    """Fact recall at the points the gate serves, at opts["facts_tokens"], hiding `hide` layers (default:
    the recompute stage's last run). It replaces the entries measured at that length with that hiding
    for these fractions (and f = 0) and keeps the others, so a point that hides at 4096 tokens gets its
    own fact check beside one that does not hide at 2048."""
    from ctxrelay.transports.heterofold.calibration.facts import calibrate_facts
    from ctxrelay.transports.heterofold.recompute.settings import stage_setting, with_setting

    fracs = [0.0] + [float(f) for f in str(opts["fractions"]).split(",") if f]
    if hide is None:
        hide = hide_code((art.params.get("recompute_stage") or {}).get("hide_layers", 0))
    n = int(opts["facts_tokens"])
    old = art.params.get("facts_stage") or {}
    res = calibrate_facts(s, r, art, fracs, str(opts["rule"]), cases=int(opts["facts_cases"]), tokens=n,
                          new_tokens=int(opts["facts_new_tokens"]), root=paths.work_dir("heterofold", "states"),
                          hide=hide)  # fmt: skip
    new = {(n, hide if f else 0, round(f, 6)) for f in fracs}

    def keep(x: dict) -> bool:
        return (x["tokens"], x["hide_translated"], round(float(x["f"]), 6)) not in new

    entries = [e for e in with_setting(art.quality.get("facts", []), *stage_setting(old, "facts_tokens")) if keep(e)]
    rows = [x for x in with_setting(old.get("rows", []), *stage_setting(old, "facts_tokens")) if keep(x)]
    runs = [v for v in _facts_runs(old, art.quality.get("facts", [])) if not _replaced(v, n, hide, fracs)]
    runs.append({"command": command, "hide_layers": hide, "fractions": str(opts["fractions"]),
                 **{k: opts[k] for k in FACTS_DEFAULTS}})  # fmt: skip
    art.quality["facts"] = sorted(entries + res["facts"], key=_by_setting)
    art.params["facts_stage"] = {"command": command, "rows": rows + res["rows"], "rule": str(opts["rule"]),
                                 "hide_layers": hide, **{k: opts[k] for k in FACTS_DEFAULTS}, "runs": runs}  # fmt: skip


def _facts_runs(stage: dict, entries: list[dict]) -> list[dict]:
    """Each run of the fact stage (older stages were one run, described by the stage's own fields and
    the fractions of its entries)."""
    if not stage:
        return []
    one = {k: stage[k] for k in ("command", "hide_layers", *FACTS_DEFAULTS) if k in stage}
    one["fractions"] = ",".join(str(e["f"]) for e in entries if e["f"])
    return list(stage.get("runs") or [one])


def _replaced(run: dict, tokens: int, hide: Hide, fractions: list[float]) -> bool:
    """Whether a new run at (tokens, hide) over `fractions` re-measured everything `run` measured."""
    same = _run_setting(run) == (tokens, hide)
    had = {round(float(f), 6) for f in str(run.get("fractions", "")).split(",") if f}
    return same and had <= {round(f, 6) for f in fractions}


def _command(sender: str, receiver: str, options: dict | None) -> str:
    sets = " ".join(f"--set {k}={v}" for k, v in (options or {}).items())
    return f"ctxrelay calibrate --transport heterofold --sender {sender} --receiver {receiver} {sets}".strip()
