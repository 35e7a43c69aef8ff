"""Calibration of one sender -> receiver pair: moments, closed-form init search, output-aware
rank-r corrections, folding, held-out report, artifact.

Stages (each cached or checkpointed under the work directory, so an interrupted run resumes):
  1. data      sender K/V and receiver targets per text (text_cache.py, cached per model and text)
  2. moments   second moments of TA-aligned pairs per receiver layer and role
  3. init      closed-form fits (ridge, recolor at several gamma/eps) scored end to end on held-out
               texts; the best per role starts the calibration (the search is kept in the artifact)
  4. correct   rank-r corrections trained layer-locally with the receiver's own queries:
               K: its attention weights (KL) and their effect through o_proj; V: the attention
               output through o_proj with the native attention pattern held fixed. Prompts only.
  5. fold      W + A B, b + db -> one affine map per layer and role; optional low-rank storage
  6. report    held-out top-1 agreement, KL and perplexity of the stored artifact
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ctxrelay import tensorfile
from ctxrelay.artifact import Artifact
from ctxrelay.models.spec import LoadedModel
from ctxrelay.transports.heterofold.calibration import heldout, text_cache
from ctxrelay.transports.heterofold.calibration.e2e import train_e2e
from ctxrelay.transports.heterofold.calibration.recolor import Moments, fit_recolor, fit_ridge
from ctxrelay.transports.heterofold.calibration.sources import choose as choose_sources
from ctxrelay.transports.heterofold.calibration.train import Corrections, feature_scales, train_corrections
from ctxrelay.transports.heterofold.kv_maps import ROLES, AffineMap, FoldMaps, layer_features
from ctxrelay.transports.heterofold.transfer import check_own_layers, make_artifact

METHODS = ("same-index", "ridge+ta", "recolor+ta", "heterofold")


@dataclass
class CalibConfig:
    method: str = "heterofold"  # same-index | ridge+ta | recolor+ta | heterofold
    ridge_alpha: float = 1e-3  # ridge penalty, relative to the mean eigenvalue of Cxx
    recolor_gamma: float = -1.0  # < 0: searched over gammas (held-out); else fixed
    recolor_eps: float = -1.0  # < 0: searched over epss; else fixed
    gammas: str = "0"
    epss: str = "0.001,0.03"
    rank: int = 16  # rank of the output-aware corrections
    epochs: int = 2
    lr: float = 2e-3
    weight_decay: float = 1e-4
    kl_weight: float = 1.0  # key loss = kl_weight * KL(native attn || mapped) + o_proj output error
    query_rows: int = 128  # sampled receiver query rows per calibration text
    heldout_suffix: int = 129  # continuation tokens per held-out text (ppl@128 needs 129)
    e2e_epochs: int = 3  # end-to-end refinement passes (0 = the paper's layer-local objectives only)
    e2e_tokens: int = 128  # receiver tokens run natively per text in the end-to-end stage
    e2e_lr: float = 5e-4
    e2e_native: float = 0.0  # share of each context's last tokens kept native in the end-to-end stage
    store_rank: int = 0  # > 0: store each folded map as rank-`store_rank` factors (small artifacts)
    # the receiver's own K/V in its first k layers for every context token, not translated (params["own_layers"]:
    # every relay from the artifact). Layer 0's cost only its token embeddings' projections. Measured on the
    # recompute stage's 24 texts: into qwen-0.5b (from gemma3) top-1 +0.005 / +0.013 at f = 0.3 / 0.4 and 2048
    # tokens, +0.017 / +0.019 at 4096; into gemma3 (from smollm2, 4096) -0.001..+0.000: free, never worse
    own_layers: int = 1
    # which sender layers each receiver layer's map reads (sources.py): offsets (the aligned layer and +-4) or
    # greedy (the source_layers layers that most lower the validation error of a ridge map, per receiver layer)
    source_select: str = "offsets"
    source_layers: int = 3
    val_every: int = 16  # every n-th training text is validation (not fitted on)
    seed: int = 0

    @staticmethod
    def from_options(options: dict | None) -> CalibConfig:
        fields = {f.name: f for f in dataclasses.fields(CalibConfig)}
        unknown = sorted(set(options or {}) - set(fields))
        if unknown:
            raise ValueError(f"unknown heterofold option(s) {unknown}; known: {sorted(fields)}")
        cfg = CalibConfig(**(options or {}))
        if cfg.method not in METHODS:
            raise ValueError(f"unknown heterofold method {cfg.method!r}; use one of {', '.join(METHODS)}")
        return cfg

    @property
    def pairing(self) -> str:
        return "same-index" if self.method == "same-index" else "ta"


# one line per CalibConfig field: what `ctxrelay calibrate --keys --transport heterofold` says of it
CALIB_HELP = {
    "method": "what to fit: same-index | ridge+ta | recolor+ta | heterofold (the job also takes all, or a comma list)",
    "ridge_alpha": "ridge penalty, relative to the mean eigenvalue of Cxx",
    "recolor_gamma": "recolor gamma (< 0: searched over gammas on held-out texts)",
    "recolor_eps": "recolor eps (< 0: searched over epss on held-out texts)",
    "gammas": "the gammas the init search tries (comma list)",
    "epss": "the epss the init search tries (comma list)",
    "rank": "rank of the output-aware corrections",
    "epochs": "passes of the layer-local correction training",
    "lr": "learning rate of the corrections",
    "weight_decay": "weight decay of the corrections",
    "kl_weight": "key loss = kl_weight * KL(native attention || mapped) + o_proj output error",
    "query_rows": "sampled receiver query rows per calibration text",
    "heldout_suffix": "continuation tokens per held-out text (ppl@128 needs 129)",
    "e2e_epochs": "end-to-end refinement passes (0: the layer-local objectives only)",
    "e2e_tokens": "receiver tokens run natively per text in the end-to-end stage",
    "e2e_lr": "learning rate of the end-to-end stage",
    "e2e_native": "share of each context's last tokens kept native in the end-to-end stage",
    "store_rank": "> 0: store each folded map as rank-k factors (small artifacts)",
    "own_layers": "the receiver's own K/V in its first k layers for every context token, not translated",
    "source_select": "which sender layers a receiver layer's map reads: offsets (aligned layer and +-4) | greedy "
    "(chosen per receiver layer by validation error)",
    "source_layers": "sender layers each map reads (greedy; offsets reads 3)",
    "val_every": "every n-th training text is validation (not fitted on)",
    "seed": "random seed of the fit",
}


def work_dir() -> Path:
    from ctxrelay.zoo import cache_dir  # zoo is on this floor; only its cache location is needed

    return cache_dir() / "heterofold"


# ---- stage 2: moments -------------------------------------------------------------------------


def accumulate(
    sender: LoadedModel,
    receiver: LoadedModel,
    pairs: list[tuple[text_cache.SenderText, text_cache.ReceiverText]],
    sources: list[list[int]],
    pairing: str,
) -> dict[str, list[Moments]]:
    dx = len(sources[0]) * sender.spec.num_kv_heads * sender.spec.head_dim
    dy = receiver.spec.num_kv_heads * receiver.spec.head_dim
    mom = {r: [Moments.zeros(dx, dy) for _ in sources] for r in ROLES}
    for role, send, recv, src, keep in text_cache.aligned_rows(sender, receiver, pairs, pairing, "moments"):
        for j, layers in enumerate(sources):
            x = layer_features(send, layers, src).float()
            y = recv[j][keep].reshape(keep.numel(), -1).float()
            mom[role][j].add(x, y)
    return mom


def closed_form(mom: dict[str, list[Moments]], fit: dict[str, dict]) -> dict[str, list[AffineMap]]:
    """fit[role] = {"kind": "ridge", "alpha": a} or {"kind": "recolor", "gamma": g, "eps": e}."""
    out = {}
    for role in ROLES:
        f = fit[role]
        maps = []
        for m in mom[role]:
            w, b = fit_ridge(m, f["alpha"]) if f["kind"] == "ridge" else fit_recolor(m, f["gamma"], f["eps"])
            maps.append(AffineMap(b, weight=w))
        out[role] = maps
    return out


def _score(r: dict) -> float:
    """Init-search objective: held-out ppl@128 relative to native (lower is better), then KL."""
    h = max(r["ppl"], key=int)
    return r["ppl"][h] / r["native_ppl"][h] + 0.1 * r["kl"]


def calibrate(
    sender: LoadedModel,
    receiver: LoadedModel,
    texts_train: list[str],
    texts_heldout: list[str],
    options: dict | None = None,
    command: str = "",
    out: str | Path | None = None,
    resume: bool = True,
) -> Artifact:
    """Calibrate `options["method"]` for sender -> receiver; save the artifact to `out` if given."""
    cfg = CalibConfig.from_options(options)
    check_own_layers(cfg.own_layers, receiver.spec.num_layers, receiver.name)
    if not texts_train or not texts_heldout:
        raise ValueError("calibration needs training texts and held-out texts (prompts only, no answers)")
    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    root = work_dir()
    states = root / "states"
    pair_dir = root / f"{text_cache.model_key(sender)}--{text_cache.model_key(receiver)}"
    pair_dir.mkdir(parents=True, exist_ok=True)

    # 1. data: every `val_every`-th training text validates (init search, epoch choice) and is not
    # fitted on; the held-out texts only measure the final artifact
    val_texts = texts_train[:: cfg.val_every] if len(texts_train) >= 2 * cfg.val_every else texts_train[:1]
    fit_texts = [t for t in texts_train if t not in set(val_texts)] or texts_train

    def load_pairs(texts: list[str], what: str) -> list[tuple[text_cache.SenderText, text_cache.ReceiverText]]:
        return [
            (text_cache.sender_text(sender, t, states), text_cache.receiver_text(receiver, t, states, cfg.query_rows))
            for t in tqdm(texts, desc=f"{what} states {sender.name} -> {receiver.name}", unit="text")
        ]

    pairs: list = []  # loaded only when needed (moments not cached yet, or training)

    def train_pairs() -> list:
        if not pairs:
            pairs.extend(load_pairs(fit_texts, "train"))
        return pairs

    digest, val_digest = text_cache.text_key("\x00".join(fit_texts)), text_cache.text_key("\x00".join(val_texts))
    choice = f"sources-{cfg.source_select}{{k}}-{cfg.pairing}-a{cfg.ridge_alpha}-{digest}-{val_digest}.json"
    sources, source_choice = choose_sources(
        sender,
        receiver,
        cfg.source_select,
        cfg.source_layers,
        train_pairs,
        lambda: load_pairs(val_texts, "val"),
        cfg.pairing,
        cfg.ridge_alpha,
        pair_dir / choice,
    )

    val = [heldout.make_item(sender, receiver, t, cfg.heldout_suffix) for t in tqdm(val_texts, desc="validation")]
    held = [heldout.make_item(sender, receiver, t, cfg.heldout_suffix) for t in tqdm(texts_heldout, desc="held-out")]

    # 2. moments (cached per pairing and training set)
    if source_choice["rule"] != "offsets":  # every cache below depends on which layers the maps read
        digest += "-src" + text_cache.text_key(json.dumps(sources))[:8]
    mom_path = pair_dir / f"moments-{cfg.pairing}-{digest}.safetensors"
    if resume and mom_path.exists():
        t = tensorfile.read(mom_path)[0]
        mom = {r: [Moments.from_tensors(t, f"{r}.{j}") for j in range(len(sources))] for r in ROLES}
    else:
        mom = accumulate(sender, receiver, train_pairs(), sources, cfg.pairing)
        flat = {k: v for r in ROLES for j, m in enumerate(mom[r]) for k, v in m.to_tensors(f"{r}.{j}").items()}
        tensorfile.write(mom_path, flat, {"kind": "heterofold_moments"})

    def scored_maps(maps: FoldMaps) -> dict:
        art = make_artifact(sender, receiver, maps, {"pairing": cfg.pairing, "method": cfg.method}, {}, command)
        return heldout.evaluate(receiver, art, val)

    search_path = pair_dir / f"search-{cfg.pairing}-{digest}-{val_digest}.json"
    search_memo = json.loads(search_path.read_text()) if resume and search_path.exists() else {}

    def scored(fit: dict) -> dict:
        key = json.dumps(fit, sort_keys=True)
        if key not in search_memo:  # closed forms are deterministic: score each once per data set
            search_memo[key] = _brief(scored_maps(FoldMaps(sources, closed_form(mom, fit))))
            search_path.write_text(json.dumps(search_memo))
        return search_memo[key]

    # 3. init: closed forms, searched on held-out texts
    ridge = {"kind": "ridge", "alpha": cfg.ridge_alpha}
    search: list[dict] = []
    if cfg.method in ("same-index", "ridge+ta"):
        best_fit = {"k": ridge, "v": ridge}
    else:
        gammas = [cfg.recolor_gamma] if cfg.recolor_gamma >= 0 else [float(g) for g in cfg.gammas.split(",")]
        epss = [cfg.recolor_eps] if cfg.recolor_eps >= 0 else [float(e) for e in cfg.epss.split(",")]
        cands = [{"kind": "recolor", "gamma": g, "eps": e} for g in gammas for e in epss]
        if cfg.method == "heterofold":
            cands.append(ridge)  # the calibration starts from whichever fit is best, ridge included
        best_fit = {"v": ridge}
        for role in ("k", "v"):  # keys first (values ridge), then values with the chosen keys
            results = []
            for c in tqdm(cands, desc=f"init search ({role})", leave=False):
                fit = {**best_fit, role: c}
                r = scored(fit)
                search.append({"role": role, "fit": fit, "score": _score(r), **_brief(r)})
                results.append((_score(r), c))
            best_fit[role] = min(results, key=lambda sc: sc[0])[1]
    maps = FoldMaps(sources, closed_form(mom, best_fit))
    stats = {r: [m.stats() for m in mom[r]] for r in ROLES}
    if cfg.store_rank:
        # small artifacts: the closed form keeps the principal directions of its output on the
        # calibration data; the corrections are then trained ON the truncated map (they can make
        # up for what it lost) and append their factors, so storage is exact at store_rank
        stages = (1 + (cfg.e2e_epochs > 0)) if cfg.method == "heterofold" else 0
        base_rank = cfg.store_rank - stages * cfg.rank
        if base_rank < 1:
            raise ValueError(
                f"store_rank={cfg.store_rank} leaves no room for the base map next to rank-{cfg.rank} corrections"
            )
        maps = FoldMaps(
            sources,
            {
                r: [m.factored(base_rank, stats[r][j][0].float(), stats[r][j][2].float()) for j, m in enumerate(ms)]
                for r, ms in maps.maps.items()
            },
        )
    params = {"method": cfg.method, "pairing": cfg.pairing, "init": best_fit, "init_search": search}
    params["source_select"] = source_choice

    # 4. output-aware corrections: layer-local (the paper's key and value objectives), then an
    # optional end-to-end stage; validation decides which maps are kept (init included)
    if cfg.method == "heterofold":
        tag = f"{digest}-r{cfg.rank}-s{cfg.seed}" + (f"-sr{cfg.store_rank}" if cfg.store_rank else "")
        pairs = train_pairs()
        scales = feature_scales([s for s, _ in pairs], sources, [r for _, r in pairs])
        val_pairs = load_pairs(val_texts, "val")
        cands = {"init": maps}
        cands["layer-local"], history = train_corrections(
            sender, receiver, maps, pairs, val_pairs, cfg, pair_dir / f"train-{tag}.safetensors", resume, scales
        )
        if cfg.e2e_epochs:
            tails = [
                text_cache.receiver_tail(receiver, t, states, cfg.e2e_tokens) for t in tqdm(fit_texts, desc="targets")
            ]
            corr = Corrections(cands["layer-local"], cfg.rank, scales, cfg.seed + 1)
            native = f"-nat{cfg.e2e_native}" if cfg.e2e_native else ""
            ckpt = pair_dir / f"e2e-{tag}-n{cfg.e2e_tokens}-lr{cfg.e2e_lr}{native}.safetensors"
            history["e2e"] = train_e2e(sender, receiver, corr, pairs, tails, cfg, ckpt, resume)
            cands["end-to-end"] = corr.fold()
        scores = {name: scored_maps(m) for name, m in cands.items()}
        history["validation"] = {name: _brief(r) for name, r in scores.items()}
        history["kept"] = min(scores, key=lambda name: _score(scores[name]))
        maps = cands[history["kept"]]
        params["train"] = history
        params.update(rank=cfg.rank, epochs=cfg.epochs, lr=cfg.lr, weight_decay=cfg.weight_decay)
        params.update(e2e_epochs=cfg.e2e_epochs, e2e_tokens=cfg.e2e_tokens, e2e_lr=cfg.e2e_lr)
        if cfg.e2e_native:
            params["e2e_native"] = cfg.e2e_native

    # 5. fold / store, 6. report on exactly what is stored
    if cfg.store_rank:
        assert all((m.rank or min(m.dense().shape)) <= cfg.store_rank for ms in maps.maps.values() for m in ms)
        params["store_rank"] = cfg.store_rank
    params["own_layers"] = cfg.own_layers
    art = make_artifact(sender, receiver, maps, params, {}, command)
    art = Artifact.load(art.save(pair_dir / f".report-{cfg.method}.safetensors"))  # exactly the stored fp16 maps
    report = heldout.evaluate(receiver, art, held)
    report.update(
        heldout_texts=len(texts_heldout),
        train_texts=len(fit_texts),
        validation_texts=len(val_texts),
        suffix_tokens=cfg.heldout_suffix,
        calibration_s=round(time.perf_counter() - t_start, 1),
        artifact_bytes=sum(t.numel() * t.element_size() for t in art.tensors.values()),
    )
    art.quality = report
    art.command = command
    if out is not None:
        art.save(out)
    (pair_dir / f"report-{cfg.method}.json").write_text(json.dumps({"params": params, "quality": report}, indent=1))
    return art


def _brief(r: dict) -> dict:
    return {k: r[k] for k in ("top1_agreement", "kl", "ppl", "native_ppl", "no_context_ppl")}
