"""The link between two tensor-parallel ranks on this host: the time of one all-reduce of a decode step's
message (batch x hidden floats) and of a large one, two processes on loopback, as gloo's all_reduce and
as the all-gather + sum lmserve uses under gloo (parallel/group.py). The CPU
defaults of `lmserve plan --device cpu --tensor-parallel-size N` (LINKS["cpu"]) come from this.

    python scripts/bench_tp_link.py [--hidden 576] [--iters 2000]
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank: int, port: int, hidden: int, iters: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    rows = []
    for name, n, reps in (("decode step (1 row)", hidden, iters), ("8 rows", 8 * hidden, iters),
                          ("16 MiB", 4 << 20, 20)):
        t = torch.ones(n)
        parts = [torch.empty(n), torch.empty(n)]
        times = []
        for op in ("all_reduce", "all_gather"):  # gloo's all-reduce; TPGroup's all-gather + sum
            for i in range(reps + 10):
                if i == 10:
                    dist.barrier()
                    t0 = time.perf_counter()
                if op == "all_reduce":
                    dist.all_reduce(t)
                else:
                    dist.all_gather(parts, t)
                    t.copy_(parts[0]).add_(parts[1])
            times.append((time.perf_counter() - t0) / reps)
        rows.append((name, n * 4, *times))
    if rank == 0:
        print(f"{'message':<22} {'bytes':>10} {'all_reduce us':>14} {'all_gather + sum us':>20}")
        for name, b, ar, ag in rows:
            print(f"{name:<22} {b:>10,} {ar * 1e6:>14.1f} {ag * 1e6:>20.1f}")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--iters", type=int, default=2000)
    a = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(run, args=(port, a.hidden, a.iters), nprocs=2)


if __name__ == "__main__":
    main()
