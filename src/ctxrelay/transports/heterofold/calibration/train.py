"""Output-aware calibration: rank-r corrections to the closed-form maps, trained layer by layer.

For receiver layer j the mapped keys and values are scored with the receiver's OWN native queries
of sampled rows t (the question tokens of a real request play that role at inference): row t sees
the translated keys/values of positions < t (the sink and specials native, as at inference) and
its own key/value natively.
  key loss    KL(native attention || attention with mapped keys) + relative error of the
              attention output through o_proj when only the keys are mapped
  value loss  relative error of the attention output through o_proj with mapped values under the
              native attention pattern (held fixed)
A correction is y += s_y * ((x - mu_x) / s_x) A B + db (A [dx, r], B [r, dy], B = 0 at start);
it folds exactly into the affine map: W += A B s_y / s_x, b += db - mu_x A B s_y / s_x.
Both models stay frozen. Checkpoints after every epoch; the best epoch by validation loss wins.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tqdm import tqdm

from ctxrelay import tensorfile
from ctxrelay.models import runner
from ctxrelay.models.attention import expand_kv, visibility_mask
from ctxrelay.models.spec import LoadedModel
from ctxrelay.transports.heterofold.calibration import text_cache
from ctxrelay.transports.heterofold.kv_maps import ROLES, AffineMap, FoldMaps, layer_features


class Corrections(torch.nn.Module):
    def __init__(self, base: FoldMaps, rank: int, scales: dict[str, list[tuple]], seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.base, self.scales = base, scales
        self.a, self.b, self.db = torch.nn.ParameterDict(), torch.nn.ParameterDict(), torch.nn.ParameterDict()
        for role in ROLES:
            for j, m in enumerate(base.maps[role]):
                dx, dy = m.dense().shape
                key = f"{role}{j}"
                self.a[key] = torch.nn.Parameter(torch.randn(dx, rank, generator=g) / dx**0.5)
                self.b[key] = torch.nn.Parameter(torch.zeros(rank, dy))
                self.db[key] = torch.nn.Parameter(torch.zeros(dy))

    def mapped(self, role: str, j: int, x: torch.Tensor) -> torch.Tensor:
        mu, sx, sy = self.scales[role][j]
        key = f"{role}{j}"
        with torch.no_grad():
            base = self.base.maps[role][j](x)
        return base + sy * (((x - mu) / sx) @ self.a[key]) @ self.b[key] + self.db[key]

    def new_rank(self) -> int:
        return self.a[next(iter(self.a))].shape[1]

    @torch.no_grad()
    def fold(self) -> FoldMaps:
        out = {}
        for role in ROLES:
            maps = []
            for j, m in enumerate(self.base.maps[role]):
                mu, sx, sy = self.scales[role][j]
                key = f"{role}{j}"
                a = self.a[key] * (sy / sx)
                bias = m.bias + self.db[key] - (mu @ a) @ self.b[key]
                if m.weight is not None:
                    maps.append(AffineMap(bias, weight=m.weight + a @ self.b[key]))
                else:  # factored base: W = U V + A B = [U A] [V; B], exact, rank grows by r
                    maps.append(AffineMap(bias, u=torch.cat([m.u, a], 1), vt=torch.cat([m.vt, self.b[key]], 0)))
            out[role] = maps
        return FoldMaps(self.base.sources, out)


def feature_scales(sender_texts: list[text_cache.SenderText], sources, receiver_texts) -> dict:
    """mu_x, s_x (RMS of centred features) per layer/role; s_y = RMS of the receiver target."""
    out: dict[str, list[tuple]] = {}
    for role in ROLES:
        rows = []
        for j, layers in enumerate(sources):
            xs, ys = [], []
            for s, r in zip(sender_texts[:8], receiver_texts[:8], strict=True):
                xs.append(layer_features(s.keys if role == "k" else s.values, layers, torch.arange(s.ids.shape[0])))
                ys.append((r.keys if role == "k" else r.values)[j].reshape(r.ids.shape[0], -1))
            x, y = torch.cat(xs).float(), torch.cat(ys).float()
            mu = x.mean(0)
            rows.append((mu, float((x - mu).pow(2).mean().sqrt()) + 1e-6, float(y.pow(2).mean().sqrt()) + 1e-6))
        out[role] = rows
    return out


def _rel(err: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return err.pow(2).sum() / ref.pow(2).sum().clamp_min(1e-12)


def layer_losses(
    receiver: LoadedModel,
    corr: Corrections,
    s: text_cache.SenderText,
    r: text_cache.ReceiverText,
    src: torch.Tensor,
    rope,
    kl_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed (over layers) key loss and value loss for one text."""
    spec = receiver.spec
    t, hkv, d, h = r.ids.shape[0], spec.num_kv_heads, spec.head_dim, spec.num_heads
    native_rows = src < 0
    rows = r.rows
    nq = rows.shape[0]
    mask = visibility_mask(0, t, t, None)[rows]  # [nq, t]
    loss_k = loss_v = torch.zeros(())
    for j, layers in enumerate(corr.base.sources):
        o_proj = runner.layers(receiver)[j].self_attn.o_proj
        window = spec.sliding_windows[j]
        m = mask if window is None else visibility_mask(0, t, t, window)[rows]
        k_nat_raw, v_nat = r.keys[j].float(), r.values[j].float()  # [t, hkv, d]
        q = r.queries[j].float()  # [h, nq, d]
        xk = layer_features(s.keys, layers, src.clamp(min=0)).float()
        xv = layer_features(s.values, layers, src.clamp(min=0)).float()
        k_raw = torch.where(native_rows[:, None, None], k_nat_raw, corr.mapped("k", j, xk).view(t, hkv, d))
        v_map = torch.where(native_rows[:, None, None], v_nat, corr.mapped("v", j, xv).view(t, hkv, d))
        to_heads = lambda x: x.transpose(0, 1).unsqueeze(0)  # [t, hkv, d] -> [1, hkv, t, d]
        k_hat = expand_kv(runner.finish_keys(receiver, j, to_heads(k_raw), rope), h)[0]
        with torch.no_grad():
            k_nat = expand_kv(runner.finish_keys(receiver, j, to_heads(k_nat_raw), rope), h)[0]
            vn = expand_kv(to_heads(v_nat), h)[0]  # [h, t, d]
            s_nat = _scores(q, k_nat, spec).masked_fill(~m, float("-inf"))
            p_nat = torch.softmax(s_nat, -1)
            o_nat = o_proj((p_nat @ vn).transpose(0, 1).reshape(nq, h * d))
        # row t's own key is native: put the native diagonal score back
        s_hat = _scores(q, k_hat, spec)
        diag = s_nat.gather(-1, rows.view(1, nq, 1).expand(h, nq, 1))
        s_hat = s_hat.scatter(-1, rows.view(1, nq, 1).expand(h, nq, 1), diag).masked_fill(~m, float("-inf"))
        logp_hat = torch.log_softmax(s_hat, -1)
        kl = (p_nat * (torch.log(p_nat.clamp_min(1e-30)) - logp_hat)).masked_fill(~m, 0).sum(-1).mean()
        o_k = o_proj((logp_hat.exp() @ vn).transpose(0, 1).reshape(nq, h * d))
        loss_k = loss_k + kl_weight * kl + _rel(o_k - o_nat, o_nat)
        # values under the native pattern; the row's own value is native
        p_off = p_nat.scatter(-1, rows.view(1, nq, 1).expand(h, nq, 1), 0.0)
        p_diag = p_nat.gather(-1, rows.view(1, nq, 1).expand(h, nq, 1))  # [h, nq, 1]
        vh = expand_kv(to_heads(v_map), h)[0]
        o_v = p_off @ vh + p_diag * vn[:, rows]
        loss_v = loss_v + _rel(o_proj(o_v.transpose(0, 1).reshape(nq, h * d)) - o_nat, o_nat)
    return loss_k, loss_v


