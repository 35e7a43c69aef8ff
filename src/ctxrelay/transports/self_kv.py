"""The "self" transport: a model continuing from the K/V its own prefill left (exact, no prefill).

The state's pre-RoPE keys and values get the model's own k-norm and RoPE at their positions; the
suffix (or, with no suffix, the last context token) runs natively over them. Used whenever the
receiver is the very model version that made the state.
"""

from __future__ import annotations

import time

import torch

from ctxrelay.artifact import Artifact
from ctxrelay.errors import UsageError
from ctxrelay.models import runner
from ctxrelay.models.runner import KVCache
from ctxrelay.models.spec import LoadedModel, ModelSpec
from ctxrelay.state import ContextState
from ctxrelay.transports.base import RelayOutput, Transport


class SelfKV(Transport):
    name = "self"
    needs = "kv"
    exact = True
    color = "tab:green"

    def implicit_edge(self, sender: ModelSpec, receiver: ModelSpec) -> bool:
        return sender.weights_hash == receiver.weights_hash and sender.tokenizer_hash == receiver.tokenizer_hash

    def relay_prefill(
        self, receiver: LoadedModel, state: ContextState, artifact: Artifact | None, suffix_ids: torch.Tensor, **options
    ) -> RelayOutput:
        if options:
            raise UsageError(f"the self transport takes no options (got {sorted(options)})")
        state.check(receiver)  # the very model version and tokenizer that made the state
        if not state.has("kv"):
            raise UsageError("this context state holds no pre-RoPE keys/values (capture them with kv=True)")
        suffix_ids = torch.as_tensor(suffix_ids, dtype=torch.long).view(-1)
        t = time.perf_counter()
        keep = state.num_tokens if len(suffix_ids) else state.num_tokens - 1
        cache = runner.cache_from_pre_rope(
            receiver, state.keys_pre_rope[:, :keep], state.values[:, :keep], len(suffix_ids) + KVCache.BLOCK
        )
        ta = time.perf_counter()
        out = runner.forward(receiver, suffix_ids if len(suffix_ids) else state.tokens[keep:], cache)
        timings = {"assemble_s": ta - t, "first_token_s": time.perf_counter() - ta}
        return RelayOutput(out.cache, out.logits, timings, {"method": "own K/V"})


transport = SelfKV()
