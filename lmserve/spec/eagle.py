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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

TOKEN_LOSS_WEIGHT = 0.1  # EAGLE's weight of the token loss against the feature loss
CHAIN_DECAY = 0.8  # weight of each further chained draft's losses (step s: CHAIN_DECAY ** (s - 1))


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


def head_config(path: str | Path) -> EagleConfig:
    """A saved head's config (its eagle_config.json)."""
    p = Path(path)
    meta = json.loads((p / "eagle_config.json").read_text())
    if meta.get("method") != "eagle":
        raise ValueError(f"{p}: eagle_config.json is not an EAGLE head's")
    return EagleConfig(**{k: meta[k] for k in EagleConfig.__dataclass_fields__ if k in meta})


def load_head(path: str | Path) -> EagleHead:
    """A saved head, exactly as saved."""
    from safetensors.torch import load_file
    p = Path(path)
    head = EagleHead(head_config(p))
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
def _scored(llm: Any, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One teacher-forced prefill through the engine (LLM.score): the target's features (T, H), the
    final hidden states its LM head reads, caught at the model's output, and its logits (T, V)."""
    out: list[torch.Tensor] = []
    handle = llm.engine.model.register_forward_hook(lambda m, a, h: out.append(h.detach().float()))
    try:
        logits = llm.score(token_ids)
    finally:
        handle.remove()
    return out[0].clone(), logits  # cloned outside inference mode: an ordinary tensor autograd may use


def features(llm: Any, token_ids: list[int]) -> torch.Tensor:
    """The target's features (T, H) over token_ids: the final hidden states its LM head reads."""
    return _scored(llm, token_ids)[0]


@torch.no_grad()
def example(llm: Any, token_ids: list[int]) -> "Example":
    """One training / evaluation sequence: the target's features over token_ids, its embeddings of them
    and its greedy token after each position (from the same teacher-forced prefill)."""
    feats, logits = _scored(llm, token_ids)  # (T, H), (T, V)
    ids = torch.tensor(token_ids)
    return Example(feats, llm.engine.model.embed(ids).float(), logits.argmax(-1), ids)


# ---------------------------------------------------------------- training

@dataclass
class Example:
    feats: torch.Tensor  # (T, H) the target's features
    embeds: torch.Tensor  # (T, H) the target's embeddings of the same tokens
    labels: torch.Tensor | None = None  # (T,) the target's greedy token after each position (argmax of its logits)
    tokens: torch.Tensor | None = None  # (T,) the token ids themselves


def chain_forward(head: EagleHead, feats: torch.Tensor, embeds: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The head drafting `steps` tokens ahead from every position of one sequence at once, as serving
    drafts them (EAGLE-3's "training-time test"). feats, embeds: (T, H). Step 1 is the plain forward:
    row t reads feature t and token t + 1 and predicts feature t + 1. Step s > 1, row t: its input is
    step s - 1's prediction of row t with the embedding of token t + s, at position t + s - 1, and it
    attends to the step-1 (true) entries of positions <= t and to its own chain's entries of steps
    2..s (positions t + 1..t + s - 1), as the proposer's KV holds them while it drafts.
    Returns [step s's predictions (T - s, H), row t = the predicted feature of position t + s]."""
    c = head.cfg
    n = feats.shape[0] - 1
    rep, d = c.num_heads // c.num_kv_heads, c.head_dim
    pos = torch.arange(n)

    def qkv(x: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, ...]:  # (m, H) -> (Hq, m, d), (Hkv, m, d) x 2
        hn = rms_norm(x, head.input_layernorm, c.rms_norm_eps)
        q = head.q_proj(hn).view(-1, c.num_heads, d).transpose(0, 1)
        k = head.k_proj(hn).view(-1, c.num_kv_heads, d).transpose(0, 1)
        v = head.v_proj(hn).view(-1, c.num_kv_heads, d).transpose(0, 1)
        return rope(q, p, c.rope_theta), rope(k, p, c.rope_theta), v

    def finish(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:  # residual, o_proj, MLP: (m, H), (Hq, m, d)
        x = x + head.o_proj(a.transpose(0, 1).reshape(x.shape[0], -1))
        hn = rms_norm(x, head.post_attention_layernorm, c.rms_norm_eps)
        return x + head.down_proj(F.silu(head.gate_proj(hn)) * head.up_proj(hn))

    x = head.fc(torch.cat([feats[:n], embeds[1:n + 1]], -1))  # (n, H) step 1's inputs, positions 0..n-1
    q, k1, v1 = qkv(x, pos)
    k1, v1 = k1.repeat_interleave(rep, 0), v1.repeat_interleave(rep, 0)  # (Hq, n, d)
    outs = [finish(x, F.scaled_dot_product_attention(q, k1, v1, is_causal=True))]
    chain_k: list[torch.Tensor] = []  # steps 2..s: (Hq, rows, d), row t at position t + step - 1
    chain_v: list[torch.Tensor] = []
    causal = torch.ones(n, n, dtype=torch.bool).tril()  # (n, n) row t sees positions j <= t
    for s in range(2, steps + 1):
        m = n + 1 - s  # rows whose target (position t + s) exists
        if m <= 0:
            break
        x = head.fc(torch.cat([outs[-1][:m], embeds[s:s + m]], -1))  # (m, H)
        q, k, v = qkv(x, pos[:m] + s - 1)
        chain_k = [ck[:, :m] for ck in chain_k] + [k.repeat_interleave(rep, 0)]
        chain_v = [cv[:, :m] for cv in chain_v] + [v.repeat_interleave(rep, 0)]
        scale = d ** -0.5
        true_s = (q @ k1.transpose(1, 2)) * scale  # (Hq, m, n)
        true_s = true_s.masked_fill(~causal[:m], float("-inf"))
        own = torch.stack([(q * ck).sum(-1) for ck in chain_k], -1) * scale  # (Hq, m, s - 1)
        p = torch.softmax(torch.cat([true_s, own], -1), -1)  # (Hq, m, n + s - 1)
        a = p[..., :n] @ v1 + (p[..., n:, None] * torch.stack(chain_v, 2)).sum(2)  # (Hq, m, d)
        outs.append(finish(x, a))
    return outs


def losses(head: EagleHead, ex: Example, lm_head: torch.Tensor, steps: int = 1
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(feature loss, token loss, top-1 agreement of step 1) of one sequence, over `steps` chained drafts
    (chain_forward; step s weighted CHAIN_DECAY ** (s - 1)): targets the target's feature at the
    predicted position and the target's distribution read from it. lm_head: the read-out rows (V', H)
    (the draft vocabulary's, when the head drafts from one: the target's distribution is then taken
    over those tokens)."""
    preds = chain_forward(head, ex.feats, ex.embeds, steps)
    with torch.no_grad():
        target = F.softmax(ex.feats[1:] @ lm_head.T, -1)  # (T - 1, V') the target's, positions 1..T-1
    feat_loss = token_loss = ex.feats.new_zeros(())
    total = 0.0
    agree = ex.feats.new_zeros(())
    for s, pred in enumerate(preds, 1):  # pred (T - s, H): positions s..T-1
        w = CHAIN_DECAY ** (s - 1)
        logp = F.log_softmax(pred @ lm_head.T, -1)  # (T - s, V')
        feat_loss = feat_loss + w * F.smooth_l1_loss(pred, ex.feats[s:])
        token_loss = token_loss + w * -(target[s - 1:] * logp).sum(-1).mean()
        total += w
        if s == 1:
            agree = (logp.argmax(-1) == target.argmax(-1)).float().mean()
    return feat_loss / total, token_loss / total, agree


@torch.no_grad()
def agreement(head: EagleHead, examples: list[Example], lm_head: torch.Tensor) -> float:
    """How often the head's next token (from the target's true feature and token) is the target's own:
    the acceptance rate of a one-token greedy draft, over held-out sequences. lm_head: the whole (V, H);
    the head drafts from its draft_vocab rows when it has one, as in serving."""
    vocab = head.draft_vocab
    rows = lm_head if vocab is None else lm_head[vocab]  # (V', H)
    hits = n = 0
    for ex in examples:
        pred = chain_forward(head, ex.feats, ex.embeds, 1)[0]  # (T - 1, H) predicted features, positions 1..T-1
        tok = (pred @ rows.T).argmax(-1)  # (T - 1,) into rows
        if vocab is not None:
            tok = vocab[tok]
        want = (ex.feats[1:] @ lm_head.T).argmax(-1)  # (T - 1,) the target's own next tokens
        hits, n = hits + int((tok == want).sum()), n + want.numel()
    return hits / max(1, n)


@torch.no_grad()
def greedy_rows(ex: Example, k: int) -> torch.Tensor:
    """(T - k,) the rows t whose tokens t + 2..t + k are the target's greedy ones (ex.labels, ex.tokens):
    where a chain of k greedy drafts meets the context it would meet in serving."""
    m = ex.feats.shape[0] - k
    greedy = torch.ones(m, dtype=torch.bool)
    for s in range(1, k):
        greedy &= ex.tokens[s + 1:s + 1 + m] == ex.labels[s:s + m]
    return greedy


def chain_acceptance(head: EagleHead, examples: list[Example], lm_head: torch.Tensor, k: int) -> list[float]:
    """Greedy chain drafting of k tokens from every position of held-out sequences, drafts accepted while
    they equal the target's greedy tokens (ex.labels) as a verification would: [P(drafts 1..s all
    accepted), s = 1..k] (sum + 1 = the mean tokens a verification yields). Over the rows whose next k
    tokens in the text are the target's greedy ones (all rows of greedy text, near-ties aside): only there
    is the text the context a greedy draft would meet. lm_head: the target's whole read-out (V, H); the
    head drafts from its draft_vocab rows when it has one."""
    vocab = head.draft_vocab
    out = lm_head if vocab is None else lm_head[vocab]
    hits = [0.0] * k
    rows = 0
    for ex in examples:
        if ex.labels is None or ex.tokens is None:
            raise ValueError("chain_acceptance needs the examples' labels and tokens (eagle.example makes them)")
        preds = chain_forward(head, ex.feats, ex.embeds, k)
        m = ex.feats.shape[0] - k  # rows with all k targets
        if len(preds) < k or m <= 0:
            continue
        greedy = greedy_rows(ex, k)
        alive = greedy.clone()
        for s, pred in enumerate(preds, 1):
            tok = (pred[:m] @ out.T).argmax(-1)  # (m,)
            if vocab is not None:
                tok = vocab[tok]
            alive &= tok == ex.labels[s:s + m]  # label at position t + s: the token after it
            hits[s - 1] += float(alive.sum())
        rows += int(greedy.sum())
    return [h / max(1, rows) for h in hits]


def train(head: EagleHead, train_set: list[Example], lm_head: torch.Tensor, steps: int, lr: float = 3e-4,
          seed: int = 0, checkpoint: Path | None = None, progress: bool = True,
          until: int | None = None, chain: int = 1) -> list[tuple[int, float]]:
    """The feature + 0.1 token loss over `steps` sequences, each over `chain` chained drafts (losses;
    spec/training.train_loop: AdamW, cosine, seeded order, resumable checkpoint). lm_head: the read-out
    rows the head drafts from (the draft vocabulary's rows when it has one). Returns the loss curve
    [(step, loss)]."""
    from lmserve.spec.training import train_loop

    def loss(i: int) -> torch.Tensor:
        feat_loss, token_loss, _ = losses(head, train_set[i], lm_head, chain)
        return feat_loss + TOKEN_LOSS_WEIGHT * token_loss
    return train_loop(head, len(train_set), loss, steps, lr, seed, checkpoint, progress, until, "train eagle head")
