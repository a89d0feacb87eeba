"""Cut a loaded model into this rank's shard, in place (Megatron-style tensor parallelism).

    qkv_proj, gate_up_proj   column-parallel: each logical projection keeps its rows of this rank
                             (q / k / v by heads, gate / up by MLP channels); no communication
    o_proj, down_proj        row-parallel: the matching input columns; the partial sums meet in one
                             all-reduce (LinearBase.reduce), the bias added once (rank 0 keeps it)
    embed_tokens             vocab-parallel: this rank's rows; ids outside them look up zeros, and an
                             all-reduce gives every rank the whole embedding
    lm_head / tied table     vocab-parallel: logits for this rank's rows, gathered on rank 0

Every rank reads the whole checkpoint on the host and keeps its part (models/loader.load_model's
`shard` hook runs before the model moves to its device, so a device holds only its shard). A quantized
linear is cut with its scales and groups (`shard_linear`): a column cut must fall on a group boundary,
and a per-row scale (int8 / fp8 per channel) stays whole on every rank, so the int8 model under TP=N
holds exactly the integers and scales of the int8 model under TP=1.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from lmserve.config import ModelConfig
from lmserve.layers.linear import LinearBase
from lmserve.layers.quant import GroupQuantLinear
from lmserve.models.llama import MLP, Attention, LlamaForCausalLM
from lmserve.models.registry import QuantEmbedding
from lmserve.parallel.group import TPGroup, even_split, head_split, vocab_split


def _set(module: nn.Module, name: str, t: torch.Tensor | None) -> None:
    """Replace a parameter or buffer of module by t (a fresh tensor: the old one is freed)."""
    if name in module._parameters:
        module._parameters[name] = None if t is None else nn.Parameter(t.contiguous().clone(), requires_grad=False)
    else:
        module._buffers[name] = None if t is None else t.contiguous().clone()


def shard_linear(layer: LinearBase, rows: list[slice] | None = None, cols: slice | None = None,
                 keep_bias: bool = True) -> None:
    """Keep, of each logical projection i of layer (layer.sizes), its output rows rows[i] (relative to
    that projection), and of the input columns `cols`. A float weight, an integer weight with its
    scales / mins per group, an fp8 weight with its per-row scales, outlier columns (int8): each cut
    the same way. keep_bias=False zeroes the bias (a row-parallel layer adds it on one rank only)."""
    if rows is not None:
        if len(rows) != len(layer.sizes):
            raise ValueError(f"{len(rows)} row ranges for a layer of {len(layer.sizes)} projections")
        idx = torch.cat([torch.arange(off + r.start, off + r.stop) for off, r in zip(layer.offsets, rows)])
        for name, t in [*layer._parameters.items(), *layer._buffers.items()]:
            if t is not None and name != "outlier_cols":
                _set(layer, name, t.index_select(0, idx.to(t.device)))
        layer.sizes = [r.stop - r.start for r in rows]
        layer.offsets = [sum(layer.sizes[:i]) for i in range(len(layer.sizes))]
        layer.out_features = sum(layer.sizes)
    if cols is not None:
        _shard_cols(layer, cols)
        if not keep_bias and layer.bias is not None:
            layer.bias.data.zero_()
    for derived in ("_tiles", "_tiles_key"):  # the CPU tile repack: rebuilt from the new buffers
        layer.__dict__.pop(derived, None)


def _shard_cols(layer: LinearBase, cols: slice) -> None:
    c0, c1, n = cols.start, cols.stop, layer.in_features
    group = getattr(layer, "group_size", None)
    per_row = group is None or group == n  # one scale per output row: kept whole
    if not per_row and (c0 % group or c1 % group):
        raise ValueError(f"tensor parallel: input columns {c0}:{c1} of {type(layer).__name__} cut its "
                         f"quantization groups of {group}")
    packed = getattr(layer, "bits", 8) == 4
    if packed and (c0 % 2 or c1 % 2):
        raise ValueError(f"tensor parallel: input columns {c0}:{c1} of {type(layer).__name__} cut a packed byte")
    for name, t in [*layer._parameters.items(), *layer._buffers.items()]:
        if t is None or name in ("bias", "outlier_cols", "outlier_weight"):
            continue
        if name in ("weight", "qweight"):
            per_col = t.shape[1] / n  # bytes (or values) per input column: 0.5 for packed int4
            _set(layer, name, t[:, int(c0 * per_col):int(c1 * per_col)])
        elif t.dim() == 2 and not per_row:  # scales / mins per group
            _set(layer, name, t[:, c0 // group:c1 // group])
    oc = getattr(layer, "outlier_cols", None)
    if oc is not None:  # int8 outlier columns: those inside the cut, renumbered
        keep = (oc >= c0) & (oc < c1)
        _set(layer, "outlier_weight", layer.outlier_weight[:, keep])
        _set(layer, "outlier_cols", oc[keep] - c0)
        if not keep.any():
            layer.outlier_cols = layer.outlier_weight = None
    layer.in_features = c1 - c0
    if group is not None:
        layer.group_size = c1 - c0 if per_row else group


class _VocabShard:
    """An embedding table holding rows [start, start + count) of the vocabulary; every rank looks up
    its rows (zeros elsewhere) and the all-reduce sums them into the whole embedding."""

    tp: TPGroup
    vocab_start: int
    vocab_count: int

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (N,) -> (N, hidden)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.vocab_count)  # (N,)
        x = super().forward(torch.where(inside, local, torch.zeros_like(local)))  # type: ignore[misc]
        return self.tp.all_reduce(x * inside.unsqueeze(-1).to(x.dtype))


class VocabParallelEmbedding(_VocabShard, nn.Embedding):
    pass


class VocabParallelQuantEmbedding(_VocabShard, QuantEmbedding):
    pass


def check_shardable(model: nn.Module, cfg: ModelConfig, size: int) -> None:
    """ValueError naming what cannot be split over `size` ranks (checked before any rank starts)."""
    if not isinstance(model, LlamaForCausalLM) or type(model).__name__ == "DeepseekForCausalLM":
        raise ValueError(f"tensor parallelism: {cfg.architecture} is not supported (dense Llama-family and "
                         f"Gemma 3 models are)")
    for i, layer in enumerate(model.layers):
        if type(layer.self_attn) is not Attention or type(layer.mlp) is not MLP:
            raise ValueError(f"tensor parallelism: layer {i} of {cfg.architecture} is not dense attention + MLP "
                             f"(mixture-of-experts and MLA layers are not sharded yet)")
    o_proj, unit = model.layers[0].self_attn.o_proj, col_unit(model.layers[0].self_attn.o_proj)
    for r in range(size):
        qh, _ = head_split(cfg.num_heads, cfg.num_kv_heads, size, r)
        c0, c1 = qh.start * cfg.head_dim, qh.stop * cfg.head_dim
        if c0 % unit or (c1 % unit and c1 != o_proj.in_features):
            raise ValueError(f"tensor parallelism: rank {r}'s attention heads (o_proj input columns {c0}:{c1}) cut "
                             f"{type(o_proj).__name__}'s blocks of {unit} columns (quantization groups / the 32 "
                             f"columns x is quantized in): use another tensor_parallel_size or quantization")
    even_split(cfg.intermediate_size, size, 0, mlp_unit(model))


X_BLOCK = 32  # an integer layer's CPU kernel quantizes x per 32 input columns (llama.cpp's way): a rank's
# columns must start on such a block, or its blocks, and so its x, are not the whole layer's


def col_unit(layer: nn.Module) -> int:
    """A row-parallel layer's input columns go to ranks in whole units of this: its quantization group
    (unless one scale a row), and for integer weights the 32-column blocks x is quantized in."""
    g = getattr(layer, "group_size", None)
    unit = 1 if g is None or g == layer.in_features else g
    return math.lcm(unit, X_BLOCK) if isinstance(layer, GroupQuantLinear) else unit


def mlp_unit(model: nn.Module) -> int:
    """The MLP channels go to ranks in whole units of the down projection's (col_unit)."""
    return col_unit(model.layers[0].mlp.down_proj)


