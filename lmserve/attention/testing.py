"""Random paged attention steps and a float64 oracle: shared by the CPU tests (Triton under
TRITON_INTERPRET=1) and scripts/gpu_check.py (the same cases compiled for the GPU)."""

from __future__ import annotations

import torch

from lmserve.attention.backend import AttentionBackend, AttentionMetadata, pack_block_tables
from lmserve.kv.cache import QuantizedKV, kv_quant_dtype
from lmserve.kv.cache import slots as slots_of

# context lengths, new-token lengths (1 = decode), GQA group, block size, window
KERNEL_CASES: list[tuple[list[int], list[int], int, int, int | None]] = [
    ([37, 5, 64, 17], [37, 5, 3, 1], 1, 16, None),
    ([50, 33, 100], [1, 1, 1], 2, 16, None),
    ([70, 20, 45], [12, 20, 1], 4, 32, None),
    ([129, 40], [1, 9], 8, 16, None),
    ([90, 61, 33], [1, 30, 7], 2, 16, 24),
    ([200, 64], [1, 1], 4, 32, 50),
]


def random_step(ctx_lens: list[int], q_lens: list[int], bs: int, hkv: int, d: int, seed: int,
                device: str | torch.device = "cpu"
                ) -> tuple[AttentionMetadata, torch.Tensor, list[list[int]]]:
    """A random paged cache (2, slots, Hkv, d) float32 holding each sequence's earlier context in
    scattered blocks, the step's metadata (on `device`), and the block tables as lists."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-c // bs) for c in ctx_lens]
    total = sum(pages) + 3
    perm = torch.randperm(total, generator=g).tolist()
    tables, k = [], 0
    for p in pages:
        tables.append(perm[k:k + p])
        k += p
    slots, qsl, pos = [], [0], []
    for i, (c, n) in enumerate(zip(ctx_lens, q_lens)):
        slots.extend(slots_of(tables[i], c - n, n, bs))
        pos.extend(range(c - n, c))
        qsl.append(qsl[-1] + n)

    def t(x: list) -> torch.Tensor:  # type: ignore[type-arg]
        return torch.tensor(x, dtype=torch.long, device=device)
    meta = AttentionMetadata(slot_mapping=t(slots), query_start_loc=t(qsl), seq_lens=t(ctx_lens),
                             block_tables=pack_block_tables(tables).to(device), positions=t(pos),
                             block_size=bs, query_lens_host=list(q_lens), seq_lens_host=list(ctx_lens))
    cache = torch.randn(2, total * bs, hkv, d, generator=g).to(device)
    return meta, cache, tables


def float64_attention(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, tables: list[list[int]],
                      scale: float, window: int | None) -> torch.Tensor:
    """Dense float64 attention on the CPU, sequence by sequence, straight from the cache contents:
    q (N, H, d), cache (2, slots, Hkv, d) -> (N, H, d) float64."""
    q, cache = q.cpu(), cache.cpu()
    out = torch.empty_like(q, dtype=torch.float64)
    h, hkv = q.shape[1], cache.shape[2]
    bs = meta.block_size
    starts = meta.query_start_loc.tolist()
    for i, (c, n) in enumerate(zip(meta.seq_lens_host, meta.query_lens_host)):
        slots = torch.tensor(slots_of(tables[i], 0, c, bs))
        k = cache[0, slots].double().repeat_interleave(h // hkv, dim=1)  # (c, H, d)
        v = cache[1, slots].double().repeat_interleave(h // hkv, dim=1)
        for t in range(n):
            qp = c - n + t
            allowed = torch.arange(c) <= qp
            if window is not None:
                allowed &= torch.arange(c) > qp - window
            sc = torch.einsum("hd,khd->hk", q[starts[i] + t].double(), k) * scale
            sc[:, ~allowed] = float("-inf")
            out[starts[i] + t] = torch.einsum("hk,khd->hd", sc.softmax(-1), v)
    return out


def pad_static_decode(meta: AttentionMetadata, pad: int) -> AttentionMetadata:
    """A decode-only step as a CUDA-graph batch: the live rows, then `pad` padding rows (slot -1,
    context 0, stale block-table rows), marked static_decode."""
    dev = meta.slot_mapping.device
    b = meta.num_seqs + pad
    width = meta.block_tables.shape[1]
    zeros = torch.zeros(pad, dtype=torch.long, device=dev)
    return AttentionMetadata(
        slot_mapping=torch.cat([meta.slot_mapping, zeros - 1]), query_start_loc=torch.arange(b + 1, device=dev),
        seq_lens=torch.cat([meta.seq_lens, zeros]),
        block_tables=torch.cat([meta.block_tables, torch.randint(0, 5, (pad, width), device=dev)]),
        positions=torch.cat([meta.positions, zeros]), block_size=meta.block_size,
        query_lens_host=[1] * b, seq_lens_host=[0] * b, static_decode=True)


def case_inputs(idx: int, hkv: int, d: int, device: str, dtype: torch.dtype, seed: int
                ) -> tuple[AttentionMetadata, torch.Tensor, list[list[int]], torch.Tensor, torch.Tensor, torch.Tensor]:
    """KERNEL_CASES[idx] as a random paged step: metadata, the cache (2, slots, Hkv, d) in dtype, the
    block tables, and q (N, H, d), k / v (N, Hkv, d) drawn from seed + idx and seed + 100 + idx."""
    ctx, qlens, group, bs, _ = KERNEL_CASES[idx]
    meta, cache, tables = random_step(ctx, qlens, bs, hkv, d, seed=seed + idx, device=device)
    g = torch.Generator().manual_seed(seed + 100 + idx)
    n, h = sum(qlens), hkv * group
    q, k, v = (torch.randn(n, x, d, generator=g).to(device, dtype) for x in (h, hkv, hkv))
    return meta, cache.to(dtype), tables, q, k, v


def check_kernels(device: str, dtype: torch.dtype, d: int = 64, hkv: int = 2,
                  cases: list[int] | None = None, fp32_dot: str = "ieee",
                  backend: AttentionBackend | None = None) -> list[dict]:
    """KERNEL_CASES (all, or those indexed by `cases`; decode-only ones also as a padded static
    batch) through the Triton backend and the torch reference on `device` in `dtype`, against
    float64. One row of errors per case. float32 prefill dots run in `fp32_dot` precision: "ieee",
    since on a GPU Triton's default (tf32, 10 mantissa bits) alone costs ~3e-3 of error. backend: the
    Triton backend checked (default TritonAttention; triton_invariant's for deterministic mode)."""
    from lmserve.attention.torch_ref import TorchAttention
    from lmserve.attention.triton_attn import TritonAttention
    tri_backend = backend or TritonAttention(fp32_dot=fp32_dot)
    rows = []
    for idx, (ctx, qlens, group, bs, window) in enumerate(KERNEL_CASES):
        if cases is not None and idx not in cases:
            continue
        meta, cache, tables, q, k, v = case_inputs(idx, hkv, d, device, dtype, seed=100)
        n, scale = sum(qlens), d ** -0.5
        ref_cache, tri_cache = cache.clone(), cache.clone()
        ref = TorchAttention().forward(q, k, v, ref_cache, meta, scale, window)
        tri = tri_backend.forward(q, k, v, tri_cache, meta, scale, window)
        exact = float64_attention(q, ref_cache, meta, tables, scale, window)
        row = {"case": idx, "group": group, "block_size": bs, "window": window,
               "store_equal": bool(torch.equal(tri_cache, ref_cache)),
               "triton_err": (tri.double().cpu() - exact).abs().max().item(),
               "torch_err": (ref.double().cpu() - exact).abs().max().item()}
        if all(x == 1 for x in qlens):  # the same step as a padded CUDA-graph batch
            st_cache = cache.clone()
            pad = 3
            z = torch.zeros(pad, *q.shape[1:], dtype=dtype, device=device)
            zk = torch.zeros(pad, *k.shape[1:], dtype=dtype, device=device)
            st = tri_backend.forward(torch.cat([q, z]), torch.cat([k, zk]), torch.cat([v, zk]),
                                     st_cache, pad_static_decode(meta, pad), scale, window)
            row["static_err"] = (st[:n].double().cpu() - exact).abs().max().item()
            row["static_pad_zero"] = bool((st[n:] == 0).all())
            row["static_store_equal"] = bool(torch.equal(st_cache, ref_cache))
        rows.append(row)
    return rows


# Bounds on max |attention(quantized cache) - attention(float cache)| (both float64 math) for the
# cases' unit-normal q / k / v (outputs ~1): measured on the CPU up to 0.015 (int8) and 0.085 (fp8)
QUANT_ATTN_BOUND = {"int8": 0.03, "fp8": 0.15}


def check_quant_kernels(device: str, dtype: torch.dtype, kv_cache_dtype: str = "int8", d: int = 64, hkv: int = 2,
                        cases: list[int] | None = None, fp32_dot: str = "ieee", target_programs: int = 264,
                        backend: AttentionBackend | None = None) -> list[dict]:
    """KERNEL_CASES through both backends with a quantized cache (kv_cache_dtype int8 / fp8): each
    case's earlier context quantized as the store path would have written it, the step's new K/V
    quantized by each backend's store. Per case: store_equal (elements and scales, byte for byte),
    triton_err / torch_err against float64 attention over the dequantized cache (the kernels' own
    error), triton_quant_err / torch_quant_err against float64 attention over the float cache (what
    quantization costs); decode-only cases also as a padded static batch (static_err, against the
    dequantized oracle; static_pad_zero; static_store_equal). target_programs: the decode split
    heuristic's aim (fewer programs under the interpreter); backend: the Triton backend checked (default
    TritonAttention with those settings)."""
    from lmserve.attention.torch_ref import TorchAttention
    from lmserve.attention.triton_attn import TritonAttention
    qdtype = kv_quant_dtype(kv_cache_dtype)
    backend = backend or TritonAttention(fp32_dot=fp32_dot, target_programs=target_programs)
    rows = []
    for idx, (ctx, qlens, group, bs, window) in enumerate(KERNEL_CASES):
        if cases is not None and idx not in cases:
            continue
        meta, cache, tables, q, k, v = case_inputs(idx, hkv, d, device, dtype, seed=300)
        n, scale = sum(qlens), d ** -0.5
        float_cache = cache.clone()
        TorchAttention().forward(q, k, v, float_cache, meta, scale, window)  # the float store: the oracle's cache
        ref_cache, tri_cache = QuantizedKV.from_float(cache, qdtype), QuantizedKV.from_float(cache, qdtype)
        ref = TorchAttention().forward(q, k, v, ref_cache, meta, scale, window)
        tri = backend.forward(q, k, v, tri_cache, meta, scale, window)
        exact = float64_attention(q, ref_cache.dequantized(), meta, tables, scale, window)
        exact_float = float64_attention(q, float_cache, meta, tables, scale, window)
        row = {"case": idx, "group": group, "block_size": bs, "window": window, "kv_cache_dtype": kv_cache_dtype,
               "store_equal": _same_bytes(tri_cache, ref_cache),
               "triton_err": (tri.double().cpu() - exact).abs().max().item(),
               "torch_err": (ref.double().cpu() - exact).abs().max().item(),
               "triton_quant_err": (tri.double().cpu() - exact_float).abs().max().item(),
               "torch_quant_err": (ref.double().cpu() - exact_float).abs().max().item()}
        if all(x == 1 for x in qlens):  # the same step as a padded CUDA-graph batch
            st_cache = QuantizedKV.from_float(cache, qdtype)
            pad = 3
            z = torch.zeros(pad, *q.shape[1:], dtype=dtype, device=device)
            zk = torch.zeros(pad, *k.shape[1:], dtype=dtype, device=device)
            st = backend.forward(torch.cat([q, z]), torch.cat([k, zk]), torch.cat([v, zk]), st_cache,
                                 pad_static_decode(meta, pad), scale, window)
            row["static_err"] = (st[:n].double().cpu() - exact).abs().max().item()
            row["static_pad_zero"] = bool((st[n:] == 0).all())
            row["static_store_equal"] = _same_bytes(st_cache, ref_cache)
        rows.append(row)
    return rows


def _same_bytes(a: QuantizedKV, b: QuantizedKV) -> bool:
    return bool(torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale))


