"""Our CPU kernel's code paths at DRAM scale (issues #14, #15): the default model's 120 decoder
linears (SmolLM2-135M shapes, int4 group 32 as its GGUF holds them, random weights) multiplied by one
row, one after another as a decode step reads them, on each path this CPU has, beside fp32 F.linear
over the same shapes. One thread by default (`--threads N`): the figures BENCHMARKS.md quotes.

    python scripts/bench_cpu_kernels.py [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmserve.layers import cpu_native  # noqa: E402
from lmserve.layers.quant import Int4Linear  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # qkv, o, gate_up, down per layer


def best_ms(fn, reps: int = 5) -> float:  # type: ignore[no-untyped-def]
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if not cpu_native.available():
        sys.exit("the CPU kernels did not build (no C compiler?)")
    g = torch.Generator().manual_seed(0)
    quant = [Int4Linear.from_float(torch.randn(n, k, generator=g) * 0.02, group_size=32) for n, k in SHAPES]
    floats = [torch.randn(n, k, generator=g) * 0.02 for n, k in SHAPES]
    xs = {576: torch.randn(1, 576, generator=g), 1536: torch.randn(1, 1536, generator=g)}
    top = cpu_native.ISA_NAMES[cpu_native.isa()]
    print(f"{a.threads} thread(s); this CPU's best path: {cpu_native.isa()}")
    for name, level in cpu_native.ISA_NAMES.items():
        if level <= top:
            ms = best_ms(lambda: [cpu_native.qgemm(xs[lay.in_features], lay.qweight, 4, lay.scales, lay.mins, 32, name)
                                  for lay in quant])
            print(f"  int4 g32, {name:<7} {ms:7.1f} ms")
    ms = best_ms(lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in floats])
    print(f"  fp32 F.linear  {ms:7.1f} ms")


if __name__ == "__main__":
    main()
