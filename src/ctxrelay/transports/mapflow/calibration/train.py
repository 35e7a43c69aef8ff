"""End-to-end training of the head-mixing weights with the receiver's response loss.

Both models are frozen; only W (softmax-parametrised, so on the simplex) learns. One step = one
calibration context: the receiver prefills it through the reuse path with the current W (autograd
through the replace operator), then runs the appended span natively over that cache; the loss is
KL(receiver native || relay) of the next-token distributions over the span (the native receiver
is the target: the relay should answer as it would). Checkpoints (W logits, Adam state, step)
are written atomically every few steps, so an interrupted calibration resumes where it stopped.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm

from ctxrelay import tensorfile
from ctxrelay.models import runner
from ctxrelay.models.spec import LoadedModel
from ctxrelay.transports.mapflow.mixing import SimplexW
from ctxrelay.transports.mapflow.reuse import ReuseConfig, context_pass

# runner.forward is wrapped in inference_mode; training needs the same loop with autograd on.
_forward_with_grad = runner.forward.__wrapped__


def response_loss(receiver: LoadedModel, item, cfg: ReuseConfig, w: dict[int, torch.Tensor]) -> torch.Tensor:
    cache, h = context_pass(
        receiver, item.ctx, item.maps, cfg, differentiable=True, w_override=w, prepared=item.prepared
    )
    first = runner.head(receiver, h, "last")
    rest = _forward_with_grad(receiver, item.suffix[:-1], cache, logits="all").logits
    log_q = torch.log_softmax(torch.cat([first, rest]).float(), -1)
    log_p = torch.log_softmax(item.native.float(), -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean()


def _save(path: Path, model: SimplexW, opt: torch.optim.Optimizer, step: int, history: list) -> None:
    tensors = {f"logits.{j}": p.detach() for j, p in model.logits.items()}
    state = opt.state_dict()
    for idx, st in state["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"adam.{idx}.{k}"] = v.detach().reshape(-1) if v.dim() == 0 else v.detach()
    tensorfile.write(path, tensors, {"kind": "mapflow_train_ckpt", "step": step, "history": history})


def _load(path: Path, model: SimplexW, opt: torch.optim.Optimizer) -> tuple[int, list]:
    tensors, manifest = tensorfile.read(path)
    with torch.no_grad():
        for j, p in model.logits.items():
            p.copy_(tensors[f"logits.{j}"])
    state = opt.state_dict()
    params = state["param_groups"][0]["params"]
    for idx in params:
        if f"adam.{idx}.step" in tensors:
            state["state"][idx] = {
                "step": tensors[f"adam.{idx}.step"].reshape(()),
                "exp_avg": tensors[f"adam.{idx}.exp_avg"],
                "exp_avg_sq": tensors[f"adam.{idx}.exp_avg_sq"],
            }
    opt.load_state_dict(state)
    return int(manifest["step"]), list(manifest.get("history", []))


def train_w(
    receiver: LoadedModel,
    items: list,
    cfg: ReuseConfig,
    init: dict[int, torch.Tensor],
    steps: int,
    lr: float,
    ckpt: Path | None,
    resume: bool = True,
    log=print,
    every: int = 8,
) -> tuple[dict[int, torch.Tensor], dict]:
    """Adam on the W logits for `steps` contexts (cycling through `items`); returns (W, training log)."""
    model = SimplexW(init)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    start, history = 0, []
    if ckpt is not None and resume and Path(ckpt).exists():
        try:
            start, history = _load(Path(ckpt), model, opt)
            log(f"resuming W training at step {start} from {ckpt}")
        except (tensorfile.TensorFileError, KeyError) as e:
            log(f"ignoring unreadable checkpoint {ckpt} ({e}); training from scratch")
    t0 = time.perf_counter()
    bar = tqdm(range(start, steps), desc="training W (response loss)", initial=start, total=steps)
    window: list[float] = []
    for step in bar:
        item = items[step % len(items)]
        loss = response_loss(receiver, item, cfg, model())
        opt.zero_grad()
        loss.backward()
        opt.step()
        window.append(float(loss.detach()))
        bar.set_postfix(kl=f"{sum(window[-len(items) :]) / len(window[-len(items) :]):.3f}")
        if (step + 1) % every == 0 or step + 1 == steps:
            history.append({"step": step + 1, "kl": round(sum(window) / len(window), 4)})
            window = []
            if ckpt is not None:
                _save(Path(ckpt), model, opt, step + 1, history)
    info = {"steps": steps, "lr": lr, "history": history, "train_s_this_run": round(time.perf_counter() - t0, 1)}
    return model.weights(), info
