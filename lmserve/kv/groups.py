"""KV cache groups: which layers share a block table (the hybrid KV cache of models that mix
full-attention and sliding-window layers, as vLLM's hybrid KV cache manager lays it out).

Layers of one kind (the same sliding window, or none) keep the same blocks for a sequence, so they
can share a block table; layers of different kinds cannot: a sliding-window layer needs only the
last `window` tokens, a full-attention layer needs them all. So the layers are split into groups of
equal size g (g = the gcd of the kinds' layer counts), each group all of one kind, and every group
has its own block table per sequence. All groups draw from one pool of blocks: block b of the pool is
slot range [b * block_size, (b + 1) * block_size) of g cache tensors, and the layer at place j of a
group reads and writes tensor j. A pool block therefore holds one group's g layers for block_size
tokens, whichever group it serves, and the budget moves between groups as sequences grow: a long
sequence's windowed groups stop growing (their out-of-window blocks are freed) while its full groups
keep growing.

Gemma 3 270M: 18 layers, 15 sliding (window 512) and 3 full: g = 3, one full group and five
sliding groups. A model of one kind is one group of all its layers (the plain paged cache).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lmserve.config import ModelConfig


@dataclass(frozen=True)
class KVGroups:
    """layers[i]: the layer ids of group i (ascending); windows[i]: its sliding window (None: full
    attention). Full-attention groups come first, so group 0's table is the longest."""

    layers: tuple[tuple[int, ...], ...]
    windows: tuple[int | None, ...]

    @classmethod
    def from_config(cls, cfg: ModelConfig, hybrid: bool = True) -> KVGroups:
        """Groups from the model's per-layer windows. hybrid=False: one group of every layer, no
        block ever freed early (the window-blind cache; what the planner and the tests compare with)."""
        n = cfg.num_layers
        if not hybrid:
            return cls((tuple(range(n)),), (None,))
        by_window: dict[int | None, list[int]] = {}
        for i in range(n):
            by_window.setdefault(cfg.layer_window(i), []).append(i)
        kinds = sorted(by_window, key=lambda w: (w is not None, w or 0))  # full attention first
        g = math.gcd(*(len(by_window[w]) for w in kinds))
        layers, windows = [], []
        for w in kinds:
            ids = by_window[w]
            for a in range(0, len(ids), g):
                layers.append(tuple(ids[a:a + g]))
                windows.append(w)
        return cls(tuple(layers), tuple(windows))

    @property
    def num_groups(self) -> int:
        return len(self.layers)

    @property
    def layers_per_group(self) -> int:
        """g: the number of cache tensors (a pool block covers g layers)."""
        return len(self.layers[0])

    def place(self, layer: int) -> tuple[int, int]:
        """(group, index in the group) of a layer: it uses that group's block table and tensor `index`."""
        for gi, ids in enumerate(self.layers):
            if layer in ids:
                return gi, ids.index(layer)
        raise IndexError(f"layer {layer} is in no KV group")

    def blocks_per_token_bound(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        """The most pool blocks one sequence of num_tokens tokens holds at any step (all groups): a
        full group holds all its blocks; a windowed group the blocks a step's queries can see, from
        window - 1 tokens before the step's first token to its last (at most max_step_tokens new)."""
        full = -(-num_tokens // block_size)
        total = 0
        for w in self.windows:
            total += full if w is None else min(full, -(-(w - 1 + max_step_tokens) // block_size) + 1)
        return total
