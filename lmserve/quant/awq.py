"""AWQ (activation-aware weight quantization) by our own calibration, on our own float model.

For every group of linears that read the same input (q/k/v; gate/up; o; down) we:

1. capture that input on calibration text (forward hooks on the linears; `capture_inputs`): the mean
   |x| of every input channel over all calibration tokens, and a seeded sample of rows for the search;
2. search a per-input-channel scale s = mean|x| ** alpha (normalised so that max(s) * min(s) = 1, as
   AutoAWQ does) for alpha on a grid 0, 1/n, ..., (n-1)/n, keeping the alpha whose quantized layer,
   Q(W * s) / s, gives the smallest mean squared output error on the sampled rows (`search_scale`;
   alpha = 0 is s = 1, plain round-to-nearest, so the search never does worse than RTN there);
3. fold s into the op before: W's columns are multiplied by s and the previous op's output divided by
   it, so the float model computes the same function (`apply_scales`): q/k/v -> input_layernorm,
   gate/up -> post_attention_layernorm, down -> the up_proj rows, o -> the v_proj rows (only when
   every query head has its own KV head, AutoAWQ's rule: with GQA one v row feeds several o columns);
4. quantize every decoder linear group-wise to int4 (`quantize_int4`), round to nearest from each
   group's min/max; lmserve/quant/checkpoint.py packs and saves the result.

Canonical int4 form (the one `Int4Linear.from_quantized` in lmserve/layers/quant.py takes): q uint8
[out, in] in 0..15, scales and zeros float [out, in // group], w = (q - zeros) * scales. Our quantizer
is not lmserve.layers.quant.quantize_int4 (llama.cpp's Q4_1 rule: min and max map exactly onto 0 and
15, so its zeros are fractional): AWQ's zero points are whole numbers in 0..15 (they are stored as
4-bit qzeros) and its scales fp16, so here the zero is rounded and the scales rounded to fp16 first,
as AutoAWQ does. Weight clipping (AutoAWQ's second search) is not done.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from lmserve.layers.linear import Linear, MergedLinear

N_GRID = 20  # AutoAWQ's grid: alpha in {0, 1/20, ..., 19/20}


# ---------------------------------------------------------------- group-wise int4, round to nearest

def quantize_int4(w: torch.Tensor, group: int, scale_dtype: torch.dtype | None = torch.float16
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q uint8 [out, in] in 0..15, scales float32 [out, in // group], zeros float32
    [out, in // group]) with w ~ (q - zeros) * scales: per group of `group` input channels, scale =
    (max - min) / 15 (at least 1e-5), zero = round(-min / scale) clamped to 0..15, q = round(w / scale)
    + zero clamped to 0..15 (AutoAWQ's pseudo_quantize_tensor). With scale_dtype (fp16 by default:
    what an AWQ checkpoint stores) the scales are rounded to it first and q is computed against the
    rounded scales, so a save / load round trip reproduces exactly these tensors."""
    out_f, in_f = w.shape
    if group <= 0 or in_f % group:
        raise ValueError(f"group_size {group} must divide in_features {in_f}")
    g = w.detach().float().reshape(out_f, in_f // group, group)  # (out, G, group)
    lo, hi = g.amin(-1), g.amax(-1)  # (out, G)
    scales = ((hi - lo).clamp(min=1e-5) / 15)
    if scale_dtype is not None:
        scales = scales.to(scale_dtype).float()
    zeros = (-torch.round(lo / scales)).clamp(0, 15)
    q = (torch.round(g / scales[..., None]) + zeros[..., None]).clamp(0, 15)
    return q.reshape(out_f, in_f).to(torch.uint8), scales, zeros


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The canonical form back to float32 [out, in]: (q - zeros) * scales, group by group."""
    out_f, in_f = q.shape
    groups = scales.shape[1]
    g = q.float().reshape(out_f, groups, in_f // groups)
    return ((g - zeros[..., None]) * scales[..., None]).reshape(out_f, in_f)


def fake_quantize(w: torch.Tensor, group: int) -> torch.Tensor:
    """What the int4 layer computes with: dequantize(quantize(w)), float32 [out, in]."""
    return dequantize_int4(*quantize_int4(w, group))


# ---------------------------------------------------------------- the scale search

def awq_scales(x_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = mean|x| ** alpha per input channel, clamped at 1e-4 and normalised by sqrt(max * min)."""
    s = x_mean.float().pow(alpha).clamp(min=1e-4)
    s = s / (s.max() * s.min()).sqrt()
    return torch.where(torch.isfinite(s), s, torch.ones_like(s))


def output_error(w: torch.Tensor, x: torch.Tensor, s: torch.Tensor, group: int) -> float:
    """Mean squared error of the layer's output on rows x [N, in] when W [out, in] is replaced by
    Q(W * s) / s (s = 1: plain round to nearest)."""
    w, x = w.float(), x.float()
    wq = fake_quantize(w * s[None, :], group) / s[None, :]
    return float((x @ (w - wq).T).pow(2).mean())


@dataclass
class ScaleSearch:
    """The outcome of one search: the chosen alpha and scales, and the error at every grid point."""

    alpha: float
    scales: torch.Tensor  # (in,)
    errors: list[tuple[float, float]]  # (alpha, output MSE), in grid order

    @property
    def error(self) -> float:
        return min(e for _, e in self.errors)

    @property
    def rtn_error(self) -> float:
        return self.errors[0][1]  # alpha = 0: s = 1


def search_scale(w: torch.Tensor, x: torch.Tensor, group: int, n_grid: int = N_GRID,
                 x_mean: torch.Tensor | None = None) -> ScaleSearch:
    """The alpha in {0, 1/n_grid, ..., (n_grid-1)/n_grid} whose scales minimise output_error on x.
    x_mean (mean |x| per channel) defaults to x's own; ties keep the smaller alpha.

    With more rows than input channels the error is the same quadratic form through the Gram matrix,
    mean((x D^T)^2) = sum((D G) * D) / (N * out) with D = W - W_q and G = x^T x, so each grid point costs
    out * in^2 instead of N * in * out."""
    w, x = w.float(), x.float()
    x_mean = x.abs().mean(0) if x_mean is None else x_mean
    n, out_f = x.shape[0], w.shape[0]
    gram = x.T @ x if n > x.shape[1] else None  # (in, in)

    def error(s: torch.Tensor) -> float:
        if gram is None:
            return output_error(w, x, s, group)
        d = w - fake_quantize(w * s[None, :], group) / s[None, :]
        return float(((d @ gram) * d).sum().clamp(min=0)) / (n * out_f)

    errors = []
    best: tuple[float, float, torch.Tensor] | None = None
    for i in range(n_grid):
        alpha = i / n_grid
        s = awq_scales(x_mean, alpha)
        err = error(s)
        errors.append((alpha, err))
        if best is None or err < best[1]:
            best = (alpha, err, s)
    assert best is not None
    return ScaleSearch(best[0], best[2], errors)


# ---------------------------------------------------------------- calibration activations

@dataclass
class Captured:
    """One linear's calibration input: sum |x| per channel over every token, and sampled rows."""

    abs_sum: torch.Tensor | None = None
    count: int = 0
    rows: list[torch.Tensor] = field(default_factory=list)

    @property
    def mean_abs(self) -> torch.Tensor:
        assert self.abs_sum is not None
        return self.abs_sum / self.count

    @property
    def sample(self) -> torch.Tensor:
        return torch.cat(self.rows)


def decoder_linears(model: nn.Module) -> dict[str, Linear]:
    """The quantizable linears: every Linear inside the decoder layers (not the LM head)."""
    return {f"layers.{name}": m for name, m in model.layers.named_modules() if isinstance(m, Linear)}


@torch.no_grad()
def capture_inputs(model: nn.Module, run: Callable[[list[int]], object], sequences: Sequence[list[int]],
                   max_rows: int = 4096, seed: int = 0) -> dict[str, Captured]:
    """Run every calibration sequence through `run` (a forward of `model`, e.g. LLM.score) with forward
    hooks on the decoder linears. Keeps, per linear, mean |x| over all tokens and about max_rows rows
    (the same seeded positions for every linear) for the scale search."""
    linears = decoder_linears(model)
    caps = {name: Captured() for name in linears}
    total = sum(len(s) for s in sequences)
    per_seq = [max(1, math.ceil(max_rows * len(s) / total)) for s in sequences]
    gen = torch.Generator().manual_seed(seed)
    keep: list[torch.Tensor] = []

    def hook(name: str) -> Callable:  # type: ignore[type-arg]
        def fn(module: nn.Module, args: tuple, _out: torch.Tensor) -> None:  # type: ignore[type-arg]
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()  # (N, in)
            c = caps[name]
            c.abs_sum = x.abs().sum(0).cpu() if c.abs_sum is None else c.abs_sum + x.abs().sum(0).cpu()
            c.count += x.shape[0]
            c.rows.append(x[keep[0].to(x.device)].cpu().clone())
        return fn

    handles = [m.register_forward_hook(hook(name)) for name, m in linears.items()]
    try:
        for seq, n in zip(sequences, per_seq):
            keep[:] = [torch.randperm(len(seq), generator=gen)[:n].sort().values]
            run(list(seq))
    finally:
        for h in handles:
            h.remove()
    return caps


# ---------------------------------------------------------------- which scale goes where

@dataclass
class ScaleGroup:
    """Linears that read one input, the op whose output is that input, and the input's capture."""

    prev: str  # module path (an RMSNorm, or a MergedLinear's shard as 'path[shard]')
    linears: list[str]
    capture: str  # the linear whose captured input is the group's input


def scale_groups(model: nn.Module) -> list[ScaleGroup]:
    """AutoAWQ's Llama rules on our fused modules (q/k/v are one MergedLinear, gate/up another)."""
    out = []
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}"
        attn = layer.self_attn
        out.append(ScaleGroup(f"{p}.input_layernorm", [f"{p}.self_attn.qkv_proj"], f"{p}.self_attn.qkv_proj"))
        if attn.h == attn.hkv:  # one v row per o column: the o_proj scale folds into v_proj's rows
            out.append(ScaleGroup(f"{p}.self_attn.qkv_proj[2]", [f"{p}.self_attn.o_proj"], f"{p}.self_attn.o_proj"))
        mlp_norm = "pre_feedforward_layernorm" if hasattr(layer, "pre_feedforward_layernorm") else "post_attention_layernorm"
        out.append(ScaleGroup(f"{p}.{mlp_norm}", [f"{p}.mlp.gate_up_proj"], f"{p}.mlp.gate_up_proj"))  # (Gemma: sandwich)
        out.append(ScaleGroup(f"{p}.mlp.gate_up_proj[1]", [f"{p}.mlp.down_proj"], f"{p}.mlp.down_proj"))
    return out


