"""The EAGLE head's KV pool, and its drafting as calls into our C kernels (issue #21).

`HeadKV` holds every sequence's head KV entries in one paged pool, (2, S, Hkv, d), in blocks of
the engine's block size's slots with a list of blocks per sequence (its block table); the proposer owns it, both drafting
paths read and write it.

`NativeHead` runs the head on the CPU decode plan's kernels (layers/csrc/decode.c: lm_eagle_draft,
lm_eagle_kv): fc, the one decoder layer (lm_llama_layers with one layer, its attention reading the
pool in place), the read-out and the argmax, `rounds` chained drafts in one call. The module path
(int8 layers called one by one, spec/eagle_proposer.py) spends most of a draft in per-call overhead at
one row: 4.1 ms a draft there, where the kernels' work is a few hundred microseconds. Its linears are
int8 copies of the head's (a scale per output row, as `int8_head` makes them), q/k/v and gate/up
joined into one linear each as the target's are (each output row is computed alone, so joining them
changes nothing); for the entries the proposer feeds after each target step, k and v as one linear.
It applies on a CPU with the tile kernel (`build` returns None otherwise) for a float32 head.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from lmserve.layers import cpu_native
from lmserve.layers.quant import Int8Linear
from lmserve.layers.rotary import RotaryEmbedding
from lmserve.models.cpu_decode import TileLinear
from lmserve.spec.eagle import EagleHead

log = logging.getLogger(__name__)


class HeadKV:
    """Every sequence's head KV entries: kv (2, S, Hkv, d), S = blocks x block slots (the target's block
    size: a sequence rounds up as its target blocks do); a state's `blocks` list is its block table,
    `length` its entries. Grows by doubling; `release` frees a state's blocks."""

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 blocks: int = 16, block: int = 16) -> None:
        self.block = block
        self.kv = torch.zeros(2, blocks * block, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.free = list(range(blocks - 1, -1, -1))
        self.grown = False  # past its first size (its budget) once: logged then

    @staticmethod
    def bytes_per_position(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """A position's K and V in the pool."""
        return 2 * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def for_budget(cls, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                   budget: int, block: int = 16) -> "HeadKV":
        """A pool of blocks of `block` slots, as many as budget bytes hold (at least one; 16 when no
        budget is given)."""
        per_block = block * cls.bytes_per_position(num_kv_heads, head_dim, dtype)
        return cls(num_kv_heads, head_dim, dtype, device, max(1, budget // per_block) if budget > 0 else 16, block)

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[1] // self.block

    def reserve(self, st: "HasBlocks", n: int) -> None:
        """Blocks enough for n entries in st's table."""
        need = -(-n // self.block) - len(st.blocks)
        while len(self.free) < need:
            old, nb = self.kv, self.num_blocks
            if not self.grown:
                log.warning("the EAGLE head's KV pool (%d blocks) is full: it grows past its share of the KV "
                            "budget (sequences swapped out keep their head state)", nb)
                self.grown = True
            self.kv = torch.zeros(2, 2 * old.shape[1], *old.shape[2:], dtype=old.dtype, device=old.device)
            self.kv[:, :old.shape[1]] = old
            self.free[:0] = range(2 * nb - 1, nb - 1, -1)
        for _ in range(max(need, 0)):
            st.blocks.append(self.free.pop())

    def slots(self, st: "HasBlocks", start: int, n: int) -> torch.Tensor:
        """Slots of st's entries start .. start + n - 1: (n,) int64."""
        idx = torch.arange(start, start + n)
        table = torch.tensor(st.blocks, dtype=torch.int64)
        return (table[idx // self.block] * self.block + idx % self.block).to(self.kv.device)

    def append_slot(self, st: "HasBlocks") -> int:
        """One more entry for st (its blocks grown if need be): the slot it goes to."""
        self.reserve(st, st.length + 1)
        slot = st.blocks[st.length // self.block] * self.block + st.length % self.block
        st.length += 1
        return slot

    def write(self, st: "HasBlocks", k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (n, Hkv, d) appended to st's entries."""
        n = k.shape[0]
        self.reserve(st, st.length + n)
        s = self.slots(st, st.length, n)
        self.kv[0, s] = k.to(self.kv.dtype)
        self.kv[1, s] = v.to(self.kv.dtype)
        st.length += n

    def read(self, st: "HasBlocks") -> tuple[torch.Tensor, torch.Tensor]:
        """st's entries: k, v (length, Hkv, d) (copies)."""
        s = self.slots(st, 0, st.length)
        return self.kv[0, s], self.kv[1, s]

    def release(self, st: "HasBlocks") -> None:
        self.free.extend(st.blocks)
        st.blocks.clear()
        st.length = 0


@dataclass
class HasBlocks:
    """What HeadKV keeps per sequence (the proposer's state extends it)."""

    blocks: list[int]
    length: int = 0  # entries in use


def _int8(w: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
    layer = Int8Linear.from_float(w.detach().float(), None if bias is None else bias.detach().float())
    layer.cpu_kernel = True
    return layer


class NativeHead:
    """See the module docstring. `draft` and `feed` take the proposer's pool and states."""

    def __init__(self, head: EagleHead, readout: torch.Tensor, vocab_embeds: torch.Tensor,
                 rotary: RotaryEmbedding) -> None:
        c = head.cfg
        self.lib, self.cfg = cpu_native.lib(), c
        self.h, self.hkv, self.d, self.hd = c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size
        w = lambda name: getattr(head, name).weight  # noqa: E731
        self.layers = {  # int8 copies, kept alive here: the rows below point into their tiles
            "fc": _int8(w("fc"), head.fc.bias), "kv": _int8(torch.cat([w("k_proj"), w("v_proj")])),
            "qkv": _int8(torch.cat([w("q_proj"), w("k_proj"), w("v_proj")])), "o": _int8(w("o_proj")),
            "gate_up": _int8(torch.cat([w("gate_proj"), w("up_proj")])), "down": _int8(w("down_proj")),
            "readout": _int8(readout)}
        self.ok = all(layer.tiled() for layer in self.layers.values())
        if not self.ok:
            return
        lin = {name: TileLinear(layer) for name, layer in self.layers.items()}
        self.vnni = lin["fc"].vnni
        self.fc, self.kv_lin, self.readout = (torch.tensor(lin[n].row, dtype=torch.int64) for n in ("fc", "kv", "readout"))
        self.fc_bias = head.fc.bias.detach().float().contiguous()  # (H,)
        self.vs = lin["readout"].n
        self.lin = torch.tensor([[*lin["qkv"].row, *lin["o"].row, *lin["gate_up"].row, *lin["down"].row]],
                                dtype=torch.int64)  # (1, 32): lm_llama_layers' one layer
        self.w_in = head.input_layernorm.detach().float().contiguous()
        self.w_post = head.post_attention_layernorm.detach().float().contiguous()
        self.norms = torch.tensor([[self.w_in.data_ptr(), self.w_post.data_ptr()]], dtype=torch.int64)  # (1, 2)
        self.scales = torch.tensor([c.head_dim ** -0.5], dtype=torch.float32)  # SDPA's default scale
        self.windows = torch.zeros(1, dtype=torch.int64)
        self.vocab_embeds = vocab_embeds.float().contiguous()  # (Vs, H)
        self.cos, self.sin = rotary.cos.contiguous(), rotary.sin.contiguous()  # (P, d) each
        self.simd = cpu_native.attn_simd()
        self.inter = lin["down"].k

    @classmethod
    def build(cls, head: EagleHead, readout: torch.Tensor, vocab_embeds: torch.Tensor, rotary: RotaryEmbedding,
              dtype: torch.dtype) -> NativeHead | None:
        """The native head, or None where it does not apply (no tile kernel here, a non-float32 head)."""
        if dtype != torch.float32 or not cpu_native.available() or not cpu_native.int8_x() \
                or rotary.cos.device.type != "cpu":
            return None
        native = cls(head, readout, vocab_embeds, rotary)
        return native if native.ok else None

    def feed(self, kv: HeadKV, owners: list[HasBlocks], feats: torch.Tensor, embeds: torch.Tensor,
             pos: list[int]) -> None:
        """Entries for rows of (feature, next token's embedding) (n, H) each at positions pos, row i
        appended to owners[i]'s entries (a state's rows consecutive, in order)."""
        n = feats.shape[0]
        slots = [kv.append_slot(st) for st in owners]  # each row's slot: its owner's next entry
        feats, embeds = feats.float().contiguous(), embeds.float().contiguous()
        pos_t, slots_t = torch.tensor(pos, dtype=torch.int64), torch.tensor(slots, dtype=torch.int64)
        hd, width = self.hd, 2 * self.hkv * self.d
        xin, x, hbuf, kvb = torch.empty(n, 2 * hd), torch.empty(n, hd), torch.empty(n, hd), torch.empty(n, width)
        c, s = torch.empty(n, self.d), torch.empty(n, self.d)
        k_cache, v_cache = kv.kv[0], kv.kv[1]
        self.lib.lm_eagle_kv(n, feats.data_ptr(), embeds.data_ptr(), pos_t.data_ptr(), slots_t.data_ptr(),
                             self.fc.data_ptr(), self.fc_bias.data_ptr(), self.w_in.data_ptr(), self.kv_lin.data_ptr(),
                             self.cfg.rms_norm_eps, self.hkv, self.d, hd, self.cos.data_ptr(), self.sin.data_ptr(),
                             k_cache.data_ptr(), v_cache.data_ptr(), torch.get_num_threads(), self.vnni,
                             xin.data_ptr(), x.data_ptr(), hbuf.data_ptr(), kvb.data_ptr(), c.data_ptr(), s.data_ptr())

    def start(self, kv: HeadKV, states: list[HasBlocks], feats: torch.Tensor, pos: list[int], rounds: int
              ) -> "Drafting":
        """A drafting run of up to `rounds` drafts for these states from their newest features (B, H) at
        positions pos: blocks reserved for the drafts' entries (the caller truncates them after)."""
        for st in states:
            kv.reserve(st, st.length + rounds)
        return Drafting(self, kv, states, feats, pos)


class Drafting:
    """One propose's buffers and per-row progress (positions, entries) across `step` calls."""

    def __init__(self, native: NativeHead, kv: HeadKV, states: list[HasBlocks], feats: torch.Tensor,
                 pos: list[int]) -> None:
        self.n, self.kv = native, kv
        b, hd = len(states), native.hd
        width = max(len(st.blocks) for st in states)
        self.tables = torch.tensor([st.blocks + [0] * (width - len(st.blocks)) for st in states],
                                   dtype=torch.int64)  # (B, T)
        self.lens = torch.tensor([st.length for st in states], dtype=torch.int64)  # (B,) entries so far
        self.pos = torch.tensor(pos, dtype=torch.int64)  # (B,)
        self.slots = torch.empty(b, dtype=torch.int64)
        self.rows = torch.tensor([self.tables.data_ptr(), width, self.lens.data_ptr(), self.slots.data_ptr()],
                                 dtype=torch.int64)  # (4,)
        self.cache = torch.tensor([[kv.kv[0].data_ptr(), kv.kv[1].data_ptr(), 0, 0]], dtype=torch.int64)  # (1, 4)
        self.feats = feats.float().contiguous().clone()  # (B, H): in, then each round's predicted features
        inter = native.inter
        self.bufs = [torch.empty(b, 2 * hd), torch.empty(b, hd),  # xin, x
                     torch.empty(b, hd), torch.empty(b, hd), torch.empty(b, (native.h + 2 * native.hkv) * native.d),
                     torch.empty(b, native.h * native.d), torch.empty(b, hd), torch.empty(b, 2 * inter),
                     torch.empty(b, inter), torch.empty(b, hd),  # res, hbuf, qkv, att, tmp, gate_up, act, out
                     torch.empty(b, native.d), torch.empty(b, native.d), torch.empty(b, hd)]  # c, s, next
        self.logits = torch.empty(b, native.vs)  # (B, Vs): the last round's

    def step(self, embeds: torch.Tensor, rounds: int = 1, min_prob: float = 0.0) -> torch.Tensor:
        """`rounds` drafts, the first from the embeddings (B, H) of each row's last token, each further one
        from the previous draft's argmax -> the argmaxes' read-out indices (r, B); self.logits holds the
        last round's logits. min_prob > 0: self.probs (r, B) the argmaxes' probabilities, and r < rounds
        when after round r no row's drafts are all at least min_prob (lm_eagle_draft)."""
        n, b = self.n, self.feats.shape[0]
        embeds = embeds.float().contiguous()
        draft = torch.empty(rounds, b, dtype=torch.int64)
        self.probs = torch.ones(rounds, b)
        done = n.lib.lm_eagle_draft(rounds, b, self.feats.data_ptr(), embeds.data_ptr(), self.pos.data_ptr(),
                             self.lens.data_ptr(), self.tables.data_ptr(), self.tables.shape[1], self.slots.data_ptr(),
                             self.rows.data_ptr(), self.kv.block, n.fc.data_ptr(), n.fc_bias.data_ptr(),
                             n.lin.data_ptr(), n.norms.data_ptr(), n.scales.data_ptr(), n.windows.data_ptr(),
                             self.cache.data_ptr(), n.cfg.rms_norm_eps, n.h, n.hkv, n.d, n.hd, n.cos.data_ptr(),
                             n.sin.data_ptr(), n.readout.data_ptr(), n.vocab_embeds.data_ptr(), n.simd,
                             torch.get_num_threads(), n.vnni, min_prob, draft.data_ptr(), self.probs.data_ptr(),
                             self.logits.data_ptr(), *(t.data_ptr() for t in self.bufs))
        self.probs = self.probs[:done]
        return draft[:done]


def int8_head(head: EagleHead, lm_head: torch.Tensor) -> tuple[EagleHead, torch.nn.Module]:
    """A copy of the head whose linears, and its read-out rows (Vs, H), are int8 layers on our CPU kernels
    (weights rounded per output row, as the target's int8 layers are)."""
    import copy
    head = copy.deepcopy(head)
    for name in ("fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        lin = getattr(head, name)
        layer = Int8Linear.from_float(lin.weight.detach().float(), None if lin.bias is None else lin.bias.detach().float())
        layer.cpu_kernel = True
        setattr(head, name, layer)
    readout = Int8Linear.from_float(lm_head.float())
    readout.cpu_kernel = True
    return head, readout
