"""Which sender layers a receiver layer's map reads: the greedy choice by validation error (fast)."""

import pytest
import torch

from ctxrelay.artifact import Artifact
from ctxrelay.models.capture import capture_state
from ctxrelay.transports.heterofold import relay_prefill
from ctxrelay.transports.heterofold.calibration import sources as source_layers
from ctxrelay.transports.heterofold.calibration.fit import calibrate
from ctxrelay.transports.heterofold.calibration.sources import Scorer, Sums, choose, greedy

TEXTS = [
    f"Note {i}. A river carries sand to the sea, and the delta grows by {i * 7} metres a year. Farmers on the "
    "plain plant rice in spring and wheat in autumn; the harbour master logs 1,204 ships, and the old lighthouse "
    f"keeper, now {60 + i}, still climbs the 212 steps each night to check the lamp before the fog rolls in."
    for i in range(10)
]


def _sums(x: torch.Tensor, y: torch.Tensor) -> Sums:
    s = Sums.zeros(x.shape[1], y.shape[1])
    s.add(x[: len(x) // 2], y[: len(y) // 2])
    s.add(x[len(x) // 2 :], y[len(y) // 2 :])
    return s


def _layered(seed: int, n: int, truth: dict[int, list[int]], layers: int = 6, fx: int = 4, fy: int = 3):
    """x: `layers` sender layers of fx features; receiver layer j = a linear function of truth[j]'s layers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, layers * fx, generator=g)
    ys = []
    for j in sorted(truth):
        w = torch.zeros(layers * fx, fy)
        for li in truth[j]:
            w[li * fx : (li + 1) * fx] = torch.randn(fx, fy, generator=torch.Generator().manual_seed(100 + 10 * j + li))
        ys.append(x @ w + 0.05 * torch.randn(n, fy, generator=g))
    return x, torch.cat(ys, 1)


def test_greedy_finds_the_layers_that_predict_each_target_on_validation_data():
    truth = {0: [4], 1: [1, 5], 2: [0, 2]}
    train, val = _layered(0, 3000, truth), _layered(1, 1000, truth)
    scorer = Scorer(_sums(*train), _sums(*val), fx=4, fy=3, alpha=1e-6)
    order, steps = greedy({"k": scorer}, sender_layers=6, receiver_layers=3, k=2)
    assert order[0][0] == 4 and sorted(order[1]) == [1, 5] and sorted(order[2]) == [0, 2]
    # the error falls with each layer that carries signal and is near the noise floor once all are in
    assert steps[1][0] > steps[1][1] and steps[1][1] < 0.01
    # a layer that carries nothing leaves the error where the layers that do left it
    assert scorer.rel_error([4, 3], 0) == pytest.approx(scorer.rel_error([4], 0), abs=0.005)
    assert scorer.rel_error([3], 0) > 0.95  # alone it predicts nothing: the error is the target's variance


def test_offsets_read_three_layers_and_the_rest_needs_greedy(tiny_by_family, tmp_path):
    m = tiny_by_family["qwen2"]
    sources, record = choose(m, m, "offsets", 3, None, None, "ta", 1e-3, tmp_path / "c.json")
    assert record == {"rule": "offsets"} and all(len(s) == 3 for s in sources)
    with pytest.raises(ValueError, match="needs greedy"):
        choose(m, m, "offsets", 5, None, None, "ta", 1e-3, tmp_path / "c.json")
    with pytest.raises(ValueError, match="source_layers must be"):
        choose(m, m, "greedy", m.spec.num_layers + 1, None, None, "ta", 1e-3, tmp_path / "c-{k}.json")
    with pytest.raises(ValueError, match="unknown source_select"):
        choose(m, m, "best", 3, None, None, "ta", 1e-3, tmp_path / "c.json")


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CTXRELAY_CACHE", str(tmp_path))
    return tmp_path


def test_a_calibration_with_greedy_sources_relays_and_records_its_choice(cache, tiny_by_family, tmp_path, monkeypatch):
    sender, receiver = tiny_by_family["llama"], tiny_by_family["gemma3"]
    opts = {"method": "ridge+ta", "heldout_suffix": 40, "query_rows": 16, "val_every": 4,
            "source_select": "greedy", "source_layers": 2}  # fmt: skip
    out = tmp_path / "a.safetensors"
    calibrate(sender, receiver, TEXTS[:8], TEXTS[8:], opts, command="cmd", out=out)
    art = Artifact.load(out)
    choice = art.params["source_select"]
    assert choice["rule"] == "greedy" and art.params["sources"] == choice["sources"]
    assert all(len(s) == 2 and s == sorted(set(s)) for s in art.params["sources"])
    assert len(choice["val_rel_error_offsets"]) == receiver.spec.num_layers
    assert art.tensors["k.0.weight"].shape[0] == 2 * sender.spec.num_kv_heads * sender.spec.head_dim
    state = capture_state(sender, TEXTS[9], "t")
    relayed = relay_prefill(receiver, state, art, torch.tensor([5, 6, 7]))
    assert relayed.logits.shape == (1, receiver.spec.vocab_size) and torch.isfinite(relayed.logits).all()
    # the choice is cached with the data it was made on: a second run reads it instead of choosing again
    monkeypatch.setattr(source_layers, "gather", lambda *a, **k: pytest.fail("chose again"))
    again = calibrate(sender, receiver, TEXTS[:8], TEXTS[8:], opts, command="cmd")
    assert again.params["source_select"] == choice
    # ... and a shorter choice is the longer one's first layers
    one = calibrate(sender, receiver, TEXTS[:8], TEXTS[8:], {**opts, "source_layers": 1}, command="cmd")
    assert one.params["sources"] == [o[:1] for o in choice["order"]]
    assert one.params["source_select"]["val_rel_error"] == [s[0] for s in choice["val_rel_error_steps"]]
