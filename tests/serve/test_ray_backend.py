"""`ctxrelay serve --backend ray` on a local Ray cluster (a head and one more node process) inside a
loopback-only network namespace: two models served as Ray Serve deployments, one conversation through
HTTP with the official openai client. Turn 2 on the other model relays from the state turn 1 stored in
Redis; the replica that served turn 1 is then killed, and turn 3 on its model continues from what is stored
(another replica of that model serves it). ray_conversation.py drives the cluster inside the namespace;
this test prepares the models, runs it, checks what it saw and records the check in scaleout-checks.json.

Skips, with the reason, where Ray Serve is not installed, no loopback-only namespace can be made (root,
`unshare --net`) or redis-server is missing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from processes import SRC, save_chat_model
from server_fixture import KEYS

from ctxrelay import zoo
from ctxrelay.relay.graph import CostModel, Profile, edge_key
from ctxrelay_bench.harness import zero_artifact
from ctxrelay_bench.ray_cluster import auth_env, in_loopback_namespace, kill_groups, namespace_missing, ray_missing

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.fixture(scope="module", autouse=True)
def _needs_ray_and_a_namespace():
    for why in (ray_missing(), namespace_missing()):
        if why:
            pytest.skip(why)
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (make dev installs it)")


def run_conversation(tmp: Path, spec: dict, env: dict[str, str], timeout_s: float = 900,
                     driver: str = "ray_conversation.py") -> dict:  # fmt: skip
    """A driver (ray_conversation.py) in a loopback-only namespace; its result. Whatever it leaves running is
    ended."""
    spec = {**spec, "work": str(tmp), "out": str(tmp / "result.json")}
    (tmp / "spec.json").write_text(json.dumps(spec))
    path = os.pathsep.join([str(SRC), str(ROOT / "benchmarks"), str(HERE), env.get("PYTHONPATH", "")])
    cmd = in_loopback_namespace([sys.executable, str(HERE / driver), str(tmp / "spec.json")])
    with (tmp / "driver.log").open("w") as log:
        env = {**env, **auth_env(), "PYTHONPATH": path}
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        proc.wait(timeout_s)
    finally:  # the driver stops its cluster; a driver that crashed or hung leaves its groups to us
        groups = {proc.pid}
        if (tmp / "ray-pgids").exists():
            groups |= {int(g) for g in (tmp / "ray-pgids").read_text().split()}
        kill_groups(groups, grace_s=5, reap=proc.poll)
    assert (tmp / "result.json").exists(), (tmp / "driver.log").read_text()[-6000:]
    out = json.loads((tmp / "result.json").read_text())
    assert out["ok"], out.get("error", "") + (tmp / "driver.log").read_text()[-3000:]
    return out


def check_turns(out: dict, a: str, b: str, turn3_transport: str) -> str:
    """The bar's check on the driver's result; returns its detail line."""
    t1, t2, t3 = out["turns"]
    r1, r2, r3 = (t["report"] for t in out["turns"])
    assert all(t["status"] == 200 for t in out["turns"])
    assert r1["turn"] == 1 and r1["model"] == a
    assert r2["transport"] == "heterofold" and r2["relayed_from"] == a and r2["turn"] == 2, r2["reason"]
    assert 0 < r2["prefilled_tokens"] < t2["prompt_tokens"]  # only the new turn was prefilled
    assert out["killed"] == t1["replica"] and t3["replica"] != t1["replica"]
    assert out["killed"] not in out["alive_replicas"]
    # turn 3 continues the stored conversation: its history, its count and the state turn 2 left
    assert r3["turn"] == 3 and r3["relayed_from"] == b and r3["transport"] == turn3_transport, r3["reason"]
    assert r3["conversation"] == r1["conversation"]
    how = "native prefill of the stored transcript" if r3["transport"] == "native" else (
        f"{r3['transport']} from {b}'s stored state")  # fmt: skip
    return (
        f"{a} -> {b} relayed ({r2['transport']}, {r2['prefilled_tokens']} of {t2['prompt_tokens']} prompt tokens "
        f"prefilled); replica {t1['replica']} of {a} killed; turn 3 on {a} served by {t3['replica']}: {how} "
        f"({r3['reason']})"
    )


def record(detail: str, passed: bool, out: dict, models: list[str], extra: dict) -> None:
    from ctxrelay.results import write_results

    row = {
        "check": "replica_killed_turn3_continued", "passed": passed, "detail": detail, "transport": "mixed",
        "models": models, "turn_transports": [t["report"]["transport"] for t in out["turns"]],
        "turn_ttft_s": [t["report"]["ttft_s"] for t in out["turns"]], "phases_s": out["phases_s"],
        "memory_gib": round(out["memory_bytes"] / 2**30, 2),
    }  # fmt: skip
    command = "python -m pytest -q -m real " + shlex.quote("tests/serve/test_ray_backend.py")
    write_results("scaleout-checks", [row], command, {**extra, "cluster": "head + 1 node process, loopback netns"})


def tiny_cache(tmp: Path, tiny_by_family) -> list[str]:
    """Two tiny chat models as HF directories and, in the cache $CTXRELAY_CACHE names, heterofold artifacts
    both ways (zero maps: the gate passes, the answers are gist) and a profile where relaying wins."""
    dirs = [save_chat_model(tiny_by_family[f], tmp / f"tiny-{f}-chat") for f in ("llama", "qwen2")]
    a, b = (zoo.load(d) for d in dirs)
    (tmp / "cache" / "artifacts").mkdir(parents=True)
    samples = lambda per, key: [(n, {key: per * n}) for n in (64, 128, 256)]
    native, edges = {}, {}
    for s, r in ((a, b), (b, a)):
        art = zero_artifact(s, r)
        art.quality = {"top1_agreement": 0.9}
        art.save(tmp / "cache" / "artifacts" / f"heterofold-{s.spec.name}-{r.spec.name}.safetensors")
        native[r.spec.weights_hash] = CostModel.fit(samples(1e-3, "prefill_s"))
        key = edge_key("heterofold", s.spec.weights_hash, r.spec.weights_hash)
        edges[key] = CostModel.fit(samples(1e-4, "translate_s"))
    Profile(native=native, edges=edges).save(tmp / "cache" / "profile.json")
    return [str(d) for d in dirs]


def test_tiny_models_turn3_continues_after_the_turn1_replica_is_killed(tmp_path, tiny_by_family):
    models = tiny_cache(tmp_path, tiny_by_family)
    env = {**os.environ, "CTXRELAY_CACHE": str(tmp_path / "cache"), "CTXRELAY_THREADS": "1"}
    turns = [[{"role": "user", "content": "What is a startup?"}], [{"role": "user", "content": "And a company?"}],
             [{"role": "user", "content": "Shorter."}]]  # fmt: skip
    names = [Path(m).name for m in models]  # the spec names requests use
    spec = {"models": models, "names": names, "replicas": {models[0]: 2, models[1]: 1}, "keys": KEYS.split(",")[0],
            "quality_threshold": 0.0, "turns": turns, "max_tokens": 8}  # fmt: skip
    out = run_conversation(tmp_path, spec, env)
    check_turns(out, *names, "heterofold")  # the reverse edge relays turn 3 too
    print(json.dumps({"phases_s": out["phases_s"], "memory_gib": out["memory_bytes"] / 2**30}))


def test_the_command_serves_on_a_ray_instance_of_its_own_and_stops_on_sigterm(tmp_path, tiny_by_family):
    """`ctxrelay serve --backend ray` as a user runs it (no cluster given: it starts Ray itself): a turn, a
    refused key and a stream, each through the ingress."""
    models = tiny_cache(tmp_path, tiny_by_family)
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's own files (short: socket paths), not /tmp/ray
    env = {**os.environ, "CTXRELAY_CACHE": str(tmp_path / "cache"), "CTXRELAY_THREADS": "1", "RAY_TMPDIR": ray_tmp}
    spec = {"models": models, "names": [Path(m).name for m in models], "keys": KEYS}
    try:
        out = run_conversation(tmp_path, spec, env, driver="ray_cli_driver.py")
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert out["status"] == 200 and out["report"]["model"] == Path(models[1]).name, out
    assert out["unauthorised"] == 401  # the replicas check the keys
    assert out["stream_status"] == 200 and out["stream_events"] >= 3 and '"ctxrelay"' in out["stream_last"], out
    assert out["exit"] == 0 and out["left"] == [], out  # SIGTERM took the application and Ray down
    print(json.dumps({"up_s": out["up_s"]}))


def measured_cache(tmp: Path, models: list[str], env: dict[str, str]) -> Path:
    """A cache folder of the test's own: the zoo's converted models (linked), this machine's profile, and the
    costs it lacks at 4096 tokens (native prefill, where a partial profile has none) measured into the copy, so
    the gate decides on this machine's costs without the test touching the installed profile."""
    from ctxrelay import paths

    home, cache = paths.cache_dir(), tmp / "cache"
    cache.mkdir()
    for name in ("models", "gguf"):
        if (home / name).exists():
            (cache / name).symlink_to(home / name)
    installed = home / "profile.json"
    if installed.exists():
        shutil.copy(installed, cache / "profile.json")
    # what a run measured is kept for the next (measuring takes minutes), keyed by the installed profile
    digest = hashlib.sha256((installed.read_bytes() if installed.exists() else b"") + ",".join(models).encode())
    kept = home / "test-profiles" / f"ray-{digest.hexdigest()[:16]}.json"
    if kept.exists():
        shutil.copy(kept, cache / "profile.json")
        return cache
    cmd = [sys.executable, "-m", "ctxrelay.cli", "profile", "--models", ",".join(models), "--lengths", "4096",
           "--repeats", "1", "--only-missing", "--merge"]  # fmt: skip
    path = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    # measured with the threads the installed profile's other costs were measured with (the default: all cores)
    env = {k: v for k, v in env.items() if k != "CTXRELAY_THREADS"}
    r = subprocess.run(cmd, env={**env, "CTXRELAY_CACHE": str(cache), "PYTHONPATH": path}, capture_output=True,
                       text=True, timeout=1200)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    kept.parent.mkdir(exist_ok=True)
    shutil.copy(cache / "profile.json", kept)
    return cache