def shard_model(model: LlamaForCausalLM, cfg: ModelConfig, tp: TPGroup) -> ModelConfig:
    """Cut the loaded model to rank tp.rank's shard, in place; returns the shard's own shape (its heads,
    KV heads and MLP channels), which sizes its KV cache."""
    check_shardable(model, cfg, tp.size)
    qh, kvh = head_split(cfg.num_heads, cfg.num_kv_heads, tp.size, tp.rank)
    inter = even_split(cfg.intermediate_size, tp.size, tp.rank, mlp_unit(model))
    d = cfg.head_dim

    def cols(s: slice) -> slice:
        return slice(s.start * d, s.stop * d)

    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        shard_linear(attn.qkv_proj, rows=[cols(qh), cols(kvh), cols(kvh)])
        shard_linear(attn.o_proj, cols=cols(qh), keep_bias=tp.rank == 0)
        attn.h, attn.hkv = qh.stop - qh.start, kvh.stop - kvh.start
        shard_linear(mlp.gate_up_proj, rows=[inter, inter])
        shard_linear(mlp.down_proj, cols=inter, keep_bias=tp.rank == 0)
        attn.o_proj.reduce = mlp.down_proj.reduce = tp
    vocab = vocab_split(cfg.vocab_size, tp.size, tp.rank)
    emb = model.embed_tokens
    if isinstance(emb, QuantEmbedding):
        shard_linear(emb.head, rows=[vocab])
        emb.__class__ = VocabParallelQuantEmbedding
    else:
        _set(emb, "weight", emb.weight.data[vocab])
        emb.num_embeddings = vocab.stop - vocab.start
        emb.__class__ = VocabParallelEmbedding
    emb.tp, emb.vocab_start, emb.vocab_count = tp, vocab.start, vocab.stop - vocab.start
    if model.lm_head is not None:
        shard_linear(model.lm_head, rows=[vocab])
    model.__dict__.pop("_cpu_plan", None)  # the CPU decode plan is built on first use, from the shard
    return dataclasses.replace(cfg, num_heads=qh.stop - qh.start, num_kv_heads=kvh.stop - kvh.start,
                               intermediate_size=inter.stop - inter.start)
