"""Transport artifacts: calibrated tensors + manifest bound to the exact sender and receiver.

A manifest records the transport and its version, both models' weights and tokenizer hashes, the
parameters the calibration chose, the quality report it measured and the command that made it.
Using an artifact with any other model pair is refused (BindingError), never silently wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ctxrelay import tensorfile
from ctxrelay.errors import BindingError

if TYPE_CHECKING:  # floor 1 names models only in annotations
    from ctxrelay.models.spec import LoadedModel

ARTIFACT_FORMAT = 1


def model_binding(m: LoadedModel) -> dict:
    return {"name": m.spec.name, "weights_hash": m.spec.weights_hash, "tokenizer_hash": m.spec.tokenizer_hash}


@dataclass
class Artifact:
    transport: str  # "mapflow" | "heterofold"
    version: int  # the transport's own format version
    sender: dict  # model_binding(...)
    receiver: dict
    tensors: dict[str, torch.Tensor]
    params: dict = field(default_factory=dict)  # what calibration chose (r, p, B, mapping, ranks...)
    quality: dict = field(default_factory=dict)  # measured vs the receiver's native prefill
    command: str = ""  # the command that produced it

    @property
    def edge(self) -> tuple[str, str]:
        return self.sender["weights_hash"], self.receiver["weights_hash"]

    def check(self, sender: LoadedModel | None, receiver: LoadedModel | None) -> None:
        for role, bound, m in (("sender", self.sender, sender), ("receiver", self.receiver, receiver)):
            if m is None:
                continue
            if m.spec.weights_hash != bound["weights_hash"]:
                raise BindingError(
                    f"{self.transport} artifact was calibrated for {role} {bound['name']} "
                    f"(weights {bound['weights_hash'][:12]}), not {m.spec.name} ({m.spec.weights_hash[:12]})"
                )
            if m.spec.tokenizer_hash != bound["tokenizer_hash"]:
                raise BindingError(f"{self.transport} artifact's {role} tokenizer differs from {m.spec.name}'s")

    def save(self, path: str | Path) -> Path:
        manifest = {
            "kind": "transport_artifact",
            "format": ARTIFACT_FORMAT,
            "transport": self.transport,
            "version": self.version,
            "sender": self.sender,
            "receiver": self.receiver,
            "params": self.params,
            "quality": self.quality,
            "command": self.command,
        }
        return tensorfile.write(path, self.tensors, manifest)

    @staticmethod
    def load(path: str | Path, transport: str | None = None, version: int | None = None) -> Artifact:
        tensors, m = tensorfile.read(path)
        if m.get("kind") != "transport_artifact" or m.get("format") != ARTIFACT_FORMAT:
            raise tensorfile.TensorFileError(f"{path} is not a ctxrelay transport artifact")
        if transport is not None and m["transport"] != transport:
            raise tensorfile.TensorFileError(f"{path} is a {m['transport']} artifact, not {transport}")
        if version is not None and m["version"] != version:
            raise tensorfile.TensorFileError(
                f"{path} is {m['transport']} format v{m['version']}; this ctxrelay reads v{version}: recalibrate"
            )
        return Artifact(
            transport=m["transport"],
            version=m["version"],
            sender=m["sender"],
            receiver=m["receiver"],
            tensors=tensors,
            params=m.get("params", {}),
            quality=m.get("quality", {}),
            command=m.get("command", ""),
        )
