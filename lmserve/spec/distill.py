"""A small draft made from the target: prune (depth, then MLP channels and KV-head groups), then distill
on the target's logits (Minitron-style), saved as an HF Llama folder any --draft-model flag (or LLM())
takes.

    importance      one pass over calibration text through the target, written out here in plain torch
                    (`Student`, the same math as models/llama.py): per layer its block influence
                    1 - cos(h_in, h_out) (ShortGPT: a layer that barely turns the residual stream
                    matters least), per MLP channel the mean |silu(gate) * up|, per KV group the mean norm
                    of its heads' attention outputs
    prune           keep the most influential layers (in order), the strongest channels and groups
    distill         KL(target || student) at temperature T (x T^2) over the target's own text, AdamW with
                    a cosine schedule, seeded, checkpointed and resumable as the EAGLE head's training

The student keeps the target's hidden size, vocabulary and tokenizer (and its tied or untied LM head).
Llama-family targets without q/k norms, qkv bias, rope scaling or windows (SmolLM2, Llama); others are refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lmserve.spec.eagle import rms_norm, rope


@dataclass(frozen=True)
class StudentConfig:
    vocab_size: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def of(cls, cfg: Any) -> "StudentConfig":
        if cfg.qk_norm or cfg.qkv_bias or cfg.rope_scaling or cfg.sliding_window is not None or \
                cfg.hidden_act != "silu" or cfg.architecture not in ("LlamaForCausalLM", "MistralForCausalLM"):
            raise ValueError(f"model: distill takes a Llama-family target without q/k norms, qkv bias, rope "
                             f"scaling or a sliding window, not this {cfg.architecture}")
        return cls(cfg.vocab_size, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                   cfg.intermediate_size, cfg.num_layers, cfg.rope_theta, cfg.rms_norm_eps,
                   cfg.tie_word_embeddings, cfg.max_position_embeddings, getattr(cfg, "bos_token_id", None),
                   tuple(cfg.eos_token_ids))

    def hf(self) -> dict[str, Any]:
        eos = list(self.eos_token_ids)
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": self.vocab_size,
                "hidden_size": self.hidden_size, "num_attention_heads": self.num_heads,
                "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
                "rope_theta": self.rope_theta, "rms_norm_eps": self.rms_norm_eps, "hidden_act": "silu",
                "tie_word_embeddings": self.tie_word_embeddings,
                "max_position_embeddings": self.max_position_embeddings, "torch_dtype": "float32",
                "bos_token_id": self.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos or None}


class Student(nn.Module):
    """A trainable Llama over HF-named float tensors (one sequence at a time, causal, no cache)."""

    def __init__(self, cfg: StudentConfig, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.cfg = cfg
        self.params = nn.ParameterDict({k.replace(".", "/"): nn.Parameter(v.detach().float().clone())
                                        for k, v in state.items()})

    def w(self, name: str) -> torch.Tensor:
        return self.params[name.replace(".", "/")]

    def state(self) -> dict[str, torch.Tensor]:
        return {k.replace("/", "."): v.detach() for k, v in self.params.items()}

    def forward(self, ids: torch.Tensor, taps: dict[str, Any] | None = None) -> torch.Tensor:
        """ids (T,) -> logits (T, V). taps: if given, the per-layer importance statistics are added to it."""
        c = self.cfg
        t = ids.shape[0]
        pos = torch.arange(t)
        x = F.embedding(ids, self.w("model.embed_tokens.weight"))  # (T, H)
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            h_in = x
            hn = rms_norm(x, self.w(p + "input_layernorm.weight"), c.rms_norm_eps)
            q = (hn @ self.w(p + "self_attn.q_proj.weight").T).view(t, c.num_heads, c.head_dim).transpose(0, 1)
            k = (hn @ self.w(p + "self_attn.k_proj.weight").T).view(t, c.num_kv_heads, c.head_dim).transpose(0, 1)
            v = (hn @ self.w(p + "self_attn.v_proj.weight").T).view(t, c.num_kv_heads, c.head_dim).transpose(0, 1)
            q, k = rope(q[None], pos, c.rope_theta)[0], rope(k[None], pos, c.rope_theta)[0]  # (heads, T, d)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (Hq, T, d)
            x = x + a.transpose(0, 1).reshape(t, -1) @ self.w(p + "self_attn.o_proj.weight").T
            hn = rms_norm(x, self.w(p + "post_attention_layernorm.weight"), c.rms_norm_eps)
            act = F.silu(hn @ self.w(p + "mlp.gate_proj.weight").T) * (hn @ self.w(p + "mlp.up_proj.weight").T)
            x = x + act @ self.w(p + "mlp.down_proj.weight").T  # (T, H)
            if taps is not None:
                with torch.no_grad():
                    rep = c.num_heads // c.num_kv_heads
                    taps.setdefault("influence", torch.zeros(c.num_layers))[i] += \
                        (1 - F.cosine_similarity(h_in, x, dim=-1)).sum()
                    taps.setdefault(f"mlp{i}", torch.zeros(c.intermediate_size)).add_(act.abs().sum(0))
                    head_norm = a.norm(dim=-1).sum(-1)  # (Hq,)
                    taps.setdefault(f"kv{i}", torch.zeros(c.num_kv_heads)).add_(head_norm.view(c.num_kv_heads, rep).sum(1))
                    taps["tokens"] = taps.get("tokens", 0) + (t if i == 0 else 0)
        x = rms_norm(x, self.w("model.norm.weight"), c.rms_norm_eps)
        head = self.w("model.embed_tokens.weight") if c.tie_word_embeddings else self.w("lm_head.weight")
        return x @ head.T  # (T, V)


def teacher_state(model: nn.Module, cfg: Any) -> dict[str, torch.Tensor]:
    """The loaded target's weights under HF names, float32 (quantized ones dequantized)."""
    from lmserve.quant.checkpoint import model_state
    out = {}
    for name, t, _ in model_state(model, cfg):
        out[name] = (t if t.is_floating_point() else t.float()).detach().float().cpu()
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