@torch.no_grad()
def apply_scales(model: nn.Module, group: ScaleGroup, s: torch.Tensor) -> None:
    """Fold s into the model: the group's linears' columns times s, the previous op's output over s."""
    modules = dict(model.named_modules())
    name, _, shard = group.prev.partition("[")
    prev = modules[name]
    if shard:
        assert isinstance(prev, MergedLinear)
        k = int(shard.rstrip("]"))
        lo, n = prev.offsets[k], prev.sizes[k]
        sv = s.to(prev.weight.device, torch.float32)
        prev.weight.data[lo:lo + n] = (prev.weight.data[lo:lo + n].float() / sv[:, None]).to(prev.weight.dtype)
        if prev.bias is not None:
            prev.bias.data[lo:lo + n] = (prev.bias.data[lo:lo + n].float() / sv).to(prev.bias.dtype)
    else:  # RMSNorm: y = weight * norm(x)
        w = prev.weight
        w.data = (w.data.float() / s.to(w.device, torch.float32)).to(w.dtype)
    for lin in group.linears:
        w = modules[lin].weight
        w.data = (w.data.float() * s.to(w.device, torch.float32)[None, :]).to(w.dtype)


# ---------------------------------------------------------------- the whole pass

@dataclass
class AwqResult:
    """Per scale group: the chosen alpha and the output error it gives against round-to-nearest."""

    group_size: int
    searches: dict[str, ScaleSearch]  # by the group's capture name

    def summary(self) -> list[dict[str, float | str]]:
        return [{"linears": name, "alpha": s.alpha, "mse": s.error, "rtn_mse": s.rtn_error}
                for name, s in self.searches.items()]


