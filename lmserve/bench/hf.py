"""The HF transformers baseline: `generate` on the same model, prompts and lengths, as a user without an
engine would run it (static batches, left-padded, each batch running to its longest request)."""

from __future__ import annotations

import time
from typing import Any

import torch

from lmserve.bench.common import Request, sync
from lmserve.config import ModelConfig


def _hf_config(cfg: ModelConfig) -> Any:
    import transformers as tf
    cls = {"LlamaForCausalLM": tf.LlamaConfig, "MistralForCausalLM": tf.MistralConfig,
           "Qwen2ForCausalLM": tf.Qwen2Config, "Qwen3ForCausalLM": tf.Qwen3Config}[cfg.architecture]
    return cls(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
               num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
               num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rope_theta=cfg.rope_theta,
               rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
               tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=cfg.qkv_bias)


def load_hf_model(model: str, dtype: torch.dtype, device: str, seed: int = 0) -> Any:
    """The same weights our engine loads for `model` (a GGUF, an HF folder, or shape:NAME)."""
    import transformers as tf

    from lmserve.models.loader import random_weights, resolve_model
    from lmserve.models.shapes import shape_config
    src = resolve_model(model)
    if src.kind == "gguf":
        m = tf.AutoModelForCausalLM.from_pretrained(str(src.path.parent), gguf_file=src.path.name, dtype=dtype)
    elif src.kind == "hf":
        m = tf.AutoModelForCausalLM.from_pretrained(str(src.path), dtype=dtype)
    else:
        cfg = shape_config(model.removeprefix("shape:"))
        with torch.device(device):
            m = tf.AutoModelForCausalLM.from_config(_hf_config(cfg), dtype=dtype)
        missing, unexpected = m.load_state_dict(dict(random_weights(cfg, seed)), strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight"]:
            raise RuntimeError(f"HF baseline weights do not line up: {missing[:3]} {unexpected[:3]}")
    return m.to(device=device, dtype=dtype).eval()


@torch.inference_mode()
def hf_generate(model: Any, requests: list[Request], batch_size: int, device: str, pad_id: int = 0,
                progress: bool = False) -> dict[str, Any]:
    """Static padded batches of `batch_size` in request order; returns output tokens/s over useful tokens."""
    t0 = time.perf_counter()
    useful = 0
    generated = 0
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(batches), desc="hf generate", unit="batch", leave=False)
    for batch in batches:
        width = max(len(r.prompt) for r in batch)
        ids = torch.tensor([[pad_id] * (width - len(r.prompt)) + r.prompt for r in batch], device=device)
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch], device=device)
        new = max(r.max_tokens for r in batch)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, eos_token_id=None, pad_token_id=pad_id)
        generated += (out.shape[1] - width) * len(batch)
        useful += sum(r.max_tokens for r in batch)
        if bar is not None:
            bar.update(1)
    sync(device)
    wall = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    prompt_tokens = sum(len(r.prompt) for r in requests)
    return {"wall_s": wall, "output_tokens": useful, "generated_tokens_incl_padding": generated,
            "output_tokens_per_s": useful / wall, "total_tokens_per_s": (useful + prompt_tokens) / wall,
            "requests_per_s": len(requests) / wall, "batch_size": batch_size}


class _TokenClock:
    """A generate() streamer that notes when each put() comes: the prompt first, then each new token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:  # noqa: ARG002 - the streamer interface
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@torch.inference_mode()
def hf_latency(model: Any, prompt: list[int], batch_size: int, output_len: int, device: str) -> dict[str, float]:
    """TTFT and TPOT ((end - first token) / (n - 1)) from one generate() of a batch of identical prompts,
    timed by a streamer at each token (two separate runs could give a TTFT longer than the whole run)."""
    ids = torch.tensor([prompt] * batch_size, device=device)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate(input_ids=ids, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
    sync(device)
    clock = _TokenClock()
    t0 = time.perf_counter()
    model.generate(input_ids=ids, max_new_tokens=output_len, min_new_tokens=output_len, streamer=clock, **kw)
    sync(device)
    total = time.perf_counter() - t0
    if len(clock.times) == output_len + 1:  # the prompt, then each step's tokens (any batch size)
        ttft = clock.times[1] - t0
    else:  # a generate() that streams otherwise: a 1-token run for the first token
        t1 = time.perf_counter()
        model.generate(input_ids=ids, max_new_tokens=1, min_new_tokens=1, **kw)
        sync(device)
        ttft = min(time.perf_counter() - t1, total)
    tpot = (total - ttft) / max(1, output_len - 1)
    return {"ttft_s": ttft, "tpot_s": tpot, "total_s": total,
            "tokens_per_s": batch_size * output_len / total,
            "decode_tokens_per_s": batch_size / tpot if tpot > 0 else float("nan")}
