"""Every place ctxrelay reads or writes on disk, in one module.

- the cache ($CTXRELAY_CACHE, default ~/.cache/ctxrelay): converted models, the user's calibrated
  artifacts, calibration work files, cached sender states, the cost profile;
- the artifacts shipped inside the package;
- the results folder of the benchmarks ($CTXRELAY_RESULTS_DIR, default benchmarks/results of the
  checkout, else of the working directory, so `ctxrelay bench` also runs from an installed wheel).
"""

from __future__ import annotations

import os
from pathlib import Path

from ctxrelay.errors import UsageError

PACKAGED_ARTIFACTS = Path(__file__).resolve().parent / "artifacts"


def cache_dir() -> Path:
    return Path(os.environ.get("CTXRELAY_CACHE", Path.home() / ".cache" / "ctxrelay"))


def work_dir(*parts: str) -> Path:
    """A folder of the cache for one kind of work file (e.g. work_dir("heterofold", "states"))."""
    return cache_dir().joinpath(*parts)


def user_artifacts() -> Path:
    """Where `ctxrelay calibrate` writes artifacts and the relay layer looks for them (beside the packaged)."""
    return cache_dir() / "artifacts"


def artifact_dirs() -> list[Path]:
    """The folders a ModelPool reads edges from, by default."""
    return [PACKAGED_ARTIFACTS, user_artifacts()]


def profile_path() -> Path:
    return cache_dir() / "profile.json"


def artifact_name(transport: str, sender: str, receiver: str, variant: str = "") -> str:
    """`<transport>-<sender>-to-<receiver>[.<variant>].safetensors` (model paths reduced to their name)."""
    stem = f"{transport}-{Path(sender).name}-to-{Path(receiver).name}"
    return f"{stem}.{variant}.safetensors" if variant else f"{stem}.safetensors"


def find_artifact(transport: str, sender: str, receiver: str) -> Path:
    """The packaged artifact of an edge when the package ships one, else the user's (may not exist yet)."""
    name = artifact_name(transport, sender, receiver)
    packaged = PACKAGED_ARTIFACTS / name
    return packaged if packaged.exists() else user_artifacts() / name


def variant_artifact(transport: str, sender: str, receiver: str, variant: str) -> Path:
    """Baselines and other variants live outside the artifact folders (they would become relay edges)."""
    return work_dir(transport, "baselines") / artifact_name(transport, sender, receiver, variant)


def repo_root() -> Path | None:
    """The ctxrelay checkout above this file or the working directory, if there is one."""
    for start in (Path(__file__).resolve().parent, Path.cwd().resolve()):
        for d in (start, *start.parents):
            py = d / "pyproject.toml"
            if py.exists() and 'name = "ctxrelay"' in py.read_text(encoding="utf-8", errors="replace"):
                return d
    return None


def results_dir() -> Path:
    env = os.environ.get("CTXRELAY_RESULTS_DIR")
    if env:
        return Path(env)
    return (repo_root() or Path.cwd()) / "benchmarks" / "results"


def results_path(name: str) -> Path:
    if not name or "/" in name or "\\" in name or name.startswith("."):
        raise UsageError(f"results name {name!r} must be a plain file stem such as 'native' or 'mapflow'")
    return results_dir() / f"{name}.json"
