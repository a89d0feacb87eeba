"""The AWQ checkpoint format: an HF folder whose quantized linears are AutoAWQ "GEMM" tensors.

Per quantized linear `<prefix>` (e.g. `model.layers.0.self_attn.q_proj`), W [out, in], group G:

    <prefix>.qweight  int32   [in, out / 8]      eight 4-bit q values per int32, along the output dim
    <prefix>.qzeros   int32   [in / G, out / 8]  the zero points, packed the same way
    <prefix>.scales   float16 [in / G, out]
    <prefix>.bias     (if any) float

Within each int32, nibble i (bits 4i .. 4i + 3) holds output column 8c + AWQ_ORDER[i]; AWQ_ORDER =
[0, 2, 4, 6, 1, 3, 5, 7] (AutoAWQ's `WQLinear_GEMM.from_linear` packs with this order map and its
`packing_utils.dequantize_gemm` unpacks with the inverse [0, 4, 1, 5, 2, 6, 3, 7]); dequantized,
W.T = (q - zero) * scale. config.json carries AutoAWQ's "quantization_config" (quant_method "awq",
bits 4, group_size, zero_point true, version "gemm"), which is also how llm-compressor / transformers
label such folders, so a user's AutoAWQ checkpoint reads back through the same `load_awq_tensors`.
Everything else (embeddings, norms, the LM head) is stored as float.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from lmserve.config import ModelConfig
from lmserve.layers.rotary import hf_rope_scaling
from lmserve.quant.awq import check_dense, dequantize_int4, quantize_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an int32 holds column AWQ_ORDER[i] of its eight
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j sits in nibble AWQ_REVERSE_ORDER[j]
AWQ_SUFFIXES = ("qweight", "qzeros", "scales")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")


class Int4Weight(NamedTuple):
    """The canonical int4 form: q uint8 [out, in] in 0..15, scales / zeros float32 [out, in // group]."""

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group: int

    def dequantize(self) -> torch.Tensor:
        return dequantize_int4(self.q, self.scales, self.zeros)


# ---------------------------------------------------------------- packing

def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] integers in 0..15 -> int32 [rows, cols / 8], AWQ's nibble order along the columns."""
    rows, cols = values.shape
    if cols % 8:
        raise ValueError(f"AWQ packing needs a multiple of 8 output features, got {cols}")
    v = values.to(torch.int64).reshape(rows, cols // 8, 8)[..., list(AWQ_ORDER)]  # nibble i <- column ORDER[i]
    if int(v.min()) < 0 or int(v.max()) > 15:
        raise ValueError("AWQ packing: values must lie in 0..15")
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    packed = (v << shifts).sum(-1)  # (rows, cols / 8) in [0, 2^32)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # the same bits, as int32


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols / 8] -> uint8 [rows, cols] in 0..15: pack_awq undone."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    nibbles = (packed.to(torch.int64)[..., None] >> shifts) & 0xF  # (rows, cols / 8, 8): nibble i
    cols = nibbles[..., list(AWQ_REVERSE_ORDER)]  # column j <- nibble REVERSE[j]
    return cols.reshape(packed.shape[0], -1).to(torch.uint8)


def awq_tensors(w: Int4Weight) -> dict[str, torch.Tensor]:
    """The canonical form -> AutoAWQ GEMM tensors {qweight, qzeros, scales}. The scales must already be
    fp16 values (quantize_int4 rounds them so) for the round trip to be exact; zeros whole, 0..15."""
    scales16 = w.scales.to(torch.float16)
    if not torch.equal(scales16.float(), w.scales.float()):
        raise ValueError("AWQ checkpoint: scales must be representable in float16 (quantize with fp16 scales)")
    if not torch.equal(w.zeros, w.zeros.round()):
        raise ValueError("AWQ checkpoint: zero points must be whole numbers")
    return {"qweight": pack_awq(w.q.T.contiguous()), "qzeros": pack_awq(w.zeros.T.contiguous()),
            "scales": scales16.T.contiguous()}


