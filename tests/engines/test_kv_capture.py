"""A sender's K/V captured inside an engine (engines/kv_capture.py), without the engine: the recorder fed
as vLLM's attention layers feed it (keys after RoPE, rows in the engine's batch order, chunked prefill,
a prefix-cache start), the file's bindings, and the state the router makes of it."""

from __future__ import annotations

import pytest
import torch

from ctxrelay.engines.kv_capture import CapturedKV, CaptureStep, Recorder, wait_for_file
from ctxrelay.engines.paged import slot_mapping
from ctxrelay.errors import BindingError, UsageError
from ctxrelay.models import runner
from ctxrelay.models.capture import capture_state, state_of_kv, unrope_keys
from ctxrelay.models.tiny import tiny_model

TEXT = "The lighthouse keeper counted ships at dusk, and every count was written in the blue ledger. " * 3


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", layers=2)


def _engine_keys(m, state) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys after RoPE and values [L, T, H, d], as an engine's attention layers hand them over."""
    cache = runner.cache_from_pre_rope(m, state.keys_pre_rope, state.values)
    t = state.num_tokens
    keys = torch.stack([cache.view(i, t)[0][0].transpose(0, 1) for i in range(len(cache.keys))])
    return keys, state.values


def test_unrope_undoes_the_models_rope(llama):
    state = capture_state(llama, TEXT, "acme")
    keys, _ = _engine_keys(llama, state)
    torch.testing.assert_close(unrope_keys(llama, keys), state.keys_pre_rope, rtol=1e-4, atol=1e-5)
    tail = unrope_keys(llama, keys[:, 10:], start=10)  # positions 10.. rotate back by their own angles
    torch.testing.assert_close(tail, state.keys_pre_rope[:, 10:], rtol=1e-4, atol=1e-5)


def test_a_family_with_k_norm_cannot_give_pre_norm_keys():
    g = tiny_model("gemma3", layers=2)
    with pytest.raises(ValueError, match="pre-norm"):
        unrope_keys(g, torch.zeros(g.spec.num_layers, 4, g.spec.num_kv_heads, g.spec.head_dim))


def _feed(rec: Recorder, steps: list[CaptureStep], batch: list[tuple[CaptureStep | None, int]], keys, values,
          layers: int, bs: int, group_of: list[int] | None = None):  # fmt: skip
    """One engine step: the batch's rows in the given order (a request's positions, or padding) per layer; each
    layer's slots come from its KV cache group's block table (`group_of`, all group 0 by default)."""
    group_of = group_of or [0] * layers
    rec.begin(steps)
    slots: dict[int, list[int]] = {g: [] for g in set(group_of)}
    krows, vrows = [], []
    for step, pos in batch:
        if step is None:
            for g in slots:
                slots[g].append(-1)
            any_keys = next(iter(keys.values()))
            krows.append(torch.zeros_like(any_keys[:, 0]))
            vrows.append(torch.zeros_like(any_keys[:, 0]))
            continue
        for g in slots:
            slots[g].append(int(slot_mapping(step.block_ids[g], pos, pos + 1, bs)[0]))
        krows.append(keys[step.req_id][:, pos])
        vrows.append(values[step.req_id][:, pos])
    slot_t = {g: torch.tensor(v) for g, v in slots.items()}
    for i in range(layers):
        g = group_of[i]
        rec.record(i, torch.stack([k[i] for k in krows]), torch.stack([v[i] for v in vrows]), slot_t[g], g)
    rec.finish()


