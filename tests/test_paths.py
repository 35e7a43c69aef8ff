"""Every on-disk location comes from ctxrelay.paths."""

from pathlib import Path

import pytest

from ctxrelay import paths
from ctxrelay.errors import UsageError


def test_repo_root_default():
    root = paths.repo_root()
    assert (root / "pyproject.toml").exists() and (root / "src" / "ctxrelay").is_dir()


def test_cache_and_artifact_locations_follow_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("CTXRELAY_CACHE", str(tmp_path))
    assert paths.cache_dir() == tmp_path
    assert paths.artifact_dirs() == [paths.PACKAGED_ARTIFACTS, tmp_path / "artifacts"]
    name = paths.artifact_name("heterofold", "/some/dir/model-a", "model-b")
    assert name == "heterofold-model-a-to-model-b.safetensors"
    assert paths.artifact_name("heterofold", "a", "b", "ridge+ta") == "heterofold-a-to-b.ridge+ta.safetensors"
    # not shipped: the user's folder; a variant never lands where the relay looks for edges
    assert paths.find_artifact("heterofold", "a", "b") == tmp_path / "artifacts" / "heterofold-a-to-b.safetensors"
    assert paths.variant_artifact("heterofold", "a", "b", "ridge+ta").parent not in paths.artifact_dirs()


def test_shipped_artifacts_are_found_in_the_package():
    shipped = sorted(paths.PACKAGED_ARTIFACTS.glob("heterofold-*.safetensors"))
    assert shipped, "the package ships heterofold artifacts"
    stem = shipped[0].name.removeprefix("heterofold-").removesuffix(".safetensors")
    sender, receiver = stem.split("-to-")
    assert paths.find_artifact("heterofold", sender, receiver) == shipped[0]


def test_results_location(tmp_path, monkeypatch):
    monkeypatch.setenv("CTXRELAY_RESULTS_DIR", str(tmp_path))
    assert paths.results_path("native") == tmp_path / "native.json"
    with pytest.raises(UsageError):
        paths.results_path("../x")
    monkeypatch.delenv("CTXRELAY_RESULTS_DIR")
    assert paths.results_dir() == Path(paths.repo_root()) / "benchmarks" / "results"
