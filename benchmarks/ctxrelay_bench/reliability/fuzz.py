"""Generated damage for every deserializer a user's file reaches: ContextState, Artifact, tensor
files and profile.json (hypothesis strategies; the reliability tests and `ctxrelay bench reliability`
both run them).

A case is one valid file, damaged one way: truncated, bit-flipped, a huge declared header or tensor
size, garbage, a manifest edited to claim another tenant or model (sealed with no secret, or with
another owner's), or a file sealed by its owner but of the wrong version, kind, dtype or shape.
Each outcome is one of:
- "refused": a CtxrelayError subclass (the clear, named error);
- "intact": the file was read and means exactly what was written (the damage touched nothing read);
- "accepted": an owner-sealed file of another valid shape, read whole (it is well formed), or a
  profile.json edited into another well-formed profile (it carries no checksum: the user's own numbers);
- "corrupt": damaged content was accepted as if valid (a partly used state);
- "unhandled": any other exception (a crash from deep inside).
Only the first three are correct.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ctxrelay import seal, tensorfile
from ctxrelay.artifact import Artifact
from ctxrelay.errors import CtxrelayError
from ctxrelay.relay.graph import CostModel, Profile
from ctxrelay.state import ContextState
from ctxrelay_bench.reliability.faults import make_state

GOOD = ("refused", "intact", "accepted")
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=6,
)


@dataclass
class Tally:
    cases: int = 0
    outcomes: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)  # first message per bad outcome

    def add(self, kind: str, outcome: str, detail: str) -> None:
        self.cases += 1
        self.kinds[kind] += 1
        self.outcomes[outcome] += 1
        if outcome not in GOOD:
            self.examples.setdefault(f"{kind}:{outcome}", detail[:300])

    @property
    def bad(self) -> int:
        return sum(n for o, n in self.outcomes.items() if o not in GOOD)

    def as_dict(self) -> dict:
        return {"cases": self.cases, "outcomes": dict(self.outcomes), "kinds": dict(self.kinds),
                "bad": self.bad, "examples": self.examples}  # fmt: skip


# ---- the valid files ----------------------------------------------------------------------------


def sample_state(tenant: str = "acme") -> ContextState:
    """A small state with keys, values and a transport part."""
    s = make_state("a shared context " * 2, tenant, tokens=6)
    s.set_part("maps", {"w": torch.randn(3, 3, generator=torch.Generator().manual_seed(0))}, {"layers": [0, 1]})
    return s


def sample_artifact() -> Artifact:
    bind = lambda name, h: {"name": name, "weights_hash": h * 64, "tokenizer_hash": h.upper() * 64}
    return Artifact("heterofold", 3, bind("s", "c"), bind("r", "d"), {"k.0.w": torch.randn(4, 4)},
                    {"sources": [0, 1]}, {"top1_agreement": 0.9}, "ctxrelay calibrate")  # fmt: skip


def sample_profile() -> bytes:
    cm = CostModel.fit([(n, {"prefill_s": 1e-3 * n}) for n in (64, 128, 256)])
    p = Profile({"a" * 64: cm}, {"heterofold:x:y": cm}, {"torch_threads": 1})
    return json.dumps({"machine": p.machine, "native": {k: v.to_json() for k, v in p.native.items()},
                       "edges": {k: v.to_json() for k, v in p.edges.items()}}).encode()  # fmt: skip


# ---- the deserializers and what "the same" means for each -------------------------------------


def _state_same(a: ContextState, b: ContextState) -> bool:
    return a.to_tensors()[1] == b.to_tensors()[1] and tensorfile.payload_digest(
        a.to_tensors()[0]
    ) == tensorfile.payload_digest(b.to_tensors()[0])


@dataclass(frozen=True)
class Target:
    name: str
    original: Callable[[], bytes]  # a valid file's bytes
    read: Callable[[bytes], object]  # the deserializer
    same: Callable[[object, bytes], bool] | None  # does what was read mean what `original` wrote?
    tensor_file: bool = True  # checksummed and sealed; profile.json is neither: any well-formed profile is valid


def _read_profile(data: bytes) -> Profile:
    p = Profile.from_json_bytes(data)
    for cm in (*p.native.values(), *p.edges.values()):  # a profile that loads must predict
        cm.total(1024)
    return p


def targets() -> dict[str, Target]:
    state_bytes = lambda: sample_state().to_bytes()
    art = sample_artifact()
    art_bytes = lambda: tensorfile.to_bytes(art.tensors, _artifact_manifest(art))
    return {
        "context_state": Target(
            "context_state", state_bytes, ContextState.from_bytes,
            lambda got, orig: _state_same(got, ContextState.from_bytes(orig)),
        ),
        "artifact": Target(
            "artifact", art_bytes, Artifact.from_bytes,
            lambda got, orig: vars(got).keys() == vars(art).keys()
            and {k: v for k, v in vars(got).items() if k != "tensors"}
            == {k: v for k, v in vars(art).items() if k != "tensors"}
            and tensorfile.payload_digest(got.tensors) == tensorfile.payload_digest(art.tensors),
        ),
        "tensor_file": Target(
            "tensor_file",
            lambda: tensorfile.to_bytes({"x": torch.arange(12.0).view(3, 4)}, {"kind": "work", "step": 3}),
            lambda d: tensorfile.from_bytes(d, "tensor file", "required"),
            lambda got, orig: got[1] == tensorfile.from_bytes(orig, "", "required")[1]
            and torch.equal(got[0]["x"], torch.arange(12.0).view(3, 4)),
        ),
        "profile": Target("profile", sample_profile, _read_profile, None, tensor_file=False),
    }  # fmt: skip


def _artifact_manifest(a: Artifact) -> dict:
    return {"kind": "transport_artifact", "format": 1, "transport": a.transport, "version": a.version,
            "sender": a.sender, "receiver": a.receiver, "params": a.params, "quality": a.quality,
            "command": a.command}  # fmt: skip


# ---- damage ------------------------------------------------------------------------------------


def _split(data: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _join(header: dict, body: bytes) -> bytes:
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + body


def edit_manifest(data: bytes, edit: Callable[[dict], None]) -> bytes:
    """The file with its manifest changed by `edit` and nothing else (the seal is left as it was)."""
    header, body = _split(data)
    m = json.loads(header["__metadata__"][tensorfile.MANIFEST_KEY])
    edit(m)
    header["__metadata__"][tensorfile.MANIFEST_KEY] = json.dumps(m)
    return _join(header, body)


@st.composite
def damaged(draw, target: Target) -> tuple[str, bytes, bool]:
    """(kind, bytes, sealed_by_owner): one damaged copy of the target's valid file."""
    data = target.original()
    kinds = ["truncate", "bitflip", "garbage", "splice"]
    sealed_kinds = ["huge_header", "huge_offsets", "edit_binding", "foreign_seal", "owner_sealed_malformed"]
    kinds += sealed_kinds * target.tensor_file
    kinds += ["json_edit"] * (not target.tensor_file)
    kind = draw(st.sampled_from(kinds))
    if kind == "truncate":
        return kind, data[: draw(st.integers(0, len(data) - 1))], False
    if kind == "bitflip":
        b = bytearray(data)
        for pos in draw(st.lists(st.integers(0, len(b) * 8 - 1), min_size=1, max_size=8, unique=True)):
            b[pos // 8] ^= 1 << (pos % 8)
        return kind, bytes(b), False
    if kind == "garbage":
        return kind, draw(st.binary(max_size=256)), False
    if kind == "splice":  # a run of bytes overwritten
        at = draw(st.integers(0, len(data) - 1))
        junk = draw(st.binary(min_size=1, max_size=32))
        return kind, data[:at] + junk + data[at + len(junk) :], False
    if kind == "json_edit":
        return kind, _json_edit(draw, data), False
    if kind == "huge_header":
        n = draw(st.integers(len(data), 2**64 - 1))
        return kind, struct.pack("<Q", n) + data[8:], False
    if kind == "huge_offsets":
        header, body = _split(data)
        name = draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
        header[name]["data_offsets"][1] = draw(st.integers(2**31, 2**63))
        if draw(st.booleans()):
            header[name]["shape"] = [draw(st.integers(2**20, 2**40))]
        return kind, _join(header, body), False
    if kind in ("edit_binding", "foreign_seal"):
        field_path = draw(st.sampled_from(_identity_fields(target.name)))
        value = draw(st.text(min_size=1, max_size=12))
        out = edit_manifest(data, lambda m: _set(m, field_path, value))
        if kind == "foreign_seal":  # edited and sealed again, with a secret that is not the owner's
            out = edit_manifest(out, lambda m: m.update(seal=_foreign_seal(m)))
        return kind, out, False
    return kind, _owner_sealed_malformed(draw, target), True


def _json_edit(draw, data: bytes) -> bytes:
    d = json.loads(data)
    node, path = d, []
    while isinstance(node, dict | list) and node and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
        path.append(key)
        node = node[key]
    value = draw(JSON | st.sampled_from([10**400, -(10**400), 1e308, float("nan"), float("inf")]))
    if not path:
        return json.dumps(value).encode()
    parent = d
    for k in path[:-1]:
        parent = parent[k]
    parent[path[-1]] = value
    return json.dumps(d).encode()


def _identity_fields(name: str) -> list[tuple[str, ...]]:
    if name == "context_state":
        return [("binding", "tenant"), ("binding", "model_name"), ("binding", "weights_hash"), ("text",)]
    if name == "artifact":
        return [("sender", "weights_hash"), ("receiver", "weights_hash"), ("receiver", "name"), ("transport",)]
    return [("kind",), ("step",)]


def _set(m: dict, path: tuple[str, ...], value) -> None:
    for k in path[:-1]:
        m = m[k]
    m[path[-1]] = value


def _foreign_seal(m: dict) -> dict:
    return {"alg": seal.ALG, "mac": seal.mac(m, key=b"not the owner")}


def _owner_sealed_malformed(draw, target: Target) -> bytes:
    """What a buggy or older writer holding the secret could leave: sealed, but the wrong shape inside."""
    tensors, manifest = tensorfile.from_bytes(target.original(), "", "required")
    manifest.pop("payload_sha256")
    how = draw(st.sampled_from(["drop_key", "replace_value", "dtype", "shape", "drop_tensor", "version"]))
    if how == "drop_key":
        manifest.pop(draw(st.sampled_from(sorted(manifest))))
    elif how == "replace_value":
        manifest[draw(st.sampled_from(sorted(manifest)))] = draw(JSON)
    elif how == "version":
        manifest[draw(st.sampled_from(["format", "version", "kind"]))] = draw(st.integers(-3, 99) | st.text(max_size=4))
    else:
        name = draw(st.sampled_from(sorted(tensors)))
        t = tensors[name]
        if how == "dtype":
            dtypes = [torch.int8, torch.float64, torch.bool, torch.uint8, torch.int32]
            tensors[name] = t.to(draw(st.sampled_from(dtypes)))
        elif how == "shape":
            tensors[name] = t.reshape(-1) if t.dim() > 1 else t.reshape(1, -1, 1)
        else:
            tensors.pop(name)
    return tensorfile.to_bytes(tensors, manifest)


# ---- one case, many cases ----------------------------------------------------------------------


def outcome(target: Target, data: bytes, owner_sealed: bool) -> tuple[str, str]:
    try:
        got = target.read(data)
    except CtxrelayError as e:
        return "refused", f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - exactly what this harness counts
        return "unhandled", f"{type(e).__name__}: {e}"
    if owner_sealed or target.same is None:
        return "accepted", ""
    try:
        return ("intact", "") if target.same(got, target.original()) else ("corrupt", "damaged content was accepted")
    except Exception as e:  # noqa: BLE001
        return "corrupt", f"what was read is unusable ({type(e).__name__}: {e})"


def run(target: Target, cases: int, tally: Tally | None = None) -> Tally:
    """Feed `cases` generated damaged files to the target's deserializer; count the outcomes."""
    tally = tally or Tally()

    @settings(max_examples=cases, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(st.data())
    def one(data) -> None:
        kind, raw, owner_sealed = data.draw(damaged(target))
        tally.add(kind, *outcome(target, raw, owner_sealed))

    one()
    return tally