def test_recorder_keeps_each_requests_rows_across_chunks_and_batch_order(llama, tmp_path):
    bs, m = 4, llama
    a, b = capture_state(m, TEXT, "acme"), capture_state(m, TEXT[::-1], "acme")
    ka, va = _engine_keys(m, a)
    kb, vb = _engine_keys(m, b)
    keys, values = {"a": ka, "b": kb}, {"a": va, "b": vb}
    na, nb = a.num_tokens, b.num_tokens
    blocks_a = list(range(100, 100 + -(-na // bs)))
    blocks_b = list(range(300, 300 + -(-nb // bs)))[::-1]  # blocks in any order
    ids_a, ids_b = a.tokens.tolist(), b.tokens.tolist()
    rec = Recorder(m.spec.weights_hash, bs)
    half = 20
    # request a starts at 8 (the prefix cache held 0..7); b from 0; both in two chunks, rows interleaved
    s1 = [CaptureStep("a", str(tmp_path / "a.st"), "acme", ids_a, 8, 8, half - 8, [blocks_a]),
          CaptureStep("b", str(tmp_path / "b.st"), "acme", ids_b, 0, 0, half, [blocks_b])]  # fmt: skip
    rows1 = [(s1[1], p) for p in range(half)] + [(None, 0)] + [(s1[0], p) for p in range(8, half)][::-1]
    _feed(rec, s1, rows1, keys, values, m.spec.num_layers, bs)
    s2 = [CaptureStep("b", str(tmp_path / "b.st"), "acme", ids_b, 0, half, nb - half, [blocks_b]),
          CaptureStep("a", str(tmp_path / "a.st"), "acme", ids_a, 8, half, na - half, [blocks_a])]  # fmt: skip
    rows2 = [(s2[1], p) for p in range(half, na)] + [(s2[0], p) for p in range(half, nb)]
    _feed(rec, s2, rows2, keys, values, m.spec.num_layers, bs)
    rec.join()
    got_a = CapturedKV.load(tmp_path / "a.st", ids_a, m.spec.weights_hash, "acme")
    got_b = CapturedKV.load(tmp_path / "b.st", ids_b, m.spec.weights_hash, "acme")
    assert got_a.start == 8 and got_b.start == 0
    torch.testing.assert_close(torch.stack(got_a.keys), ka[:, 8:])
    torch.testing.assert_close(torch.stack(got_b.values), vb)
    # the router's state of it: a's first 8 positions from the state it holds, the rest from the engine
    pre = unrope_keys(m, torch.stack(got_a.keys), got_a.start)
    state = state_of_kv(m, TEXT, "acme", pre, torch.stack(got_a.values), got_a.start, base=a)
    torch.testing.assert_close(state.keys_pre_rope, a.keys_pre_rope, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state.values, a.values)
    assert state.meta["extended_from"] == 8 and state.binding == a.binding


def test_recorder_reads_each_layer_through_its_kv_cache_groups_block_table(llama, tmp_path):
    """Under vLLM's hybrid KV manager a sliding-window layer's slots come from a block table of its own (the
    null block where its window has passed): rows are found per group, never through another group's table."""
    bs, m = 4, llama
    a = capture_state(m, TEXT, "acme")
    ka, va = _engine_keys(m, a)
    n, ids, nblocks = a.num_tokens, a.tokens.tolist(), -(-a.num_tokens // 4)
    full, sliding = list(range(10, 10 + nblocks)), list(range(500, 500 + nblocks))[::-1]
    rec = Recorder(m.spec.weights_hash, bs)
    half = 16
    s1 = [CaptureStep("a", str(tmp_path / "a.st"), "acme", ids, 0, 0, half, [full, sliding])]
    _feed(rec, s1, [(s1[0], p) for p in range(half)], {"a": ka}, {"a": va}, m.spec.num_layers, bs, [1, 0])
    # the window has passed the first block: the sliding table holds the null block there from now on
    later = [0, *sliding[1:]]
    s2 = [CaptureStep("a", str(tmp_path / "a.st"), "acme", ids, 0, half, n - half, [full, later])]
    _feed(rec, s2, [(s2[0], p) for p in range(half, n)][::-1], {"a": ka}, {"a": va}, m.spec.num_layers, bs, [1, 0])
    rec.join()
    got = CapturedKV.load(tmp_path / "a.st", ids, m.spec.weights_hash, "acme")
    torch.testing.assert_close(torch.stack(got.keys)[:, :half], ka[:, :half])
    # the second chunk came in reversed batch order; rows are put back by position
    torch.testing.assert_close(torch.stack(got.keys)[:, half:], ka[:, half:])
    torch.testing.assert_close(torch.stack(got.values), va)


def test_recorder_refuses_a_step_whose_positions_are_not_in_the_batch(llama, tmp_path):
    rec = Recorder(llama.spec.weights_hash, 4)
    rec.begin([CaptureStep("a", str(tmp_path / "a.st"), "acme", [1, 2, 3, 4, 5], 0, 0, 5, [[7, 8]])])
    k = torch.zeros(3, llama.spec.num_kv_heads, llama.spec.head_dim)
    with pytest.raises(BindingError, match="not in this step"):
        rec.record(0, k, k, torch.tensor([28, 29, 30]))


def test_captured_file_is_refused_for_another_tenant_model_or_prompt(llama, tmp_path):
    k = [torch.randn(6, llama.spec.num_kv_heads, llama.spec.head_dim) for _ in range(2)]
    ids = [5, 6, 7, 8, 9, 10]
    v = [x.clone() for x in k]
    path = CapturedKV(k, v, 0, ids, llama.spec.weights_hash, "acme").save(tmp_path / "c.st")
    assert CapturedKV.load(path, ids, llama.spec.weights_hash, "acme").end == 6
    with pytest.raises(BindingError, match="another tenant"):
        CapturedKV.load(path, ids, llama.spec.weights_hash, "globex")
    with pytest.raises(BindingError, match="other weights"):
        CapturedKV.load(path, ids, "0" * 64, "acme")
    with pytest.raises(BindingError, match="other tokens"):
        CapturedKV.load(path, [*ids[:-1], 11], llama.spec.weights_hash, "acme")
    with pytest.raises(TimeoutError, match="no capture"):
        wait_for_file(tmp_path / "missing.st", 0.05)


def test_state_of_kv_refuses_parts_that_do_not_make_the_text(llama):
    a = capture_state(llama, TEXT, "acme")
    k, v = a.keys_pre_rope, a.values
    with pytest.raises(UsageError, match="positions"):
        state_of_kv(llama, TEXT, "acme", k[:, 1:], v[:, 1:])
    with pytest.raises(UsageError, match="needs a state"):
        state_of_kv(llama, TEXT, "acme", k[:, 4:], v[:, 4:], start=4)
    other = capture_state(llama, "x" + TEXT, "acme")
    with pytest.raises(UsageError, match="other tokens"):
        state_of_kv(llama, TEXT, "acme", k[:, 4:], v[:, 4:], start=4, base=other)
