"""The Triton dequantize-in-matmul kernels (layers/triton_quant.py) under TRITON_INTERPRET=1, against float64
over the layers' own dequantize(): int8 per channel / per group (with and without mins, a group that is no
power of two), int4 groups of 32 / 64 / 128 and per row, fp8; K and the outputs no multiple of any block, one
and several K tiles, K splits, M = 1, 3, 17. Outputs are poisoned with NaN before each run (torch.empty /
new_empty), so an element a kernel does not write fails. Launches are recorded, so each test also checks it
ran the kernel (and the grid) it means to. float32 activations: the interpreter's tl.dot is wrong for bf16
(float16 is right: one test runs the 16-bit paths with it; the bf16 runs are in scripts/gpu_check.py,
compiled for the GPU).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from lmserve.layers import triton_quant as tq  # noqa: E402
from lmserve.layers.quant import Fp8Linear, Int4Linear, Int8Linear, QuantizedWeight  # noqa: E402

OUT = 40  # output features: no multiple of any BLOCK_N used here
TOL = 1e-6  # of max |reference|: float32 rounding (the kernels reach ~2e-7), far below any real mistake


def _int8_with_mins(w: torch.Tensor) -> Int8Linear:
    """A GGUF-style integer layer: int8 values, a scale and a min per group of 16 (Q6_K's group)."""
    g = torch.Generator().manual_seed(5)
    out_f, in_f = w.shape
    layer = Int8Linear(in_f, [out_f], group_size=16, zero_point=True)
    layer.load(QuantizedWeight(torch.randint(-128, 128, (out_f, in_f), generator=g, dtype=torch.int8),
                               torch.rand(out_f, in_f // 16, generator=g) * 0.01 + 1e-3,
                               torch.randn(out_f, in_f // 16, generator=g) * 0.1, 16))
    return layer


# name -> (in_features, layer from a float weight [OUT, in])
LAYERS: dict[str, tuple[int, Callable[[torch.Tensor], Any]]] = {
    "int8": (100, lambda w: Int8Linear.from_float(w)),
    "int8_g32": (96, lambda w: Int8Linear.from_float(w, group_size=32)),
    "int8_g16_mins": (96, _int8_with_mins),
    "int8_g48": (96, lambda w: Int8Linear.from_float(w, group_size=48)),  # tiles of 16 inside each group
    "int4_g32": (96, lambda w: Int4Linear.from_float(w, group_size=32)),
    "int4_g64": (320, lambda w: Int4Linear.from_float(w, group_size=64)),
    "int4_g128": (384, lambda w: Int4Linear.from_float(w, group_size=128)),
    "int4_row": (100, lambda w: Int4Linear.from_float(w, group_size=100)),  # one group per row, no power of two
    "fp8": (100, lambda w: Fp8Linear.from_float(w)),
}


@functools.cache
def _layer(kind: str) -> Any:
    in_f, make = LAYERS[kind]
    w = torch.randn(OUT, in_f, generator=torch.Generator().manual_seed(len(kind) * 7 + in_f)) * 0.05
    return make(w)


def _x(m: int, in_f: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(m, in_f, generator=torch.Generator().manual_seed(seed + 1000 * m))


def _ref(x: torch.Tensor, layer: Any) -> torch.Tensor:
    return x.double() @ layer.dequantize().double().T  # (m, out)


def _check(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.shape == ref.shape and y.dtype == torch.float32
    err = (y.double() - ref).abs().max().item()
    assert err < TOL * ref.abs().max().item(), f"max err {err:.2e} vs max |ref| {ref.abs().max().item():.2e}"


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):  # type: ignore[no-untyped-def]
    """Every torch.empty / new_empty (the kernels' outputs and partial sums) starts as NaN."""
    real_empty, real_new_empty = torch.empty, torch.Tensor.new_empty

    def empty(*a, **kw):  # type: ignore[no-untyped-def]
        t = real_empty(*a, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def new_empty(self, *a, **kw):  # type: ignore[no-untyped-def]
        t = real_new_empty(self, *a, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "new_empty", new_empty)


@pytest.fixture
def launches(monkeypatch):  # type: ignore[no-untyped-def]
    """The kernel launches made in the test: (kernel name, grid, constexpr keywords)."""
    seen: list[tuple[str, tuple, dict]] = []
    for name in ("_gemv_kernel", "_tiled_kernel"):
        kern = getattr(tq, name)

        def recording(*args, grid, warmup, _run=kern.run, _n=name, **kwargs):  # type: ignore[no-untyped-def]
            seen.append((_n, tuple(grid), kwargs))
            return _run(*args, grid=grid, warmup=warmup, **kwargs)
        monkeypatch.setattr(kern, "run", recording)
    return seen


def test_reference_is_the_layers_dequantize():
    """The float weight the kernels are checked against (and fall back to) is each layer's own."""
    for kind in LAYERS:
        layer = _layer(kind)
        assert torch.equal(tq.dequantized(tq.packed_weight(layer)), layer.dequantize()), kind


# GEMV: defaults (one K tile for these K, one program of 64 outputs off CUDA), and narrow blocks over
# several K tiles (a partial one last where K is no multiple of 32) split over 2 or 3 programs
GEMV_CONFIGS = {"default": {}, "tiles": dict(block_n=16, block_k=32, split_k=3),
                "reduce_each": dict(block_n=16, block_k=32, split_k=3, reduce_each=True)}  # (a tile's sum at once)


@pytest.mark.parametrize("config", GEMV_CONFIGS)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("kind", LAYERS)
def test_gemv_kernel(kind, m, config, launches):  # type: ignore[no-untyped-def]
    layer = _layer(kind)
    x = _x(m, layer.in_features)
    _check(tq.gemv(x, tq.packed_weight(layer), **GEMV_CONFIGS[config]), _ref(x, layer))
    [(name, grid, kw)] = launches
    assert name == "_gemv_kernel" and kw["BLOCK_M"] == (1 if m == 1 else 4)
    assert kw["REDUCE_EACH"] == (config == "reduce_each")
    if config != "default":  # 3 output blocks (40 = 16 + 16 + 8) x K splits (K 100: 4 tiles, 2 a split)
        assert grid == (3, 2 if layer.in_features == 100 else 3) and kw["BLOCK_N"] == 16
        assert kw["BLOCK_K"] == (16 if kind == "int8_g48" else 32)


def test_gemv_kernel_17_rows(launches):  # type: ignore[no-untyped-def]
    for kind in ("int8", "int4_g32"):
        layer = _layer(kind)
        x = _x(17, layer.in_features)
        _check(tq.gemv(x, tq.packed_weight(layer), block_k=64), _ref(x, layer))
    assert [kw["BLOCK_M"] for _, _, kw in launches] == [32, 32]


# tiled: the defaults (one tile over all outputs here), and 16 x 16 tiles over 2 x 3 output blocks,
# K tiles of 32 split in 2
TILED_CONFIGS = {"default": {}, "tiles": dict(block_m=16, block_n=16, block_k=32, split_k=2)}


@pytest.mark.parametrize("config", TILED_CONFIGS)
@pytest.mark.parametrize("m", [3, 17])
@pytest.mark.parametrize("kind", LAYERS)
def test_tiled_kernel(kind, m, config, launches):  # type: ignore[no-untyped-def]
    layer = _layer(kind)
    x = _x(m, layer.in_features)
    _check(tq.tiled(x, tq.packed_weight(layer), **TILED_CONFIGS[config]), _ref(x, layer))
    [(name, grid, kw)] = launches
    assert name == "_tiled_kernel"
    if config == "tiles":
        assert grid == ((1 if m <= 16 else 2), 3, 2)
        assert kw["BLOCK_K"] == (16 if kind == "int8_g48" else 32)


@pytest.mark.parametrize("kind", ["int8_g32", "int4_g32", "fp8"])
def test_half_precision_activations(kind, launches):  # type: ignore[no-untyped-def]
    """16-bit activations (float16: the interpreter's tl.dot is right for it, not for bf16): the tiled
    kernel's 16-bit blocks (TILED_SMALL_M up to 16 rows, TILED above), its cast of the dequantized tile
    to x's dtype, and both kernels' 16-bit output (rounding: 2^-11 of each value)."""
    layer = _layer(kind)
    w = tq.packed_weight(layer)
    for m in (3, 17):
        x = _x(m, layer.in_features).half()
        ref = _ref(x, layer)
        for kernel in (tq.gemv, tq.tiled):
            y = kernel(x, w)
            assert y.dtype == torch.float16
            assert (y.double() - ref).abs().max() < 2e-3 * ref.abs().max()
    tiled = [kw for name, _, kw in launches if name == "_tiled_kernel"]
    assert [kw["BLOCK_M"] for kw in tiled] == [tq.TILED_SMALL_M["BLOCK_M"], tq.TILED["BLOCK_M"]] == [16, 64]


def test_group_slices_of_a_tile():
    """A tile over several groups is cut into NG equal runs, each with its group's scale and min."""
    layer = _layer("int4_g32")  # K 96: groups of 32; GEMV tiles of 2 x 64 columns (NG 4, the last 2 groups
    w = tq.packed_weight(layer)  # of the second tile past K)
    x = _x(2, 96)
    assert tq._fit_block_k(128, w, 16) == (128, 4)
    _check(tq.gemv(x, w, block_k=128), _ref(x, layer))
    _check(tq.tiled(x, w, block_k=64), _ref(x, layer))
    assert tq._fit_block_k(32, tq.packed_weight(_layer("int4_g64")), 16) == (32, 1)  # inside a group
    assert tq._fit_block_k(64, tq.packed_weight(_layer("int8_g48")), 16) == (16, 1)  # 48 = 3 x 16
    assert tq._fit_block_k(64, tq.packed_weight(_layer("int8")), 16) == (64, 1)  # per row: any tile


@pytest.mark.parametrize("native", [True, False])
def test_fp8_decodes_every_e4m3_value(native, monkeypatch):  # type: ignore[no-untyped-def]
    """All 254 finite e4m3 bytes (subnormals, zero and -0 included), with the hardware convert and with
    the integer bit work used before sm89: exactly their float values."""
    monkeypatch.setattr(tq, "_fp8_native", lambda device: native)
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # (254,)
    layer = Fp8Linear(16, [254])
    layer.qweight[:, 0] = codes  # row r: the value of codes[r], then zeros (the byte 0 is +0.0)
    x = torch.zeros(1, 16)
    x[0, 0] = 1.0
    exact = codes.view(torch.float8_e4m3fn).float()  # (254,)
    for y in (tq.gemv(x, tq.packed_weight(layer)), tq.tiled(x, tq.packed_weight(layer))):
        assert torch.equal(y[0], exact)


def test_quant_matmul_picks_the_kernel_by_rows(launches):  # type: ignore[no-untyped-def]
    layer = _layer("int4_g64")
    for m in (1, 8, 9, 40):
        x = _x(m, layer.in_features, seed=3)
        _check(tq.quant_matmul(x, layer), _ref(x, layer))
    assert [n for n, _, _ in launches] == ["_gemv_kernel", "_gemv_kernel", "_tiled_kernel", "_tiled_kernel"]
    assert tq.GEMV_MAX_M == 8
    x = _x(6, layer.in_features).view(2, 3, -1)  # leading dimensions kept
    y = tq.quant_matmul(x, layer, gemv_max_rows=4)
    assert y.shape == (2, 3, OUT) and launches[-1][0] == "_tiled_kernel"
    _check(y.reshape(6, OUT), _ref(x.reshape(6, -1), layer))


def test_quant_matmul_outlier_columns():
    """Int8Linear's float outlier columns: the int8 part holds zeros there, added back in float."""
    w = torch.randn(OUT, 96, generator=torch.Generator().manual_seed(9)) * 0.05
    w[:, [3, 50]] *= 40
    layer = Int8Linear.from_float(w, outlier_cols=torch.tensor([3, 50]))
    for m in (2, 12):
        x = _x(m, 96)
        _check(tq.quant_matmul(x, layer), _ref(x, layer))
    assert (layer.dequantize()[:, [3, 50]] == w[:, [3, 50]]).all()


def test_model_dtype_scales():
    """In a bf16 model the scales and mins are bf16 (layer.to(dtype)); the kernels read them as they are
    and dequantize in float32 (the layer's own dequantize() would round in bf16)."""
    for kind in ("int8_g32", "int4_g32", "fp8"):
        layer = LAYERS[kind][1](torch.randn(OUT, 96 if kind != "fp8" else 100) * 0.05).to(torch.bfloat16)
        w = tq.packed_weight(layer)
        assert w.scales.dtype == torch.bfloat16 and w.q.dtype in (torch.int8, torch.uint8)
        x = _x(3, layer.in_features)
        ref = x.double() @ tq.dequantized(w).double().T
        _check(tq.gemv(x, w), ref)
        _check(tq.tiled(x, w), ref)


def test_fine_groups_fall_back_to_dequantize(launches):  # type: ignore[no-untyped-def]
    """Groups of 6 (largest power-of-two divisor 2): no kernel tile fits, so dequantize + matmul."""
    w = torch.randn(OUT, 96, generator=torch.Generator().manual_seed(2)) * 0.05
    layer = Int4Linear.from_float(w, group_size=6)
    x = _x(3, 96)
    _check(tq.quant_matmul(x, layer), _ref(x, layer))
    _check(tq.tiled(x, tq.packed_weight(layer)), _ref(x, layer))
    assert not launches


def test_no_rows_and_wrong_width():
    layer = _layer("int8")
    assert tq.quant_matmul(torch.zeros(0, 100), layer).shape == (0, OUT)
    assert tq.tiled(torch.zeros(0, 100), tq.packed_weight(layer)).shape == (0, OUT)
    with pytest.raises(ValueError, match="columns"):
        tq.quant_matmul(torch.zeros(2, 99), layer)
    with pytest.raises(TypeError, match="no Triton quant kernel"):
        tq.quant_matmul(torch.zeros(2, 100), torch.nn.Linear(100, 4))


def test_module_imports_without_triton():
    """With Triton hidden (as scripts/gpu_check.py hides it after a failed preflight) the module
    imports, says it is not available, and the entry point raises."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\n"
            "from lmserve.layers import triton_quant as tq\n"
            "from lmserve.layers.quant import Int8Linear\n"
            "assert not tq.available()\n"
            "try:\n"
            "    tq.quant_matmul(torch.zeros(1, 32), Int8Linear.from_float(torch.ones(16, 32)))\n"
            "except RuntimeError as e:\n"
            "    print('raised', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "raised the Triton quant kernels need Triton" in out.stdout


def test_jit_variants_do_not_depend_on_the_row_count(monkeypatch):  # type: ignore[no-untyped-def]
    """Triton's JIT (on the GPU) compiles a variant per key: the row count and the split stride are not
    specialized on, so prefill chunks of any length share one tiled variant, and decode batches one
    GEMV variant per power of two. Keys computed with Triton's own binder (the interpreter compiles
    nothing), as tests/test_triton_kernels.py does for the attention kernels."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import JITFunction, create_function_from_signature
    w = tq.packed_weight(_layer("int4_g128"))
    args_seen: list[tuple] = []
    for name in ("_gemv_kernel", "_tiled_kernel"):  # record the launches, run nothing
        monkeypatch.setattr(getattr(tq, name), "run",
                            lambda *a, grid, warmup, _n=name, **kw: args_seen.append((_n, a, kw)))
    for m in (17, 30, 48, 64, 100):
        tq.tiled(_x(m, 384), w, split_k=2)
    for m in (3, 4):
        tq.gemv(_x(m, 384), w)
    keys: dict[str, set] = {}
    for name, a, kw in args_seen:
        kern = getattr(tq, name)
        jf = JITFunction(kern.fn, do_not_specialize=kern.kwargs.get("do_not_specialize"))
        binder = create_function_from_signature(jf.signature, jf.params, CUDABackend)
        _, spec, options = binder(*a, **kw)
        keys.setdefault(name, set()).add(str(spec) + str(options))
    assert len(args_seen) == 7
    assert len(keys["_tiled_kernel"]) == 1 and len(keys["_gemv_kernel"]) == 1, {k: len(v) for k, v in keys.items()}


def test_gpu_check_part_dry_run(tmp_path):  # type: ignore[no-untyped-def]
    """The 'quant matmul' part of scripts/gpu_check.py (run on CUDA by the device check) on tiny shapes:
    its checks pass and it reports every scheme."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import gpu_check
    p = gpu_check.Part("quant matmul", tmp_path / "part.json")
    gpu_check.part_quant_matmul(p, {"device": "cpu", "small": True})
    assert not p.failures
    labels = [r[0] for r in p.rows]
    assert labels[0] == "quant matmul kernels fp32: checks passed" and p.rows[0][1].startswith("10 of 10")
    assert [lab.rsplit(", ", 1)[1] for lab in labels[1:]] == ["bf16", "int8", "int4", "fp8"]
    t = p.data["quant_decode_timing"]
    assert t["config"]["layers"] == 1 and all(t[s]["gb"] > 0 for s in ("bf16", "int8", "int4", "fp8"))
    assert t["int4"]["gb"] < t["int8"]["gb"] < t["bf16"]["gb"]