@torch.no_grad()
def importance(student: Student, seqs: list[list[int]]) -> dict[str, Any]:
    """Mean statistics over the calibration sequences (see the module doc)."""
    taps: dict[str, Any] = {}
    for s in seqs:
        student(torch.tensor(s), taps)
    n = max(1, taps.get("tokens", 0))
    return {k: (v / n if isinstance(v, torch.Tensor) else v) for k, v in taps.items()}


def prune(cfg: StudentConfig, state: dict[str, torch.Tensor], imp: dict[str, Any], num_layers: int,
          intermediate_size: int, num_kv_heads: int) -> tuple[StudentConfig, dict[str, torch.Tensor], list[int]]:
    """The pruned (config, state, kept layer indices of the target)."""
    for name, val, top in (("num_layers", num_layers, cfg.num_layers),
                           ("intermediate_size", intermediate_size, cfg.intermediate_size),
                           ("num_kv_heads", num_kv_heads, cfg.num_kv_heads)):
        if not 1 <= val <= top:
            raise ValueError(f"{name}: must be in [1, {top}], got {val}")
    keep = sorted(torch.topk(imp["influence"], num_layers).indices.tolist())
    rep, d = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    out = {k: v for k, v in state.items() if not k.startswith("model.layers.")}
    for new, old in enumerate(keep):
        p, q = f"model.layers.{old}.", f"model.layers.{new}."
        ch = torch.sort(torch.topk(imp[f"mlp{old}"], intermediate_size).indices).values
        groups = torch.sort(torch.topk(imp[f"kv{old}"], num_kv_heads).indices).values
        kv_rows = (groups[:, None] * d + torch.arange(d)).reshape(-1)  # rows of the kept KV heads
        q_heads = (groups[:, None] * rep + torch.arange(rep)).reshape(-1)
        q_rows = (q_heads[:, None] * d + torch.arange(d)).reshape(-1)
        out[q + "input_layernorm.weight"] = state[p + "input_layernorm.weight"]
        out[q + "post_attention_layernorm.weight"] = state[p + "post_attention_layernorm.weight"]
        out[q + "self_attn.q_proj.weight"] = state[p + "self_attn.q_proj.weight"][q_rows]
        out[q + "self_attn.k_proj.weight"] = state[p + "self_attn.k_proj.weight"][kv_rows]
        out[q + "self_attn.v_proj.weight"] = state[p + "self_attn.v_proj.weight"][kv_rows]
        out[q + "self_attn.o_proj.weight"] = state[p + "self_attn.o_proj.weight"][:, q_rows]
        out[q + "mlp.gate_proj.weight"] = state[p + "mlp.gate_proj.weight"][ch]
        out[q + "mlp.up_proj.weight"] = state[p + "mlp.up_proj.weight"][ch]
        out[q + "mlp.down_proj.weight"] = state[p + "mlp.down_proj.weight"][:, ch]
    small = replace(cfg, num_layers=num_layers, intermediate_size=intermediate_size, num_kv_heads=num_kv_heads,
                    num_heads=num_kv_heads * rep)
    return small, {k: v.contiguous() for k, v in out.items()}, keep


def kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) at temperature T, times T^2, mean over positions. (T, V) each."""
    t = temperature
    return F.kl_div(F.log_softmax(student_logits / t, -1), F.log_softmax(teacher_logits / t, -1),
                    log_target=True, reduction="batchmean") * t * t


def distill(student: Student, seqs: list[list[int]], teacher_logits: Any, steps: int, lr: float = 1e-4,
            temperature: float = 2.0, seed: int = 0, checkpoint: Path | None = None, progress: bool = True,
            until: int | None = None) -> list[tuple[int, float]]:
    """Train the student on teacher_logits(ids) -> (T, V) over `steps` sequences (spec/training.train_loop:
    AdamW, cosine, seeded order, resumable checkpoint). Returns the loss curve [(step, loss)]."""
    from lmserve.spec.training import train_loop

    def loss(i: int) -> torch.Tensor:
        with torch.no_grad():
            target = teacher_logits(seqs[i]).float()  # (T, V)
        return kl_loss(student(torch.tensor(seqs[i])), target, temperature)
    return train_loop(student, len(seqs), loss, steps, lr, seed, checkpoint, progress, until, "distill")


@torch.no_grad()
def perplexity(logits_of: Any, seqs: list[list[int]]) -> float:
    """exp of the mean next-token cross-entropy over seqs, with logits_of(ids) -> (T, V)."""
    nll, n = 0.0, 0
    for s in seqs:
        lg = logits_of(s).float()[:-1]  # (T-1, V)
        nll += F.cross_entropy(lg, torch.tensor(s[1:]), reduction="sum").item()
        n += len(s) - 1
    return math.exp(nll / max(1, n))


def save_student(student: Student, out: Path, tokenizer: Any = None, extra: dict[str, Any] | None = None) -> None:
    """An HF Llama folder: config.json, model.safetensors, the tokenizer's files."""
    from safetensors.torch import save_file

    from lmserve.quant.checkpoint import write_tokenizer
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in student.state().items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**student.cfg.hf(), **({"lmserve_distill": extra} if extra else {})},
                                                indent=2))
    if tokenizer is not None:
        write_tokenizer(tokenizer, out)
