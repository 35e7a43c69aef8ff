"""The relay's own compute in bf16 (where receivers decode in a bf16 engine): the same binding, fp32 RoPE tables,
and exactness at bf16 tolerance: recomputing every token in bf16 reproduces the receiver's bf16 native prefill."""

import pytest
import torch

from conftest import SAMPLE_TEXT, zero_artifact
from ctxrelay.models import runner
from ctxrelay.models.capture import capture_state
from ctxrelay.models.tokens import context_ids, suffix_ids
from ctxrelay.relay import ModelPool
from ctxrelay.relay.graph import CostModel, Profile
from ctxrelay.serve.engine_profile import relay_dtype
from ctxrelay.transports.heterofold import relay_prefill

SUFFIX = " Question: what is a startup? Answer:"
PAIRS = [("llama", "gemma3"), ("gemma3", "qwen2"), ("qwen2", "llama")]  # every family as a receiver


def _close_in_bf16(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the logits' scale (bf16 keeps 8 bits of mantissa: ~0.4% a rounding)."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))


def test_a_model_in_bf16_keeps_its_binding_and_rope_in_fp32(tiny):
    b = tiny.in_dtype(torch.bfloat16)
    assert tiny.in_dtype(torch.float32) is tiny  # nothing to copy
    assert b.spec is tiny.spec and b.dtype == torch.bfloat16 and tiny.dtype == torch.float32
    assert all(p.dtype == torch.bfloat16 for p in b.hf.parameters())
    assert all(p.dtype == torch.float32 for p in tiny.hf.parameters())  # the original is left as it was
    buffers = dict(b.hf.named_buffers())
    assert any("inv_freq" in k for k in buffers) and all(
        x.dtype == tiny_buf.dtype for (k, x), tiny_buf in zip(buffers.items(), tiny.hf.buffers(), strict=True)
    )  # RoPE's inverse frequencies stay fp32, as in a model loaded in bf16
    if tiny.hf.lm_head.weight is tiny.hf.model.embed_tokens.weight:
        assert b.hf.lm_head.weight is b.hf.model.embed_tokens.weight  # tied weights stay tied
    ids = context_ids(tiny, SAMPLE_TEXT)
    ref, got = runner.forward(tiny, ids, logits="all").logits, runner.forward(b, ids, logits="all").logits
    assert got.dtype == torch.bfloat16 and _close_in_bf16(got, ref) < 0.05


@pytest.mark.parametrize(("s", "r"), PAIRS)
def test_recomputing_every_token_in_bf16_reproduces_bf16_native_prefill(tiny_by_family, s, r):
    sender, receiver = tiny_by_family[s], tiny_by_family[r].in_dtype(torch.bfloat16)
    state = capture_state(sender, SAMPLE_TEXT, "t")  # fp32 sender K/V, as a stored state holds them
    suffix = suffix_ids(receiver, SUFFIX)
    native = runner.forward(receiver, torch.cat([context_ids(receiver, SAMPLE_TEXT), suffix]), logits="all")
    native = native.logits[-len(suffix) :]
    art = zero_artifact(sender, receiver)  # a translation wrong everywhere: only the recompute can fix it
    out = relay_prefill(receiver, state, art, suffix, logits="all", recompute=1.0, selection="mix")
    assert out.cache.keys[0].dtype == torch.bfloat16 and out.info["recompute_fraction"] == 1.0
    err = _close_in_bf16(out.logits, native)
    assert err < 0.02 and torch.equal(out.logits.argmax(-1), native.argmax(-1)), err
    plain = relay_prefill(receiver, state, art, suffix, logits="all")
    assert _close_in_bf16(plain.logits, native) > 5 * max(err, 1e-3)  # the control: zero maps change the logits


def test_a_pool_relays_and_decodes_in_its_compute_dtype(tiny_by_family, tmp_path):
    llama = tiny_by_family["llama"]
    kept = tmp_path / "profile-relay-bf16.json"
    Profile(native={"x": CostModel.fit([(256, {"prefill_s": 0.1}), (512, {"prefill_s": 0.2})])}).save(kept)
    pool = ModelPool([llama], artifact_dirs=[tmp_path / "artifacts"], profile=Profile())
    pool.use_compute_dtype(torch.bfloat16, kept)
    assert pool.profile_path == kept and "x" in pool.profile.native  # its costs are bf16's, kept apart
    made = dict(pool._compute)  # made by use_compute_dtype: an edge (its own K/V) leads into llama
    b = pool.relay_model(llama)
    assert made.get(llama.name) is b and b.dtype == torch.bfloat16 and pool.relay_model(llama) is b
    assert pool.models[llama.name] is llama
    state = pool.prefill(llama.name, SAMPLE_TEXT, tenant="acme")  # the sender reads in fp32
    res = pool.continue_from(state, llama.name, SUFFIX, max_new_tokens=4)
    ids = torch.cat([torch.as_tensor(state.tokens), suffix_ids(llama, SUFFIX)])
    ref = runner.forward(b, ids).logits[-1]
    assert res.transport == "self" and res.first_logits.dtype == torch.bfloat16
    assert _close_in_bf16(res.first_logits, ref) < 0.02 and len(res.tokens) == 4


def test_the_relay_computes_in_bf16_only_for_a_bf16_engine_on_a_cpu_with_bf16_units():
    assert relay_dtype("bfloat16", "amx") == torch.bfloat16
    assert relay_dtype("bfloat16", "avx512", bf16=True) == torch.bfloat16
    assert relay_dtype("bfloat16", "avx512", bf16=False) == torch.float32  # emulated: slower than fp32
    assert relay_dtype("bfloat16", "avx2") == torch.float32
    assert relay_dtype("float32", "amx") == torch.float32  # the cache an fp32 engine loads stays fp32


@pytest.mark.parametrize(("heads", "kv_heads", "window"), [(4, 1, None), (6, 2, 48), (4, 4, None)])
def test_bf16_masked_attention_as_gemms_matches_sdpa(monkeypatch, heads, kv_heads, window):
    """Scattered queries (selective recompute) over a cache: the GEMM path equals SDPA's masked kernel at bf16
    tolerance, over row chunks too (a small score budget forces several)."""
    from ctxrelay.models import attention

    monkeypatch.setattr(attention, "GEMM_SCORES", 2000)
    g = torch.Generator().manual_seed(0)
    s, d = 300, 32
    qpos = torch.randperm(s, generator=g)[:70].sort().values
    q = torch.randn(1, heads, 70, d, generator=g).bfloat16()
    k, v = (torch.randn(1, kv_heads, s, d, generator=g).bfloat16() for _ in range(2))
    mask = attention.positions_mask(qpos, s, window)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, scale=d**-0.5, enable_gqa=kv_heads != heads
    )
    got = attention.gemm_attention(q, k, v, mask, d**-0.5)
    assert got.dtype == torch.bfloat16 and float((got.float() - ref).abs().max()) < 0.02
