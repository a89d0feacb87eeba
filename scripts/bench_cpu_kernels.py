"""Our CPU kernel's code paths at DRAM scale (issues #14, #15): the default model's 120 decoder
linears (SmolLM2-135M shapes, int4 group 32 as its GGUF holds them, random weights) and its int8 LM
head (49152 x 576, Q8_0), multiplied one after another as a step reads them, on each path this CPU
has, beside fp32 F.linear over the same shapes; for 1, 2, 4, 5, 8 and 16 rows of x (a decode batch or
a speculative verification). The tile kernel's paths (vnni, avx2int8) multiply the layers' repacked
tiles (what the layers use); the float-x paths the layers' own layouts. Two threads by default (`--threads N`): the figures
BENCHMARKS.md quotes.

    python scripts/bench_cpu_kernels.py [--threads 2] [--rows 1,2,4,5,8,16]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmserve.layers import cpu_native  # noqa: E402
from lmserve.layers.quant import GroupQuantLinear, Int4Linear, Int8Linear  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # qkv, o, gate_up, down per layer
HEAD = (49152, 576)


def median_ms(fn, reps: int = 7) -> float:  # type: ignore[no-untyped-def]
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[reps // 2] * 1e3


def step(layers: list[GroupQuantLinear], xs: dict[int, torch.Tensor], path: str) -> None:
    """Every linear once, on `path` (the VNNI tiles, or qgemv.c's paths in the layers' layouts)."""
    for lay in layers:
        x = xs[lay.in_features]
        if path in ("vnni", "avx2int8"):
            cpu_native.qgemm_tiles(x, lay.tiles(), isa_name=path)
        else:
            cpu_native.qgemm(x, lay.qweight, lay.bits, lay.scales, lay.mins, lay.group_size, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,2,4,5,8,16")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if not cpu_native.available():
        sys.exit("the CPU kernels did not build (no C compiler?)")
    g = torch.Generator().manual_seed(0)
    layers: list[GroupQuantLinear] = [Int4Linear.from_float(torch.randn(n, k, generator=g) * 0.02, group_size=32)
                                      for n, k in SHAPES]
    layers.append(Int8Linear.from_float(torch.randn(*HEAD, generator=g) * 0.02, group_size=32))
    floats = [torch.randn(n, k, generator=g) * 0.02 for n, k in [*SHAPES, HEAD]]
    rows = [int(r) for r in a.rows.split(",")]
    top = cpu_native.ISA_NAMES[cpu_native.isa()]
    paths = [name for name, level in cpu_native.ISA_NAMES.items()  # those this CPU has; plain C: never used
             if 0 < level <= top and cpu_native._level_for(name) == level]
    print(f"{a.threads} thread(s), this CPU's best path: {cpu_native.isa()}; ms for the 121 linears "
          f"(x the ratio to one row)")
    print(f"{'path':<12}" + "".join(f"{r:>8} row{'s' if r > 1 else ' '}" for r in rows))
    for path in [*paths, "fp32"]:
        base, cells = None, []
        for r in rows:
            xs = {k: torch.randn(r, k, generator=g) for k in (576, 1536)}
            if path == "fp32":
                ms = median_ms(lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in floats])
            else:
                os.environ["LMSERVE_ISA"] = path
                ms = median_ms(lambda: step(layers, xs, path))
            base = base or ms
            cells.append(f"{ms:6.1f} ({ms / base:.2f}x)")
        print(f"{path:<12}" + "".join(f"{c:>13}" for c in cells))


if __name__ == "__main__":
    main()
