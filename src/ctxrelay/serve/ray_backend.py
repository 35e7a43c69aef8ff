"""`ctxrelay serve --backend ray`: the server as a Ray Serve application, past one process.

One deployment per served model (`model-0`, `model-1`, ... in --models order; each replica runs the
existing server for that model, ray_models.ModelReplica) and an ingress deployment that routes each
request by the model it names (ray_models.Ingress). Conversations and states live in the shared Redis
store, so a turn served by one replica continues on any replica of any model, and a replica that dies
loses nothing its turns saved. Plain Ray Serve deployments: never `ray[llm]` (it pulls vLLM's CUDA build).

Ray is imported only when a function here runs, so the library imports without the `ray` extra.
"""

from __future__ import annotations

import os
import time

from ctxrelay.errors import UsageError
from ctxrelay.serve.ray_models import Ingress, ModelReplica, RayConfig

APP = "ctxrelay"
INSTALL = 'pip install "ctxrelay[ray]"'  # the extra pins ray[serve]


def require_ray() -> None:
    """UsageError naming the extra when Ray Serve is not installed."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as e:
        raise UsageError(f"--backend ray needs Ray Serve, which is not installed ({e}): {INSTALL}") from None


def parse_replicas(spec: str, models: list[str]) -> dict[str, int]:
    """'2' (every model), or 'MODEL=N,...' (the others 1): replicas per --models entry."""
    spec = spec.strip()
    if not spec:
        return dict.fromkeys(models, 1)
    if spec.isdigit():
        return dict.fromkeys(models, _positive(spec))
    out = dict.fromkeys(models, 1)
    for part in spec.split(","):
        name, sep, n = part.partition("=")
        if not sep or name.strip() not in out:
            raise UsageError(f"--replicas: {part!r} is not MODEL=N for one of the served models ({', '.join(models)})")
        out[name.strip()] = _positive(n)
    return out


def _positive(n: str) -> int:
    if not n.strip().isdigit() or int(n) < 1:
        raise UsageError(f"--replicas: {n!r} is not a positive number of replicas")
    return int(n)


def check(config: RayConfig, engine: str) -> None:
    """Refuse what the Ray backend cannot serve, before Ray starts."""
    require_ray()
    if engine != "native":
        raise UsageError("--backend ray serves --engine native for now (the vLLM engine as a deployment is not built)")
    if "redis://" not in config.store:
        raise UsageError(
            "--backend ray keeps conversations and states in Redis, where every replica reads them: "
            "give --store redis://HOST:PORT/DB (or memory+redis://...)"
        )


def application(config: RayConfig):
    """The Ray Serve application: the model deployments and the ingress bound to their handles."""
    from ray import serve

    actor = {"num_cpus": config.replica_cpus, "runtime_env": {"env_vars": dict(config.env)}}
    handles = []
    for i, name in enumerate(config.models):
        dep = serve.deployment(
            ModelReplica, name=f"model-{i}", num_replicas=config.replicas.get(name, 1), ray_actor_options=actor,
            max_ongoing_requests=config.settings.max_queue,  # the replica's own queue bound answers 429 past it
            health_check_period_s=2, graceful_shutdown_timeout_s=5,
        )  # fmt: skip
        handles.append(dep.bind(config, i))
    ingress = serve.deployment(
        Ingress, name="ingress", ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": dict(config.env)}},
        max_ongoing_requests=1000,
    )  # fmt: skip
    return ingress.bind(handles, config.settings.max_body_bytes, config.retry_s)


def deploy(config: RayConfig, host: str, port: int, timeout_s: float = 600.0) -> None:
    """Deploy on the Ray cluster this process joined (ray.init), serving HTTP on host:port from the head
    node (one proxy: several node processes on one machine cannot share a port). Returns once every
    replica is up."""
    from ray import serve

    serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port})
    serve.run(application(config), name=APP, route_prefix="/", blocking=False)
    deadline = time.monotonic() + timeout_s
    while (status := serve.status().applications[APP].status) != "RUNNING":
        if status in ("DEPLOY_FAILED", "UNHEALTHY") or time.monotonic() > deadline:
            raise UsageError(f"the Ray Serve application is {status}: {serve.status().applications[APP].message}")
        time.sleep(0.5)


def serve_on(
    backend: str, models: list[str], store: str, quality_threshold: float, settings, replicas: str, threads: int,
    host: str, port: int,
) -> None:  # fmt: skip
    """`ctxrelay serve --backend BACKEND` other than local: checked before Ray starts, then `run`."""
    if backend != "ray":
        raise UsageError(f"--backend must be local or ray, not {backend!r}")
    cpus = float(threads or 1)  # each replica reserves the CPUs its torch threads use
    config = RayConfig(models, store, quality_threshold, settings, parse_replicas(replicas, models), cpus, threads,
                       replica_env())  # fmt: skip
    check(config, settings.engine)
    run(config, host, port)


def run(config: RayConfig, host: str, port: int, address: str = "") -> None:
    """Join the cluster at `address` (empty: $RAY_ADDRESS, or a Ray instance started in this process), deploy,
    serve until SIGINT/SIGTERM, then take the application down."""
    import signal
    import threading

    import ray
    from ray import serve

    ray.init(address=address or None, namespace="ctxrelay", runtime_env={"env_vars": dict(config.env)})
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        deploy(config, host, port)
        print(f"ctxrelay on Ray Serve: http://{host}:{port} ({', '.join(config.models)})", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()


def replica_env() -> dict[str, str]:
    """What the replicas take from this process's environment: ctxrelay's settings (cache folder, keys,
    threads; not the API keys) and the import path (a checkout's code rather than the installed one)."""
    keep = ("CTXRELAY_", "PYTHONPATH", "HF_", "TRANSFORMERS_")
    # the keys travel as digests in the settings, never as plain keys in the replicas' environment
    return {k: v for k, v in os.environ.items() if k.startswith(keep) and k != "CTXRELAY_API_KEYS"}