def batching_outputs(backend: AttentionBackend, device: str, dtype: torch.dtype, window: int | None = None,
                     kv_cache_dtype: str | None = None, h: int = 2, hkv: int = 1, d: int = 16, bs: int = 16,
                     seed: int = 7) -> dict[str, torch.Tensor]:
    """One sequence (48 tokens) computed four ways through `backend` (each on a fresh copy of one random
    cache, float or quantized): as one prefill chunk, as three chunks ending mid-block, as a chunk then
    one decode step a token, and inside a crowd of two other sequences prefilling and decoding beside
    it. Returns each way's outputs (48, H, d) on the CPU: a batch-invariant backend gives them bit for
    bit equal (deterministic mode), a fast one within rounding."""
    g = torch.Generator().manual_seed(seed)
    lengths = {0: 48, 1: 12, 2: 9}
    perm = torch.randperm(16, generator=g).tolist()
    tables: dict[int, list[int]] = {}
    used = 0
    for s, n in lengths.items():
        pages = -(-(n + 8) // bs)
        tables[s], used = perm[used:used + pages], used + pages
    qkv = {s: tuple(torch.randn(n + 8, x, d, generator=g).to(device, dtype) for x in (h, hkv, hkv))
           for s, n in lengths.items()}
    base = torch.randn(2, 16 * bs, hkv, d, generator=g).to(device, dtype)
    a, b, n0, (n1, n2) = 21, 37, lengths[0], (lengths[1], lengths[2])  # chunk ends mid-block
    crowd = [[(1, 0, 5), (0, 0, a), (2, 0, n2)], [(2, n2, 1), (0, a, b - a), (1, 5, n1 - 5)],
             [(0, b, n0 - b - 3), (1, n1, 1)]]
    crowd += [[(1, n1 + 1 + i, 1), (0, n0 - 3 + i, 1), (2, n2 + 1 + i, 1)] for i in range(3)]
    ways = {"one chunk": [[(0, 0, n0)]], "three chunks": [[(0, 0, a)], [(0, a, b - a)], [(0, b, n0 - b)]],
            "chunk then decodes": [[(0, 0, n0 - 4)]] + [[(0, n0 - 4 + i, 1)] for i in range(4)], "in a crowd": crowd}
    res = {}
    for name, steps in ways.items():
        cache = QuantizedKV.from_float(base, kv_quant_dtype(kv_cache_dtype)) if kv_cache_dtype else base.clone()
        out = torch.full((n0, h, d), float("nan"))
        for step in steps:  # (sequence, first new position, new tokens) a sequence
            slots, qsl, pos, lens = [], [0], [], []
            for s, start, n in step:
                slots.extend(slots_of(tables[s], start, n, bs))
                pos.extend(range(start, start + n))
                qsl.append(qsl[-1] + n)
                lens.append(start + n)
            t = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
            meta = AttentionMetadata(slot_mapping=t(slots), query_start_loc=t(qsl), seq_lens=t(lens),
                                     block_tables=pack_block_tables([tables[s] for s, _, _ in step]).to(device),
                                     positions=t(pos), block_size=bs, query_lens_host=[n for _, _, n in step],
                                     seq_lens_host=lens)
            q, k, v = (torch.cat([qkv[s][i][start:start + n] for s, start, n in step]) for i in range(3))
            o = backend.forward(q, k, v, cache, meta, d ** -0.5, window).float().cpu()
            for (s, start, n), first in zip(step, qsl):
                if s == 0:
                    out[start:start + n] = o[first:first + n]
        res[name] = out
    return res
