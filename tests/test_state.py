"""ContextState and transport artifacts: round trips, corruption and binding refusals."""

import pytest
import torch

from conftest import SAMPLE_TEXT
from ctxrelay import tensorfile
from ctxrelay.artifact import Artifact, model_binding
from ctxrelay.errors import BindingError
from ctxrelay.models.capture import capture_state
from ctxrelay.models.tokens import tokenize_context
from ctxrelay.state import ContextState


@pytest.fixture(scope="module")
def llama_state(tiny_by_family):
    m = tiny_by_family["llama"]
    state = capture_state(m, SAMPLE_TEXT, tenant="acme")
    return m, state


def test_offsets_cover_the_text(tiny):
    ids, offsets = tokenize_context(tiny, SAMPLE_TEXT)
    assert ids.shape[0] == offsets.shape[0]
    real = offsets[offsets[:, 1] > 0]
    assert int(real[-1, 1]) == len(SAMPLE_TEXT)
    assert bool((real[1:, 1] >= real[:-1, 1]).all())


def test_capture_state_shapes(llama_state):
    m, state = llama_state
    s = m.spec
    assert state.keys_pre_rope.shape == (s.num_layers, state.num_tokens, s.num_kv_heads, s.head_dim)
    assert state.values.shape == state.keys_pre_rope.shape
    assert state.has("kv") and not state.has("maps")


def test_state_round_trip(tmp_path, llama_state):
    _, state = llama_state
    state.set_part("maps", {"layer0.cols": torch.arange(6, dtype=torch.int32)}, {"block": 64})
    path = state.save(tmp_path / "s.safetensors")
    back = ContextState.load(path)
    assert back.text == state.text and back.binding == state.binding
    assert torch.equal(back.tokens, state.tokens) and torch.equal(back.offsets, state.offsets)
    assert torch.equal(back.keys_pre_rope, state.keys_pre_rope) and torch.equal(back.values, state.values)
    assert torch.equal(back.parts["maps"]["layer0.cols"], state.parts["maps"]["layer0.cols"])
    assert back.parts_meta == {"maps": {"block": 64}} and back.has("maps")
    assert ContextState.from_bytes(state.to_bytes()).content_hash == state.content_hash
    state.parts, state.parts_meta = {}, {}


def test_corrupted_state_is_a_clear_error(tmp_path, llama_state):
    _, state = llama_state
    path = state.save(tmp_path / "s.safetensors")
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # flip a byte inside the tensor payload
    path.write_bytes(bytes(data))
    with pytest.raises(tensorfile.TensorFileError, match="corrupted"):
        ContextState.load(path)
    path.write_bytes(b"not a tensor file at all")
    with pytest.raises(tensorfile.TensorFileError, match="damaged"):
        ContextState.load(path)
    with pytest.raises(tensorfile.TensorFileError, match="does not exist"):
        ContextState.load(tmp_path / "missing.safetensors")


def test_state_refuses_other_tenant_and_other_model(tiny_by_family, llama_state):
    m, state = llama_state
    state.check(m, "acme")  # its own model and tenant: fine
    with pytest.raises(BindingError, match="tenant"):
        state.check(m, "globex")
    with pytest.raises(BindingError, match="weights"):
        state.check(tiny_by_family["qwen2"], "acme")


def test_artifact_round_trip_and_binding(tmp_path, tiny_by_family):
    llama, qwen, gemma = (tiny_by_family[f] for f in ("llama", "qwen2", "gemma3"))
    art = Artifact(
        transport="heterofold",
        version=1,
        sender=model_binding(llama),
        receiver=model_binding(qwen),
        tensors={"w": torch.randn(3, 4)},
        params={"rank": 16},
        quality={"top1_agreement": 0.8},
        command="ctxrelay calibrate ...",
    )
    path = art.save(tmp_path / "a.safetensors")
    back = Artifact.load(path, transport="heterofold", version=1)
    assert torch.equal(back.tensors["w"], art.tensors["w"]) and back.quality == art.quality
    back.check(llama, qwen)
    with pytest.raises(BindingError, match="receiver"):
        back.check(llama, gemma)
    with pytest.raises(tensorfile.TensorFileError, match="not mapflow"):
        Artifact.load(path, transport="mapflow")
    with pytest.raises(tensorfile.TensorFileError, match="recalibrate"):
        Artifact.load(path, version=2)
