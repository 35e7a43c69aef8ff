import os

import pytest
import torch

torch.set_num_threads(int(os.environ.get("CTXRELAY_TEST_THREADS", "2")))
# one store owner for the whole suite, whatever CTXRELAY_CACHE a test points at (seal.py); the
# reliability tests that need their own key file take the `own_cache` fixture
os.environ.setdefault("CTXRELAY_STORE_SECRET", "ctxrelay-test-suite")

FAMILIES = ["llama", "qwen2", "gemma3"]


@pytest.fixture(scope="session", params=FAMILIES)
def tiny(request):
    from ctxrelay.models.tiny import tiny_model

    return tiny_model(request.param)


@pytest.fixture(scope="session")
def tiny_by_family():
    from ctxrelay.models.tiny import tiny_model

    return {f: tiny_model(f) for f in FAMILIES}


SAMPLE_TEXT = (
    "Startups are companies designed to grow fast. The quick brown fox jumps over the lazy dog, "
    "and in 2024 it paid $1,234.56 for 42 items. def forward(self, x): return x + 1. "
    "Café naïve résumé; 東京は日本の首都です。 🙂 Being newly founded does not in itself make a "
    "company a startup. Nor is it necessary for a startup to work on technology."
)


def pytest_collection_modifyitems(config, items):
    # real-model tests need the zoo cache; `make test` pulls it first. Skip only if asked.
    if os.environ.get("CTXRELAY_SKIP_REAL") == "1":
        skip = pytest.mark.skip(reason="CTXRELAY_SKIP_REAL=1")
        for item in items:
            if "real" in item.keywords:
                item.add_marker(skip)


def zero_artifact(sender, receiver):
    """Cross-family artifact whose maps output zeros (ctxrelay_bench.harness, shared with the bench)."""
    from ctxrelay_bench.harness import zero_artifact as make

    return make(sender, receiver)


def assert_components_cover_ttft(res, share: float) -> None:
    """A relay result's component stopwatches never add up to more than its TTFT (no part counted twice) and
    cover it up to `share` plus 20 ms: scheduler noise between stopwatches on ms-scale tiny relays (a loaded CI
    machine), not a share of the work."""
    detail = (res.transport, res.timings, res.ttft_s)
    assert res.components_s <= res.ttft_s * 1.001, detail
    assert res.ttft_s - res.components_s <= share * res.ttft_s + 0.02, detail


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """A fresh cache for one test, so its store key (seal.py) and states are its own."""
    monkeypatch.setenv("CTXRELAY_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CTXRELAY_STORE_SECRET", raising=False)
    return tmp_path / "cache"