def load_awq_tensors(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                     group_size: int | None = None) -> Int4Weight:
    """AutoAWQ GEMM tensors (qweight int32 [in, out/8], qzeros int32 [in/G, out/8], scales fp16
    [in/G, out]) -> the canonical (q uint8 [out, in], scales float32 [out, in/G], zeros float32
    [out, in/G], group). group_size defaults to in / (in/G), and is checked if given."""
    in_f, groups = qweight.shape[0], scales.shape[0]
    group = in_f // groups
    if in_f % groups or (group_size not in (None, -1) and group_size != group):
        raise ValueError(f"AWQ tensors: {in_f} input features in {groups} groups do not match "
                         f"group_size {group_size}")
    out_f = scales.shape[1]
    if tuple(qweight.shape) != (in_f, out_f // 8) or tuple(qzeros.shape) != (groups, out_f // 8):
        raise ValueError(f"AWQ tensors: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and "
                         f"scales {tuple(scales.shape)} do not fit together")
    q = unpack_awq(qweight).T.contiguous()  # (out, in)
    zeros = unpack_awq(qzeros).T.float().contiguous()  # (out, in/G)
    return Int4Weight(q, scales.T.float().contiguous(), zeros, group)


def group_awq_tensors(weights: Iterable[tuple[str, torch.Tensor]], group_size: int | None = None
                      ) -> Iterator[tuple[str, torch.Tensor | Int4Weight]]:
    """A checkpoint's (name, tensor) stream with each linear's qweight / qzeros / scales gathered into one
    ('<prefix>.weight', Int4Weight) item (yielded once all three have been seen); other tensors pass."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights:
        prefix, _, kind = name.rpartition(".")
        if kind not in AWQ_SUFFIXES:
            yield name, t
            continue
        parts = pending.setdefault(prefix, {})
        parts[kind] = t
        if len(parts) == 3:
            del pending[prefix]
            yield f"{prefix}.weight", load_awq_tensors(parts["qweight"], parts["qzeros"], parts["scales"], group_size)
    if pending:
        raise ValueError(f"AWQ checkpoint: incomplete quantized tensors for {sorted(pending)[:4]}")


def dequantized_weights(weights: Iterable[tuple[str, torch.Tensor]], group_size: int | None = None
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's stream with every AWQ linear dequantized to a float32 '<prefix>.weight'."""
    for name, t in group_awq_tensors(weights, group_size):
        yield name, (t.dequantize() if isinstance(t, Int4Weight) else t)


def read_quantization_config(path: str | Path) -> dict[str, Any] | None:
    """config.json's "quantization_config" (or a quant_config.json beside it, AutoAWQ's older place)."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text()).get("quantization_config")
    if cfg is None and (path / "quant_config.json").is_file():
        cfg = json.loads((path / "quant_config.json").read_text())
    return cfg


def check_awq_config(qc: dict[str, Any]) -> int:
    """The group size of an AWQ quantization config we can load (4 bits, zero point, GEMM packing; the
    newer names or AutoAWQ's older quant_config.json names); ValueError naming what is not supported."""
    method = qc.get("quant_method", "awq")
    bits = qc.get("bits", qc.get("w_bit"))
    version = str(qc.get("version", "gemm")).lower()
    group = qc.get("group_size", qc.get("q_group_size"))
    if method != "awq" or bits != 4 or version != "gemm" or not qc.get("zero_point", True):
        raise ValueError(f"quantization_config: only AWQ 4-bit GEMM with zero points is supported, got "
                         f"quant_method={method!r} bits={bits!r} version={version!r} zero_point={qc.get('zero_point')!r}")
    if not isinstance(group, int) or group < -1 or group == 0:
        raise ValueError(f"quantization_config: bad group_size {group!r}")
    if qc.get("modules_to_not_convert"):  # every decoder linear loads as int4: float ones would be re-rounded
        raise ValueError(f"quantization_config.modules_to_not_convert: layers kept in float inside an AWQ "
                         f"checkpoint are not supported, got {qc['modules_to_not_convert']!r}")
    return group


# ---------------------------------------------------------------- saving

MODEL_TYPES = {"Gemma3ForCausalLM": "gemma3_text"}  # HF's model_type where it is not the lowered name ("gemma3"
# is the multimodal wrapper: HF would build its default 4B text config)


def hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """An HF config.json for our ModelConfig (what ModelConfig.from_hf reads back)."""
    rope = cfg.rope_scaling
    if rope and rope.get("rope_type") == "freq_factors":  # a Llama-3.x GGUF's rope_freqs: only we read the type
        rope = hf_rope_scaling(rope["freq_factors"], cfg.rope_theta)
    model_type = MODEL_TYPES.get(cfg.architecture, cfg.architecture.removesuffix("ForCausalLM").lower())
    d: dict[str, Any] = {
        "architectures": [cfg.architecture], "model_type": model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.qkv_bias, "hidden_act": cfg.hidden_act, "rope_scaling": rope,
        "sliding_window": cfg.sliding_window, "use_sliding_window": cfg.sliding_window is not None,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) if len(cfg.eos_token_ids) != 1 else cfg.eos_token_ids[0],
    }
    if cfg.layer_types is not None:  # which layers slide (Gemma 3's pattern, Qwen's max_window_layers)
        d["layer_types"] = list(cfg.layer_types)
    if cfg.architecture.startswith("Gemma3"):  # (a missing key would take Gemma3TextConfig's default)
        d.update(query_pre_attn_scalar=cfg.query_pre_attn_scalar or cfg.head_dim,
                 rope_local_base_freq=cfg.rope_local_theta, final_logit_softcapping=cfg.final_logit_softcapping)
    return d


def model_state(model: nn.Module, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(HF name, float tensor [out, in] or vector, is a quantized linear) for every tensor of our model,
    the fused q/k/v and gate/up split back into their HF projections."""
    split = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    norms, offset = getattr(model, "offset_norms", ()), getattr(model, "norm_offset", 0.0)  # Gemma: 1 + w

    def hf(leaf: str, kind: str, t: torch.Tensor) -> torch.Tensor:  # a norm's weight as HF holds it
        return t.float() - offset if offset and kind == "weight" and leaf in norms else t

    yield "model.embed_tokens.weight", model.embed_tokens.weight, False
    for i, layer in enumerate(model.layers):
        for name, m in layer.named_modules():
            params = {k: v for k, v in m.named_parameters(recurse=False) if v is not None}
            if not params:
                continue
            base = f"model.layers.{i}.{name}"
            parent, _, leaf = base.rpartition(".")
            quantized = hasattr(m, "in_features")  # a Linear
            for kind, t in params.items():
                if leaf in split:
                    for part, chunk in zip(split[leaf], t.split(m.sizes, dim=0)):
                        yield f"{parent}.{part}.{kind}", chunk, quantized and kind == "weight"
                else:
                    yield f"{base}.{kind}", hf(leaf, kind, t), quantized and kind == "weight"
    yield "model.norm.weight", hf("norm", "weight", model.norm.weight), False
    if model.lm_head is not None:
        yield "lm_head.weight", model.lm_head.weight, False


@torch.no_grad()
def save_awq_checkpoint(model: nn.Module, cfg: ModelConfig, out: str | Path, group_size: int,
                        source: str | Path | None = None, tokenizer: Any = None,
                        float_dtype: torch.dtype = torch.float32) -> dict[str, Int4Weight]:
    """Quantize every decoder linear of `model` (already scaled by awq_calibrate) group-wise to int4 and
    write an AWQ HF folder: config.json (the source's, when it is an HF folder, else built from cfg)
    with the quantization config, model.safetensors, and the tokenizer files (copied from an HF
    source; written from our tokenizer for a GGUF one). Returns what was saved, in canonical form."""
    from safetensors.torch import save_file

    check_dense(model)  # before anything is written
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    saved: dict[str, Int4Weight] = {}
    for name, t, quantized in model_state(model, cfg):
        if quantized:
            q, s, z = quantize_int4(t.detach().float().cpu(), group_size)
            w = saved[name.removesuffix(".weight")] = Int4Weight(q, s, z, group_size)
            for kind, packed in awq_tensors(w).items():
                tensors[f"{name.removesuffix('.weight')}.{kind}"] = packed
        else:
            tensors[name] = t.detach().to("cpu", float_dtype).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    src = Path(source) if source is not None else None
    src_dir = src if src is not None and src.is_dir() else None
    config = json.loads((src_dir / "config.json").read_text()) if src_dir and (src_dir / "config.json").is_file() \
        else hf_config_dict(cfg)
    config["torch_dtype"] = str(float_dtype).removeprefix("torch.")
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                     "zero_point": True, "version": "gemm", "modules_to_not_convert": None}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if src_dir is not None and src_dir.resolve() != out.resolve():
        for f in TOKENIZER_FILES:
            if (src_dir / f).is_file():
                shutil.copy2(src_dir / f, out / f)
    elif tokenizer is not None:
        write_tokenizer(tokenizer, out)
    return saved


def write_tokenizer(tokenizer: Any, out: Path) -> None:
    """Our Tokenizer (e.g. built from GGUF metadata) as tokenizer.json + tokenizer_config.json."""
    raw = tokenizer.raw
    if tokenizer.add_bos:  # HF's tokenizer adds the BOS through tokenizer.json's post-processor (it ignores
        from tokenizers import Tokenizer as RawTokenizer  # add_bos_token), which a GGUF's has none of
        from tokenizers import processors
        raw = RawTokenizer.from_str(raw.to_str())
        bos = processors.TemplateProcessing(single=f"{tokenizer.bos_token}:0 $A:0",
                                            pair=f"{tokenizer.bos_token}:0 $A:0 $B:1",
                                            special_tokens=[(tokenizer.bos_token, tokenizer.bos_token_id)])
        raw.post_processor = bos if raw.post_processor is None else processors.Sequence([raw.post_processor, bos])
    raw.save(str(out / "tokenizer.json"))
    tc = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_token,
          "eos_token": tokenizer.eos_token, "add_bos_token": tokenizer.add_bos,
          "chat_template": tokenizer.chat_template}
    (out / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in tc.items() if v is not None}, indent=2))
