"""Our CPU kernels (layers/csrc/qtile.c, qgemv.c through layers/cpu_native.py) against float64 oracles,
on every code path this CPU can run (the tile kernel with int8 activations on VNNI or AVX2; float
activations on AVX-512, AVX2, plain C), and the quantized
layers' choice between it and the reference path."""

from __future__ import annotations

import shutil

import pytest
import torch

from lmserve.layers import cpu_native, quant
from lmserve.layers.quant import Int4Linear, Int8Linear

LEVELS = {"vnni": 4, "avx2int8": 3, "avx512": 2, "avx2": 1, "c": 0}
INT8_X = ("vnni", "avx2int8")  # the tile kernel's paths: x quantized to int8 per 32 columns


def runnable() -> list[str]:
    """The code paths this CPU runs (a cap naming a path it lacks runs a lower one: not listed)."""
    if not cpu_native.available():
        return []
    return [name for name, lv in LEVELS.items() if cpu_native._level_for(name) == lv]


def test_the_kernels_build_where_a_compiler_is():
    assert cpu_native.available() == (shutil.which("cc") is not None or shutil.which("gcc") is not None)
    assert cpu_native.isa() in LEVELS


needs_lib = pytest.mark.skipif(not cpu_native.available(), reason="no C compiler to build the CPU kernels")

LAYERS = {  # name -> (build from a float weight [out, in]); sizes below fit every path (in % 64 == 0)
    "int8_row": lambda w: Int8Linear.from_float(w),
    "int8_g32": lambda w: Int8Linear.from_float(w, group_size=32),
    "int8_g16_mins": lambda w: _int8_with_mins(w, 16),
    "int4_g32": lambda w: Int4Linear.from_float(w, group_size=32),
    "int4_g64": lambda w: Int4Linear.from_float(w, group_size=64),
    "int4_g128": lambda w: Int4Linear.from_float(w, group_size=128),
}


def _int8_with_mins(w: torch.Tensor, group: int) -> Int8Linear:
    """An int8 layer with a min per group (what GGUF's K-quants load into): q in 0..63, w = q * s + min."""
    out_f, in_f = w.shape
    g = w.view(out_f, -1, group)
    lo, hi = g.amin(-1), g.amax(-1)  # (out, G)
    s = (hi - lo).clamp(min=1e-8) / 63
    q = ((g - lo[..., None]) / s[..., None]).round().clamp(0, 63).to(torch.int8).view(out_f, in_f)
    layer = Int8Linear(in_f, out_f, group_size=group, zero_point=True)
    layer.load(quant.QuantizedWeight(q, s, lo, group))
    return layer


