"""What the cross-family engine scripts share, run inside vLLM's venv: the sender, the receiver and their
shipped heterofold artifact; a context relayed from the sender's state into the receiver's cache and saved as
the connector's file; a vLLM engine for the receiver with ctxrelay's connector."""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TENANT = "acme"


@dataclass
class CrossPair:
    sender_name: str
    receiver_name: str
    sender: Any  # LoadedModel
    receiver: Any
    artifact: Any
    work: Path

    @staticmethod
    def load(sender: str, receiver: str) -> CrossPair:
        from ctxrelay import paths, zoo
        from ctxrelay.artifact import Artifact
        from ctxrelay.engines.vllm_connector import cpu_engine_env

        cpu_engine_env(2)
        art = Artifact.load(paths.find_artifact("heterofold", sender, receiver))
        work = Path(tempfile.mkdtemp(prefix="ctxrelay-cross-"))
        return CrossPair(sender, receiver, zoo.load(sender), zoo.load(receiver), art, work)

    def relay(self, context: str, suffix: torch.Tensor, name: str, warm: bool = False, **options):
        """The receiver's cache of `context` relayed from the sender's state (heterofold with `options`), saved
        as the connector's file: (context ids, the file, the relay's compute in seconds; `warm`: after one
        untimed relay)."""
        from ctxrelay import transports
        from ctxrelay.engines.kv_payload import KVPayload
        from ctxrelay.models.capture import capture_state
        from ctxrelay.models.tokens import tokenize_context

        heterofold = transports.get("heterofold")
        state = capture_state(self.sender, context, TENANT)
        ctx = tokenize_context(self.receiver, context)[0].tolist()
        with torch.inference_mode():
            if warm:
                heterofold.relay_prefill(self.receiver, state, self.artifact, suffix, **options)
            t = time.perf_counter()
            out = heterofold.relay_prefill(self.receiver, state, self.artifact, suffix, **options)
            seconds = time.perf_counter() - t
        assert out.cache.length == len(ctx) + suffix.numel(), (out.cache.length, len(ctx))  # the engine's context
        payload = KVPayload.from_cache(out.cache, ctx, self.receiver.spec.weights_hash, TENANT, exact=False)
        return ctx, payload.save(self.work / f"{name}.safetensors"), seconds

    def engine(self, max_model_len: int, dtype: str = "float32"):
        """vLLM (eager, prefix caching on) for the receiver, with ctxrelay's connector."""
        from vllm import LLM

        from ctxrelay import zoo
        from ctxrelay.engines.vllm_connector import transfer_config

        return LLM(
            model=str(zoo.pull(self.receiver_name)), dtype=dtype, enforce_eager=True, enable_prefix_caching=True,
            max_model_len=max_model_len, skip_tokenizer_init=True, seed=0,
            kv_transfer_config=transfer_config(self.receiver.spec.weights_hash),
        )  # fmt: skip
