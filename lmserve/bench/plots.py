"""PNG plots for the benches (matplotlib, imported only when --plot is given)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def _figure(path: Path, title: str, xlabel: str | None, ylabel: str, legend: bool) -> Iterator[Any]:
    """A 6x4 figure: the caller draws on the axes it yields; labels, layout and saving are done here."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    try:
        yield ax
        if xlabel is not None:
            ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        if legend:
            ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def bars(title: str, values: dict[str, float], ylabel: str, path: Path) -> Path:
    with _figure(path, title, None, ylabel, legend=False) as ax:
        names = list(values)
        ax.bar(names, [values[n] for n in names], color=["#1f77b4", "#ff7f0e", "#2ca02c"][: len(names)])
        for i, n in enumerate(names):
            ax.text(i, values[n], f"{values[n]:,.1f}", ha="center", va="bottom")
    return path


def naive_curve(res: dict[str, Any], path: Path) -> Path:
    with _figure(path, "Time per generated token vs context length", "context length (tokens)",
                 "time per generated token (ms)", legend=True) as ax:
        ax.plot(res["lengths"], [t * 1e3 for t in res["naive_s_per_token"]], "o-", label="no KV cache (recompute)")
        ax.plot(res["lengths"], [t * 1e3 for t in res["cached_s_per_token"]], "s-", label="paged KV cache")
    return path


def cdfs(series: dict[str, list[float]], xlabel: str, path: Path) -> Path:
    with _figure(path, "Latency CDFs", xlabel, "fraction of requests", legend=True) as ax:
        for name, vals in series.items():
            v = sorted(vals)
            if v:
                ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=name)
    return path
