"""End-to-end refinement of the corrections: the receiver's own next-token distributions.

The layer-local losses (train.py) score each layer with native queries; errors that compound
through the receiver's depth are invisible to them. This stage runs the receiver itself on the
last `n` tokens of each calibration text over the translated cache of the rest (exactly what
relay_prefill does at inference) and minimises KL(native || relay) of the next-token
distributions. Targets are the receiver's own predictions (prompts only, no gold answers), kept
as top-k plus one "rest" bin. Only the same rank-r corrections learn, so the result still folds
into one affine map per layer and role.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tqdm import tqdm

from ctxrelay import tensorfile
from ctxrelay.models import runner
from ctxrelay.models.attention import eager_attention, native_attention
from ctxrelay.models.spec import LoadedModel
from ctxrelay.transports.heterofold.calibration import text_cache
from ctxrelay.transports.heterofold.calibration.train import Corrections, flatten_opt_state, unflatten_opt_state
from ctxrelay.transports.heterofold.kv_maps import layer_features


def suffix_logits(m: LoadedModel, keys: list[torch.Tensor], values: list[torch.Tensor], ids: torch.Tensor):
    """Differentiable receiver pass of `ids` over a given cache (runner.forward is inference-only)."""
    start = keys[0].shape[2]
    h = runner.embed(m, ids.view(1, -1))
    rope = runner.rope_tables(m, torch.arange(start, start + ids.numel()), h)
    for i in range(m.spec.num_layers):
        x = runner.attn_input(m, i, h)
        q = runner.project_q(m, i, x, rope)
        k = runner.finish_keys(m, i, runner.project_k_raw(m, i, x), rope)
        v = runner.project_v(m, i, x)
        call = runner.attn_call(m, i, q, torch.cat([keys[i], k], 2), torch.cat([values[i], v], 2), start)
        out = eager_attention(call) if m.spec.softcap is not None else native_attention(call)
        h = runner.layer_output(m, i, h, out)
    return runner.head(m, h, "all")


def coarse_kl(logits: torch.Tensor, tail: text_cache.NativeTail) -> torch.Tensor:
    """KL(native || relay) over the native top-k tokens plus one bin for all other tokens."""
    logq = torch.log_softmax(logits.float(), -1)
    q_top = logq.gather(1, tail.index)
    p_top = tail.logp.exp()
    p_rest = (1 - p_top.sum(-1)).clamp_min(1e-8)
    q_rest = (1 - q_top.exp().sum(-1)).clamp_min(1e-8)
    kl = (p_top * (tail.logp - q_top)).sum(-1) + p_rest * (p_rest.log() - q_rest.log())
    return kl.mean()


def e2e_loss(
    receiver,
    corr: Corrections,
    s: text_cache.SenderText,
    r: text_cache.ReceiverText,
    src,
    tail,
    n: int,
    rope_cache,
    native_share: float = 0.0,
):
    """KL of the suffix's predictions over the translated context. native_share > 0: the context's last
    tokens (that share of it) keep the receiver's own K/V, as the relay's recompute gives them at serving
    (its rule spends most of the budget on the last tokens), so the corrections learn for the translated
    entries the suffix still reads next to native ones."""
    t = r.ids.shape[0]
    c = t - n
    ctx_src = src[:c]
    native = ctx_src < 0
    if native_share > 0:
        native = native.clone()
        native[c - round(native_share * c) :] = True
    rows = ctx_src.clamp(min=0)
    spec = receiver.spec
    if c not in rope_cache:
        rope_cache[c] = runner.rope_tables(receiver, torch.arange(c), torch.empty(1, c, spec.hidden_size))
    rope = rope_cache[c]
    keys, values = [], []
    for j, layers in enumerate(corr.base.sources):
        shape = (c, spec.num_kv_heads, spec.head_dim)
        k_map = corr.mapped("k", j, layer_features(s.keys, layers, rows).float()).view(shape)
        v_map = corr.mapped("v", j, layer_features(s.values, layers, rows).float()).view(shape)
        k_raw = torch.where(native[:, None, None], r.keys[j][:c].float(), k_map)
        v = torch.where(native[:, None, None], r.values[j][:c].float(), v_map)
        keys.append(runner.finish_keys(receiver, j, k_raw.transpose(0, 1).unsqueeze(0), rope))
        values.append(v.transpose(0, 1).unsqueeze(0))
    logits = suffix_logits(receiver, keys, values, r.ids[c:])
    return coarse_kl(logits, tail)


def train_e2e(
    sender: LoadedModel,
    receiver: LoadedModel,
    corr: Corrections,
    pairs: list[tuple[text_cache.SenderText, text_cache.ReceiverText]],
    tails: list[text_cache.NativeTail],
    cfg,
    ckpt: Path,
    resume: bool = True,
) -> list[dict]:
    """cfg.e2e_epochs passes over `pairs`; corr is trained in place. Checkpointed per epoch."""
    n = cfg.e2e_tokens
    aligns = [text_cache.pair_alignment(sender, receiver, s, r, cfg.pairing).src for s, r in pairs]
    opt = torch.optim.AdamW(corr.parameters(), lr=cfg.e2e_lr, weight_decay=cfg.weight_decay)
    history, start = [], 0
    if resume and ckpt.exists():
        t, meta = tensorfile.read(ckpt)
        corr.load_state_dict({k[6:]: v for k, v in t.items() if k.startswith("model.")})
        opt.load_state_dict(unflatten_opt_state(t, meta["opt"]))
        start, history = meta["epoch"], meta["history"]
    rope_cache: dict = {}
    for epoch in range(start, cfg.e2e_epochs):
        order = [i for i in range(len(pairs)) if pairs[i][1].ids.shape[0] > n + 32]
        # seeded per epoch: a run resumed after epoch k shuffles epoch k+1 as an uninterrupted run would
        random.Random(cfg.seed + 1 + epoch).shuffle(order)
        total = 0.0
        bar = tqdm(order, desc=f"end-to-end epoch {epoch + 1}/{cfg.e2e_epochs}", unit="text", leave=False)
        for i in bar:
            s, r = pairs[i]
            loss = e2e_loss(receiver, corr, s, r, aligns[i], tails[i], n, rope_cache, cfg.e2e_native)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(corr.parameters(), 1.0)
            opt.step()
            total += loss.item()
            bar.set_postfix(kl=f"{loss.item():.3f}")
        history.append({"epoch": epoch + 1, "train_kl": total / max(len(order), 1)})
        flat_opt, opt_meta = flatten_opt_state(opt.state_dict())
        tensors = {f"model.{k}": v.detach() for k, v in corr.state_dict().items()} | flat_opt
        meta = {"kind": "heterofold_e2e", "epoch": epoch + 1, "history": history, "opt": opt_meta}
        tensorfile.write(ckpt, tensors, meta)
    return history
