"""How many long sequences a KV budget holds, hybrid KV cache vs window-blind, for a sliding-window model.

Runs the engine's own block accounting (KVCache.blocks_for_budget, BlockManager with the model's KV
groups) on the model's shape, no weights: sequences are admitted with a prompt and decoded token by
token (one reserve per step, as the scheduler does) until each is `--seq-len` long; it counts how many
reach that length together before the pool runs out, and the blocks each KV group holds per sequence.
The engine test tests/test_gemma3.py::test_more_long_sequences_fit_than_window_blind checks the same
with real forwards on a tiny model.

    python scripts/kv_groups_memory.py --model gemma-3-270m --kv-cache-memory 256MiB --seq-len 4096
"""

from __future__ import annotations

import argparse

import torch

from lmserve.config import parse_bytes
from lmserve.kv.block_manager import NULL_BLOCK, BlockManager
from lmserve.kv.cache import KVCache
from lmserve.kv.groups import KVGroups
from lmserve.models.shapes import shape_config


def fill(cfg, budget: int, block_size: int, seq_len: int, prompt: int, hybrid: bool) -> dict:  # type: ignore[no-untyped-def]
    groups = KVGroups.from_config(cfg, hybrid)
    num_blocks = KVCache.blocks_for_budget(cfg, block_size, torch.float32, budget, hybrid=hybrid)
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False, windows=groups.windows)
    held: list[list[list[int]]] = []
    while True:
        tables: list[list[int]] = []
        if not bm.allocate(tables, prompt):
            break
        ok = True
        for n in range(prompt, seq_len):  # decode steps: token n is computed
            if bm.reserve(tables, n, n + 1) is None:
                ok = False
                break
        if not ok:
            bm.free(tables)
            break
        held.append(tables)
    per_group = [sum(b != NULL_BLOCK for b in t) for t in held[0]] if held else []
    return {"blocks": num_blocks, "layers_per_block": groups.layers_per_group, "groups": groups.num_groups,
            "sequences": len(held), "blocks_per_group": per_group, "windows": groups.windows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma-3-270m", help="a named shape (lmserve.models.shapes)")
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--prompt", type=int, default=128)
    a = p.parse_args()
    cfg = shape_config(a.model)
    budget = parse_bytes(a.kv_cache_memory)
    print(f"{a.model}: {cfg.num_layers} layers, windows {sorted({cfg.layer_window(i) or 0 for i in range(cfg.num_layers)})}"
          f" (0 = full); budget {a.kv_cache_memory} fp32, blocks of {a.block_size} tokens; sequences of "
          f"{a.prompt} prompt tokens decoded to {a.seq_len}")
    print(f"{'cache':<14} {'pool blocks':>11} {'layers/block':>12} {'groups':>6} {'sequences held':>15}  blocks per group "
          f"for one sequence")
    for hybrid in (True, False):
        r = fill(cfg, budget, a.block_size, a.seq_len, a.prompt, hybrid)
        desc = ", ".join(f"{b} ({'full' if w is None else f'window {w}'})"
                         for b, w in zip(r["blocks_per_group"], r["windows"]))
        print(f"{'hybrid' if hybrid else 'window-blind':<14} {r['blocks']:>11,} {r['layers_per_block']:>12} "
              f"{r['groups']:>6} {r['sequences']:>15}  {desc}")


if __name__ == "__main__":
    main()
