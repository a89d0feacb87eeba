"""Preemption by swapping: a preempted sequence's KV blocks copied to host memory and back, beside
recompute (which frees them and runs the tokens again), chosen by cost.

The scheduler decides (it owns which blocks a sequence holds and how much swap space is left) and
lists the moves in its SchedulerOutput; `HostSwap`, owned by the model runner next to the KV cache it
copies from, carries them out before the step's copy-on-write copies and forward: swap-outs first
(their blocks were freed in this schedule and may be written by this step), then swap-ins."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lmserve.kv.cache import KVCache
from lmserve.utils import to_device

# what a move costs, roughly (bytes / s of host <-> cache copies, FLOP / s of the forward); only the
# ratio of the two estimates matters, and it is far apart on both kinds of device
COPY_BYTES_PER_S = {"cpu": 10e9, "cuda": 20e9}  # a memcpy in RAM; PCIe to pinned host memory
FLOPS = {"cpu": 50e9, "cuda": 200e12}


def swap_is_cheaper(tokens: int, blocks: int, block_bytes: int, num_params: int, device: str) -> bool:
    """Swap when moving the blocks out and back (2 x blocks x block_bytes) takes less than running the
    tokens through the model again (2 x params FLOP each). On a CPU it nearly always is (a 135M model:
    ~5 ms a token to recompute, ~10 us to move its KV); on a GPU recompute nearly always is."""
    kind = "cuda" if str(device).startswith("cuda") else "cpu"
    swap_s = 2 * blocks * block_bytes / COPY_BYTES_PER_S[kind]
    recompute_s = tokens * 2 * num_params / FLOPS[kind]
    return swap_s < recompute_s


def swap_policy(mode: str, swap_space: int, block_bytes: int, num_params: int, device: str
                ) -> tuple[int, Callable[[Any, int], bool] | None]:
    """The scheduler's swap settings for an engine: (host space in blocks, whether a victim holding
    that many blocks swaps), from preemption_mode: swap (when there is room), recompute (never), auto
    (when swap_is_cheaper for its computed tokens)."""
    blocks = swap_space // block_bytes if mode != "recompute" else 0
    if not blocks:
        return 0, None

    def pays(seq: Any, n: int) -> bool:
        return mode == "swap" or swap_is_cheaper(seq.num_computed_tokens, n, block_bytes, num_params, device)
    return blocks, pays


class HostSwap:
    """Host copies of swapped-out sequences' blocks, keyed by sequence: every tensor of the cache
    (every layer at each place of the KV groups; data and scales of a quantized cache)."""

    def __init__(self, kv: KVCache) -> None:
        self.kv = kv
        self.saved: dict[Any, list[torch.Tensor]] = {}
        self.pin = torch.cuda.is_available() and kv.tensors[0].device.type == "cuda"

    def _slots(self, blocks: list[int], device: torch.device) -> torch.Tensor:
        bs = self.kv.block_size
        b = to_device(torch.tensor(blocks, dtype=torch.long), device)  # (n,)
        return (b[:, None] * bs + torch.arange(bs, device=device)).reshape(-1)  # (n * bs,)

    def out(self, key: Any, blocks: list[int]) -> None:
        """Copy the blocks' slots of every tensor to host memory under key."""
        parts = self.kv.parts()
        slots = self._slots(blocks, parts[0].device)
        host = []
        for t in parts:
            x = t.index_select(1, slots)  # (parts, n * bs, ...)
            if x.device.type != "cpu":
                x = x.to("cpu", non_blocking=False)
            host.append(x.pin_memory() if self.pin else x)
        self.saved[key] = host

    def into(self, key: Any, blocks: list[int]) -> None:
        """Copy key's host copy into these blocks (as many as were saved, in the same order); drop it."""
        host = self.saved.pop(key)
        parts = self.kv.parts()
        slots = self._slots(blocks, parts[0].device)
        for t, x in zip(parts, host):
            t.index_copy_(1, slots, x.to(t.device, non_blocking=self.pin))

    def drop(self, key: Any) -> None:
        self.saved.pop(key, None)

    def apply(self, swap_out: list[tuple[Any, list[int]]], swap_in: list[tuple[Any, list[int]]],
              dropped: list[Any]) -> None:
        """A step's moves, in the order that keeps every block's content: outs, then ins."""
        for key in dropped:
            self.drop(key)
        for key, blocks in swap_out:
            self.out(key, blocks)
        for key, blocks in swap_in:
            self.into(key, blocks)
