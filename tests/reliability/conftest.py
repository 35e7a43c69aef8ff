import pytest


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test owns a fresh cache, so its store key (seal.py) is its own."""
    monkeypatch.setenv("CTXRELAY_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CTXRELAY_STORE_SECRET", raising=False)
    return tmp_path / "cache"