def x_blocks_dequantized(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) as the VNNI path sees it: per 32 columns, int8 with scale max|x| / 127, round half away
    from zero; float64."""
    xb = x.double().view(x.shape[0], -1, 32)  # (M, K / 32, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, xb / torch.where(d > 0, d, 1), 0)
    q = torch.sign(q) * torch.floor(q.abs() + 0.5)
    return (q * d).view_as(x)


@needs_lib
@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("isa", list(LEVELS))
def test_kernel_equals_the_float64_oracle(kind, isa, monkeypatch):  # type: ignore[no-untyped-def]
    if isa not in runnable():
        pytest.skip(f"this CPU has no {isa}")
    monkeypatch.setenv("LMSERVE_ISA", isa)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(203, 256, generator=g)  # an odd row count: the kernel's short last block
    layer = LAYERS[kind](w)
    W = layer.dequantize().double()  # (203, 256)
    for m in (1, 2, 3, 4, 5, 8, 9, 16) + ((17, 70) if isa in INT8_X else ()):  # the tile kernel's row chunks
        x = torch.randn(m, 256, generator=g) * torch.linspace(0.1, 3, 256)  # columns of different scales
        y = cpu_native.qgemm(x, layer.qweight, layer.bits, layer.scales, layer.mins, layer.group_size)  # (m, 203)
        xs = x_blocks_dequantized(x) if isa in INT8_X else x.double()
        want = xs @ W.T  # (m, 203)
        assert y.shape == (m, 203)
        assert (y.double() - want).abs().max() <= 2e-5 * want.abs().max(), (kind, isa, m)
        if isa in INT8_X:  # and it really quantized x: within, not at, the float result
            exact = x.double() @ W.T
            bound = (x.double() - xs).abs() @ W.abs().T + 1e-4 * exact.abs().max()  # |dx| . |w| per output
            assert ((y.double() - exact).abs() <= bound).all()
            assert (y.double() - exact).abs().max() > 1e-6 * exact.abs().max()


@needs_lib
@pytest.mark.parametrize("kind", ["int8_row", "int4_g32"])
def test_layers_use_the_kernel_for_few_rows_and_the_reference_for_many(kind, monkeypatch):  # type: ignore[no-untyped-def]
    if "avx2" not in runnable():
        pytest.skip("the layers take the kernel on SIMD paths only")
    monkeypatch.setenv("LMSERVE_ISA", "avx2")  # float x: equal to the reference
    torch.manual_seed(0)
    w = torch.randn(64, 128)
    layer = LAYERS[kind](w)
    layer.cpu_kernel = True
    ref = quant.dequant_matmul
    calls: list[int] = []
    monkeypatch.setattr(quant, "dequant_matmul", lambda x, lay: calls.append(x.shape[0]) or ref(x, lay))
    few, many = torch.randn(cpu_native.MAX_ROWS, 128), torch.randn(cpu_native.MAX_ROWS + 1, 128)
    assert torch.allclose(layer(few), few @ layer.dequantize().T, atol=1e-4) and calls == []
    assert torch.allclose(layer(many), many @ layer.dequantize().T, atol=1e-4) and calls == [cpu_native.MAX_ROWS + 1]
    layer.cpu_kernel = False  # the layer's own default: the reference path always
    layer(few)
    assert calls[-1] == cpu_native.MAX_ROWS


@needs_lib
@pytest.mark.parametrize("kind", ["int8_g16_mins", "int4_g32"])
@pytest.mark.parametrize("isa", INT8_X)
def test_layers_take_the_tile_kernel_for_any_rows_and_repack_when_the_weight_changes(kind, isa, monkeypatch):  # type: ignore[no-untyped-def]
    if isa not in runnable():
        pytest.skip(f"this CPU has no {isa}")
    monkeypatch.setenv("LMSERVE_ISA", isa)
    calls: list[int] = []
    monkeypatch.setattr(quant, "dequant_matmul", lambda x, lay: calls.append(x.shape[0]))
    g = torch.Generator().manual_seed(1)
    layer = LAYERS[kind](torch.randn(40, 96, generator=g))
    layer.cpu_kernel = True
    x = torch.randn(100, 96, generator=g)  # prefill-sized: still the kernel
    want = x_blocks_dequantized(x) @ layer.dequantize().double().T
    assert (layer(x).double() - want).abs().max() <= 2e-5 * want.abs().max() and calls == []
    first = layer.tiles()
    assert layer.tiles() is first  # repacked once, not per call
    with torch.no_grad():
        layer.qweight[:5] = layer.qweight[5:10].clone()  # an in-place change: the tiles are rebuilt
    want = x_blocks_dequantized(x) @ layer.dequantize().double().T
    assert layer.tiles() is not first and (layer(x).double() - want).abs().max() <= 2e-5 * want.abs().max()


@needs_lib
def test_int8_outlier_columns_are_added_back_on_the_kernel_path(monkeypatch):  # type: ignore[no-untyped-def]
    if "avx2" not in runnable():
        pytest.skip("the layers take the kernel on SIMD paths only")
    monkeypatch.setenv("LMSERVE_ISA", "avx2")
    calls: list[int] = []
    real = cpu_native.qgemm
    monkeypatch.setattr(cpu_native, "qgemm", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    w = torch.randn(32, 64)
    w[:, [3, 40]] *= 50  # two outlier columns kept in float
    layer = Int8Linear.from_float(w, outlier_cols=torch.tensor([3, 40]))
    x = torch.randn(3, 64)
    ref = layer(x)  # the reference path (dequantize restores the float columns)
    layer.cpu_kernel = True
    assert torch.allclose(layer(x), ref, atol=1e-4) and calls == [3]
    assert torch.allclose(ref, x @ w.T, rtol=0, atol=0.05 * (x @ w.T).abs().max())


def test_shape_rules():
    assert cpu_native.fits(8, 576, 576) and cpu_native.fits(8, 256, 16) and cpu_native.fits(4, 576, 32)
    assert not cpu_native.fits(4, 576, 16) and not cpu_native.fits(8, 100, 100) and not cpu_native.fits(4, 96, 64)
    assert cpu_native.tiles_fit(4, 576, 32) and cpu_native.tiles_fit(8, 576, 576) and cpu_native.tiles_fit(8, 96, 16)
    assert cpu_native.tiles_fit(4, 544, 32) and not cpu_native.tiles_fit(4, 560, 16 * 5)  # groups of 80 columns
    assert not cpu_native.tiles_fit(4, 520, 8)  # 520 is not a whole number of 32-column blocks


def test_auto_keeps_a_gguf_quantized_on_the_cpu_only():
    from lmserve.models.loader import resolve_quantization
    assert resolve_quantization("auto", "gguf", "cpu") == ("gguf" if cpu_native.fast() else None)
    assert resolve_quantization("auto", "hf", "cpu") is None and resolve_quantization("auto", "gguf", "cuda") is None
    assert resolve_quantization("none", "gguf", "cpu") is None and resolve_quantization("int8", "hf", "cpu") == "int8"


def test_plain_c_is_never_the_layers_path(monkeypatch):  # type: ignore[no-untyped-def]
    """Plain C is slower than dequantize + matmul: capped to it, the layers take the reference."""
    monkeypatch.setenv("LMSERVE_ISA", "c")
    layer = LAYERS["int4_g32"](torch.randn(64, 128))
    layer.cpu_kernel = True
    assert not cpu_native.fast() and not layer.native_fits()


@needs_lib
def test_f16c_gates_the_avx2_tiles_only(monkeypatch):  # type: ignore[no-untyped-def]
    """The AVX2 tile variant reads float16 scales (F16C): a CPU with AVX2 and FMA but no F16C takes the
    float-x kernels instead, while the attention keeps its AVX2 loop (it needs no F16C)."""
    lib = cpu_native._lib()
    if not lib.lm_has_avx2():
        pytest.skip("this CPU has no AVX2")
    monkeypatch.setattr(lib, "lm_has_tiles_avx2", lambda: 0)
    cpu_native._level_for.cache_clear()
    try:
        assert cpu_native._level_for("avx2int8") <= 2  # not the tile kernel
        assert cpu_native.attn_simd("avx2") == 1
    finally:
        cpu_native._level_for.cache_clear()


@needs_lib
def test_layers_made_under_inference_mode_take_the_kernel():  # type: ignore[no-untyped-def]
    """Inference tensors track no version counter: the tile cache keys on their address then."""
    with torch.inference_mode():
        layer = LAYERS["int8_g32"](torch.randn(32, 64))
        layer.cpu_kernel = True
        x = torch.randn(3, 64)
        y = layer(x)
        assert torch.allclose(y, x @ layer.dequantize().T, atol=0.05 * (x @ layer.dequantize().T).abs().max())
        assert torch.equal(layer(x), y)  # the cached tiles


@needs_lib
def test_avx2_tiles_refuse_an_int8_weight_holding_minus_128(monkeypatch):  # type: ignore[no-untyped-def]
    """vpsignb cannot negate -128: the AVX2 tile kernel refuses such a weight by name, and the layer takes
    the float-x kernel instead, exactly."""
    if "avx2int8" not in runnable():
        pytest.skip("this CPU has no AVX2")
    monkeypatch.setenv("LMSERVE_ISA", "avx2int8")
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=g)
    layer = Int8Linear(64, 48, group_size=32)
    q = (w * 40).round().clamp(-127, 127).to(torch.int8)
    q[7, 5] = -128  # a value GGUF's Q8_0 may hold, ours never write
    layer.load(quant.QuantizedWeight(q, torch.full((48, 2), 0.01), None, 32))
    layer.cpu_kernel = True
    assert not layer.tiles().avx2_ok and not layer.tiled()
    with pytest.raises(ValueError, match="-128"):
        cpu_native.qgemm_tiles(torch.randn(2, 64), layer.tiles())
    x = torch.randn(3, 64, generator=g)
    want = x.double() @ layer.dequantize().double().T  # float x: no activation rounding
    assert (layer(x).double() - want).abs().max() <= 2e-5 * want.abs().max()
    q[7, 5] = -127  # the same weight without it: tiled
    layer.load(quant.QuantizedWeight(q, torch.full((48, 2), 0.01), None, 32))
    assert layer.tiles().avx2_ok and layer.tiled()


@needs_lib
@pytest.mark.parametrize("kind", LAYERS)
def test_the_avx2_tiles_equal_the_vnni_tiles_bit_for_bit(kind):  # type: ignore[no-untyped-def]
    """Both variants sum exact int32 products per sub-block and scale in the same order: the same floats."""
    if "vnni" not in runnable():
        pytest.skip("this CPU has no AVX-512 VNNI to compare with")
    g = torch.Generator().manual_seed(4)
    layer = LAYERS[kind](torch.randn(203, 256, generator=g))
    for m in (1, 3, 8, 17):
        x = torch.randn(m, 256, generator=g)
        a = cpu_native.qgemm_tiles(x, layer.tiles(), isa_name="vnni")
        b = cpu_native.qgemm_tiles(x, layer.tiles(), isa_name="avx2int8")
        assert torch.equal(a, b), (kind, m)


@needs_lib
@pytest.mark.parametrize("bits, group, with_mins", [(4, 16, True), (4, 32, False), (8, 16, True), (8, 64, False)])
@pytest.mark.parametrize("isa", INT8_X)
def test_tile_kernel_short_last_tile_and_every_block_kind(bits, group, with_mins, isa):  # type: ignore[no-untyped-def]
    """The tile kernel straight from packed values: 197 rows (the last tile holds 5: under one 8-row
    half), groups of 16 (int4 too, which no layer takes but qgemm can), with and without mins."""
    if isa not in runnable():
        pytest.skip(f"this CPU has no {isa}")
    g = torch.Generator().manual_seed(5)
    n, k = 197, 128
    values = torch.randint(0, 16, (n, k), generator=g) if bits == 4 else torch.randint(-127, 128, (n, k), generator=g)
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 0.001
    mins = (torch.rand(n, k // group, generator=g) - 0.5) * 0.1 if with_mins else None
    tiles = cpu_native.pack_tiles(values, bits, scales, mins, group)
    W = (values.double().view(n, -1, group) * scales.double()[..., None]
         + (0 if mins is None else mins.double()[..., None])).view(n, k)
    for m in (1, 5, 9):
        x = torch.randn(m, k, generator=g)
        y = cpu_native.qgemm_tiles(x, tiles, isa_name=isa)  # (m, 197)
        want = x_blocks_dequantized(x) @ W.T
        assert (y.double() - want).abs().max() <= 2e-5 * want.abs().max(), (m, isa)


@needs_lib
@pytest.mark.parametrize("bits, group, with_mins", [(4, 32, True), (4, 16, True), (8, 32, False), (8, 64, True)])
@pytest.mark.parametrize("isa", INT8_X)
def test_float16_scales_give_the_float32_scales_bits(bits, group, with_mins, isa):  # type: ignore[no-untyped-def]
    """Scales and mins that are all float16 values (a GGUF file's block scales) are stored as float16
    (fewer bytes a weight for the memory-bound one-row step) and widen to the same float32 values: the
    outputs equal, bit for bit, those of the same tiles packed with float32 scales, at every row count,
    and the float64 oracle. Scales that are not all float16 values stay float32; asking for float16
    then is refused."""
    if isa not in runnable():
        pytest.skip(f"this CPU has no {isa}")
    g = torch.Generator().manual_seed(7)
    n, k = 197, 256
    values = torch.randint(0, 16, (n, k), generator=g) if bits == 4 else torch.randint(-127, 128, (n, k), generator=g)
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-5).half().float()  # float16 values, subnormal ones too
    scales[0, 0] = 2.0 ** -24  # the smallest float16 subnormal
    mins = ((torch.rand(n, k // group, generator=g) - 0.5) * 0.1).half().float() if with_mins else None
    half = cpu_native.pack_tiles(values, bits, scales, mins, group)
    full = cpu_native.pack_tiles(values, bits, scales, mins, group, half=False)
    assert half.half and half.scales.dtype == torch.float16 and (mins is None or half.mins.dtype == torch.float16)
    assert not full.half and full.scales.dtype == torch.float32
    W = (values.double().view(n, -1, group) * scales.double()[..., None]
         + (0 if mins is None else mins.double()[..., None])).view(n, k)
    for m in (1, 2, 8, 9, 70):  # 70: past a 64-row chunk
        x = torch.randn(m, k, generator=g)
        y = cpu_native.qgemm_tiles(x, half, isa_name=isa)  # (m, n)
        assert torch.equal(y, cpu_native.qgemm_tiles(x, full, isa_name=isa)), (m, isa)
        want = x_blocks_dequantized(x) @ W.T
        assert (y.double() - want).abs().max() <= 2e-5 * want.abs().max(), (m, isa)
    off = scales.clone()
    off[3, 1] += 1e-7  # not a float16 value
    assert not cpu_native.pack_tiles(values, bits, off, mins, group).half
    with pytest.raises(ValueError, match="float16"):
        cpu_native.pack_tiles(values, bits, off, mins, group, half=True)


def test_gguf_block_scales_are_packed_as_float16():  # type: ignore[no-untyped-def]
    """The default model's linears (its GGUF's Q4_1 / Q8_0 blocks) all take float16 scales in the tiles."""
    if not cpu_native.available() or not cpu_native.int8_x():
        pytest.skip("no tile kernel on this CPU")
    from lmserve import LLM
    from lmserve.layers.quant import GroupQuantLinear
    model = LLM(max_model_len=64, kv_cache_memory="16MiB").engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, GroupQuantLinear) and m.tiled()]
    assert len(layers) == 121 and all(m.tiles().half for m in layers)


@needs_lib
@pytest.mark.parametrize("isa", INT8_X)
def test_tile_kernel_non_finite_and_tiny_activations(isa):  # type: ignore[no-untyped-def]
    """x with a NaN or an infinity in a 32-column block gives NaN rows (quantized to int8 they became
    -127: a finite answer, or an infinity of the wrong sign; a NaN in the block's first 24 columns fell
    out of the max); a row whose blocks are so small that 1 / scale overflows gives zeros, not the
    opposite sign of the float64 answer. Other rows of the batch are unchanged (M > 4: the parallel loop)."""
    if isa not in runnable():
        pytest.skip(f"this CPU has no {isa}")
    g = torch.Generator().manual_seed(6)
    layer = Int8Linear.from_float(torch.randn(40, 96, generator=g), group_size=32)
    tiles = layer.tiles()
    for col in (0, 5, 23, 31, 64):
        for bad in (float("nan"), float("inf"), float("-inf")):
            x = torch.randn(6, 96, generator=g)
            x[2, col] = bad
            y = cpu_native.qgemm_tiles(x, tiles, isa_name=isa)  # (6, 40)
            assert y[2].isnan().all(), (col, bad)
            clean = torch.cat([x[:2], x[3:]])
            assert torch.equal(torch.cat([y[:2], y[3:]]), cpu_native.qgemm_tiles(clean, tiles, isa_name=isa))
    x = torch.full((1, 96), 1e-37)
    x[0, ::3] = -2e-37
    y = cpu_native.qgemm_tiles(x, tiles, isa_name=isa).double()
    exact = x.double() @ layer.dequantize().double().T
    assert y.isfinite().all() and (y * exact >= 0).all() and (y.abs() <= exact.abs()).all()
