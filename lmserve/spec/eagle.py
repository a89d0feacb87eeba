"""An EAGLE-style draft head (Li et al., 2024): one decoder layer that, from the target's feature at
position t (its final hidden state, after the last norm: what its LM head reads) and the embedding of
token t + 1, predicts the target's feature at t + 1; the target's own frozen LM head reads the
prediction out as a next-token distribution. Chained, the head drafts several tokens from one target
step for the price of one small layer each.

    x_t      = fc([feature_t ; embed(token_{t+1})])          (2H -> H, with bias)
    f_{t+1}' = x_t + attn(norm(x_t)) (causal, RoPE) ... + mlp(norm(.))   one Llama decoder layer
    p_{t+2}' = softmax(lm_head(f_{t+1}'))

Training (`train`) follows EAGLE: a feature loss (smooth L1 between f' and the target's f) plus 0.1 x a
token loss (cross-entropy of p' against the target's own distribution at that position), over the
target's features on text the target itself wrote from a prompt set (`collect`): what the head must
imitate is the target, so the target's own continuations are its natural data. Seeded, bounded by a
token budget, resumable from its checkpoint, a loss curve written beside it.

Saved as safetensors (`model.safetensors`, HF Llama names under `layers.0.` plus `fc.`) with
`eagle_config.json`; `load_head` reads them back bit for bit. Serving: spec/eagle_proposer.py.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

TOKEN_LOSS_WEIGHT = 0.1  # EAGLE's weight of the token loss against the feature loss


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    target: str = ""  # the target model it was trained for
    trained_tokens: int = 0
    seed: int = 0

    @classmethod
    def for_target(cls, cfg: Any, target: str = "") -> "EagleConfig":
        """One decoder layer of the target's own shape."""
        return cls(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                   cfg.rope_theta, cfg.rms_norm_eps, target)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x: (B, heads, T, d) rotated at positions (T,) (the half-split layout HF Llama uses)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)  # (d/2,)
    ang = positions.to(torch.float64)[:, None] * inv[None, :]  # (T, d/2)
    cos, sin = (torch.cat([f(ang)] * 2, -1).to(x.dtype) for f in (torch.cos, torch.sin))  # (T, d)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class EagleHead(nn.Module):
    """fc + one Llama decoder layer, trainable (ordinary nn.Parameters, plain torch ops)."""

    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.fc = nn.Linear(2 * h, h, bias=True)
        lin = lambda i, o: nn.Linear(i, o, bias=False)  # noqa: E731
        self.q_proj, self.k_proj = lin(h, cfg.num_heads * d), lin(h, cfg.num_kv_heads * d)
        self.v_proj, self.o_proj = lin(h, cfg.num_kv_heads * d), lin(cfg.num_heads * d, h)
        self.gate_proj, self.up_proj = lin(h, cfg.intermediate_size), lin(h, cfg.intermediate_size)
        self.down_proj = lin(cfg.intermediate_size, h)
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        # token ids the read-out is restricted to when drafting (None: the whole vocabulary); not trained
        self.draft_vocab: torch.Tensor | None = None

    def forward(self, features: torch.Tensor, next_embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """features, next_embeds: (B, T, H) (feature t and the embedding of token t + 1), positions (T,)
        -> predicted features (B, T, H) of positions t + 1, causal over T."""
        c = self.cfg
        b, t, _ = features.shape
        x = self.fc(torch.cat([features, next_embeds], -1))  # (B, T, H)
        hn = rms_norm(x, self.input_layernorm, c.rms_norm_eps)
        q = self.q_proj(hn).view(b, t, c.num_heads, c.head_dim).transpose(1, 2)  # (B, Hq, T, d)
        k = self.k_proj(hn).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)  # (B, Hkv, T, d)
        v = self.v_proj(hn).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q, k = rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta)
        rep = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # (B, Hq, T, d)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, Hq, T, d)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, -1))
        hn = rms_norm(x, self.post_attention_layernorm, c.rms_norm_eps)
        return x + self.down_proj(F.silu(self.gate_proj(hn)) * self.up_proj(hn))  # (B, T, H)

    # HF Llama names, so a one-layer model can later be loaded from the same file
    NAMES = {"fc.weight": "fc.weight", "fc.bias": "fc.bias",
             "input_layernorm": "layers.0.input_layernorm.weight",
             "post_attention_layernorm": "layers.0.post_attention_layernorm.weight",
             **{f"{p}.weight": f"layers.0.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
             **{f"{p}.weight": f"layers.0.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}}

    def save(self, out: Path, extra: dict[str, Any] | None = None) -> None:
        from safetensors.torch import save_file
        out.mkdir(parents=True, exist_ok=True)
        state = self.state_dict()
        tensors = {self.NAMES[k]: v.detach().contiguous() for k, v in state.items()}
        if self.draft_vocab is not None:
            tensors["draft_vocab"] = self.draft_vocab.to(torch.int64).contiguous()
        save_file(tensors, str(out / "model.safetensors"))
        (out / "eagle_config.json").write_text(json.dumps({"method": "eagle", **asdict(self.cfg), **(extra or {})},
                                                          indent=2))


def load_head(path: str | Path) -> EagleHead:
    """A saved head, exactly as saved."""
    from safetensors.torch import load_file
    p = Path(path)
    meta = json.loads((p / "eagle_config.json").read_text())
    if meta.get("method") != "eagle":
        raise ValueError(f"{p}: eagle_config.json is not an EAGLE head's")
    cfg = EagleConfig(**{k: meta[k] for k in EagleConfig.__dataclass_fields__ if k in meta})
    head = EagleHead(cfg)
    tensors = load_file(str(p / "model.safetensors"))
    head.load_state_dict({k: tensors[v] for k, v in EagleHead.NAMES.items()})
    head.draft_vocab = tensors.get("draft_vocab")
    return head


def frequent_vocab(seqs: list[list[int]], size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The `size` most frequent token ids of seqs (ties by id), plus `always` (EOS ids): the subset a
    head's read-out is restricted to when drafting (FR-Spec). Sorted ids (K,)."""
    counts: dict[int, int] = {}
    for s in seqs:
        for t in s:
            counts[t] = counts.get(t, 0) + 1
    top = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    return torch.tensor(sorted(set(top) | set(always)), dtype=torch.int64)


# ---------------------------------------------------------------- the target's side

def float_head(model: nn.Module) -> torch.Tensor:
    """The target's LM head as one float matrix (V, H) (dequantized if quantized; the tied table if tied)."""
    if getattr(model, "lm_head", None) is not None:
        lm = model.lm_head
        return (lm.weight if hasattr(lm, "weight") and lm.weight.is_floating_point() else lm.dequantize()).float()
    emb = model.embed_tokens
    return (emb.weight if isinstance(emb, nn.Embedding) else emb.head.dequantize()).float()


@torch.no_grad()
def features(llm: Any, token_ids: list[int]) -> torch.Tensor:
    """The target's features (T, H) over token_ids: the final hidden states its LM head reads, from one
    teacher-forced prefill through the engine (LLM.score), caught at the model's output."""
    out: list[torch.Tensor] = []
    handle = llm.engine.model.register_forward_hook(lambda m, a, h: out.append(h.detach().float()))
    try:
        llm.score(token_ids)
    finally:
        handle.remove()
    return out[0].clone()  # (T, H); cloned outside inference mode: an ordinary tensor autograd may use


def collect(llm: Any, prompts: list[str], budget: int, seed: int, max_tokens: int = 256,
            progress: bool = True) -> list[list[int]]:
    """Texts the target writes itself: each prompt (through the chat template when the tokenizer has one)
    and a sampled continuation, until `budget` tokens; token id lists, in a seeded order."""
    from lmserve.sequence import SamplingParams
    rng = random.Random(seed)
    tok = llm.tokenizer
    out: list[list[int]] = []
    total, round_ = 0, 0
    while total < budget:
        order = prompts[:]
        rng.shuffle(order)
        ids = []
        for p in order:
            text = tok.apply_chat_template([{"role": "user", "content": p}]) if tok.has_chat_template else p
            ids.append(tok.encode(text, add_special_tokens=False))
        params = [SamplingParams(max_tokens=max_tokens, temperature=0.7, top_p=0.95, seed=seed * 100003 + round_ * 997 + i)
                  for i in range(len(ids))]
        for prompt, o in zip(ids, llm.generate(ids, params, use_tqdm=progress)):
            seq = prompt + o.outputs[0].token_ids
            out.append(seq)
            total += len(seq)
            if total >= budget:
                break
        round_ += 1
    return out


# ---------------------------------------------------------------- training

@dataclass
class Example:
    feats: torch.Tensor  # (T, H) the target's features
    embeds: torch.Tensor  # (T, H) the target's embeddings of the same tokens


def losses(head: EagleHead, ex: Example, lm_head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(feature loss, token loss, top-1 agreement) of one sequence: inputs feature t and embedding t + 1,
    targets feature t + 1 and the target's distribution read from it."""
    t = ex.feats.shape[0] - 1
    pred = head(ex.feats[None, :t], ex.embeds[None, 1:t + 1], torch.arange(t))[0]  # (t, H)
    true = ex.feats[1:t + 1]  # (t, H)
    feat_loss = F.smooth_l1_loss(pred, true)
    logp = F.log_softmax(pred @ lm_head.T, -1)  # (t, V)
    with torch.no_grad():
        target = F.softmax(true @ lm_head.T, -1)
    token_loss = -(target * logp).sum(-1).mean()
    agree = (logp.argmax(-1) == target.argmax(-1)).float().mean()
    return feat_loss, token_loss, agree


@torch.no_grad()
def agreement(head: EagleHead, examples: list[Example], lm_head: torch.Tensor) -> float:
    """How often the head's next token (from the target's true feature and token) is the target's own:
    the acceptance rate of a one-token greedy draft, over held-out sequences."""
    hits = n = 0.0
    for ex in examples:
        _, _, a = losses(head, ex, lm_head)
        k = ex.feats.shape[0] - 1
        hits, n = hits + a.item() * k, n + k
    return hits / max(1.0, n)


def train(head: EagleHead, train_set: list[Example], lm_head: torch.Tensor, steps: int, lr: float = 3e-4,
          seed: int = 0, checkpoint: Path | None = None, progress: bool = True,
          until: int | None = None) -> list[tuple[int, float]]:
    """The feature + 0.1 token loss over `steps` sequences (spec/training.train_loop: AdamW, cosine,
    seeded order, resumable checkpoint). Returns the loss curve [(step, loss)]."""
    from lmserve.spec.training import train_loop

    def loss(i: int) -> torch.Tensor:
        feat_loss, token_loss, _ = losses(head, train_set[i], lm_head)
        return feat_loss + TOKEN_LOSS_WEIGHT * token_loss
    return train_loop(head, len(train_set), loss, steps, lr, seed, checkpoint, progress, until, "train eagle head")