@pytest.mark.real
def test_smollm2_to_gemma3_turn3_continues_after_the_turn1_replica_is_killed(tmp_path):
    """The zoo models with their shipped artifact (smollm2-135m -> gemma3-270m) and this machine's costs, the
    gate at its default: a 4096-token document relays on turn 2. gemma3 -> smollm2 has no artifact, so turn 3
    on smollm2 is a native prefill of the stored transcript (its reason says so)."""
    from ctxrelay.data.datasets import essay_haystack

    a, b = "smollm2-135m", "gemma3-270m"
    doc = essay_haystack(zoo.tokenizer(a), 4096, split="train", seed=3)
    turns = [[{"role": "user", "content": f"Here is a document.\n\n{doc}\n\nSay OK."}],
             [{"role": "user", "content": "What is the document about? One sentence."}],
             [{"role": "user", "content": "Say it shorter."}]]  # fmt: skip
    spec = {"models": [a, b], "names": [a, b], "replicas": {a: 2, b: 1}, "keys": KEYS.split(",")[0],
            "quality_threshold": 0.85, "turns": turns, "max_tokens": 16}  # fmt: skip
    env = {**os.environ, "CTXRELAY_THREADS": "1"}
    env["CTXRELAY_CACHE"] = str(measured_cache(tmp_path, [a, b], env))
    out = run_conversation(tmp_path, spec, env, timeout_s=1500)
    passed, detail = False, ""
    try:
        detail = check_turns(out, a, b, "native")
        assert "no " in out["turns"][2]["report"]["reason"] or "edge" in out["turns"][2]["report"]["reason"]
        passed = True
    finally:
        record(detail or f"failed: {[t['report']['reason'] for t in out['turns']]}", passed, out, [a, b],
               {"ray": _ray_version(), "threads_per_replica": 1})  # fmt: skip
        print(json.dumps({"phases_s": out["phases_s"], "memory_gib": out["memory_bytes"] / 2**30}))


def _ray_version() -> str:
    import ray

    return ray.__version__
