"""heterofold calibration: closed forms, folding, artifact, resume (tiny models, fast)."""

import pytest
import torch

from ctxrelay.artifact import Artifact
from ctxrelay.errors import BindingError
from ctxrelay.models.capture import capture_state
from ctxrelay.models.tiny import tiny_model
from ctxrelay.transports.heterofold import relay_prefill
from ctxrelay.transports.heterofold.calibration.fit import calibrate
from ctxrelay.transports.heterofold.calibration.recolor import Moments, fit_recolor, fit_ridge
from ctxrelay.transports.heterofold.calibration.train import Corrections
from ctxrelay.transports.heterofold.kv_maps import AffineMap, FoldMaps

TEXTS = [
    "Startups are companies designed to grow fast. Being newly founded does not in itself make a company a "
    "startup. Nor is it necessary for a startup to work on technology, take venture funding, or have some sort "
    "of exit. The only essential thing is growth. Everything else we associate with startups follows from "
    f"growth. Case {i}: the quick brown fox jumps over the lazy dog {i} times, and 3.14159 people paid $1,234.56."
    for i in range(10)
]


def _moments(x, y):
    m = Moments.zeros(x.shape[1], y.shape[1])
    m.add(x[: len(x) // 2], y[: len(y) // 2])
    m.add(x[len(x) // 2 :], y[len(y) // 2 :])
    return m


def test_ridge_recovers_a_linear_map_and_recolor_restores_covariance():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 12, generator=g) @ torch.randn(12, 12, generator=g)
    w_true, b_true = torch.randn(12, 5, generator=g), torch.randn(5, generator=g)
    y = x @ w_true + b_true + 0.3 * torch.randn(4000, 5, generator=g)
    m = _moments(x, y)
    w, b = fit_ridge(m, alpha=1e-8)
    assert torch.allclose(w, w_true, atol=0.05) and torch.allclose(b, b_true, atol=0.05)
    # gamma=1 is the regression itself; gamma=0 (recolor) reproduces the receiver covariance exactly
    w1, b1 = fit_recolor(m, gamma=1.0, eps=1e-8)
    assert torch.allclose(w1, w, atol=1e-3)
    w0, b0 = fit_recolor(m, gamma=0.0, eps=1e-8)
    y0 = x @ w0 + b0
    assert torch.allclose(torch.cov(y0.T), torch.cov(y.T), rtol=0.02, atol=0.02)
    assert torch.allclose(y0.mean(0), y.mean(0), atol=1e-3)
    # ridge's predictions have LESS variance than the target (it shrinks); recolor's do not
    assert torch.cov((x @ w + b).T).trace() < torch.cov(y.T).trace()


def test_corrections_fold_exactly_into_one_affine_map():
    g = torch.Generator().manual_seed(1)
    base = FoldMaps(
        [[0, 1, 2]], {r: [AffineMap(torch.randn(6, generator=g), torch.randn(9, 6, generator=g))] for r in "kv"}
    )
    scales = {r: [(torch.randn(9, generator=g), 2.0, 3.0)] for r in "kv"}
    corr = Corrections(base, rank=2, scales=scales)
    with torch.no_grad():
        for p in corr.parameters():
            p.normal_(generator=g)
    x = torch.randn(7, 9, generator=g)
    folded = corr.fold()
    for role in "kv":
        assert torch.allclose(folded.maps[role][0](x), corr.mapped(role, 0, x), atol=1e-4)
    # a factored base stays factored: the corrections append their factors (rank 3 + 2)
    low = FoldMaps(base.sources, {r: [base.maps[r][0].factored(3)] for r in "kv"})
    corr_low = Corrections(low, rank=2, scales=scales)
    corr_low.load_state_dict(corr.state_dict())
    folded = corr_low.fold()
    for role in "kv":
        assert folded.maps[role][0].rank == 5
        assert torch.allclose(folded.maps[role][0](x), corr_low.mapped(role, 0, x), atol=1e-4)


def test_low_rank_storage_is_the_truncated_svd():
    g = torch.Generator().manual_seed(2)
    m = AffineMap(torch.randn(8, generator=g), weight=torch.randn(20, 8, generator=g))
    x = torch.randn(5, 20, generator=g)
    assert torch.allclose(m.factored(8)(x), m(x))  # full rank: unchanged (kept dense)
    f = m.factored(3)
    assert f.u.shape == (20, 3) and f.vt.shape == (3, 8)
    s = torch.linalg.svdvals(m.weight)
    err = torch.linalg.matrix_norm(f.dense() - m.weight, ord=2)
    assert torch.isclose(err, s[3], rtol=1e-4)
    assert torch.allclose(f.blocks([x[:, :11], x[:, 11:]]), f(x), atol=1e-5)


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CTXRELAY_CACHE", str(tmp_path))
    return tmp_path


def test_self_calibration_with_ridge_is_near_exact(cache, tiny_by_family):
    m = tiny_by_family["qwen2"]
    opts = {"method": "ridge+ta", "ridge_alpha": 1e-9, "heldout_suffix": 40, "query_rows": 16, "val_every": 4}
    art = calibrate(m, m, TEXTS[:8], TEXTS[8:], opts, command="test")
    assert art.quality["top1_agreement"] > 0.97 and art.quality["kl"] < 0.01
    assert set(art.quality["ppl"]) >= {"1", "16", "32"}


def test_calibrate_cross_family_artifact_resume_and_bindings(cache, tiny_by_family, tmp_path):
    sender, receiver = tiny_by_family["llama"], tiny_by_family["gemma3"]
    opts = {"method": "heterofold", "epochs": 2, "heldout_suffix": 40, "query_rows": 16, "val_every": 4,
            "gammas": "0,1", "epss": "0.01", "store_rank": 40, "e2e_epochs": 1, "e2e_tokens": 24}  # fmt: skip
    out = tmp_path / "a.safetensors"
    art = calibrate(sender, receiver, TEXTS[:8], TEXTS[8:], opts, command="cmd", out=out)
    loaded = Artifact.load(out)
    assert loaded.command == "cmd" and loaded.params["method"] == "heterofold"
    assert loaded.params["own_layers"] == 1  # new artifacts serve the receiver's own layer-0 K/V
    for key in ("top1_agreement", "kl", "ppl", "native_ppl", "no_context_ppl"):
        assert key in loaded.quality
    train = loaded.params["train"]
    assert [h["epoch"] for h in train["history"]] == [0, 1, 2] and len(train["e2e"]) == 1
    assert set(train["validation"]) == {"init", "layer-local", "end-to-end"} and train["kept"] in train["validation"]
    assert {s["role"] for s in loaded.params["init_search"]} == {"k", "v"}
    # store_rank 40 = an 8-dim base + two stages of rank-16 corrections, stored as exact fp16 factors
    assert loaded.tensors["k.0.u"].dtype == torch.float16
    assert loaded.tensors["k.0.u"].shape[1] == {"init": 8, "layer-local": 24, "end-to-end": 40}[train["kept"]]
    # resume: the finished checkpoint is picked up, nothing is retrained, same result
    again = calibrate(sender, receiver, TEXTS[:8], TEXTS[8:], opts, command="cmd")
    assert again.params["train"]["history"] == art.params["train"]["history"]
    assert again.quality["top1_agreement"] == art.quality["top1_agreement"]
    state = capture_state(sender, TEXTS[9], "t")
    out_relay = relay_prefill(receiver, state, loaded, torch.tensor([5, 6, 7]))
    assert out_relay.logits.shape == (1, receiver.spec.vocab_size) and out_relay.info["own_layers"] == 1
    with pytest.raises(BindingError):
        relay_prefill(tiny_model("gemma3", seed=3), state, loaded, torch.tensor([5]))


def test_bad_options_are_clear_errors(cache, tiny_by_family):
    m = tiny_by_family["llama"]
    with pytest.raises(ValueError, match="unknown heterofold option"):
        calibrate(m, m, TEXTS, TEXTS, {"rnak": 4})
    with pytest.raises(ValueError, match="method"):
        calibrate(m, m, TEXTS, TEXTS, {"method": "magic"})
    with pytest.raises(ValueError, match="held-out"):
        calibrate(m, m, TEXTS, [], {})
    with pytest.raises(ValueError, match="own_layers must be a layer count"):
        calibrate(m, m, TEXTS, TEXTS, {"own_layers": m.spec.num_layers + 1})


def test_output_pca_truncation_is_optimal_for_the_data():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6000, 20, generator=g) * torch.logspace(1, -2, 20) + 5.0  # anisotropic, off-centre
    m = AffineMap(torch.randn(10, generator=g), weight=torch.randn(20, 10, generator=g))
    mean, cov = x.mean(0), torch.cov(x.T)
    err = lambda f: float(((f(x) - m(x)) ** 2).sum(1).mean())
    plain, pca = m.factored(4), m.factored(4, mean, cov)
    assert err(pca) < 0.5 * err(plain)
    # the error left is exactly the output variance outside the kept principal directions
    out_var = torch.linalg.eigvalsh(m.weight.T @ cov @ m.weight)
    assert abs(err(pca) - float(out_var[:-4].sum())) < 0.01 * float(out_var.sum())


def test_end_to_end_stage_resumed_after_an_epoch_matches_an_uninterrupted_run(cache, tiny_by_family):
    from ctxrelay.transports.heterofold.calibration.fit import work_dir

    sender, receiver = tiny_by_family["qwen2"], tiny_by_family["llama"]
    opts = {"method": "heterofold", "epochs": 1, "heldout_suffix": 40, "query_rows": 16, "val_every": 4,
            "gammas": "0", "epss": "0.01", "e2e_epochs": 1, "e2e_tokens": 24}  # fmt: skip
    calibrate(sender, receiver, TEXTS[:8], TEXTS[8:], opts)
    resumed = calibrate(sender, receiver, TEXTS[:8], TEXTS[8:], {**opts, "e2e_epochs": 2})
    (ckpt,) = list(work_dir().glob("*--*/e2e-*.safetensors"))
    ckpt.unlink()  # the layer-local stage stays cached: both runs start the end-to-end stage from the same maps
    straight = calibrate(sender, receiver, TEXTS[:8], TEXTS[8:], {**opts, "e2e_epochs": 2})
    assert len(straight.params["train"]["e2e"]) == 2
    kl = lambda art: [h["train_kl"] for h in art.params["train"]["e2e"]]
    assert kl(resumed) == pytest.approx(kl(straight), rel=1e-5)


def test_a_cached_heldout_item_is_the_item_it_stored_and_a_damaged_one_is_made_again(tiny_by_family, tmp_path):
    from conftest import SAMPLE_TEXT
    from ctxrelay.transports.heterofold.calibration import heldout as quality

    sender, receiver = tiny_by_family["llama"], tiny_by_family["qwen2"]
    text = SAMPLE_TEXT * 2
    made = quality.make_item(sender, receiver, text, 40, cache=tmp_path)
    (path,) = tmp_path.rglob("*.st")
    quality._MEMO.clear()
    read = quality.make_item(sender, receiver, text, 40, cache=tmp_path)
    assert read is not made  # from disk, not the memo
    for a, b in [(made.suffix, read.suffix), (made.native_logprobs, read.native_logprobs),
                 (made.no_context_nll, read.no_context_nll), (made.state.keys_pre_rope, read.state.keys_pre_rope),
                 (made.state.values, read.state.values), (made.state.tokens, read.state.tokens)]:  # fmt: skip
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert read.state.binding == made.state.binding and read.state.text == made.state.text
    path.write_bytes(path.read_bytes()[:100])  # a crash mid-copy, a full disk
    quality._MEMO.clear()
    again = quality.make_item(sender, receiver, text, 40, cache=tmp_path)
    assert torch.equal(again.native_logprobs, made.native_logprobs) and path.stat().st_size > 100


def test_end_to_end_stage_with_the_whole_context_native_has_nothing_to_learn(cache, tiny_by_family):
    """e2e_native = 1: every context entry keeps the receiver's own K/V, so the suffix's predictions are its
    native ones (KL 0); the run does not resume from the checkpoint of a run with another share."""
    sender, receiver = tiny_by_family["llama"], tiny_by_family["qwen2"]
    opts = {"method": "heterofold", "epochs": 1, "heldout_suffix": 40, "query_rows": 16, "val_every": 4,
            "gammas": "0", "epss": "0.01", "e2e_epochs": 1, "e2e_tokens": 24}  # fmt: skip
    translated = calibrate(sender, receiver, TEXTS[:8], TEXTS[8:], opts)
    native = calibrate(sender, receiver, TEXTS[:8], TEXTS[8:], {**opts, "e2e_native": 1.0})
    assert translated.params["train"]["e2e"][0]["train_kl"] > 1e-3
    assert native.params["train"]["e2e"][0]["train_kl"] < 1e-5
    assert native.params["e2e_native"] == 1.0 and "e2e_native" not in translated.params
