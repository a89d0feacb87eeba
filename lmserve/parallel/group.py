"""TPGroup: one rank's view of a tensor-parallel group, and the collectives the sharded model uses.

Every rank holds 1/N of each layer (parallel/shard.py) and the whole residual stream (N, hidden): a
column-parallel projection (qkv, gate/up) needs no communication, a row-parallel one (o, down) ends
with `all_reduce`, and the LM head's vocab slices meet on rank 0 through `gather_vocab`. The group is
passed explicitly to the modules that communicate; there is no global process group state beyond
torch.distributed's own.

A collective that fails (a rank died: its sockets closed; or a timeout) raises RankLost, which the
engine treats as fatal (Engine.step re-raises it; the server's /health turns 503 and it exits).
"""

from __future__ import annotations

import datetime
import os
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lmserve.utils import EngineFatalError


GATHER_SUM_MAX = 1 << 16  # elements: 256 KiB of float32 (a 16 MiB message is 3x slower gathered)


class RankLost(EngineFatalError):
    """A tensor-parallel peer is gone (or did not answer within the group's timeout)."""


@dataclass
class TPGroup:
    """rank in [0, size); group: the torch.distributed process group (None: the default one)."""

    rank: int
    size: int
    group: object = None
    device: torch.device = torch.device("cpu")
    lock: threading.RLock = field(default_factory=threading.RLock)  # rank 0: one sender at a time
    gather_sum: bool = False  # gloo: small all-reduces as an all-gather and a sum in rank order (all_reduce)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum t over the ranks, in place; returns t. Under gloo a tensor of up to GATHER_SUM_MAX elements
        goes as an all-gather and a sum in rank order: the same bits on every rank, as an all-reduce
        gives, at about a third of gloo's all-reduce time for a decode step's few KB (1.2 ms -> 0.4 ms on
        two local ranks, scripts/bench_tp_link.py); larger ones (prefill chunks) take gloo's ring."""
        try:
            if self.gather_sum and t.numel() <= GATHER_SUM_MAX:
                parts = [torch.empty_like(t) for _ in range(self.size)]
                dist.all_gather(parts, t.contiguous(), group=self.group)
                t.copy_(parts[0])
                for p in parts[1:]:
                    t.add_(p)
                return t
            dist.all_reduce(t, group=self.group)
        except Exception as e:  # gloo / NCCL: a closed peer or a timeout
            raise RankLost(f"tensor-parallel all-reduce failed: {e}") from e
        return t

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """t from rank 0 to every rank, in place (the same shape and dtype everywhere); returns t."""
        try:
            dist.broadcast(t, src=0, group=self.group)
        except Exception as e:
            raise RankLost(f"tensor-parallel broadcast failed: {e}") from e
        return t

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Each rank's (B, V_r) logits -> the whole (B, vocab_size) on rank 0 (None elsewhere). Slices
        are padded to the largest one for the gather (vocab_split), then cut."""
        width = -(-vocab_size // self.size)
        if local.shape[-1] < width:
            local = torch.nn.functional.pad(local, (0, width - local.shape[-1]))
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        try:
            dist.gather(local, parts, dst=0, group=self.group)
        except Exception as e:
            raise RankLost(f"tensor-parallel gather failed: {e}") from e
        if parts is None:
            return None
        starts = [vocab_split(vocab_size, self.size, r) for r in range(self.size)]
        return torch.cat([p[:, : s.stop - s.start] for p, s in zip(parts, starts)], dim=-1)  # (B, vocab)


def even_split(n: int, parts: int, rank: int, unit: int = 1) -> slice:
    """Rank's contiguous share of n items handed out in whole units (earlier ranks take the extra
    unit when they do not divide evenly). ValueError when n is not a whole number of units, or there
    are fewer units than parts."""
    if n % unit or n // unit < parts:
        raise ValueError(f"cannot split {n} into {parts} tensor-parallel shards of whole {unit}s")
    units = n // unit
    base, extra = divmod(units, parts)
    start = rank * base + min(rank, extra)
    return slice(start * unit, (start + base + (rank < extra)) * unit)


def vocab_split(vocab_size: int, parts: int, rank: int) -> slice:
    """Rank's rows of the embedding table and the LM head: ceil(V / N) each, the last one shorter."""
    width = -(-vocab_size // parts)
    return slice(min(rank * width, vocab_size), min((rank + 1) * width, vocab_size))


def head_split(num_heads: int, num_kv_heads: int, parts: int, rank: int) -> tuple[slice, slice]:
    """Rank's (query heads, KV heads). Each rank keeps whole GQA groups: with at least as many KV
    heads as ranks, the KV heads are split (unevenly when they must: 3 over 2 -> 2 + 1) and the query
    heads follow their KV head; with fewer, each KV head is replicated on parts / num_kv_heads ranks
    which split its query heads. ValueError naming the counts when neither works."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= parts:
        kv = even_split(num_kv_heads, parts, rank)
        return slice(kv.start * group, kv.stop * group), kv
    if parts % num_kv_heads or group % (parts // num_kv_heads):
        raise ValueError(f"tensor_parallel_size={parts}: {num_heads} query heads over {num_kv_heads} KV heads "
                         f"cannot be split over {parts} ranks (the ranks per KV head must divide its "
                         f"{group} query heads)")
    per = parts // num_kv_heads  # ranks sharing one KV head
    kv, part = divmod(rank, per)
    q = group // per
    return slice(kv * group + part * q, kv * group + (part + 1) * q), slice(kv, kv + 1)


def refuse_a_running_group() -> None:
    """A process holds one group: joining a running one would talk to another engine's ranks and shards."""
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel group is already running in this process: close its engine "
                           "(LLM.close) before starting another")


def init_group(size: int, rank: int, device: str, timeout_s: float, interface: str | None,
               init_method: str = "env://") -> TPGroup:
    """Join the group: gloo on CPUs, NCCL on GPUs. init_method: env:// (MASTER_ADDR / MASTER_PORT, as
    torchrun sets them) or tcp://host:port (our one-host launcher). interface: the network interface
    the ranks bind to (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)."""
    if interface:
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = interface
    cuda = str(device).startswith("cuda")
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    refuse_a_running_group()
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return TPGroup(rank, size, None, dev, gather_sum=not cuda)