def check_dense(model: nn.Module) -> None:
    """ValueError unless every decoder layer is dense attention (one qkv_proj, o_proj) and a dense MLP
    (gate_up_proj, down_proj): the layers AutoAWQ's Llama rules (scale_groups) and the HF AWQ layout
    describe. A mixture-of-experts layer (an expert sees only its routed tokens; the router stays
    float) or an MLA one is refused before any work."""
    for i, layer in enumerate(model.layers):
        parts = {"self_attn": ("qkv_proj", "o_proj"), "mlp": ("gate_up_proj", "down_proj")}
        for owner, names in parts.items():
            if not all(isinstance(getattr(getattr(layer, owner), n, None), Linear) for n in names):
                raise ValueError(f"AWQ: layer {i}'s {owner} is not dense ({type(getattr(layer, owner)).__name__}): "
                                 f"mixture-of-experts and MLA models are not supported")


def check_group_size(model: nn.Module, group: int) -> None:
    bad = sorted({m.in_features for m in decoder_linears(model).values() if m.in_features % group})
    if group <= 0 or bad:
        raise ValueError(f"group_size {group} must divide every quantized linear's in_features ({bad})")


def default_group_size(model: nn.Module, preferred: int = 128) -> int:
    """`preferred`, or the largest power of two below it that divides every decoder linear's input."""
    ins = {m.in_features for m in decoder_linears(model).values()}
    g = preferred
    while g > 1 and any(i % g for i in ins):
        g //= 2
    return g


def awq_calibrate(model: nn.Module, run: Callable[[list[int]], object], sequences: Sequence[list[int]],
                  group: int, n_grid: int = N_GRID, max_rows: int = 4096, seed: int = 0) -> AwqResult:
    """Capture, search every scale group on the original weights, then fold every chosen scale into
    `model` (in place; the float model's outputs are unchanged). Quantize afterwards."""
    check_dense(model)
    check_group_size(model, group)
    caps = capture_inputs(model, run, sequences, max_rows, seed)
    modules = dict(model.named_modules())
    chosen = []
    for g in scale_groups(model):
        w = torch.cat([modules[n].weight.detach().float().cpu() for n in g.linears])
        cap = caps[g.capture]
        chosen.append((g, search_scale(w, cap.sample, group, n_grid, cap.mean_abs)))
    for g, search in chosen:
        apply_scales(model, g, search.scales)
    return AwqResult(group, {g.capture: s for g, s in chosen})


@torch.no_grad()
def fake_quantize_model(model: nn.Module, group: int) -> None:
    """Replace every decoder linear's weight by its int4 round trip (the quantized model, in float)."""
    for m in decoder_linears(model).values():
        m.weight.data = fake_quantize(m.weight.data, group).to(m.weight.device, m.weight.dtype)
