"""Shared fixtures: tiny randomly initialised HF models of each family, saved as HF folders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Under pytest-xdist (`make test` runs two workers) each worker gets its share of the cores for torch
# and our OpenMP kernels, so the workers do not oversubscribe the machine (2 cores in CI).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // _WORKERS))

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "llama_mqa"]


def hf_from_gguf(path: Path, **model_kw):  # type: ignore[no-untyped-def]
    """HF transformers' own GGUF loader on the file at path: (tokenizer, model). transformers parses the
    file's metadata once for the tokenizer, once for the config and once for the weights, element by
    element (~40 s each for gemma-3's 262,144-token vocabulary on two cores); the parse is read-only,
    so here the three share one `gguf.GGUFReader`. What HF computes from it is unchanged."""
    import gguf
    import transformers
    real = gguf.GGUFReader
    readers: dict = {}

    def shared(file, *a, **k):  # type: ignore[no-untyped-def]
        key = (str(file), a, tuple(sorted(k.items())))
        if key not in readers:
            readers[key] = real(file, *a, **k)
        return readers[key]
    gguf.GGUFReader = shared
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **model_kw)
    finally:
        gguf.GGUFReader = real
    return tok, model.eval()


@pytest.fixture(autouse=True, scope="module")
def _collect_garbage():  # type: ignore[no-untyped-def]
    """After each test module, collect what reference cycles the tests themselves made (closures,
    monkeypatches): the suite loads many engines, each with a KV cache, on a 24 GiB machine."""
    yield
    import gc
    gc.collect()


def _hf_config(family: str):  # type: ignore[no-untyped-def]
    import transformers as tf
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    if family == "llama":
        return tf.LlamaConfig(**common, rope_theta=10000.0)
    if family == "llama_mqa":
        return tf.LlamaConfig(**{**common, "num_key_value_heads": 1, "tie_word_embeddings": True})
    if family == "qwen2":
        return tf.Qwen2Config(**common, use_sliding_window=False)
    if family == "qwen3":
        return tf.Qwen3Config(**{**common, "num_attention_heads": 4, "num_key_value_heads": 1}, head_dim=32,
                              use_sliding_window=False)
    if family == "mistral":
        return tf.MistralConfig(**common, sliding_window=24)
    raise ValueError(family)


def make_tiny(family: str, path: Path, seed: int = 0):  # type: ignore[no-untyped-def]
    """Build, randomly initialise (seeded) and save a tiny HF model; returns the HF model."""
    import transformers as tf
    torch.manual_seed(seed)
    cfg = _hf_config(family)
    cfg._attn_implementation = "eager"
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():  # larger-than-default weights give peaked, tie-free logits
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    return model


def make_tiny_gemma(path: Path):  # type: ignore[no-untyped-def]
    """A tiny random Gemma 3 (three layers: local, global, local, window 6), saved at path; returns the HF model."""
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=6,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                              max_position_embeddings=256)
    cfg.architectures = ["Gemma3ForCausalLM"]
    hf = tf.Gemma3ForCausalLM(cfg).float()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0, 0.3 if "norm" in name else 0.08)
    hf.save_pretrained(path)
    return hf


class FailOnCall:
    """A stand-in for `real` that raises `error` on its n-th call (counted in `calls`, which a test may
    reset) and passes every other call through: a fault injected into one step of a running engine."""

    def __init__(self, real, n: int, error: BaseException) -> None:  # type: ignore[no-untyped-def]
        self.real, self.n, self.error, self.calls = real, n, error, 0

    def __call__(self, *a, **kw):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.calls == self.n:
            raise self.error
        return self.real(*a, **kw)


def char_tokenizer_model(src: Path, dst: Path) -> Path:
    """A copy of a tiny model folder with a character-level tokenizer (ASCII ids < 128), so commands that
    read text can run on it."""
    import shutil

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    shutil.copytree(src, dst)
    tok = Tokenizer(models.WordLevel({chr(i): i for i in range(128)}, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.save(str(dst / "tokenizer.json"))
    return dst


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):  # type: ignore[no-untyped-def]
    """family -> (folder, HF model)."""
    root = tmp_path_factory.mktemp("tiny")
    return {f: (root / f, make_tiny(f, root / f, seed=i)) for i, f in enumerate(FAMILIES)}


@pytest.fixture(scope="session")
def smol():  # type: ignore[no-untyped-def]
    """The real default model, loaded once for the whole run."""
    from lmserve import LLM
    return LLM(quantization="none")  # the float weights: the HF-parity reference (auto keeps the GGUF's blocks)


@pytest.fixture(scope="session")
def smol_default():  # type: ignore[no-untyped-def]
    """The real default model as `lmserve serve` runs it (quantization auto: the GGUF's blocks through our
    CPU kernels), loaded once: what the server tests serve (they check the server against this same
    engine, not against HF, and decode ~7x faster than the float weights)."""
    from lmserve import LLM
    return LLM()
