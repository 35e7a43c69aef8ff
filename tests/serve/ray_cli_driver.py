"""Driver of the `ctxrelay serve --backend ray` command-line test (test_ray_backend.py), run INSIDE a
loopback-only network namespace:

    python ray_cli_driver.py SPEC.json

It starts a throwaway redis-server and the command as a user would (it starts a Ray instance of its own),
waits for /healthz, serves one chat turn, stops the command with SIGTERM and records whether it exited and
left no process behind. SPEC: {"models": [...], "names": [...], "keys": "key:tenant,...", "work": dir,
"out": path}.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import httpx

from ctxrelay_bench.harness import free_port, start_redis
from ctxrelay_bench.ray_cluster import kill_groups


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    work = Path(spec["work"])
    out: dict = {"ok": False}
    redis_proc, url = start_redis(work)
    port = free_port()
    serve = ["serve", "--backend", "ray", "--models", ",".join(spec["models"]), "--store", f"memory+{url}"]
    cmd = [sys.executable, "-m", "ctxrelay.cli", *serve, "--quality-threshold", "0", "--port", str(port)]
    env = {**os.environ, "CTXRELAY_API_KEYS": spec["keys"]}
    t0 = time.perf_counter()
    with (work / "serve.log").open("w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        while True:
            assert proc.poll() is None, "ctxrelay serve --backend ray exited before it served"
            assert time.perf_counter() - t0 < 300, "ctxrelay serve --backend ray did not come up in 300 s"
            try:
                if httpx.get(base + "/healthz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        out["up_s"] = round(time.perf_counter() - t0, 2)
        key = spec["keys"].split(",")[0].split(":")[0]
        body = {"model": spec["names"][1], "max_tokens": 4, "messages": [{"role": "user", "content": "Hi?"}]}
        auth = {"Authorization": f"Bearer {key}"}
        r = httpx.post(base + "/v1/chat/completions", json=body, headers=auth, timeout=120)
        out["status"], out["report"] = r.status_code, r.json().get("ctxrelay")
        out["unauthorised"] = httpx.post(base + "/v1/chat/completions", json=body, timeout=60).status_code
        with httpx.stream("POST", base + "/v1/chat/completions", json={**body, "stream": True}, headers=auth,
                          timeout=120) as streamed:  # fmt: skip
            events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
        out["stream_status"], out["stream_events"] = streamed.status_code, len(events)
        out["stream_last"] = events[-2] if len(events) > 1 else ""  # the chunk before [DONE]: the ctxrelay field
        proc.send_signal(signal.SIGTERM)
        out["exit"] = proc.wait(120)
        time.sleep(2)
        out["left"] = _left_in_namespace({os.getpid(), redis_proc.pid})
        out["ok"] = True
    except Exception:
        out["error"] = traceback.format_exc() + (work / "serve.log").read_text()[-4000:]
    finally:
        kill_groups({proc.pid}, grace_s=5, reap=proc.poll)
        redis_proc.kill()
        redis_proc.wait()
        Path(spec["out"]).write_text(json.dumps(out, indent=1))
    return 0 if out["ok"] else 1


def _left_in_namespace(mine: set[int]) -> list[str]:
    """Processes of this network namespace other than this driver, its children's shells and redis-server."""
    ns = os.readlink("/proc/self/ns/net")
    left = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) in mine:
            continue
        try:
            if os.readlink(d / "ns" / "net") != ns:
                continue
            args = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if args and not args.startswith(("sh -c", "unshare")):
            left.append(args[:120])
    return left


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
