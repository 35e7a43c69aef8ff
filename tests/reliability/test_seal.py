"""The keyed seal: a manifest edited to claim another tenant or model is refused by name, in a file,
in every store backend, and through the pool (which then prefills natively)."""

import json
import os
import stat

import pytest
import torch

from ctxrelay import seal, tensorfile
from ctxrelay.artifact import Artifact
from ctxrelay.relay.store import DiskStore, MemoryStore, StateKey, StoreUnavailable
from ctxrelay.state import ContextState
from ctxrelay_bench.reliability.fuzz import edit_manifest, sample_artifact, sample_state

pytestmark = pytest.mark.usefixtures("own_cache")


def test_key_file_is_created_private_and_reused(own_cache):
    first = seal.secret()
    path = own_cache / seal.KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    seal._cache.clear()
    assert seal.secret() == first  # read back, not made again
    os.chmod(path, 0o644)
    seal._cache.clear()
    with pytest.raises(seal.SecretError, match="chmod 600"):
        seal.secret()


def test_env_secret_wins_and_other_owners_cannot_read(monkeypatch, tmp_path):
    data = sample_state().to_bytes()
    assert ContextState.from_bytes(data).binding.tenant == "acme"
    monkeypatch.setenv("CTXRELAY_STORE_SECRET", "another owner")
    with pytest.raises(tensorfile.SealError, match="another owner's secret"):
        ContextState.from_bytes(data)


@pytest.mark.parametrize("field,value", [("tenant", "globex"), ("weights_hash", "f" * 64), ("model_name", "big")])
def test_edited_binding_is_refused(field, value):
    data = edit_manifest(sample_state().to_bytes(), lambda m: m["binding"].update({field: value}))
    with pytest.raises(tensorfile.SealError, match="seal does not match"):
        ContextState.from_bytes(data)


def test_stripped_seal_is_refused_for_states_and_artifacts(tmp_path):
    strip = lambda m: m.pop("seal")
    with pytest.raises(tensorfile.SealError, match="unsealed"):
        ContextState.from_bytes(edit_manifest(sample_state().to_bytes(), strip))
    path = sample_artifact().save(tmp_path / "a.safetensors")
    path.write_bytes(edit_manifest(path.read_bytes(), strip))
    with pytest.raises(tensorfile.SealError, match=r"unsealed \(if you trust it: `ctxrelay seal .*a.safetensors`\)"):
        Artifact.load(path)
    # a work file written before seals existed is still read (it binds nobody)
    work = tmp_path / "w.safetensors"
    work.write_bytes(edit_manifest(tensorfile.to_bytes({"x": torch.ones(2)}, {"kind": "w"}), strip))
    assert tensorfile.read(work)[1]["kind"] == "w"


def test_disk_store_entry_edited_to_another_tenant_is_never_served(tmp_path):
    store = DiskStore(tmp_path / "disk")
    s = sample_state("acme")
    key = store.put(s)
    path = store._path(key)
    forged_path = tmp_path / "disk" / "globex" / path.name  # moved into globex's folder, tenant edited
    forged_path.parent.mkdir(parents=True)
    forged_path.write_bytes(edit_manifest(path.read_bytes(), lambda m: m["binding"].update(tenant="globex")))
    with pytest.raises(StoreUnavailable, match="seal"):
        store.get(StateKey("globex", key.content_hash, key.model_hash), "globex")
    assert store.get(key, "acme").binding.tenant == "acme"  # the owner's own entry is untouched


def test_memory_store_entries_are_sealed():
    store = MemoryStore(1 << 20, 4096)
    key = store.put(sample_state())
    raw = store.arena[store._entries[key].pages].reshape(-1)[: store._entries[key].nbytes].numpy().tobytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert json.loads(header["__metadata__"][tensorfile.MANIFEST_KEY])["seal"]["alg"] == seal.ALG


def test_reseal_vouches_for_an_unsealed_artifact(tmp_path):
    path = sample_artifact().save(tmp_path / "a.safetensors")
    path.write_bytes(edit_manifest(path.read_bytes(), lambda m: m.pop("seal")))
    with pytest.raises(tensorfile.SealError):
        Artifact.load(path)
    tensorfile.reseal(path)
    assert Artifact.load(path).sender == sample_artifact().sender
    damaged = bytearray(path.read_bytes())
    damaged[-3] ^= 0xFF
    path.write_bytes(bytes(damaged))
    with pytest.raises(tensorfile.TensorFileError, match="corrupted"):
        tensorfile.reseal(path)  # a damaged file is never vouched for


@pytest.mark.parametrize("mac", ["é" * 64, "A" * 64, 7, "0" * 63])
def test_a_malformed_seal_is_refused_not_a_crash(mac):
    # found by the bench's fuzzing: a spliced non-ASCII mac made hmac.compare_digest raise TypeError
    data = edit_manifest(sample_state().to_bytes(), lambda m: m["seal"].update(mac=mac))
    with pytest.raises(tensorfile.SealError, match="not a hmac"):
        ContextState.from_bytes(data)
