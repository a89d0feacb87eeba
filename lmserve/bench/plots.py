"""PNG plots for the benches (matplotlib, imported only when --plot is given)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _plt():  # type: ignore[no-untyped-def]
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def bars(title: str, values: dict[str, float], ylabel: str, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(values)
    ax.bar(names, [values[n] for n in names], color=["#1f77b4", "#ff7f0e", "#2ca02c"][: len(names)])
    for i, n in enumerate(names):
        ax.text(i, values[n], f"{values[n]:,.1f}", ha="center", va="bottom")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def naive_curve(res: dict[str, Any], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(res["lengths"], [t * 1e3 for t in res["naive_s_per_token"]], "o-", label="no KV cache (recompute)")
    ax.plot(res["lengths"], [t * 1e3 for t in res["cached_s_per_token"]], "s-", label="paged KV cache")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("time per generated token (ms)")
    ax.set_title("Time per generated token vs context length")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def cdfs(series: dict[str, list[float]], xlabel: str, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, vals in series.items():
        v = sorted(vals)
        if v:
            ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_title("Latency CDFs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
