"""Small helpers shared by the runner, the graphs, the attention backends and the sampler."""

from __future__ import annotations

import argparse
from typing import Any

import functools
import math
import importlib.util
import os
import re
from pathlib import Path

import torch

_UNITS = {"b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str, name: str = "kv_cache_memory") -> int:
    """A byte count, parsed exactly: a number is bytes (123, 2e9); a string needs its unit
    ('2GiB', '512MiB', '1e9B', '500MB'; KiB/MiB/GiB/TiB are powers of 2, KB/MB/GB/TB of 10). No
    unit is ever guessed: '512B' is 512 bytes, and '2' is refused."""
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected a byte count, got {value!r}")
    if isinstance(value, (int, float)):
        n = float(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]+)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{name}: cannot parse {value!r}: give a number of bytes or a size "
                             f"with its unit, e.g. '2GiB', '512MiB', '1000000B'")
        n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not n > 0 or n != int(n):
        raise ValueError(f"{name} must be a positive whole number of bytes, got {value!r}")
    return int(n)


def cache_root() -> Path:
    """Where lmserve keeps what it builds once per machine (LMSERVE_CACHE, default ~/.cache/lmserve):
    kernels/ (the compiled C kernels), models/ (models joined from part packages), tokenizers/."""
    return Path(os.environ.get("LMSERVE_CACHE", Path.home() / ".cache" / "lmserve"))


@functools.cache
def triton_available() -> bool:
    """Whether Triton can be imported (looked up once, without importing it)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def sm_count(device: torch.device) -> int:
    """A CUDA device's streaming multiprocessors (what a kernel grid is sized against), looked up once."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def tensor_version(t: torch.Tensor) -> int:
    """t._version (bumped by every in-place change), or -1 for a tensor made under inference_mode, which
    tracks none (then only its address identifies it)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`. To CUDA it goes through pinned memory without blocking, so
    building a step's inputs never waits for the device (the caching host allocator keeps the
    pinned buffer until the copy is done); the step's one sync is reading its tokens back."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class EngineFatalError(RuntimeError):
    """An error after which the engine cannot go on (a tensor-parallel rank lost): Engine.step lets it
    through instead of failing only the step's requests, and the server stops."""


def is_whole(v: Any) -> bool:
    """An integer (numpy's too: it has __index__), not a bool."""
    return hasattr(v, "__index__") and not isinstance(v, bool)


def given_flags(argv: list[str]) -> set[str]:
    """The flags a command line names (`--flag value` or `--flag=value`)."""
    return {x.split("=", 1)[0] for x in argv}


def at_least(lo: float, kind: type = int, finite: bool = False) -> Any:
    """An argparse type: `kind` (int or float) >= lo (and finite when asked), else the flag's usage error
    (exit status 2)."""
    def parse(text: str) -> Any:
        v = kind(text)  # not a number: argparse's "invalid int value"
        if not v >= lo or finite and not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be {'a finite number ' if finite else ''}>= {lo}, got {text}")
        return v
    parse.__name__ = kind.__name__
    return parse


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0..65535 (0: any free one), else the flag's usage error (70000 was
    bound as 70000 - 65536 by the server, and raised OverflowError in the router)."""
    v = int(text)  # not a number: argparse's "invalid port_number value"
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 0..65535, got {text}")
    return v


def above(lo: float, hi: float | None = None, finite: bool = False) -> Any:
    """An argparse type: a float > lo (and <= hi when given; finite when asked: inf may mean "no limit")."""
    def parse(text: str) -> float:
        v = float(text)
        if not (v > lo and (hi is None or v <= hi)) or finite and not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be {'a finite number ' if finite else ''}> {lo}"
                                             + (f" and <= {hi}" if hi is not None else "") + f", got {text}")
        return v
    parse.__name__ = "float"
    return parse

