"""Held-out quality of a heterofold artifact against the receiver's own native prefill.

A held-out text is cut into a context (the sender prefills it; the receiver gets it only through
the transport) and a continuation of `suffix` receiver tokens, teacher-forced natively on top.
Over the continuation: top-1 agreement and KL(native || relay) of the next-token distributions,
perplexity of the true continuation at several horizons (relay, native, and with no context).
These are the numbers the relay layer gates on (artifact.quality). The same formulas live in
ctxrelay.metrics, a floor above this one (transports may not import it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ctxrelay.artifact import Artifact
from ctxrelay.metrics import PooledQuality, pooled_perplexity, token_nll
from ctxrelay.models import runner
from ctxrelay.models.capture import capture_state
from ctxrelay.models.spec import LoadedModel
from ctxrelay.models.tokens import context_ids, suffix_ids, tokenize_context
from ctxrelay.state import ContextState
from ctxrelay.transports.heterofold.calibration.text_cache import cached_file, model_key, text_key

HORIZONS = (1, 16, 32, 128)


@dataclass
class HeldoutItem:
    state: ContextState  # sender state of the context text
    suffix: torch.Tensor  # [n] receiver ids of the continuation
    native_logprobs: torch.Tensor  # [n - 1, V] native log-probs at suffix positions 0..n-2
    no_context_nll: torch.Tensor  # [n - 1] NLL of suffix[1:] with the suffix alone


def split_text(receiver: LoadedModel, text: str, suffix_tokens: int) -> tuple[str, str]:
    """Cut `text` at a receiver token end so the continuation holds about `suffix_tokens` tokens."""
    ids, offs = tokenize_context(receiver, text)
    if ids.shape[0] < suffix_tokens + 32:
        raise ValueError(
            f"held-out text has {ids.shape[0]} {receiver.name} tokens; need > {suffix_tokens + 32} "
            "(context + continuation): pass longer held-out texts"
        )
    cut = int(offs[ids.shape[0] - suffix_tokens - 1, 1])
    return text[:cut], text[cut:]


_MEMO: dict[tuple, HeldoutItem] = {}  # items of the last model pair (calibrating several methods in a row)


def make_item(
    sender: LoadedModel, receiver: LoadedModel, text: str, suffix_tokens: int = 129, cache: Path | None = None
) -> HeldoutItem:
    """The item of `text`: memoised for the last model pair and, with `cache` (a folder), kept on disk
    in fp32, so a rerun of a calibration stage (other fractions, other hiding) skips the sender's and
    the receiver's native prefills (at 4096 tokens ~55 s of each ~65 s item for the 1.5B -> 0.5B)."""
    key = (sender.spec.weights_hash, receiver.spec.weights_hash, suffix_tokens, text)
    if key not in _MEMO:
        if any(k[:2] != key[:2] for k in _MEMO):
            _MEMO.clear()
        if cache is None:
            _MEMO[key] = _make_item(sender, receiver, text, suffix_tokens)
        else:
            pair = f"{model_key(sender)}-to-{model_key(receiver)}"
            path = Path(cache) / pair / f"{text_key(text)}-{suffix_tokens}.st"
            _MEMO[key] = _cached_item(path, lambda: _make_item(sender, receiver, text, suffix_tokens))
    return _MEMO[key]


def _cached_item(path: Path, make) -> HeldoutItem:
    """The item stored at `path`, else `make()` stored there. fp32 as computed: a cached stage measures
    exactly what an uncached one does. A damaged file is made again."""

    def to_file() -> tuple[dict, dict]:
        item = make()
        state, state_manifest = item.state.to_tensors()
        tensors = {f"state.{k}": v for k, v in state.items()}
        tensors.update(suffix=item.suffix, native_logprobs=item.native_logprobs, no_context_nll=item.no_context_nll)
        return tensors, {"kind": "heterofold_heldout_item", "state": state_manifest}

    def load(tensors: dict, manifest: dict) -> HeldoutItem:
        state = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("state.")}
        return HeldoutItem(ContextState.from_tensors(state, manifest["state"], what=str(path)),
                           tensors["suffix"], tensors["native_logprobs"], tensors["no_context_nll"])  # fmt: skip

    return cached_file(path, to_file, load)


@torch.inference_mode()
def _make_item(sender: LoadedModel, receiver: LoadedModel, text: str, suffix_tokens: int) -> HeldoutItem:
    context, rest = split_text(receiver, text, suffix_tokens)
    state = capture_state(sender, context, tenant="calibration")
    suf = suffix_ids(receiver, rest)
    ctx_ids = context_ids(receiver, context)
    native = runner.tail_logits(receiver, torch.cat([ctx_ids, suf]), len(suf))[:-1]
    alone = runner.forward(receiver, suf, logits="all").logits[:-1]
    return HeldoutItem(state, suf, torch.log_softmax(native.float(), -1), token_nll(alone, suf[1:]))


@torch.inference_mode()
def evaluate(receiver: LoadedModel, artifact: Artifact, items: list[HeldoutItem], horizons=HORIZONS) -> dict:
    """top1_agreement, kl, ppl / native_ppl / no_context_ppl per horizon over `items`."""
    from ctxrelay.transports.heterofold.transfer import relay_prefill

    pooled = PooledQuality()
    for it in items:
        out = relay_prefill(receiver, it.state, artifact, it.suffix, logits="all")
        pooled.add(it.native_logprobs, torch.log_softmax(out.logits[:-1].float(), -1), it.suffix[1:])
    no_context = pooled_perplexity([it.no_context_nll for it in items], horizons)
    return {**pooled.result(horizons), "no_context_ppl": no_context, "items": len(items)}
