"""Weight-only quantized linear layers behind the one Linear interface (issue #14), and their packing.

Each class derives from LinearBase: the same forward (x (N, in) -> (N, out)) and `load(tensor, shard,
kind)` as Linear / MergedLinear, so models take them unchanged: models/registry.py swaps them in, after
loading (float weights quantized) or before it (each checkpoint tensor quantized as it streams in).

    scheme  class        stored                                                 dequantized
    int8    Int8Linear   int8, a scale per output row (or per group)            w = q * scale
    int4    Int4Linear   4 bits two a byte (low nibble = even column), a scale  w = q * scale + min
                         and a min per group of 32 / 64 / 128
    fp8     Fp8Linear    float8 e4m3 bits as uint8, a scale per output row      w = q * scale
    gguf    Int4Linear / Int8Linear holding the file's blocks (`gguf_blocks`; models/loader.py)

`load` takes a float tensor (round to nearest here) or an already-quantized weight: a QuantizedWeight,
or a q / scales / zeros / group record (canonical int4, w = (q - zeros) * scales, kept as min = -zeros
* scales) such as the AWQ checkpoint's Int4Weight. Int8Linear can keep chosen input columns in float
(LLM.int8()-style outliers: columns whose calibration activations pass a threshold, `input_absmax`).

Forward, the fp32 reference: dequantize a tile of rows at a time on the CPU (the tile stays in cache),
then matmul. On CUDA the Triton kernels of layers/triton_quant.py dequantize inside the matmul. With
cpu_kernel (load_model sets it) int8 / int4 multiply with our CPU kernels (layers/cpu_native.py: the
packed bytes read once per call): with AVX2 any number of rows, the weight repacked into tiles
(`tiles()`), x quantized per 32 columns as llama.cpp does; where the tiles do not apply up to MAX_ROWS
rows with float x, more (prefill) on the reference path. fp8 uses
torch._scaled_mm on GPUs with fp8 tensor cores.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from lmserve.layers import cpu_native
from lmserve.layers.linear import LinearBase, check_shape
from lmserve.utils import tensor_version

SCHEMES = ("int8", "int4", "fp8")
TILE_ELEMS = 1 << 18  # CPU forward: weights dequantized per tile of about this many values (1 MiB of fp32)
FP8_MAX = 448.0  # largest float8 e4m3 value


class QuantizedWeight(NamedTuple):
    """A weight [out, in] already quantized: w = q * scales + mins per group of `group` input columns.

    q: uint8 in 0..15 (4-bit) or int8 [out, in]; scales, mins: float [out, in // group]; mins None
    for symmetric formats."""

    q: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    group: int


# ---------------------------------------------------------------- quantizers and packing

def quantize_int8(w: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round to nearest: w [out, in] -> (q int8 [out, in] in -127..127, scales float32 [out]
    per output row, or [out, in // group_size] per group), w ~ q * scale."""
    out_f, in_f = w.shape
    g = group_size or in_f
    wg = w.detach().float().reshape(out_f, in_f // g, g)  # (out, G, g)
    scales = wg.abs().amax(-1).clamp(min=1e-12) / 127  # (out, G)
    q = torch.round(wg / scales[..., None]).clamp(-127, 127).to(torch.int8).reshape(out_f, in_f)
    return q, (scales[:, 0] if group_size is None else scales)


def _affine_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q uint8 [out, in] in 0..15, scales, mins [out, in // group]): w ~ q * scale + min,
    each group's min and max mapped onto 0 and 15 (llama.cpp's Q4_1 rule)."""
    out_f, in_f = w.shape
    if group_size <= 0 or in_f % group_size:
        raise ValueError(f"group_size {group_size} must divide in_features {in_f}")
    wg = w.detach().float().reshape(out_f, in_f // group_size, group_size)  # (out, G, g)
    lo, hi = wg.amin(-1), wg.amax(-1)  # (out, G)
    scales = ((hi - lo) / 15).clamp(min=1e-8)  # (out, G)
    q = torch.round((wg - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(out_f, in_f), scales, lo


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise asymmetric round to nearest from each group's min / max: w [out, in] -> (q uint8
    [out, in] in 0..15, scales float32 [out, in // g], zeros float32 [out, in // g]), w ~ (q - zeros) * scales."""
    q, scales, mins = _affine_int4(w, group_size)
    return q, scales, -mins / scales


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q float8_e4m3fn [out, in], scales float32 [out]), w ~ q * scale, each row's
    largest magnitude mapped onto e4m3's 448."""
    scales = w.detach().float().abs().amax(1).clamp(min=1e-12) / FP8_MAX  # (out,)
    q = (w.detach().float() / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scales


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, in] in 0..15 -> uint8 [rows, in // 2]: column 2j in the low nibble, 2j + 1 in the high."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """pack_int4 undone: uint8 [rows, in // 2] -> uint8 [rows, in]."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


# GGUF block types kept as they are with quantization="gguf": type -> (bits of the layer, group size)
GGUF_NATIVE = {"Q4_0": (4, 32), "Q4_1": (4, 32), "Q4_K": (4, 32), "Q8_0": (8, 32), "Q6_K": (8, 16), "Q5_0": (8, 32)}


def gguf_blocks(data: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    """Raw blocks of a GGUF_NATIVE type, uint8 [rows, bytes] -> (q [rows, in], scales, mins [rows,
    in // group], group) with w = q * scale + min, the same float ops gguf.quants.dequantize does: the
    integers come out of the bytes as they are. Blocks (ggml-common.h): Q8_0: f16 d, 32 int8 (q d);
    Q4_0: f16 d, 16 bytes (q d - 8 d); Q4_1: f16 d, f16 m, 16 bytes (q d + m), byte j holding value j
    in its low nibble and j + 16 in its high; Q5_0: f16 d, 4 bytes of fifth bits (bit j: value j), 16
    bytes of nibbles as Q4_0's ((q - 16) d, kept as int8 in -16..15); Q4_K (256 values): f16 d, f16 dmin, 12 bytes of 6-bit
    scales and mins, 128 bytes of nibbles (q (d sc) - dmin m per 32); Q6_K (256 values): 128 bytes of
    low 4 bits, 64 of high 2 bits, an int8 scale per 16, f16 d ((q - 32) (d sc))."""
    from gguf import quants
    rows = data.shape[0]

    def f16(b: np.ndarray) -> np.ndarray:  # (rows, nb, 2) bytes -> (rows, nb) float32
        return b.copy().view(np.float16).astype(np.float32)[..., 0]

    def nibbles(b: np.ndarray) -> np.ndarray:  # (..., k) bytes -> (..., 2, k): the low nibbles, then the high
        return np.stack([b & 15, b >> 4], axis=-2)

    if kind == "Q8_0":
        b = data.reshape(rows, -1, 34)
        return b[..., 2:].view(np.int8).reshape(rows, -1), f16(b[..., :2]), None, 32
    if kind == "Q5_0":
        b = data.reshape(rows, -1, 22)
        high = (b[..., 2:6].copy().view("<u4") >> np.arange(32, dtype=np.uint32)) & 1  # (rows, nb, 32): bit 4 of value j
        q = (nibbles(b[..., 6:]).reshape(rows, -1, 32) | (high.astype(np.uint8) << 4)).astype(np.int8) - np.int8(16)
        return q.reshape(rows, -1), f16(b[..., :2]), None, 32
    if kind in ("Q4_0", "Q4_1"):
        head = 2 if kind == "Q4_0" else 4
        b = data.reshape(rows, -1, head + 16)
        d = f16(b[..., :2])  # (rows, nb)
        return nibbles(b[..., head:]).reshape(rows, -1), d, -8 * d if kind == "Q4_0" else f16(b[..., 2:4]), 32
    if kind == "Q4_K":
        b = data.reshape(rows, -1, 144)
        sc, m = (a.reshape(rows, -1, 8).astype(np.float32) for a in quants.Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12)))
        scales = f16(b[..., 0:2])[..., None] * sc  # (rows, nb, 8)
        mins = -(f16(b[..., 2:4])[..., None] * m)  # (rows, nb, 8)
        q = nibbles(b[..., 16:].reshape(rows, -1, 4, 32))  # (rows, nb, 4, 2, 32): sub-blocks 2c, 2c + 1
        return q.reshape(rows, -1), scales.reshape(rows, -1), mins.reshape(rows, -1), 32
    if kind == "Q6_K":
        b = data.reshape(rows, -1, 210)
        low = nibbles(b[..., :128].reshape(rows, -1, 2, 64)).reshape(rows, -1, 8, 32)  # (rows, nb, 8, 32)
        high = (b[..., 128:192].reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
        q = (low | (high.reshape(rows, -1, 8, 32) << 4)).astype(np.int8) - np.int8(32)  # (rows, nb, 8, 32)
        scales = f16(b[..., 208:210])[..., None] * b[..., 192:208].view(np.int8).astype(np.float32)  # (rows, nb, 16)
        return q.reshape(rows, -1), scales.reshape(rows, -1), None, 16
    raise ValueError(f"GGUF type {kind} is not kept as blocks ({', '.join(GGUF_NATIVE)} are)")


# ---------------------------------------------------------------- the layers

class GroupQuantLinear(LinearBase):
    """Integer weights with a float scale, and optionally a float min, per group of `group_size` input
    columns: w = q * scale (+ min). Subclasses fix the bit width and the integer storage.

    cpu_kernel (off by default; load_model turns it on): on the CPU, x multiplies with our kernels
    (layers/cpu_native.py: any rows through the tile kernel where it applies, else up to MAX_ROWS
    with float x); off, or more rows without the tiles, the fp32 reference (dequantize + matmul)."""

    bits = 8
    qdtype = torch.int8

    def __init__(self, in_features: int, sizes: int | Sequence[int], bias: bool = False, group_size: int | None = None,
                 zero_point: bool = False) -> None:
        super().__init__(in_features, sizes, bias)
        self.group_size = group_size or in_features
        if in_features % self.group_size or in_features * self.bits % 8:
            raise ValueError(f"group_size {self.group_size} must divide in_features {in_features}")
        groups = in_features // self.group_size
        self.register_buffer("qweight", torch.zeros(self.out_features, in_features * self.bits // 8, dtype=self.qdtype))
        self.register_buffer("scales", torch.ones(self.out_features, groups))
        self.register_buffer("mins", torch.zeros(self.out_features, groups) if zero_point else None)
        self.cpu_kernel = False

    def pack(self, q: torch.Tensor) -> torch.Tensor:  # integer values [rows, in] -> the stored form
        return q.to(self.qdtype)

    def values(self, idx: slice | torch.Tensor) -> torch.Tensor:
        """The integer values of rows `idx`: [rows, in]."""
        return self.qweight[idx]

    def quantize(self, w: torch.Tensor) -> QuantizedWeight:
        """Float rows [rows, in] -> this layer's format (round to nearest)."""
        raise NotImplementedError

    def load_weight(self, tensor: Any, shard: int | None) -> None:
        rows = self.rows(shard)
        shape = (rows.stop - rows.start, self.in_features)
        if isinstance(tensor, torch.Tensor):
            check_shape(tensor, shape, "weight", shard)
            qw = self.quantize(tensor)
        else:
            qw = self._prequantized(tensor, shape, shard)
        self.qweight[rows] = self.pack(qw.q)
        self.scales[rows] = qw.scales.to(self.scales.dtype)
        if self.mins is not None:
            self.mins[rows] = qw.mins.to(self.mins.dtype) if qw.mins is not None else 0
        elif qw.mins is not None:
            raise ValueError(f"{type(self).__name__} is symmetric (no mins): it cannot hold this weight")

    def _prequantized(self, t: Any, shape: tuple[int, int], shard: int | None) -> QuantizedWeight:
        """An already-quantized weight (QuantizedWeight, or q / scales / zeros / group) in this layer's groups."""
        check_shape(t.q, shape, "weight", shard)
        mins = getattr(t, "mins", None)
        if hasattr(t, "zeros"):  # canonical zero points: w = (q - zeros) * scales
            mins = -t.zeros.float() * t.scales.float()
        lo, hi = (0, 15) if self.bits == 4 else (-128, 127)
        if t.q.numel() and not lo <= int(t.q.min()) <= int(t.q.max()) <= hi:
            raise ValueError(f"{type(self).__name__} holds integers in {lo}..{hi}")
        if t.group % self.group_size:
            raise ValueError(f"weight groups of {t.group} do not split into the layer's groups of {self.group_size}")
        k = t.group // self.group_size  # the layer's groups are finer: repeat each scale k times (exact)
        scales = t.scales.float().repeat_interleave(k, dim=1)  # (rows, in // group_size)
        return QuantizedWeight(t.q, scales, None if mins is None else mins.float().repeat_interleave(k, dim=1),
                               self.group_size)

    def dequantize(self, rows: slice | torch.Tensor | None = None) -> torch.Tensor:
        """The float weight [rows, in] this layer multiplies by (rows: a slice or row indices; None: all)."""
        idx = slice(None) if rows is None else rows
        q = self.values(idx)  # (r, in)
        r = q.shape[0]
        w = q.reshape(r, -1, self.group_size).to(self.scales.dtype) * self.scales[idx][..., None]  # (r, G, g)
        if self.mins is not None:
            w = w + self.mins[idx][..., None]
        return w.reshape(r, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, in) -> (N, out)
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # (N, in) -> (N, out), no bias
        if x.is_cuda:
            return gpu_matmul(x, self)
        if self.cpu_kernel and self.native_fits() and (x.shape[0] <= cpu_native.MAX_ROWS or self.tiled()):
            return self.native_matmul(x)
        return dequant_matmul(x, self)

    def native_fits(self) -> bool:
        """Our CPU kernel is built, has a SIMD path on this CPU, and takes this layer's shape."""
        return cpu_native.fast() and cpu_native.fits(self.bits, self.in_features, self.group_size)

    def tiled(self) -> bool:
        """The tile kernel takes this layer here (any number of rows: prefill too)."""
        return cpu_native.int8_x() and cpu_native.tiles_fit(self.bits, self.in_features, self.group_size) \
            and (cpu_native.tile_vnni() or self.tiles().avx2_ok)

    def tiles(self) -> cpu_native.Tiles:
        """The weight repacked for the tile kernel: built on first use, again whenever qweight,
        scales or mins changed (a derived copy: the buffers stay the layer's state)."""
        key = tuple((t.data_ptr(), tensor_version(t)) for t in (self.qweight, self.scales, self.mins) if t is not None)
        if getattr(self, "_tiles_key", None) != key:
            self._tiles = cpu_native.pack_tiles(self.values(slice(None)), self.bits, self.scales, self.mins,
                                                self.group_size)
            self._tiles_key = key
        return self._tiles

    def native_matmul(self, x: torch.Tensor) -> torch.Tensor:  # (N, in) -> (N, out) with our CPU kernel
        if self.tiled():
            return cpu_native.qgemm_tiles(x, self.tiles()).to(x.dtype)
        return cpu_native.qgemm(x, self.qweight, self.bits, self.scales, self.mins, self.group_size).to(x.dtype)


def gpu_matmul(x: torch.Tensor, layer: Any) -> torch.Tensor:
    """On a GPU: the Triton kernels that dequantize inside the matmul (layers/triton_quant.py, outlier
    columns included), or dequantize + matmul without Triton."""
    from lmserve.layers import triton_quant  # imported on first GPU use only
    return triton_quant.quant_matmul(x, layer) if triton_quant.available() else dequant_matmul(x, layer)


def dequant_matmul(x: torch.Tensor, layer: Any) -> torch.Tensor:
    """x (N, in) @ layer.dequantize().T -> (N, out). On the CPU a tile of rows at a time (the tile stays
    in cache, only the quantized bytes come from memory); elsewhere the whole weight at once."""
    if x.device.type != "cpu":
        return F.linear(x, layer.dequantize().to(x.dtype))
    step = max(1, TILE_ELEMS // layer.in_features)
    if step >= layer.out_features:
        return F.linear(x, layer.dequantize().to(x.dtype))
    y = x.new_empty(x.shape[0], layer.out_features)  # (N, out)
    for lo in range(0, layer.out_features, step):
        rows = slice(lo, min(lo + step, layer.out_features))
        y[:, rows] = F.linear(x, layer.dequantize(rows).to(x.dtype))  # (N, step)
    return y


class Int8Linear(GroupQuantLinear):
    """int8 weights, symmetric: a scale per output row (group_size None) or per group of input columns
    (zero_point: a float min per group as well, for integer formats that carry one). outlier_cols:
    input columns kept in float (LLM.int8()-style), excluded from the int8 part and its scales."""

    def __init__(self, in_features: int, sizes: int | Sequence[int], bias: bool = False, group_size: int | None = None,
                 zero_point: bool = False, outlier_cols: torch.Tensor | None = None) -> None:
        super().__init__(in_features, sizes, bias, group_size, zero_point)
        cols = torch.as_tensor([] if outlier_cols is None else outlier_cols, dtype=torch.long).flatten()
        self.register_buffer("outlier_cols", cols if cols.numel() else None)
        self.register_buffer("outlier_weight", torch.zeros(self.out_features, cols.numel()) if cols.numel() else None)

    def quantize(self, w: torch.Tensor) -> QuantizedWeight:
        if self.outlier_cols is not None:
            w = w.detach().float().clone()  # (rows, in)
            w[:, self.outlier_cols] = 0
        q, scales = quantize_int8(w, self.group_size)
        return QuantizedWeight(q, scales, None, self.group_size)

    def load_weight(self, tensor: Any, shard: int | None) -> None:
        super().load_weight(tensor, shard)
        if self.outlier_cols is not None:
            if not isinstance(tensor, torch.Tensor):
                raise ValueError("outlier columns need the float weight to keep them from")
            self.outlier_weight[self.rows(shard)] = tensor[:, self.outlier_cols].to(self.outlier_weight.dtype)

    def dequantize(self, rows: slice | torch.Tensor | None = None) -> torch.Tensor:
        w = super().dequantize(rows)  # (r, in)
        if self.outlier_cols is not None:
            w[:, self.outlier_cols] = self.outlier_weight[slice(None) if rows is None else rows].to(w.dtype)
        return w

    def native_matmul(self, x: torch.Tensor) -> torch.Tensor:  # (N, in) -> (N, out)
        if self.outlier_cols is None:
            return super().native_matmul(x)
        inliers = x.index_fill(1, self.outlier_cols, 0)  # else an outlier sets its 32-column block's int8 scale
        return super().native_matmul(inliers) + x[:, self.outlier_cols] @ self.outlier_weight.to(x.dtype).T


class Int4Linear(GroupQuantLinear):
    """4-bit affine weights, two a byte (low nibble = even input column): w = q * scale + min per group."""

    bits = 4
    qdtype = torch.uint8

    def __init__(self, in_features: int, sizes: int | Sequence[int], bias: bool = False, group_size: int = 128) -> None:
        super().__init__(in_features, sizes, bias, group_size, zero_point=True)

    def values(self, idx: slice | torch.Tensor) -> torch.Tensor:
        return unpack_int4(self.qweight[idx])

    @classmethod
    def from_quantized(cls, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                       bias: torch.Tensor | None = None) -> "Int4Linear":
        """The canonical form: q uint8 [out, in] in 0..15, scales / zeros float [out, in // group_size],
        w = (q - zeros) * scales."""
        layer = cls(q.shape[1], [q.shape[0]], bias is not None, group_size)
        layer.load(QuantizedWeight(q, scales.float(), -zeros.float() * scales.float(), group_size))
        if bias is not None:
            layer.load(bias, kind="bias")
        return layer

    def pack(self, q: torch.Tensor) -> torch.Tensor:
        return pack_int4(q)

    def quantize(self, w: torch.Tensor) -> QuantizedWeight:
        q, scales, mins = _affine_int4(w, self.group_size)
        return QuantizedWeight(q, scales, mins, self.group_size)


class Fp8Linear(LinearBase):
    """float8 e4m3 weights with a float scale per output row. The e4m3 bits are stored as uint8, so
    that moving the model to another float dtype leaves them alone."""

    def __init__(self, in_features: int, sizes: int | Sequence[int], bias: bool = False) -> None:
        super().__init__(in_features, sizes, bias)
        self.register_buffer("qweight", torch.zeros(self.out_features, in_features, dtype=torch.uint8))
        self.register_buffer("scales", torch.ones(self.out_features))

    def load_weight(self, tensor: Any, shard: int | None) -> None:
        rows = self.rows(shard)
        check_shape(tensor, (rows.stop - rows.start, self.in_features), "weight", shard)
        q, scales = quantize_fp8(tensor)
        self.qweight[rows] = q.view(torch.uint8)
        self.scales[rows] = scales.to(self.scales.dtype)

    def dequantize(self, rows: slice | torch.Tensor | None = None) -> torch.Tensor:
        idx = slice(None) if rows is None else rows
        return self.qweight[idx].view(torch.float8_e4m3fn).to(self.scales.dtype) * self.scales[idx][:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, in) -> (N, out)
        fp8_cores = x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 9)
        y = self.scaled_mm(x) if fp8_cores and self.in_features % 16 == 0 and self.out_features % 16 == 0 \
            else gpu_matmul(x, self) if x.is_cuda else dequant_matmul(x, self)
        return y if self.bias is None else y + self.bias

    def scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        """fp8 x fp8 on tensor cores: x quantized to e4m3 per row on the fly, scales applied row-wise."""
        xs = x.detach().float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX  # (N, 1)
        xq = (x.float() / xs).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # (N, in)
        w = self.qweight.view(torch.float8_e4m3fn).t()  # (in, out), column-major as _scaled_mm wants
        out_dtype = torch.float32 if x.device.type == "cpu" else torch.bfloat16
        y = torch._scaled_mm(xq, w, scale_a=xs, scale_b=self.scales.float()[None, :], out_dtype=out_dtype)  # (N, out)
        return y.to(x.dtype)
