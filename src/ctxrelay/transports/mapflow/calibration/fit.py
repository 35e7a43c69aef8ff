"""Calibrate one sender -> receiver pair: cached sender maps, diagnosis, end-to-end W, per-layer modes.

Steps (each with a progress bar; the expensive ones cached or checkpointed so a rerun resumes):
  1. sender maps of every calibration context, compressed once and cached on disk (the sender is
     the expensive model; later runs never prefill it again);
  2. receiver reference: native next-token logits over each appended span, sampled map rows;
  3. diagnosis: simplex fits + TV for every (receiver layer, sender layer), coverage, heatmap,
     layer mapping, r, refusal (diagnose.py);
  4. W trained end to end with the receiver's response loss, all reused layers in replace mode
     (train.py; checkpointed, resumable);
  5. per-layer mode choice (modes.py): guided where it keeps quality, replace where even the
     trained mixture keeps it, native where neither does;
  6. held-out report and the artifact (tensors W per layer + manifest with r, p, B, mapping, modes).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from tqdm import tqdm

from ctxrelay import paths, tensorfile
from ctxrelay.artifact import Artifact, model_binding
from ctxrelay.errors import CtxrelayError
from ctxrelay.models import runner
from ctxrelay.models.capture import CapturePlan, run_capture
from ctxrelay.models.spec import LoadedModel
from ctxrelay.models.tokens import context_ids, suffix_ids
from ctxrelay.transports.mapflow.calibration import diagnose, modes, train
from ctxrelay.transports.mapflow.reuse import ReuseConfig
from ctxrelay.transports.mapflow.sparse import BlockMaps, MapCapture, maps_from_tensors

VERSION = 1


class Refused(CtxrelayError, RuntimeError):
    """The pair has no reliable reuse region: mapflow should not be used for it."""


@dataclass
class CalibOptions:
    block: int = 64
    top_p: float = 0.9  # sender map top-p the artifact uses
    capture_p: float = 0.98  # sender maps are cached at this p and re-selected down
    guided_p: float = 0.9
    unit: str = "group"
    ctx_tokens: int = 512  # training and diagnosis contexts (short: cheap)
    suffix_tokens: int = 64
    eval_tokens: int = 2048  # mode choice and held-out report run on longer contexts, where reuse pays
    cost_tokens: int = 4096  # per-layer attention costs are measured on one context this long (0: eval_tokens)
    train_texts: int = 16
    select_texts: int = 4  # train texts (at eval_tokens) the mode choice is scored on
    heldout_texts: int = 6
    diag_texts: int = 6
    diag_rows: int = 64
    tv_max: float = 0.5
    mapping: str = "auto"
    r: int = -1  # -1: chosen by the diagnosis
    min_layers: int = 2
    train_steps: int = 96
    lr: float = 0.05
    min_top1: float = 0.85  # mode choice target (on the selection texts)
    modes: str = "mixed"  # mixed (per-layer choice) | replace | guided | hybrid (every reused layer)
    hybrid: bool = True  # the mode choice may upgrade guided layers to hybrid before native
    replace_trials: int = 8  # best-fitting layers the mode choice tries in replace mode
    force: bool = False  # calibrate even when the diagnosis refuses the pair
    seed: int = 0
    cache_dir: str = ""

    @staticmethod
    def from_dict(options: dict) -> CalibOptions:
        known = {f.name: f.type for f in fields(CalibOptions)}
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"unknown mapflow calibration option(s) {unknown}; known: {', '.join(sorted(known))}")
        opts = CalibOptions(**options)
        if opts.modes not in ("mixed", "replace", "guided", "hybrid"):
            raise ValueError(f"modes={opts.modes!r}: use mixed, replace, guided or hybrid")
        if not 0 < opts.top_p <= opts.capture_p <= 1:
            raise ValueError(f"need 0 < top_p ({opts.top_p}) <= capture_p ({opts.capture_p}) <= 1")
        return opts


# one line per CalibOptions field: what `ctxrelay calibrate --keys --transport mapflow` says of it
OPTION_HELP = {
    "block": "attention-map block size (tokens)",
    "top_p": "sender map top-p the artifact uses",
    "capture_p": "sender maps are cached at this p and re-selected down",
    "guided_p": "top-p of the guided pattern over the sender's maps",
    "unit": "guided pattern per kv group or per head (group | head)",
    "ctx_tokens": "training and diagnosis context length (short: cheap)",
    "suffix_tokens": "appended tokens per text whose logits the loss scores",
    "eval_tokens": "context length of the mode choice and held-out report, where reuse pays",
    "cost_tokens": "per-layer attention costs are measured on one context this long (0: eval_tokens)",
    "train_texts": "texts W is trained on",
    "select_texts": "train texts (at eval_tokens) the mode choice is scored on",
    "heldout_texts": "held-out texts of the quality report",
    "diag_texts": "texts the diagnosis fits and compares maps on",
    "diag_rows": "sampled query rows per diagnosis text",
    "tv_max": "a layer is reused from the first whose map TV (under the mapping) is at most this",
    "mapping": "receiver -> sender layer mapping: best | suffix | auto (best where it lowers the mean TV)",
    "r": "first reused receiver layer (-1: chosen by the diagnosis)",
    "min_layers": "refuse the pair when fewer reused layers fit within tv_max",
    "train_steps": "end-to-end training steps of W",
    "lr": "learning rate of W",
    "min_top1": "mode choice target: top-1 agreement with native on the selection texts",
    "modes": "mixed (per-layer choice) | replace | guided | hybrid (every reused layer)",
    "hybrid": "the mode choice may upgrade guided layers to hybrid before native",
    "replace_trials": "best-fitting layers the mode choice tries in replace mode",
    "force": "calibrate even when the diagnosis refuses the pair",
    "seed": "random seed",
    "cache_dir": "where sender maps are cached (default: ctxrelay's cache)",
}


@dataclass
class Item:
    """One calibration context and what both models say about it."""

    ctx: torch.Tensor  # [T]
    suffix: torch.Tensor  # [S]
    held_maps: dict[int, BlockMaps] | None  # sender maps at capture_p, or None: read from `path` when used
    native: torch.Tensor  # [S, V] receiver logits predicting each suffix token
    path: Path | None = None  # the sender-maps cache file (long contexts stay on disk between uses)
    prepared: dict = field(default_factory=dict)  # operator plans cached across training steps

    @property
    def maps(self) -> dict[int, BlockMaps]:
        if self.held_maps is not None:
            return self.held_maps
        tensors, manifest = tensorfile.read(self.path)
        tensors.pop("diag_rows", None)
        return maps_from_tensors(tensors, manifest["maps_meta"])


# ---- data ------------------------------------------------------------------------------------------


def split_texts(m: LoadedModel, texts: list, opts: CalibOptions, limit: int, ctx_tokens: int) -> list[tuple]:
    """(context ids, suffix ids) per text.

    A plain string is cut at ctx_tokens (its next suffix_tokens tokens are the appended span); a
    (context, suffix) pair keeps its own split (needle QA: the suffix is question + answer) when its
    context has ctx_tokens to ctx_tokens + 64 tokens (cut to ctx_tokens). Texts too short are skipped.
    """
    out = []
    for text in texts:
        if isinstance(text, str):
            ids = context_ids(m, text)
            if ids.shape[0] >= ctx_tokens + opts.suffix_tokens:
                out.append((ids[:ctx_tokens].clone(), ids[ctx_tokens : ctx_tokens + opts.suffix_tokens].clone()))
        else:
            context, suffix = text
            ctx, suf = context_ids(m, context), suffix_ids(m, suffix)
            if ctx_tokens - 48 <= ctx.shape[0] <= ctx_tokens + 64 and suf.shape[0] >= 2:
                out.append((ctx[:ctx_tokens].clone(), suf[: opts.suffix_tokens].clone()))
        if len(out) == limit:
            break
    if len(out) < min(limit, 2):
        raise ValueError(
            f"only {len(out)} calibration text(s) reach {ctx_tokens + opts.suffix_tokens} tokens; "
            "pass longer texts or lower ctx_tokens/eval_tokens/suffix_tokens"
        )
    return out


def pair_cache_dir(sender: LoadedModel, receiver: LoadedModel, opts: CalibOptions) -> Path:
    root = Path(opts.cache_dir or paths.cache_dir()) / "mapflow"
    return root / f"{sender.spec.name}-{sender.spec.weights_hash[:10]}"


def sender_maps(
    sender: LoadedModel, ctx: torch.Tensor, opts: CalibOptions, rows: torch.Tensor | None, cache: Path
) -> tuple[dict[int, BlockMaps], torch.Tensor | None, Path]:
    """Compressed maps (at capture_p) and, given `rows`, sampled dense rows of every sender layer.

    Cached on disk by content: the sender is the expensive model, so later runs never prefill it again.
    """
    tag = f"{opts.block}:{opts.capture_p}:{None if rows is None else rows.tolist()}"
    key = hashlib.sha256(ctx.numpy().tobytes() + tag.encode())
    path = cache / f"maps-{key.hexdigest()[:24]}.safetensors"
    if path.exists():
        try:
            tensors, manifest = tensorfile.read(path)
            rows_t = tensors.pop("diag_rows", None)
            return maps_from_tensors(tensors, manifest["maps_meta"]), rows_t, path
        except (tensorfile.TensorFileError, KeyError):
            path.unlink(missing_ok=True)  # damaged cache entry: recompute
    s = sender.spec
    cap = MapCapture(s.num_heads, s.num_layers, top_p=opts.capture_p, block=opts.block, sender=s.name)
    plans = [CapturePlan(on_probs=cap.on_probs, prob_chunk=opts.block)]
    sampler = None
    if rows is not None:
        sampler = diagnose.RowSampler(rows, s.num_layers)
        plans.append(CapturePlan(on_probs=sampler.on_probs, prob_chunk=opts.block))
    run_capture(sender, ctx, plans)
    tensors, meta = cap.result()
    rows_t = sampler.result() if sampler is not None else None
    extra = {} if rows_t is None else {"diag_rows": rows_t}
    tensorfile.write(path, {**tensors, **extra}, {"kind": "mapflow_sender_maps", "maps_meta": meta})
    return maps_from_tensors(tensors, meta), rows_t, path


def receiver_reference(receiver: LoadedModel, ctx: torch.Tensor, suffix: torch.Tensor) -> torch.Tensor:
    """Native logits [S, V] predicting each suffix token (the last context position predicts suffix[0])."""
    first = runner.forward(receiver, ctx, logits="last")
    rest = runner.forward(receiver, suffix[:-1], first.cache, logits="all").logits
    return torch.cat([first.logits, rest]).float()


def receiver_diag(receiver: LoadedModel, ctx: torch.Tensor, rows: torch.Tensor, block: int):
    """Sampled dense rows [Lr, Hr, R, T] and full block masses [Lr, Hr, nqb, nkb] of the receiver."""
    s = receiver.spec
    sampler = diagnose.RowSampler(rows, s.num_layers)
    mass = diagnose.BlockMassCollector(s.num_layers, ctx.shape[0], block)
    run_capture(receiver, ctx, [CapturePlan(on_probs=c.on_probs, prob_chunk=block) for c in (sampler, mass)])
    return sampler.result(), mass.result()


# ---- the whole calibration ---------------------------------------------------------------------------


def calibrate(
    sender: LoadedModel,
    receiver: LoadedModel,
    texts_train: list[str],
    texts_heldout: list[str],
    options: dict,
    command: str,
    out: str | Path | None,
    resume: bool = True,
    log=print,
) -> Artifact:
    opts = CalibOptions.from_dict(options)
    s, r = sender.spec, receiver.spec
    if s.tokenizer_hash != r.tokenizer_hash:
        raise Refused(
            f"{s.name} and {r.name} do not share a tokenizer: attention maps cannot be reused between them "
            "(use heterofold for cross-tokenizer pairs)"
        )
    torch.manual_seed(opts.seed)
    t_start = time.perf_counter()
    cache = pair_cache_dir(sender, receiver, opts)
    cache.mkdir(parents=True, exist_ok=True)
    rows = diagnose.sample_rows(opts.ctx_tokens, opts.diag_rows, opts.block)

    train_pairs = split_texts(receiver, texts_train, opts, opts.train_texts, opts.ctx_tokens)
    eval_len = opts.eval_tokens or opts.ctx_tokens
    select_pairs = split_texts(receiver, texts_train, opts, opts.select_texts, eval_len)
    held_pairs = split_texts(receiver, texts_heldout, opts, opts.heldout_texts, eval_len)
    with torch.inference_mode():
        items, diag_s, diag_r, diag_mass = [], [], [], []
        for k, (ctx, suf) in enumerate(tqdm(train_pairs, desc=f"train contexts ({opts.ctx_tokens} tokens)")):
            diag = k < opts.diag_texts
            maps, s_rows, _ = sender_maps(sender, ctx, opts, rows if diag else None, cache)
            items.append(Item(ctx, suf, maps, receiver_reference(receiver, ctx, suf)))
            if diag:
                r_rows, r_mass = receiver_diag(receiver, ctx, rows, opts.block)
                diag_s.append(s_rows)
                diag_r.append(r_rows)
                diag_mass.append(r_mass)
        select, held = [], []
        pairs = select_pairs + held_pairs
        for k, (ctx, suf) in enumerate(tqdm(pairs, desc=f"selection + held-out contexts ({eval_len} tokens)")):
            _, _, path = sender_maps(sender, ctx, opts, None, cache)  # long: kept on disk, read per use
            (select if k < len(select_pairs) else held).append(
                Item(ctx, suf, None, receiver_reference(receiver, ctx, suf), path)
            )
    log(
        f"data: {len(items)} train contexts of {opts.ctx_tokens} tokens, {len(select)} selection and {len(held)} "
        f"held-out of {eval_len} (+{opts.suffix_tokens} appended)"
    )

    # diagnosis
    tv, w_fit = diagnose.fit_grid(diag_s, diag_r)
    diag_maps = [{sl: it.maps[sl] for sl in range(s.num_layers)} for it in items[: len(diag_s)]]
    cov = diagnose.coverage_grid(diag_maps, diag_mass, w_fit, opts.guided_p, r.num_kv_heads, opts.unit)
    d = diagnose.decide(
        tv,
        cov,
        w_fit,
        tv_max=opts.tv_max,
        mapping=opts.mapping,
        min_layers=opts.min_layers,
        r=None if opts.r < 0 else opts.r,
    )
    fig = Path(out).with_suffix(".diagnosis.png") if out else None
    if fig is not None:
        diagnose.heatmap(d, fig, f"mapflow diagnosis {s.name} -> {r.name} ({len(diag_s)} contexts)")
    log(f"diagnosis: mapping={d.mapping_name} r={d.r} refused={d.refused} {d.reason}")
    if d.refused and not opts.force:
        raise Refused(f"mapflow refuses {s.name} -> {r.name}: {d.reason}")

    reused = list(range(d.r, r.num_layers))
    w_guided = {j: w_fit[j, d.mapping[j]] for j in reused}

    def config(layer_modes: list[str], w_rep: dict[int, torch.Tensor]) -> ReuseConfig:
        w = {j: (w_rep[j] if m == "replace" else w_guided[j]) for j, m in enumerate(layer_modes) if m != "native"}
        mapping = [d.mapping[j] if m != "native" else -1 for j, m in enumerate(layer_modes)]
        return ReuseConfig(layer_modes, mapping, w, opts.top_p, opts.guided_p, opts.unit, opts.guided_p, opts.block)

    def every(mode: str) -> list[str]:
        return ["native"] * d.r + [mode] * len(reused)

    # end-to-end training of W (replace mode in every reused layer, as the paper trains it)
    w_trained, train_log = w_guided, {}
    if opts.modes in ("mixed", "replace") and reused and opts.train_steps > 0:
        ckpt = cache / f"train-{r.weights_hash[:10]}-{_opts_key(opts, d)}.safetensors"
        w_trained, train_log = train.train_w(
            receiver, items, config(every("replace"), w_guided), w_guided, opts.train_steps, opts.lr, ckpt, resume, log
        )

    # per-layer modes, scored on longer selection contexts
    cost_len = opts.cost_tokens or eval_len
    cost_ctx, _ = split_texts(receiver, texts_train, opts, 1, cost_len)[0]
    with torch.inference_mode():
        _, _, cost_path = sender_maps(sender, cost_ctx, opts, None, cache)
    cost_item = Item(cost_ctx, cost_ctx[:0], None, torch.zeros(0), cost_path)
    costs = modes.layer_costs(receiver, cost_item, config(every("guided"), w_trained), w_trained)
    log(
        "layer attention ms (native/guided/hybrid/replace): "
        + ", ".join(
            f"{j}: {c['native']:.0f}/{c['guided']:.0f}/{c['hybrid']:.0f}/{c['replace']:.0f}" for j, c in costs.items()
        )
    )
    if opts.modes != "mixed":
        chosen, choice_log = every(opts.modes), {}
    else:
        chosen, choice_log = modes.choose_modes(
            lambda lm: modes.evaluate(receiver, select, config(lm, w_trained)),
            every("guided"),
            replace_order=sorted(reused, key=lambda j: float(d.tv[j, d.mapping[j]]))[: opts.replace_trials],
            upgrade_order=sorted(reused, key=lambda j: float(d.coverage[j, d.mapping[j]])),  # worst-covered first
            upgrades=("hybrid", "native") if opts.hybrid else ("native",),
            min_top1=opts.min_top1,
            cost=costs,
            log=log,
        )

    # held-out report
    final = config(chosen, w_trained)
    quality = modes.evaluate(receiver, held, final)
    variants = {}
    for name in ("replace", "guided", "hybrid"):
        if every(name) != chosen:
            variants[name] = modes.evaluate(receiver, held, config(every(name), w_trained))
    quality.update(
        {
            "method": final.method(),
            "heldout_contexts": len(held),
            "context_tokens": eval_len,
            "train_context_tokens": opts.ctx_tokens,
            "suffix_tokens": opts.suffix_tokens,
            "variants": variants,
            "selection": choice_log,
            "layer_costs_ms": {str(j): {m: round(v, 2) for m, v in c.items()} for j, c in costs.items()},
            "cost_context_tokens": int(cost_ctx.shape[0]),
            "training": train_log,
            "diagnosis": d.summary(),
            "calibration_s": round(time.perf_counter() - t_start, 1),
        }
    )
    log(f"held-out: top1 {quality['top1_agreement']:.3f} kl {quality['kl']:.3f} ({final.method()}: {final.counts()})")
    params = {
        **final.to_params(),
        "mapping_name": d.mapping_name,
        "alignment": "suffix" if d.mapping_name == "suffix" else "best-fit",
        "capture_p": opts.capture_p,
        "reuse_from": d.r,  # the diagnosis' r (the chosen modes may keep more leading layers native)
        "diagnosis_mapping": d.mapping,  # sender layer per receiver layer, also for layers left native
        "options": asdict(opts),
    }
    art = Artifact(
        transport="mapflow",
        version=VERSION,
        sender=model_binding(sender),
        receiver=model_binding(receiver),
        tensors={
            **final.w_tensors(),
            **{f"w_fit.{j}": w.float().clone() for j, w in w_guided.items()},
            **{f"w_trained.{j}": w.float().clone() for j, w in w_trained.items()},
            "diagnosis.tv": d.tv.float(),
            "diagnosis.coverage": d.coverage.float(),
        },
        params=params,
        quality=quality,
        command=command,
    )
    if out:
        art.save(out)
    return art


def _opts_key(opts: CalibOptions, d: diagnose.Diagnosis) -> str:
    parts = [opts.capture_p, opts.top_p, opts.block, opts.ctx_tokens, opts.suffix_tokens, opts.train_texts, opts.lr]
    parts += [d.r, d.mapping]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:12]
