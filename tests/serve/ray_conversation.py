"""Driver of the Ray backend test (test_ray_backend.py), run INSIDE a loopback-only network namespace:

    python ray_conversation.py SPEC.json

It starts a throwaway redis-server and a local Ray cluster (a head and one more node process, 127.0.0.1),
deploys `ctxrelay serve --backend ray` over two models, and runs one conversation through HTTP with the
official openai client: turn 1 on model A, turn 2 on model B (relayed from A's stored state), then kills
the replica that served turn 1 and sends turn 3 on model A. It writes what it saw to the spec's `out`
(JSON) and always takes everything it started down.

SPEC: {"models": [A, B] (as --models), "names": their spec names, "replicas": {A: n, B: n},
"keys": "key:tenant", "quality_threshold": q, "turns": [[{role, content}, ...] new messages per turn (3)],
"max_tokens": n, "work": dir, "out": path}
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import openai
import ray

from ctxrelay.serve.app import Settings
from ctxrelay.serve.auth import load_keys
from ctxrelay.serve.ray_backend import deploy, replica_env
from ctxrelay.serve.ray_models import REPLICA_HEADER, RayConfig
from ctxrelay_bench.harness import free_port, start_redis
from ctxrelay_bench.ray_cluster import LocalCluster, namespace_rss_bytes


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    work = Path(spec["work"])
    out: dict = {"turns": [], "phases_s": {}}
    t0 = time.perf_counter()
    phase = lambda name: out["phases_s"].__setitem__(name, round(time.perf_counter() - t0, 2))
    redis_proc, url = start_redis(work)
    cluster = LocalCluster(work)
    try:
        cluster.start()
        phase("cluster_up")
        port = free_port()
        settings = Settings(keys=load_keys(env=spec["keys"]), max_queue=8)
        models = spec["models"]
        config = RayConfig(models, f"memory+{url}", spec["quality_threshold"], settings, spec["replicas"],
                           replica_cpus=1.0, threads=1, env=replica_env())  # fmt: skip
        deploy(config, "127.0.0.1", port)
        phase("deployed")
        out["memory_deployed_bytes"] = namespace_rss_bytes()
        key = spec["keys"].split(":")[0]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=600)
        history: list[dict] = []
        conversation = "new"
        names = spec["names"]  # what requests call the models (their spec names)
        order = [names[0], names[1], names[0]]
        for i, (model, new) in enumerate(zip(order, spec["turns"], strict=True)):
            if i == 2:  # the replica that served turn 1 dies; its model's next turn goes elsewhere
                killed = out["turns"][0]["replica"]
                ray.kill(ray.get_actor(killed, namespace="serve"), no_restart=True)
                out["killed"] = killed
                phase("killed")
            history += new
            raw = client.chat.completions.with_raw_response.create(
                model=model, messages=history, max_tokens=spec["max_tokens"], extra_body={"conversation": conversation}
            )  # fmt: skip
            c = raw.parse()
            report = c.model_extra["ctxrelay"]
            conversation = report["conversation"]
            text = c.choices[0].message.content
            history.append({"role": "assistant", "content": text})
            out["turns"].append({"model": model, "status": raw.status_code, "replica": raw.headers.get(REPLICA_HEADER),
                                 "report": report, "text": text, "prompt_tokens": c.usage.prompt_tokens})  # fmt: skip
            phase(f"turn{i + 1}")
        out["memory_bytes"] = namespace_rss_bytes()
        out["alive_replicas"] = sorted(
            a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "SERVE_REPLICA" in a["name"]
        )  # fmt: skip
        out["history"] = history
        out["ok"] = True
    except Exception:
        out["ok"] = False
        out["error"] = traceback.format_exc()
    finally:
        if ray.is_initialized():  # serve.shutdown() alone would start a Ray instance of its own
            from ray import serve

            serve.shutdown()
        cluster.stop()
        redis_proc.kill()
        redis_proc.wait()
        out["phases_s"]["total"] = round(time.perf_counter() - t0, 2)
        Path(spec["out"]).write_text(json.dumps(out, indent=1))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