def _scores(q: torch.Tensor, k: torch.Tensor, spec) -> torch.Tensor:
    s = (q @ k.transpose(-1, -2)) * spec.attn_scale
    if spec.softcap is not None:
        s = torch.tanh(s / spec.softcap) * spec.softcap
    return s


def _rope(receiver: LoadedModel, t: int):
    like = torch.empty(1, t, receiver.spec.hidden_size)
    return runner.rope_tables(receiver, torch.arange(t), like)


def _epoch_loss(receiver, corr, pairs, aligns, ropes, kl_weight) -> tuple[float, float]:
    tk = tv = 0.0
    with torch.no_grad():
        for (s, r), src in zip(pairs, aligns, strict=True):
            lk, lv = layer_losses(receiver, corr, s, r, src, ropes[r.ids.shape[0]], kl_weight)
            tk, tv = tk + float(lk), tv + float(lv)
    n = max(len(pairs), 1) * len(corr.base.sources)
    return tk / n, tv / n


def train_corrections(
    sender: LoadedModel,
    receiver: LoadedModel,
    base: FoldMaps,
    train_pairs: list[tuple[text_cache.SenderText, text_cache.ReceiverText]],
    val_pairs: list[tuple[text_cache.SenderText, text_cache.ReceiverText]],
    cfg,
    ckpt: Path,
    resume: bool = True,
    scales: dict | None = None,
) -> tuple[FoldMaps, dict]:
    aligns = [text_cache.pair_alignment(sender, receiver, s, r, cfg.pairing).src for s, r in train_pairs]
    val_aligns = [text_cache.pair_alignment(sender, receiver, s, r, cfg.pairing).src for s, r in val_pairs]
    lengths = {r.ids.shape[0] for _, r in train_pairs + val_pairs}
    ropes = {t: _rope(receiver, t) for t in lengths}
    scales = scales or feature_scales([s for s, _ in train_pairs], base.sources, [r for _, r in train_pairs])
    corr = Corrections(base, cfg.rank, scales, cfg.seed)
    opt = torch.optim.AdamW(corr.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    history: list[dict] = []
    start = 0
    best_state, best_loss = None, float("inf")
    if resume and ckpt.exists():
        t, meta = tensorfile.read(ckpt)
        corr.load_state_dict({k[6:]: v for k, v in t.items() if k.startswith("model.")})
        best_state = {k[5:]: v for k, v in t.items() if k.startswith("best.")}
        opt.load_state_dict(unflatten_opt_state(t, meta["opt"]))
        start, history, best_loss = meta["epoch"], meta["history"], meta["best_loss"]
    if start == 0:
        vk, vv = _epoch_loss(receiver, corr, val_pairs, val_aligns, ropes, cfg.kl_weight)
        history.append({"epoch": 0, "val_key_loss": vk, "val_value_loss": vv})
        best_loss, best_state = vk + vv, {k: v.detach().clone() for k, v in corr.state_dict().items()}
    rng = random.Random(cfg.seed)
    for epoch in range(start, cfg.epochs):
        order = list(range(len(train_pairs)))
        rng.shuffle(order)
        tk = tv = 0.0
        bar = tqdm(order, desc=f"correct epoch {epoch + 1}/{cfg.epochs}", unit="text", leave=False)
        for i in bar:
            s, r = train_pairs[i]
            lk, lv = layer_losses(receiver, corr, s, r, aligns[i], ropes[r.ids.shape[0]], cfg.kl_weight)
            opt.zero_grad(set_to_none=True)
            (lk + lv).backward()
            torch.nn.utils.clip_grad_norm_(corr.parameters(), 1.0)
            opt.step()
            tk, tv = tk + lk.item(), tv + lv.item()
            bar.set_postfix(key=f"{lk.item() / len(base.sources):.4f}", value=f"{lv.item() / len(base.sources):.4f}")
        vk, vv = _epoch_loss(receiver, corr, val_pairs, val_aligns, ropes, cfg.kl_weight)
        n = len(order) * len(base.sources)
        history.append(
            {"epoch": epoch + 1, "train_key_loss": tk / n, "train_value_loss": tv / n, "val_key_loss": vk,
             "val_value_loss": vv}
        )  # fmt: skip
        if vk + vv < best_loss:
            best_loss, best_state = vk + vv, {k: v.detach().clone() for k, v in corr.state_dict().items()}
        flat_opt, opt_meta = flatten_opt_state(opt.state_dict())
        tensors = {f"model.{k}": v.detach() for k, v in corr.state_dict().items()}
        tensors.update({f"best.{k}": v for k, v in best_state.items()})
        tensors.update(flat_opt)
        meta = {"kind": "heterofold_train", "epoch": epoch + 1, "history": history, "best_loss": best_loss}
        tensorfile.write(ckpt, tensors, {**meta, "opt": opt_meta})
    corr.load_state_dict(best_state)
    best_epoch = min(history, key=lambda h: h["val_key_loss"] + h["val_value_loss"])["epoch"]
    return corr.fold(), {"history": history, "best_epoch": best_epoch}


def flatten_opt_state(sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, state_meta = {}, {}
    for pid, st in sd["state"].items():
        state_meta[str(pid)] = {}
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"opt.{pid}.{k}"] = v.reshape(-1) if v.dim() == 0 else v
                if v.dim() == 0:
                    state_meta[str(pid)].setdefault("_scalars", []).append(k)
            else:
                state_meta[str(pid)][k] = v
    return tensors, {"state": state_meta, "param_groups": sd["param_groups"]}


def unflatten_opt_state(t: dict[str, torch.Tensor], meta: dict) -> dict:
    state = {}
    for pid, extra in meta["state"].items():
        st = {k: v for k, v in extra.items() if k != "_scalars"}
        for k, v in t.items():
            parts = k.split(".")
            if parts[0] == "opt" and parts[1] == pid:
                st[parts[2]] = v.reshape(()) if parts[2] in extra.get("_scalars", []) else v
        state[int(pid)] = st
    return {"state": state, "param_groups": meta["param_groups"]}
