"""Our own CPU kernels (layers/csrc/*.c), built with the system C compiler on first use and called
through ctypes: the weight-only int8 / int4 matmul of the quantized layers (qtile.c: any number of
rows, weights repacked in tiles of 16 output rows, x quantized to int8, with AVX-512 VNNI or AVX2;
qgemv.c: float x, up to MAX_ROWS rows in the layers' own layouts, where neither applies), paged attention for one query token a row reading the KV
cache in place (paged_attn.c; the CPU attention backend, attention/cpu_attn.py), and fused elementwise
ops (fused.c; layers/cpu_fused.py).

Why our own: PyTorch's weight-only CPU kernels lost to plain bf16 when measured at DRAM scale (issue
#14), and an fp32 matmul over dequantized weights reads the float bytes. These read the packed bytes
once per call whatever the number of rows.

The library is compiled once per source text and compiler into LMSERVE_CACHE (default
~/.cache/lmserve) / kernels, picking its code path (AVX-512 VNNI, AVX-512, AVX2, plain C) at run time
from what the CPU has; with no compiler, or LMSERVE_NATIVE=0, `available()` is False and callers keep
their torch path. LMSERVE_ISA=vnni|avx2int8|avx512|avx2|c caps the path (to compare them): vnni and
avx2int8 are the tile kernel's two variants (int8 x); avx512, avx2 and c the float-x kernels. Threads: torch's
intra-op thread count, on the same OpenMP runtime torch uses (the process has one libgomp).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from lmserve.kv.cache import QuantizedKV
from lmserve.utils import cache_root

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name("csrc") / name for name in ("qgemv.c", "qtile.c", "paged_attn.c", "fused.c",
                                                                           "decode.c")]
MAX_ROWS = 16  # qgemv.c: up to this many rows of x it beats dequantize + matmul (measured: docs/architecture.md)
HEADERS = [Path(__file__).with_name("csrc") / "vmath.h"]  # included by the sources (part of the build's key)
# vnni / avx2int8: the tile kernel (qtile.c, int8 activations) with AVX-512 VNNI / AVX2;
# avx512 / avx2 / c: float activations (qgemv.c). Ordered by speed: the first this CPU has is its path.
ISA_NAMES = {"vnni": 4, "avx2int8": 3, "avx512": 2, "avx2": 1, "c": 0}
_LEVEL_NAMES = {v: k for k, v in ISA_NAMES.items()}
# -fno-trapping-math: no FP traps, so the clamps in vmath.h vectorise. -ffp-contract=off: C expressions
# round as written (explicit _mm*_fmadd intrinsics stay fused), so a loop gives the same bits whether
# its vector body or its scalar remainder computes an element; with contraction the decode plan and
# the module path (rotary through different alias checks) parted at a near tie on an AVX2 + FMA clone.
FLAGS = ["-O3", "-fPIC", "-shared", "-fopenmp", "-std=gnu11", "-fno-trapping-math", "-ffp-contract=off"]


def cache_dir() -> Path:
    return cache_root() / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def _lib() -> ctypes.CDLL | None:
    """The built library, or None (no compiler, a failed build, or LMSERVE_NATIVE=0)."""
    if os.environ.get("LMSERVE_NATIVE", "1") == "0":
        return None
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler found: quantized layers use the torch path on the CPU")
        return None
    src = b"".join(f.read_bytes() for f in [*SOURCES, *HEADERS])
    key = hashlib.sha256(src + " ".join([cc, *FLAGS]).encode()).hexdigest()[:16]
    path = cache_dir() / f"qgemv-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # build aside, then rename: atomic
            out = Path(tmp) / path.name
            res = subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", str(out), "-lm"], capture_output=True, text=True)
            if res.returncode != 0:
                log.warning("building the CPU kernels failed (%s): the torch path is used\n%s", cc, res.stderr[-2000:])
                return None
            os.replace(out, path)
    lib = ctypes.CDLL(str(path))
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.lm_qgemm.argtypes = [p, i64, i64, p, i32, i64, p, p, i64, p, i32, i32]
    lib.lm_qgemm.restype = None
    lib.lm_permute_x4.argtypes = [p, i64, i64, p]
    lib.lm_isa.argtypes = [i32]
    lib.lm_isa.restype = i32
    lib.lm_qgemm_tiles.argtypes = [p, i64, i64, p, i32, i64, p, p, i32, i64, p, i32, i32]
    lib.lm_qgemm_tiles.restype = None
    lib.lm_has_vnni.restype = i32
    lib.lm_has_avx2.restype = i32
    lib.lm_has_tiles_avx2.restype = i32
    lib.lm_paged_decode_attn.argtypes = [p, p, p, i32, p, p, p, i64, p, i64, i32, i32, i32, i64, ctypes.c_float, i64, p,
                                         i32, i32, p, p, p, i64, i64]
    lib.lm_paged_decode_attn.restype = None
    lib.lm_attn_avx512.restype = i32
    f32 = ctypes.c_float
    lib.lm_add_rmsnorm.argtypes = [p, i64, p, i64, p, f32, i64, i64, p, p, i32]
    lib.lm_silu_and_mul.argtypes = [p, i64, i64, p, i32]
    lib.lm_gelu_tanh_and_mul.argtypes = [p, i64, i64, p, i32]
    lib.lm_rotary.argtypes = [p, i64, i64, i64, i64, i64, p, p]
    lib.lm_apply_bitmask.argtypes = [p, i64, i64, p, i64, i32]
    lib.lm_argmax_rows.argtypes = [p, i64, i64, i64, p, i32]
    lib.lm_llama_layers.argtypes = [i64, p, p, p, p, p, p, p, i64, i64, f32, i32, i32, i32, i64, p, p, i32, i32, i32,
                                    i32, p, p, p, p, p, p, p, p, p, i64, p]  # (+ LoRA: deltas [G, L, 4, 5], G, row groups)
    lib.lm_gemma_layers.argtypes = [i64, p, p, p, p, p, p, p, p, i64, i64, f32, i32, i32, i32, i64, i32, i32, i32, i32,
                                    p, p, p, p, p, p, p, p, p, p, i64, p]
    lib.lm_lora_add.argtypes = [p, i64, i64, p, p, i64, i64, p, p, i64, p, i64, i32]
    lib.lm_eagle_kv.argtypes = [i64, p, p, p, p, p, p, p, p, f32, i32, i32, i64, p, p, p, p, i32, i32, p, p, p, p, p, p]
    lib.lm_eagle_draft.argtypes = [i64, i64, p, p, p, p, p, i64, p, p, i64, p, p, p, p, p, p, p, f32, i32, i32, i32, i64,
                                   p, p, p, p, i32, i32, i32, f32, p, p, p, *[p] * 13]
    for fn in (lib.lm_add_rmsnorm, lib.lm_silu_and_mul, lib.lm_gelu_tanh_and_mul, lib.lm_rotary, lib.lm_apply_bitmask,
               lib.lm_argmax_rows, lib.lm_llama_layers, lib.lm_gemma_layers, lib.lm_eagle_kv, lib.lm_lora_add):
        fn.restype = None
    lib.lm_eagle_draft.restype = i64  # the rounds run
    return lib


def _level(lib: ctypes.CDLL, cap: str | None) -> int:
    """The best code path this CPU has, capped by `cap` or LMSERVE_ISA (names in ISA_NAMES)."""
    return _level_for(cap or os.environ.get("LMSERVE_ISA", "vnni"))


@functools.cache
def _level_for(name: str) -> int:
    if name not in ISA_NAMES:
        raise ValueError(f"LMSERVE_ISA must be one of {', '.join(ISA_NAMES)}, got {name!r}")
    lib, limit = _lib(), ISA_NAMES[name]
    assert lib is not None
    if limit >= 4 and lib.lm_has_vnni():
        return 4
    if limit >= 3 and lib.lm_has_tiles_avx2():
        return 3
    return lib.lm_isa(min(limit, 2))


def _float_level(level: int) -> int:
    """The float kernels' path (qgemv.c, the attention): 2 AVX-512, 1 AVX2, 0 C; under a tile level,
    the best this CPU has."""
    return _lib().lm_isa(2) if level >= 3 else level  # type: ignore[union-attr]


def available() -> bool:
    return _lib() is not None


def fast() -> bool:
    """The library is built and has a SIMD path here (plain C is slower than dequantize + matmul:
    221 ms against 30 ms for fp32 on the default model's linears at one thread: scripts/bench_cpu_kernels.py)."""
    return available() and isa() != "c"


def lib() -> ctypes.CDLL:
    """The built library (callers check available() first)."""
    built = _lib()
    assert built is not None, "the CPU kernels are not built (check cpu_native.available())"
    return built


def int8_x() -> bool:
    """The tile kernel (csrc/qtile.c: int8 activations, AVX-512 VNNI or AVX2) is this CPU's path."""
    return isa() in ("vnni", "avx2int8")


def tile_vnni(isa_name: str | None = None) -> bool:
    """The tile kernel takes its AVX-512 VNNI variant here (else the AVX2 one, which needs int8 weights
    in -127..127: Tiles.avx2_ok)."""
    return _level(lib(), isa_name) == 4


def isa() -> str:
    """The code path the kernels take on this CPU: vnni, avx2int8, avx512, avx2 or c ('none': not built)."""
    lib = _lib()
    return "none" if lib is None else _LEVEL_NAMES[_level(lib, None)]


def fits(bits: int, in_features: int, group_size: int) -> bool:
    """The kernel's shape rules: groups of whole 16-column (int8) or 32-column (int4) chunks."""
    chunk = 16 if bits == 8 else 32
    return group_size % chunk == 0 and in_features % group_size == 0


def tiles_fit(bits: int, in_features: int, group_size: int) -> bool:
    """The VNNI tile kernel's shape rules (csrc/qtile.c): 32-column blocks; groups of 16 columns or of
    whole blocks."""
    return bits in (4, 8) and in_features % 32 == 0 and in_features % group_size == 0 \
        and (group_size == 16 or group_size % 32 == 0)


class Tiles(NamedTuple):
    """A quantized weight [n, k] repacked for the tile kernel (csrc/qtile.c): q uint8 [n16 / 16,
    k / 4, 16, 4] (int8, stored + 128) or [n16 / 16, k / 8, 16, 4] (int4, two columns a byte); scales,
    mins [n16 / 16, k / group, 16], float16 where every value of both is one exactly (`half`: a GGUF
    file's Q4_0 / Q4_1 / Q5_0 / Q8_0 block scales), else float32; n16: n rounded up to 16 (padding rows
    are zero). avx2_ok: the AVX2 variant multiplies it exactly (int4, or int8 without a -128)."""

    q: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bits: int
    n: int
    k: int
    group: int
    avx2_ok: bool

    @property
    def half(self) -> bool:
        """Scales and mins stored as float16 (the tile kernel's `half`)."""
        return self.scales.dtype == torch.float16


def avx2_exact(values: torch.Tensor, bits: int) -> bool:
    """The AVX2 tile variant multiplies these integer values exactly: int4, or int8 without a -128
    (vpsignb cannot negate it; csrc/qtile.c)."""
    return bits == 4 or values.numel() == 0 or int(values.min()) > -128


def pack_tiles(values: torch.Tensor, bits: int, scales: torch.Tensor, mins: torch.Tensor | None,
               group_size: int, half: bool | None = None) -> Tiles:
    """Integer values [n, k] (int8 in -128..127, or 0..15 for bits 4), scales / mins float [n, k / group]
    -> the tile layout (see Tiles). half: scales and mins stored as float16 (None: where that is exact;
    True where it is not raises)."""
    n, k = values.shape
    if not tiles_fit(bits, k, group_size):
        raise ValueError(f"the tile kernel takes in_features % 32 == 0 and groups of 16 or 32s, not {k} / {group_size}")
    pad = -n % 16
    t = (n + pad) // 16
    v = F.pad(values.to(torch.int16), (0, 0, 0, pad))  # (n16, k)
    if bits == 8:
        u = (v + 128).to(torch.uint8).view(t, 16, k // 4, 4).permute(0, 2, 1, 3)  # (T, k/4, 16, 4)
    else:
        v = v.to(torch.uint8).view(t, 16, k // 8, 2, 4)  # column 8j + 4h + b
        u = (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).permute(0, 2, 1, 3)  # (T, k/8, 16, 4)

    def per_tile(a: torch.Tensor) -> torch.Tensor:  # (n, G) -> (T, G, 16)
        return F.pad(a.float(), (0, 0, 0, pad)).view(t, 16, -1).transpose(1, 2).contiguous()

    sc, mn = per_tile(scales), None if mins is None else per_tile(mins)
    exact = all(halves_exactly(a) for a in (sc, mn) if a is not None)
    if half and not exact:
        raise ValueError("half: these scales or mins are not all float16 values")
    if exact if half is None else half:  # int4 + mins: 320 bytes a 16 x 32 unit instead of 384 (csrc/qtile.c)
        sc, mn = sc.half(), None if mn is None else mn.half()
    return Tiles(u.contiguous(), sc, mn, bits, n, k, group_size, avx2_exact(values, bits))


def halves_exactly(a: torch.Tensor) -> bool:
    """Every value of a float32 tensor is a float16 one (NaN included): stored as float16, widened back the same."""
    b = a.half().float()
    return bool(((b == a) | (b.isnan() & a.isnan())).all())


def qgemm_tiles(x: torch.Tensor, w: Tiles, out: torch.Tensor | None = None, isa_name: str | None = None
                ) -> torch.Tensor:
    """x (M, k) @ W.T -> (M, n) float32 with the tile kernel (needs int8_x()): x quantized per 32
    columns to int8, as llama.cpp does; the VNNI variant where the CPU has it (and isa_name /
    LMSERVE_ISA allow it), else the AVX2 one."""
    level = _level(lib(), isa_name)
    if level < 3:
        raise ValueError(f"the tile kernel needs AVX2 (this path: {_LEVEL_NAMES[level]})")
    if level == 3 and not w.avx2_ok:
        raise ValueError("the AVX2 tile kernel cannot take an int8 weight holding -128 (Tiles.avx2_ok)")
    xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()  # (M, k)
    y = torch.empty(x.shape[0], w.n, dtype=torch.float32) if out is None else out  # (M, n)
    lib().lm_qgemm_tiles(xf.data_ptr(), xf.shape[0], w.k, w.q.data_ptr(), w.bits, w.n, w.scales.data_ptr(),
                         None if w.mins is None else w.mins.data_ptr(), int(w.half), w.group, y.data_ptr(),
                         torch.get_num_threads(), int(level == 4))
    return y


def qgemm(x: torch.Tensor, q: torch.Tensor, bits: int, scales: torch.Tensor, mins: torch.Tensor | None,
          group_size: int, isa_name: str | None = None) -> torch.Tensor:
    """x (M, K) @ W.T -> (M, N) float32, W [N, K] = q * scales (+ mins) per group of group_size columns.

    q: int8 [N, K] (bits 8) or uint8 [N, K // 2] two values a byte, low nibble = even column (bits 4);
    scales, mins: float32 [N, K // group_size]. All CPU tensors."""
    lib = _lib()
    assert lib is not None, "cpu_native.qgemm called without the library (check available())"
    M, K = x.shape
    N = q.shape[0]
    xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()  # (M, K)
    y = torch.empty(M, N, dtype=torch.float32)  # (M, N)
    sc = scales if scales.dtype == torch.float32 else scales.float()  # (N, G): buffers are contiguous
    mn = None if mins is None or mins.dtype == torch.float32 else mins.float()
    mn = mins if mn is None else mn
    level = _level(lib, isa_name)
    if level >= 3 and tiles_fit(bits, K, group_size) and (level == 4 or avx2_exact(q, bits)):
        values = q if bits == 8 else torch.stack([q & 15, q >> 4], dim=-1).reshape(N, K)  # (N, K)
        return qgemm_tiles(xf, pack_tiles(values, bits, sc, mn, group_size), isa_name=isa_name)  # repacked per
        # call here (a test and bench entry point); layers keep theirs. A -128 on AVX2: the float-x kernel.
    if bits == 4:
        xp = torch.empty_like(xf)  # (M, K), each 32-column chunk as evens then odds
        lib.lm_permute_x4(xf.data_ptr(), M, K, xp.data_ptr())
        xf = xp
    lib.lm_qgemm(xf.data_ptr(), M, K, q.data_ptr(), bits, N, sc.data_ptr(), None if mn is None else mn.data_ptr(),
                 group_size, y.data_ptr(), _float_level(level), torch.get_num_threads())
    return y


def attn_simd(isa_name: str | None = None) -> int:
    """The attention kernel's code path here (capped by isa_name / LMSERVE_ISA): 2 AVX-512 (for a head
    dim a multiple of 16), 1 AVX2, 0 plain C."""
    lib, level = _lib(), _level(_lib(), isa_name)  # type: ignore[arg-type]
    assert lib is not None
    level = _float_level(level)
    return 2 if level >= 2 and lib.lm_attn_avx512() else int(level >= 1 and lib.lm_has_avx2())


KV_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}  # paged_attn.c's cache element types


def kv_reads(cache: torch.Tensor | QuantizedKV) -> bool:
    """The attention kernel reads this cache in place: float32, bf16, or an int8 QuantizedKV, contiguous,
    on the CPU."""
    data = cache.data if isinstance(cache, QuantizedKV) else cache
    return data.device.type == "cpu" and data.dtype in KV_KINDS and data.is_contiguous() \
        and (isinstance(cache, QuantizedKV) == (data.dtype == torch.int8))


def kv_pointers(cache: torch.Tensor | QuantizedKV) -> tuple[int, int, int, int | None, int | None]:
    """(kind, K, V, K scales, V scales) as the kernel takes a layer's cache (2, S, Hkv, D): its element
    type (KV_KINDS), the addresses of its halves, and for an int8 cache those of its scales' halves."""
    if isinstance(cache, QuantizedKV):
        d, sc = cache.data, cache.scale
        return (2, d.data_ptr(), d.data_ptr() + d.stride(0) * d.element_size(), sc.data_ptr(),
                sc.data_ptr() + sc.stride(0) * sc.element_size())
    return (KV_KINDS[cache.dtype], cache.data_ptr(), cache.data_ptr() + cache.stride(0) * cache.element_size(), None,
            None)


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor | QuantizedKV, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, block_size: int, scale: float, window: int | None,
                           new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                           isa_name: str | None = None) -> torch.Tensor:
    """One query token per sequence against its paged context, read in place: q (B, H, D), kv_cache
    (2, S, Hkv, D) float32 or bf16, or an int8 QuantizedKV (kv_cache_dtype int8), block_tables (B, T)
    int64, seq_lens (B,) int64 -> (B, H, D) float32. window: attend to the last `window` keys only
    (None: all). new_kv: (k, v (B, Hkv, D) in the cache's dtype (float32 for an int8 cache, quantized
    as QuantizedKV.store does), slots (B,)) written into the cache first (a slot < 0 skipped)."""
    lib = _lib()
    assert lib is not None, "cpu_native.paged_decode_attention called without the library (check available())"
    B, H, D = q.shape
    if not kv_reads(kv_cache):
        raise ValueError("paged_decode_attention reads a contiguous float32 or bfloat16 cache, or an int8 QuantizedKV, "
                         f"not {kv_cache.dtype}")
    kind, k_ptr, v_ptr, ks_ptr, vs_ptr = kv_pointers(kv_cache)
    Hkv = kv_cache.data.shape[2] if isinstance(kv_cache, QuantizedKV) else kv_cache.shape[2]
    qc = q if q.dtype == torch.float32 and q.is_contiguous() else q.float().contiguous()  # (B, H, D)
    tables = block_tables.long().contiguous()  # (B, T); no copies when already so
    lens = seq_lens.long().contiguous()  # (B,)
    out = torch.empty(B, H, D, dtype=torch.float32)  # (B, H, D)
    simd = attn_simd(isa_name)
    ptrs = (None, None, None)
    if new_kv is not None:
        want = torch.float32 if kind == 2 else kv_cache.dtype
        nk, nv, slots = (t.contiguous() for t in new_kv)
        if nk.dtype != want or nv.dtype != want or slots.dtype != torch.int64:
            raise ValueError(f"new_kv: k / v in {want} (the cache's dtype, float32 for an int8 cache), slots int64")
        ptrs = (nk.data_ptr(), nv.data_ptr(), slots.data_ptr())
    lib.lm_paged_decode_attn(qc.data_ptr(), k_ptr, v_ptr, kind, ks_ptr, vs_ptr,
                             tables.data_ptr(), tables.shape[1], lens.data_ptr(), B, H, Hkv,
                             D, block_size, scale, window or 0, out.data_ptr(), simd, torch.get_num_threads(), *ptrs,
                             H * D, Hkv * D)
    return out


def lora_add(x: torch.Tensor, y: torch.Tensor, at: torch.Tensor, bt: torch.Tensor, row_group: torch.Tensor | None,
             g: int, spans: torch.Tensor | None = None) -> None:
    """y (B, n) += (x (B, k) @ at (k, r)) @ bt (r, n) in place, on the rows whose row_group (B,) int64 is g
    (every row: None); float32, y contiguous; spans (S, 2) int64: the output columns each block of r / S rows
    of bt reaches (None: all). Each element in a fixed order, whatever the batch (fused.c: lm_lora_add)."""
    x = x.contiguous()
    rb = at.shape[1] // spans.shape[0] if spans is not None else at.shape[1]
    lib().lm_lora_add(x.data_ptr(), x.shape[0], x.shape[1], at.data_ptr(), bt.data_ptr(), at.shape[1], bt.shape[1],
                      y.data_ptr(), None if row_group is None else row_group.data_ptr(), g,
                      None if spans is None else spans.data_ptr(), rb, torch.get_num_threads())
