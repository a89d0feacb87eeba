"""The CPU decode plan: a Llama-family decode step (every sequence one new token, or a few: a
speculative verification) as a short run of calls into our C kernels, with the layers' pointers and
the step's buffers prepared once.

Why: at batch 1 on two cores the default model's weights stream in ~8 ms, and the Python around ~300
module calls, dispatch checks and tensor allocations per step cost as much again. The plan runs
exactly the kernels the module path runs on the CPU (layers/cpu_native.py: add + RMSNorm, the
quantized GEMV, rotary, store + paged attention, SiLU-and-mul), in the same order, so its hidden
states equal the module path's; tests/test_cpu_decode.py holds it to that. It is what CUDA graphs are
for the GPU path: the same math with the host work taken out, and the module path stays the reference.
The layer loop itself is one C call (layers/csrc/decode.c: the Llama layer and Gemma's); the Python
loop stays for tensor parallelism (an all-reduce between kernels).

It applies (`CpuDecodePlan.build` returns None otherwise) to float32 Llama / Mistral / Qwen2-shaped
models without q/k norms or biases whose four linears per layer are quantized layers our CPU kernel
takes (the default GGUF model under quantization=auto), with float32 or int8 (kv_cache_dtype int8) caches, when the fused CPU ops
are not switched off (layers/dispatch.use_fused(False) keeps the torch reference).
"""

from __future__ import annotations

from typing import Any

import torch

from lmserve.attention.backend import AttentionMetadata
from lmserve.attention.cpu_attn import ROWS_PER_SEQ
from lmserve.layers import cpu_native, dispatch
from lmserve.layers.quant import GroupQuantLinear, Int8Linear
from lmserve.utils import tensor_version


LIN_ROW = 8  # int64s in a TileLinear.row (decode.c's LIN_ROW)


class TileLinear:
    """One quantized linear as the tile kernel takes it (its repacked weight): pointers read once."""

    def __init__(self, layer: GroupQuantLinear) -> None:
        self.layer = layer
        self.tiles = t = layer.tiles()  # kept alive here
        self.n, self.k = t.n, t.k
        # (tiles, bits, n, k, scales, mins or 0 (NULL), group, half): the tile kernel's arguments, as decode.c reads
        # a linear (half: scales and mins float16)
        self.row = [t.q.data_ptr(), t.bits, t.n, t.k, t.scales.data_ptr(), 0 if t.mins is None else t.mins.data_ptr(),
                    t.group, int(t.half)]
        assert len(self.row) == LIN_ROW
        self.vnni = int(cpu_native.tile_vnni())  # the kernel's variant (layer.tiled() said this one takes it)

    def __call__(self, lib: Any, x: torch.Tensor, y: torch.Tensor, threads: int) -> None:
        """y (B, N) = x (B, K) @ W.T, both float32 contiguous."""
        q, bits, n, k, sc, mn, group, half = self.row
        lib.lm_qgemm_tiles(x.data_ptr(), x.shape[0], k, q, bits, n, sc, mn, half, group, y.data_ptr(), threads,
                           self.vnni)


def weights_key(items: Any) -> tuple[tuple[int, int], ...]:
    """(address, in-place version) of each tensor, or of each quantized layer's qweight (a reload
    writes it, with its scales)."""
    return tuple((t.data_ptr(), tensor_version(t)) for t in
                 (item if isinstance(item, torch.Tensor) else item.layer.qweight for item in items))


