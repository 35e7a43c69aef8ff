"""Small matplotlib helpers (Agg backend) for the figure beside each results file."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_path(results_path: str | Path, suffix: str = "") -> Path:
    """benchmarks/results/NAME.json -> benchmarks/results/NAME[suffix].png."""
    p = Path(results_path)
    return p.with_name(f"{p.stem}{suffix}.png")


def grouped(
    rows: Sequence[dict], label_of: Callable[[dict], str | None], x: str, y: str
) -> dict[str, tuple[list[float], list[float]]]:
    """{label: (xs, ys)} of rows[x], rows[y] per label_of(row), in row order (None: left out)."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    for row in rows:
        label = label_of(row)
        if label is not None:
            xs, ys = out.setdefault(label, ([], []))
            xs.append(row[x])
            ys.append(row[y])
    return out


def line_plot(
    path: str | Path,
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
    logx: bool = False,
    logy: bool = False,
    note: str = "",
) -> Path:
    """One line with markers per series {label: (xs, ys)}; log axes on request."""
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    for label, (xs, ys) in series.items():
        ax.plot(list(xs), list(ys), marker="o", label=label)
    if logx:
        ax.set_xscale("log", base=2)
        ticks = sorted({float(x) for xs, _ in series.values() for x in xs})
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])  # the measured lengths, not powers of 2
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    if note:
        fig.text(0.01, 0.01, note, fontsize=6, alpha=0.7)
    return save_figure(fig, path)


def scatter_plot(
    path: str | Path,
    points: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
    logx: bool = False,
    hline: float | None = None,
    vline: float | None = None,
) -> Path:
    """Quality-vs-cost style scatter, one colour per group; optional reference lines (bars, native)."""
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    for label, (xs, ys) in points.items():
        ax.scatter(list(xs), list(ys), label=label, s=22)
    if hline is not None:
        ax.axhline(hline, color="grey", ls="--", lw=0.8)
    if vline is not None:
        ax.axvline(vline, color="grey", ls="--", lw=0.8)
    if logx:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if points:
        ax.legend(fontsize=8)
    return save_figure(fig, path)


def heatmap(
    path: str | Path,
    matrix,
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
    cbar_label: str = "",
    cmap: str = "viridis",
) -> Path:
    """A 2-D array as an image (rows = y); e.g. TV distance receiver layer x sender layer."""
    import numpy as np

    data = np.asarray(matrix, dtype=float)
    fig, ax = plt.subplots(figsize=(6.4, 5.2), dpi=120)
    im = ax.imshow(data, aspect="auto", origin="lower", cmap=cmap)
    cb = fig.colorbar(im, ax=ax)
    cb.set_label(cbar_label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return save_figure(fig, path)


def save_figure(fig, path: str | Path) -> Path:
    """Lay out, write (folders made) and close a figure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def cdf_step(ax, values: Sequence[float], **style) -> None:
    """The empirical CDF of `values` as a step line on `ax` (share of values <= x)."""
    s = sorted(values)
    ax.step(s, [(i + 1) / len(s) for i in range(len(s))], where="post", **style)
