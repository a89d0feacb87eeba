"""GGUF files (llama.cpp's format): `GGUFFile` parses one once and gives its ModelConfig, its tensors
under HF names with HF's conventions (dequantized, or the blocks themselves for GGUF_NATIVE types), and
the metadata the tokenizer reads; `gguf_layers` swaps a model's linears for quantized layers that hold
a file's blocks as they are (quantization="gguf")."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lmserve.config import ModelConfig
from lmserve.layers.linear import Linear
from lmserve.layers.quant import GGUF_NATIVE, Int4Linear, Int8Linear, QuantizedWeight, gguf_blocks
from lmserve.models.registry import GGUF_ARCHS, QuantEmbedding

class GGUFFile:
    """One parsed GGUF file: metadata fields and tensors, read once and shared by config/weights/tokenizer."""

    def __init__(self, path: Path) -> None:
        import gguf  # lazy: only GGUF users need it

        class _Reader(gguf.GGUFReader):
            """GGUFReader over a plain ndarray view of its memmap: slicing a memmap runs Python
            code per slice, and the reader slices ~1M times for the vocabulary (5 s -> 1.7 s)."""

            @property
            def data(self) -> np.ndarray:
                return self._plain

            @data.setter
            def data(self, value: np.ndarray) -> None:
                self._plain = np.asarray(value)

        self.path = path
        self.reader = _Reader(str(path))
        self.arch = self.field("general.architecture")  # read once: every tensor name maps through it

    def field(self, key: str, default=None):  # type: ignore[no-untyped-def]
        f = self.reader.fields.get(key)
        if f is None:
            return default
        return f.contents()

    def config(self) -> ModelConfig:
        arch = self.arch
        if arch not in GGUF_ARCHS:
            raise ValueError(f"GGUF architecture {arch!r} is not supported ({', '.join(GGUF_ARCHS)})")
        g = lambda k, d=None: self.field(f"{arch}.{k}", d)  # noqa: E731
        heads = g("attention.head_count")
        hidden = g("embedding_length")
        names = {t.name for t in self.reader.tensors}
        vocab = g("vocab_size") or len(self.reader.fields["tokenizer.ggml.tokens"].data)
        eos = self.field("tokenizer.ggml.eos_token_id")
        eos_ids = [eos] if eos is not None else []
        eot = self.field("tokenizer.ggml.eot_token_id")
        if eot is not None and eot not in eos_ids:
            eos_ids.append(eot)
        extra: dict[str, Any] = {}
        if arch == "gemma3":
            n = int(g("block_count"))
            extra = dict(layer_types=tuple("full_attention" if (i + 1) % self.GEMMA3_SWA_PATTERN == 0 else
                                           "sliding_attention" for i in range(n)),
                         rope_local_theta=self.GEMMA3_LOCAL_ROPE, hidden_act="gelu_pytorch_tanh",
                         # 27B (62 layers) scales attention by hidden / heads, the others by head_dim
                         # (llama.cpp's rule; HF's configs say the same through query_pre_attn_scalar)
                         query_pre_attn_scalar=float(hidden // heads) if n == 62 else None)
            tokens = self.field("tokenizer.ggml.tokens") or []
            if "<end_of_turn>" in tokens and tokens.index("<end_of_turn>") not in eos_ids:
                eos_ids.append(tokens.index("<end_of_turn>"))  # the chat turn's end (HF's generation config)
        return ModelConfig(
            **extra,
            architecture=GGUF_ARCHS[arch],
            vocab_size=int(vocab),
            hidden_size=int(hidden),
            intermediate_size=int(g("feed_forward_length")),
            num_layers=int(g("block_count")),
            num_heads=int(heads),
            num_kv_heads=int(g("attention.head_count_kv", heads)),
            head_dim=int(g("attention.key_length", hidden // heads)),
            rope_theta=float(g("rope.freq_base", 10000.0)),
            rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
            max_position_embeddings=int(g("context_length", 2048)),
            tie_word_embeddings="output.weight" not in names,
            qkv_bias="blk.0.attn_q.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            sliding_window=g("attention.sliding_window"),
            rope_scaling=self._rope_scaling(arch),
            bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )

    def _rope_scaling(self, arch: str) -> dict[str, Any] | None:
        """The `{arch}.rope.scaling.*` keys and the `rope_freqs` tensor as ModelConfig.rope_scaling.

        Read as llama.cpp reads them: a missing type means linear, the factor may sit under its old
        name `rope.scale_linear`, type 'none' turns the factor off, and `rope_freqs` (what the converter
        writes for Llama-3.x's llama3 scaling) divides each frequency, on top of any linear factor.
        Other types (yarn, longrope) are passed on by name, so that building the rotary raises, as for
        an HF config whose scaling it does not implement.
        """
        g = lambda k: self.field(f"{arch}.{k}")  # noqa: E731
        kind = g("rope.scaling.type") or "linear"
        if kind not in ("none", "linear"):
            return {"rope_type": kind, "factor": float(g("rope.scaling.factor") or 1.0)}
        factor = 1.0 if kind == "none" else float(g("rope.scaling.factor") or g("rope.scale_linear") or 1.0)
        freqs = next((t for t in self.reader.tensors if t.name == "rope_freqs.weight"), None)
        if freqs is not None:
            from gguf import quants
            divisors = np.asarray(quants.dequantize(freqs.data, freqs.tensor_type), dtype=np.float64)  # (d/2,)
            return {"rope_type": "freq_factors", "freq_factors": tuple((divisors.reshape(-1) * factor).tolist())}
        return {"rope_type": "linear", "factor": factor} if factor != 1.0 else None

    _NAMES = {
        "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    # Gemma 3's sandwich norms: llama.cpp's ffn_norm is the norm before the MLP there
    _GEMMA3_NAMES = {**_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                     "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
    GEMMA3_SWA_PATTERN = 6  # every 6th layer global, as llama.cpp and HF set it for Gemma 3
    GEMMA3_LOCAL_ROPE = 10_000.0  # the local layers' rope base (llama.cpp's freq_base_swa for Gemma 3)

    def weights(self, cfg: ModelConfig, native: frozenset[str] = frozenset()
                ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """Tensors under HF names and HF's conventions, dequantized, except those named in `native`: their
        blocks as they are (`gguf_blocks`); Llama Q/K rows un-permuted (llama.cpp permutes them), scales
        with their rows; Gemma norm weights back from llama.cpp's 1 + w to w.

        Dequantization (numpy, releases the GIL) runs on a thread pool: it halves cold-load time.
        """
        arch = self.arch
        wanted = [(t, self._hf_name(t.name)) for t in self.reader.tensors]
        wanted = [(t, n) for t, n in wanted if n is not None]

        def convert(item):  # type: ignore[no-untyped-def]
            from gguf import quants
            t, name = item
            part = t.name.split(".")[2] if t.name.startswith("blk.") else ""
            heads = (cfg.num_heads if part == "attn_q" else cfg.num_kv_heads) \
                if arch == "llama" and part in ("attn_q", "attn_k") else None
            if t.name in native:
                q, scales, mins, group = gguf_blocks(np.asarray(t.data), t.tensor_type.name)
                q, scales, mins = (a if a is None or heads is None else _unpermute(a, heads) for a in (q, scales, mins))
                return name, QuantizedWeight(*(None if a is None else torch.from_numpy(np.ascontiguousarray(a))
                                               for a in (q, scales, mins)), group)
            arr = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
            arr = arr.reshape([int(x) for x in reversed(t.shape)])  # GGUF lists dims innermost first
            if heads is not None:
                arr = _unpermute(arr, heads)
            if arch == "gemma3" and t.name.endswith("norm.weight"):
                arr = arr - 1  # llama.cpp stores Gemma's norm weights as 1 + w; HF names mean w
            return name, torch.from_numpy(np.array(arr, copy=not arr.flags.writeable or None))

        with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
            yield from pool.map(convert, wanted)

    def _hf_name(self, name: str) -> str | None:
        if name == "token_embd.weight":
            return "model.embed_tokens.weight"
        if name == "output_norm.weight":
            return "model.norm.weight"
        if name == "output.weight":
            return "lm_head.weight"
        if name.startswith("blk."):
            _, layer, part, kind = name.split(".")
            table = self._GEMMA3_NAMES if self.arch == "gemma3" else self._NAMES
            if part not in table:
                raise ValueError(f"GGUF tensor {name!r} is not understood")
            return f"model.layers.{layer}.{table[part]}.{kind}"
        return None  # e.g. rope_freqs: not a parameter (config() reads it as RoPE scaling)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a Q/K weight (out, in) or bias (out,)."""
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_layers(model: nn.Module, g: GGUFFile) -> frozenset[str]:
    """quantization='gguf': each linear (and the embedding / LM head) whose GGUF tensors are all of
    GGUF_NATIVE types becomes a quantized layer that holds them as they are: 4-bit types an Int4Linear,
    Q8_0 / Q6_K (or a mix of widths) an Int8Linear, with the finest group and a min where a 4-bit
    type needs one. Other types (F32, F16, other K-quants) are dequantized once and stay float.
    Returns the names of the GGUF tensors to read as blocks."""
    shards: dict[str, list[tuple[str, tuple[int, int] | None]]] = {}
    for t in g.reader.tensors:
        name = g._hf_name(t.name)
        if name is None or not name.endswith(".weight"):
            continue
        parent, _, leaf = name.removeprefix("model.").removesuffix(".weight").rpartition(".")
        leaf = model.stacked.get(leaf, (leaf,))[0]
        path = f"{parent}.{leaf}" if parent else leaf
        shards.setdefault(path, []).append((t.name, GGUF_NATIVE.get(t.tensor_type.name)))
    native: set[str] = set()
    for path, tensors in shards.items():
        try:
            module = model.get_submodule(path)
        except AttributeError:  # a layer a truncated copy (the draft model's num_layers) does not have
            continue
        specs = [spec for _, spec in tensors]
        if None in specs or not isinstance(module, (Linear, nn.Embedding)):
            continue
        bits, group = max(b for b, _ in specs), min(gs for _, gs in specs)
        if isinstance(module, Linear):
            shape = (module.in_features, module.sizes, module.bias is not None)
        else:
            shape = (module.embedding_dim, [module.num_embeddings], False)
        layer = Int4Linear(*shape, group) if bits == 4 else Int8Linear(*shape, group, any(b == 4 for b, _ in specs))
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent), leaf, QuantEmbedding(layer) if path == "embed_tokens" else layer)
        native.update(n for n, _ in tensors)
    return frozenset(native)
