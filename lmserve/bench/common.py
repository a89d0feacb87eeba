"""Shared bench plumbing: workloads, percentiles, run metadata, JSON output."""

from __future__ import annotations

import json
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Request:
    """One benchmark request: prompt token ids and how many tokens to generate."""

    prompt: list[int]
    max_tokens: int


PRESETS = {
    # the nano-vllm / mini-sglang workload (GPU)
    "gpu": dict(num_requests=256, input_len=(100, 1024), output_len=(100, 1024)),
    # the same shape scaled for a 2-core CPU
    "cpu": dict(num_requests=32, input_len=(16, 256), output_len=(16, 256)),
    # CI smoke size
    "tiny": dict(num_requests=6, input_len=(4, 24), output_len=(4, 16)),
}


def random_workload(num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int],
                    vocab_size: int, seed: int = 0) -> list[Request]:
    """Prompts of random token ids with lengths uniform in input_len, max_tokens uniform in output_len."""
    rng = random.Random(seed)
    lo = min(10, vocab_size - 1)  # keep clear of the lowest ids, where special tokens live
    return [Request([rng.randrange(lo, vocab_size) for _ in range(rng.randint(*input_len))],
                    rng.randint(*output_len)) for _ in range(num_requests)]


def latency_prompts(vocab_size: int, batch_size: int, input_len: int, repeats: int, seed: int = 0
                    ) -> list[list[list[int]]]:
    """The prompts of `bench latency`: repeats + 1 rounds (the first warms up) of batch_size fresh random
    prompts of input_len token ids each; every engine compared gets these same ids."""
    rng = random.Random(seed)
    return [[[rng.randrange(10, vocab_size) for _ in range(input_len)] for _ in range(batch_size)]
            for _ in range(repeats + 1)]


def percentiles(values: list[float], ps: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    """Nearest-rank-interpolated percentiles plus the mean (NaN each, of no values: e.g. TPOT of
    one-token outputs, which has none)."""
    if not values:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in ps}}
    v = sorted(values)
    out = {"mean": sum(v) / len(v)}
    for p in ps:
        k = (len(v) - 1) * p / 100
        f = int(k)
        c = min(f + 1, len(v) - 1)
        out[f"p{p}"] = v[f] + (v[c] - v[f]) * (k - f)
    return out


def run_metadata(args: dict[str, Any]) -> dict[str, Any]:
    """Model, device, versions, git commit and the exact options of this run."""
    import torch
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                                cwd=Path(__file__).parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    versions = {"python": sys.version.split()[0], "torch": torch.__version__}
    for mod in ("transformers", "triton"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            pass
    device = args.get("device", "cpu")
    dev_name = torch.cuda.get_device_name() if str(device).startswith("cuda") and torch.cuda.is_available() \
        else platform.processor() or platform.machine()
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_commit": commit, "versions": versions,
            "device_name": dev_name, "cpu_count": __import__("os").cpu_count(), "args": args}


OUTPUT_DIR = Path("bench_out")  # where a command's figures go without --output-json


def output_path(given: str | None, kind: str) -> Path:
    """--output-json's path, else a new OUTPUT_DIR/<kind>-<time>.json."""
    return Path(given) if given else OUTPUT_DIR / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=2, default=str))
    return p


def sync(device: str) -> None:
    if str(device).startswith("cuda"):
        import torch
        torch.cuda.synchronize()
