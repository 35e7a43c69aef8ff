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

from ctxrelay import paths, tensorfile
from ctxrelay.errors import BindingError

if TYPE_CHECKING:  # floor 1 names models only in annotations
    from ctxrelay.models.spec import LoadedModel

ARTIFACT_FORMAT = 1
BINDING_FIELDS = ("name", "weights_hash", "tokenizer_hash")


def model_binding(m: LoadedModel) -> dict:
    return {k: getattr(m.spec, k) for k in BINDING_FIELDS}


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
    # its tensors' sha256 as read from a file ("" for one built in memory): which artifact a cost was measured with
    digest: str = ""

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
        """An artifact file: the user's must carry this owner's seal; the package's own are trusted as
        installed code (their checksum is still checked)."""
        path = Path(path)
        packaged = path.resolve().parent == paths.PACKAGED_ARTIFACTS
        tensors, m = tensorfile.read(path, "ignored" if packaged else "required")
        return Artifact.from_tensors(tensors, m, str(path), transport, version)

    @staticmethod
    def from_bytes(data: bytes, what: str = "artifact", transport: str | None = None) -> Artifact:
        return Artifact.from_tensors(*tensorfile.from_bytes(data, what, "required"), what, transport)

    @staticmethod
    def from_tensors(
        tensors: dict[str, torch.Tensor], m: dict, what: str, transport: str | None = None, version: int | None = None
    ) -> Artifact:
        if m.get("kind") != "transport_artifact" or m.get("format") != ARTIFACT_FORMAT:
            raise tensorfile.TensorFileError(f"{what} is not a ctxrelay transport artifact")
        bad = lambda why: tensorfile.TensorFileError(f"{what} is a malformed transport artifact: {why}")
        if not isinstance(m.get("transport"), str) or type(m.get("version")) is not int:
            raise bad("its transport must be a name and its version an integer")
        for role in ("sender", "receiver"):
            b = m.get(role)
            if not isinstance(b, dict) or not all(isinstance(b.get(k), str) for k in BINDING_FIELDS):
                raise bad(f"its {role} must name the model, its weights hash and tokenizer hash")
        if not all(isinstance(m.get(k, {}), dict) for k in ("params", "quality")):
            raise bad("its params and quality must be JSON objects")
        if transport is not None and m["transport"] != transport:
            raise tensorfile.TensorFileError(f"{what} is a {m['transport']} artifact, not {transport}")
        if version is not None and m["version"] != version:
            raise tensorfile.TensorFileError(
                f"{what} is {m['transport']} format v{m['version']}; this ctxrelay reads v{version}: recalibrate"
            )
        return Artifact(
            transport=m["transport"],
            version=m["version"],
            sender=m["sender"],
            receiver=m["receiver"],
            tensors=tensors,
            params=m.get("params", {}),
            quality=m.get("quality", {}),
            command=str(m.get("command", "")),
            digest=str(m.get("payload_sha256", "")),
        )