class CpuDecodePlan:
    """See the module docstring. `run` takes the model's forward arguments for a step `applies` accepts."""

    def __init__(self, model: Any) -> None:
        cfg = model.cfg
        self.model, self.lib = model, cpu_native.lib()
        attn = model.layers[0].self_attn  # its head counts: a tensor-parallel shard's own
        self.h, self.hkv, self.d = attn.h, attn.hkv, cfg.head_dim
        self.reduce = attn.o_proj.reduce  # tensor parallel: the all-reduce after o and down (else None)
        self.hidden, self.eps = cfg.hidden_size, float(cfg.rms_norm_eps)
        self.layers = [self.read_layer(layer) for layer in model.layers]
        self.rotary = model.layers[0].self_attn.rotary
        self.simd = cpu_native.attn_simd()
        self.ptrs = self._weights_key()  # the weights the plan read, as they were
        # the linears decode.c's loops add LoRA deltas to, in its order (lora_args looks adapters up by them)
        self.lora_names = tuple(f"layers.{i}.{leaf}" for i in range(len(self.layers)) for leaf in
                                ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"))
        self.native = self.layer_arrays()  # the layer loop in C (decode.c), where this layer shape has one
        # what `applies` re-reads each step: each norm weight, and each linear's buffers (its qweight is
        # looked up again there: a reload may rebind it; a dict lookup, not nn.Module's __getattr__)
        self._watch = [(t, None) if isinstance(t, torch.Tensor) else (t.layer.qweight, t.layer._buffers)
                       for entry in self.layers for t in entry if isinstance(t, (torch.Tensor, TileLinear))]

    def layer_arrays(self) -> tuple[torch.Tensor, ...] | None:
        """The per-layer pointers decode.c's lm_llama_layers takes (linears [L, 4, 8], norms [L, 2],
        scales [L], windows [L]), or None where the loop stays in Python: tensor parallel (an all-reduce
        between kernels)."""
        if self.reduce is not None:
            return None
        lin = torch.tensor([[*qkv.row, *o.row, *gu.row, *down.row] for _, qkv, o, _, gu, down, _, _ in self.layers],
                           dtype=torch.int64)  # (L, 32)
        norms = torch.tensor([[w_in.data_ptr(), w_post.data_ptr()] for w_in, _, _, w_post, *_ in self.layers],
                             dtype=torch.int64)  # (L, 2)
        scales = torch.tensor([entry[6] for entry in self.layers], dtype=torch.float32)  # (L,)
        windows = torch.tensor([entry[7] for entry in self.layers], dtype=torch.int64)  # (L,)
        return lin, norms, scales, windows

    @staticmethod
    def read_layer(layer: Any) -> tuple[Any, ...]:
        """What `run` needs of one decoder layer: its norm weights, linears, attention scale and window."""
        a, m = layer.self_attn, layer.mlp
        return (layer.input_layernorm.weight, TileLinear(a.qkv_proj), TileLinear(a.o_proj),
                layer.post_attention_layernorm.weight, TileLinear(m.gate_up_proj), TileLinear(m.down_proj),
                a.scale, a.window or 0)

    def _weights_key(self) -> tuple[tuple[int, int], ...]:
        """Where the weights are and their in-place version counts (a change means the plan is stale:
        it multiplies the tiles it took when built)."""
        return weights_key(t for entry in self.layers for t in entry if isinstance(t, (torch.Tensor, TileLinear)))

    @staticmethod
    def shape_fits(cfg: Any, mlp: Any) -> bool:
        """The model's layer shape is the one `run` computes: no q/k norms or biases, a SiLU MLP (not a
        mixture of experts, not GeGLU)."""
        return not cfg.qk_norm and not cfg.qkv_bias and hasattr(mlp, "gate_up_proj") and mlp.silu

    @classmethod
    def build(cls, model: Any) -> CpuDecodePlan | None:
        """The plan for `model`, or None where it does not apply (then the module path runs)."""
        cfg = getattr(model, "cfg", None)
        if cfg is None or not cpu_native.available() or not cpu_native.int8_x() \
                or model.norm.weight.dtype != torch.float32 or model.norm.weight.device.type != "cpu":
            return None
        for layer in model.layers:
            a, m = layer.self_attn, layer.mlp
            if not cls.shape_fits(cfg, m):
                return None
            for lin in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj):
                if not isinstance(lin, GroupQuantLinear) or not lin.cpu_kernel or lin.bias is not None \
                        or (isinstance(lin, Int8Linear) and lin.outlier_cols is not None) \
                        or not lin.tiled():
                    return None
        return cls(model)

    def applies(self, x: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> bool:
        """This step can run here: at most ROWS_PER_SEQ new tokens a sequence (decode, verification; any
        number of sequences), float32 or int8 caches, fused ops not off."""
        lora = getattr(self.model, "lora", None)  # LoRA rows: the C loop takes them, the Python loop not
        return (dispatch.cpu_fast_allowed() and not meta.static_decode and meta.max_query_len <= ROWS_PER_SEQ
                and all(cpu_native.kv_reads(c) and cpu_native.kv_pointers(c)[0] in (0, 2) for c in kv_caches[:1])
                and (self.native is not None or lora is None or not lora.active) and self._weights_unchanged())

    def lora_args(self) -> tuple[Any, ...]:
        """decode.c's LoRA arguments for this step: (deltas [G, L, 4, 5] (adapter.table), G, row groups (B,)) as
        pointers, and the tensors that hold them (to keep alive for the call); (None, 0, None) without
        adapter rows."""
        ctx = getattr(self.model, "lora", None)
        if ctx is None or not ctx.active:
            return (None, 0, None), ()
        table = torch.stack([adapter.table(self.lora_names) for adapter, _ in ctx.groups])  # (G, 4L, 5)
        return (table.data_ptr(), len(ctx.groups), ctx.row_group.data_ptr()), (table, ctx.row_group)

    def _weights_unchanged(self) -> bool:
        """The weights are those the plan read: each the same tensor (a linear's qweight looked up again)
        at the same in-place version. (`_weights_key` compared again, without building it: it took ~0.3 ms
        a step, mostly in nn.Module attribute lookups.)"""
        for (t, buffers), (ptr, version) in zip(self._watch, self.ptrs):
            now = t if buffers is None else buffers["qweight"]
            if now.data_ptr() != ptr or tensor_version(now) != version:
                return False
        return True

    @torch.inference_mode()
    def run(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
            meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the embedded tokens (B, hidden) float32 -> (hidden states before the final norm, residual)."""
        lib, threads = self.lib, torch.get_num_threads()
        b, hd, h, hkv, d = x.shape[0], self.hidden, self.h, self.hkv, self.d
        width = (h + 2 * hkv) * d
        x = x.contiguous()
        res = torch.empty(b, hd)  # (B, hidden): the residual stream
        hbuf = torch.empty(b, hd)  # (B, hidden): normed input of each block
        qkv = torch.empty(b, width)  # (B, (H + 2 Hkv) d)
        att = torch.empty(b, h * d)  # (B, H d)
        tmp = torch.empty(b, hd)  # (B, hidden)
        cos, sin = meta.memo(("rope2d", id(self.rotary)), lambda: tuple(
            t.squeeze(1) for t in self.rotary.lookup(positions)))  # (B, d) each
        cos, sin = cos.contiguous(), sin.contiguous()
        if self.native is not None:
            return self._run_native(x, cos, sin, kv_caches, meta)
        first = True
        for i, ((w_in, qkv_mm, o_mm, w_post, gu_mm, down_mm, scale, window), cache) in enumerate(
                zip(self.layers, kv_caches)):
            tables, lens, slots = _rows(meta.for_layer(i))
            if first:  # residual = x; h = norm(x)
                lib.lm_add_rmsnorm(x.data_ptr(), hd, None, 0, w_in.data_ptr(), self.eps, b, hd, hbuf.data_ptr(),
                                   None, threads)
                res.copy_(x)
                first = False
            else:  # residual += x; h = norm(residual)
                lib.lm_add_rmsnorm(x.data_ptr(), x.shape[1], res.data_ptr(), hd, w_in.data_ptr(), self.eps, b, hd,
                                   hbuf.data_ptr(), res.data_ptr(), threads)
            qkv_mm(lib, hbuf, qkv, threads)
            lib.lm_rotary(qkv.data_ptr(), b, h + hkv, d, width, d, cos.data_ptr(), sin.data_ptr())  # q and k heads
            kind, k_cache, v_cache, k_scale, v_scale = cpu_native.kv_pointers(cache)
            new_k = qkv.data_ptr() + h * d * 4
            lib.lm_paged_decode_attn(qkv.data_ptr(), k_cache, v_cache, kind, k_scale, v_scale, tables.data_ptr(),
                                     tables.shape[1], lens.data_ptr(), b, h, hkv, d, meta.block_size, scale, window,
                                     att.data_ptr(), self.simd, threads, new_k, new_k + hkv * d * 4, slots.data_ptr(),
                                     width, width)
            o_mm(lib, att, tmp, threads)
            if self.reduce is not None:
                self.reduce.all_reduce(tmp)
            lib.lm_add_rmsnorm(tmp.data_ptr(), hd, res.data_ptr(), hd, w_post.data_ptr(), self.eps, b, hd,
                               hbuf.data_ptr(), res.data_ptr(), threads)
            gate_up = torch.empty(b, gu_mm.n)  # (B, 2I)
            gu_mm(lib, hbuf, gate_up, threads)
            act = torch.empty(b, gu_mm.n // 2)  # (B, I)
            lib.lm_silu_and_mul(gate_up.data_ptr(), b, gu_mm.n // 2, act.data_ptr(), threads)
            x = torch.empty(b, hd)  # (B, hidden)
            down_mm(lib, act, x, threads)
            if self.reduce is not None:
                self.reduce.all_reduce(x)
        return x, res

    def _step_arrays(self, kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, int]:
        """This step's per-layer pointers for decode.c: rows (L, 4) (block tables, their width, lens,
        slots; kept alive by the step's memo), caches (L, 4) (K, V and an int8 cache's scales) and the
        caches' element type."""
        n_layers = len(self.layers)
        rows = []
        for i in range(n_layers):
            tables, lens, slots = _rows(meta.for_layer(i))
            rows.append((tables.data_ptr(), tables.shape[1], lens.data_ptr(), slots.data_ptr()))
        ptrs = [cpu_native.kv_pointers(c) for c in kv_caches[:n_layers]]  # (kind, K, V, K scales, V scales) each
        caches = torch.tensor([(k, v, ks or 0, vs or 0) for _, k, v, ks, vs in ptrs], dtype=torch.int64)  # (L, 4)
        return torch.tensor(rows, dtype=torch.int64), caches, ptrs[0][0]

    def _buffers(self, b: int, extra: int = 0) -> list[torch.Tensor]:
        """A step's buffers for decode.c: res, hbuf, tmp, out (and `extra` more) (B, hidden); qkv
        (B, (H + 2 Hkv) d); att (B, H d); gate_up (B, 2I); act (B, I)."""
        lin = self.native[0]  # type: ignore[index]
        inter = int(lin[0, 2 * LIN_ROW + 2]) // 2  # gate_up's n / 2 (the third linear's n)
        hidden = [torch.empty(b, self.hidden) for _ in range(4 + extra)]
        return [*hidden, torch.empty(b, (self.h + 2 * self.hkv) * self.d), torch.empty(b, self.h * self.d),
                torch.empty(b, 2 * inter), torch.empty(b, inter)]

    def _run_native(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: list[torch.Tensor],
                    meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """`run`'s layer loop as one call into decode.c (the same kernels, arguments and order)."""
        lin, norms, scales, windows = self.native  # type: ignore[misc]
        rows, caches, kind = self._step_arrays(kv_caches, meta)
        res, hbuf, tmp, out, qkv, att, gate_up, act = self._buffers(x.shape[0])
        lora, _alive = self.lora_args()
        self.lib.lm_llama_layers(len(self.layers), lin.data_ptr(), norms.data_ptr(), scales.data_ptr(),
                                 windows.data_ptr(), caches.data_ptr(), rows.data_ptr(), x.data_ptr(), x.shape[0],
                                 self.hidden, self.eps, self.h, self.hkv, self.d, meta.block_size, cos.data_ptr(),
                                 sin.data_ptr(), self.simd, torch.get_num_threads(), self.layers[0][1].vnni, kind,
                                 res.data_ptr(), hbuf.data_ptr(), qkv.data_ptr(), att.data_ptr(), tmp.data_ptr(),
                                 gate_up.data_ptr(), act.data_ptr(), out.data_ptr(), *lora)
        return out, res


def _rows(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's attention rows, once per KV group and step: each new token's block table (B, T), its
    number of keys (B,) and its cache slot (B,), as contiguous int64."""
    def build() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tables, lens = (t.long().contiguous() for t in meta.token_rows())
        return tables, lens, meta.slot_mapping.long().contiguous()
    return meta.memo("plan_rows", build)


class GemmaDecodePlan(CpuDecodePlan):
    """The plan for Gemma 3 (models/gemma3.py): q / k normed per head, sandwich norms, GeGLU, and a
    window and a rotary table per layer; the same kernels as its module path, in its order."""

    def layer_arrays(self) -> tuple[torch.Tensor, ...] | None:
        """decode.c's lm_gemma_layers' per-layer pointers: linears [L, 4, 8], norms [L, 6] (input, q, k,
        post-attention, pre- and post-feedforward), scales [L], windows [L]; None under tensor
        parallelism."""
        if self.reduce is not None:
            return None
        lin = torch.tensor([[*e[1].row, *e[6].row, *e[8].row, *e[9].row] for e in self.layers], dtype=torch.int64)
        norms = torch.tensor([[e[j].data_ptr() for j in (0, 3, 4, 2, 7, 10)] for e in self.layers], dtype=torch.int64)
        scales = torch.tensor([e[11] for e in self.layers], dtype=torch.float32)  # (L,)
        windows = torch.tensor([e[12] for e in self.layers], dtype=torch.int64)  # (L,)
        return lin, norms, scales, windows

    @staticmethod
    def read_layer(layer: Any) -> tuple[Any, ...]:
        a, m = layer.self_attn, layer.mlp
        return (layer.input_layernorm.weight, TileLinear(a.qkv_proj), layer.post_attention_layernorm.weight,
                a.q_norm.weight, a.k_norm.weight, a.rotary, TileLinear(a.o_proj), layer.pre_feedforward_layernorm.weight,
                TileLinear(m.gate_up_proj), TileLinear(m.down_proj), layer.post_feedforward_layernorm.weight,
                a.scale, a.window or 0)

    @staticmethod
    def shape_fits(cfg: Any, mlp: Any) -> bool:
        """Gemma's layer shape: a GeGLU MLP (q / k norms and sandwich norms are the model's own)."""
        return hasattr(mlp, "gate_up_proj") and mlp.gelu_tanh

    @torch.inference_mode()
    def run(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
            meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the scaled embeddings (B, hidden) float32 -> (the last block's output, the residual stream)."""
        lib, threads, eps = self.lib, torch.get_num_threads(), self.eps
        b, hd, h, hkv, d = x.shape[0], self.hidden, self.h, self.hkv, self.d
        width = (h + 2 * hkv) * d
        x = x.contiguous()
        if self.native is not None:
            return self._run_gemma_native(x, positions, kv_caches, meta)
        res = torch.empty(b, hd)  # (B, hidden): the residual stream
        hbuf, tmp, normed = torch.empty(b, hd), torch.empty(b, hd), torch.empty(b, hd)  # (B, hidden) each
        qkv = torch.empty(b, width)  # (B, (H + 2 Hkv) d): q and k normed and rotated in place
        att = torch.empty(b, h * d)  # (B, H d)
        for i, ((w_in, qkv_mm, w_post_attn, w_q, w_k, rotary, o_mm, w_pre_ff, gu_mm, down_mm, w_post_ff, scale,
                 window), cache) in enumerate(zip(self.layers, kv_caches)):
            tables, lens, slots = _rows(meta.for_layer(i))
            if i == 0:  # residual = x; h = norm(x)
                lib.lm_add_rmsnorm(x.data_ptr(), hd, None, 0, w_in.data_ptr(), eps, b, hd, hbuf.data_ptr(), None, threads)
                res.copy_(x)
            else:  # residual += x; h = norm(residual)
                lib.lm_add_rmsnorm(x.data_ptr(), hd, res.data_ptr(), hd, w_in.data_ptr(), eps, b, hd, hbuf.data_ptr(),
                                   res.data_ptr(), threads)
            qkv_mm(lib, hbuf, qkv, threads)
            for t in range(b):  # q and k heads normed in place, a row of d per head
                row = qkv.data_ptr() + t * width * 4
                lib.lm_add_rmsnorm(row, d, None, 0, w_q.data_ptr(), eps, h, d, row, None, threads)
                lib.lm_add_rmsnorm(row + h * d * 4, d, None, 0, w_k.data_ptr(), eps, hkv, d, row + h * d * 4, None,
                                   threads)
            cos, sin = meta.memo(("rope2d", id(rotary)), lambda r=rotary: tuple(
                t.squeeze(1).contiguous() for t in r.lookup(positions)))  # (B, d) each
            lib.lm_rotary(qkv.data_ptr(), b, h + hkv, d, width, d, cos.data_ptr(), sin.data_ptr())
            kind, k_cache, v_cache, k_scale, v_scale = cpu_native.kv_pointers(cache)
            new_k = qkv.data_ptr() + h * d * 4
            lib.lm_paged_decode_attn(qkv.data_ptr(), k_cache, v_cache, kind, k_scale, v_scale, tables.data_ptr(),
                                     tables.shape[1], lens.data_ptr(), b, h, hkv, d, meta.block_size, scale, window,
                                     att.data_ptr(), self.simd, threads, new_k, new_k + hkv * d * 4, slots.data_ptr(),
                                     width, width)
            o_mm(lib, att, tmp, threads)
            if self.reduce is not None:
                self.reduce.all_reduce(tmp)
            lib.lm_add_rmsnorm(tmp.data_ptr(), hd, None, 0, w_post_attn.data_ptr(), eps, b, hd, normed.data_ptr(), None,
                               threads)  # the attention block's output norm
            lib.lm_add_rmsnorm(normed.data_ptr(), hd, res.data_ptr(), hd, w_pre_ff.data_ptr(), eps, b, hd,
                               hbuf.data_ptr(), res.data_ptr(), threads)
            gate_up = torch.empty(b, gu_mm.n)  # (B, 2I)
            gu_mm(lib, hbuf, gate_up, threads)
            act = torch.empty(b, gu_mm.n // 2)  # (B, I)
            lib.lm_gelu_tanh_and_mul(gate_up.data_ptr(), b, gu_mm.n // 2, act.data_ptr(), threads)
            down_mm(lib, act, tmp, threads)
            if self.reduce is not None:
                self.reduce.all_reduce(tmp)
            x = torch.empty(b, hd)  # (B, hidden): the MLP block's output, normed
            lib.lm_add_rmsnorm(tmp.data_ptr(), hd, None, 0, w_post_ff.data_ptr(), eps, b, hd, x.data_ptr(), None, threads)
        return x, res

    def _run_gemma_native(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                          meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """`run`'s layer loop as one call into decode.c (the same kernels, arguments and order)."""
        lin, norms, scales, windows = self.native  # type: ignore[misc]
        rows, caches, kind = self._step_arrays(kv_caches, meta)
        rope = []
        for entry in self.layers:
            rotary = entry[5]
            cos, sin = meta.memo(("rope2d", id(rotary)), lambda r=rotary: tuple(
                t.squeeze(1).contiguous() for t in r.lookup(positions)))  # (B, d) each, kept alive by the memo
            rope.append((cos.data_ptr(), sin.data_ptr()))
        rope_t = torch.tensor(rope, dtype=torch.int64)  # (L, 2)
        res, hbuf, tmp, out, normed, qkv, att, gate_up, act = self._buffers(x.shape[0], extra=1)
        lora, _alive = self.lora_args()
        self.lib.lm_gemma_layers(len(self.layers), lin.data_ptr(), norms.data_ptr(), scales.data_ptr(),
                                 windows.data_ptr(), caches.data_ptr(), rows.data_ptr(), rope_t.data_ptr(), x.data_ptr(),
                                 x.shape[0], self.hidden, self.eps, self.h, self.hkv, self.d, meta.block_size, self.simd,
                                 torch.get_num_threads(), self.layers[0][1].vnni, kind, res.data_ptr(), hbuf.data_ptr(),
                                 qkv.data_ptr(), att.data_ptr(), tmp.data_ptr(), normed.data_ptr(), gate_up.data_ptr(),
                                 act.data_ptr(), out.data_ptr(), *lora)
        return out, res
