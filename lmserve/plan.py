"""`lmserve plan`: the roofline and KV-memory arithmetic behind serving a model on a device.

All figures are lower bounds from first principles:
  KV bytes / token   = 2 (K and V) x layers x kv_heads x head_dim x kv_bytes    (MLA: layers x (latent + rope) x kv_bytes)
                       + with a quantized KV dtype (int8, fp8): a float32 scale per token, head, 32 channels
                       and K/V (2 x layers x kv_heads x head_dim / 32 x 4, one per head when head_dim is not a
                       multiple of 32), as lmserve's kv_cache_dtype int8 / fp8 stores them (MLA: refused, as
                       lmserve refuses a quantized latent cache)
  KV bytes / seq     = KV bytes / token / layers x sum over layers of the tokens each layer keeps: the whole
                       sequence (full attention), at most its window (a sliding-window layer, Gemma 3's local
                       layers: lmserve frees the blocks that fall out of the window); "window-blind" = all of them
  params             from the shape: attention (MLA: its LoRA projections), the MLP of each layer (a sparse
                       layer's experts, shared experts and router; "active": the k experts a token runs), norms,
                       the embedding and an untied LM head
  decode step time  >= max(bytes moved / bandwidth, FLOPs / peak)
                       bytes = active weight bytes (the input embedding is looked up, not read whole: an untied
                       one is left out) + batch x KV bytes each sequence's layers keep; FLOPs = 2 x those
                       weights x batch + attention: 2 x heads x (q.k width + value width) per kept token and
                       layer (MLA decode, absorbed: over the latent + rope and the latent; prefill: causal pairs)
  ridge point        = peak FLOP/s / bandwidth  (a kernel below it is memory-bound)
  tensor parallel N  = weights / N per rank (vocab, heads and MLP channels split), KV heads / N per rank (at
                       least one: replicated when fewer than N; MLA's latent whole on every rank); per decode step
                       2 x layers + 1 all-reduces of batch x hidden x activation bytes (fp32 on a CPU, else 2)
                       (after attention and the MLP, the embedding), each moving
                       2 (N - 1) / N of it over a rank's link (ring), + the logits gather to rank 0; step time
                       >= the per-rank roofline + collectives x (latency + bytes / link bandwidth)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2,
               "fp8": 1, "int8": 1, "int4": 0.5}
KV_DTYPES = {k: v for k, v in DTYPE_BYTES.items() if k != "int4"}  # the caches lmserve has (kv_cache_dtype)
KV_SCALE_BYTES = 4  # a quantized KV cache's float32 scale per token, head, group of channels and K/V (absmax)
KV_SCALE_GROUP = 32  # channels per scale (lmserve.kv.cache.KV_GROUP)

# name -> (memory GB, bandwidth TB/s, dense bf16 TFLOP/s), vendor spec-sheet figures;
# "cpu" is this project's 2-core CI machine as measured (fp32 matmul, memcpy).
DEVICES: dict[str, tuple[float, float, float]] = {
    "h100": (80, 3.35, 989),
    "h200": (141, 4.8, 989),
    "a100-80g": (80, 2.039, 312),
    "a100-40g": (40, 1.555, 312),
    "l4": (24, 0.3, 121),
    "cpu": (24, 0.019, 0.1),
}
# name -> (link GB/s one way, latency of one small collective in us) between the ranks of a group: NVLink
# (H100 / H200: 18 links, 450 GB/s; A100: 300), PCIe 4 x16 (L4), and for "cpu" gloo on loopback between
# two processes on 2 cores as measured here (scripts/bench_tp_link.py: ~0.3 ms a small all-reduce, 1 GB/s)
LINKS: dict[str, tuple[float, float]] = {"h100": (450, 10), "h200": (450, 10), "a100-80g": (300, 10),
                                         "a100-40g": (300, 10), "l4": (32, 20), "cpu": (1, 300)}


@dataclass
class PlanModel:
    """The shape facts the cost model needs."""

    name: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    tied: bool = False
    params: float | None = None  # total parameters (computed from the shape when None)
    active_params: float | None = None  # per-token parameters (MoE); = params when None
    mla_latent: int | None = None  # MLA: cached latent width (kv_lora_rank)
    mla_rope: int = 0  # MLA: decoupled rope key width
    mla_nope: int = 0  # MLA: a head's q.k width besides the rope part (its value width is head_dim)
    windows: tuple[int | None, ...] | None = None  # per layer: its sliding window (None: full attention)
    split_embedding: bool = True  # params hold an input embedding apart from the LM head (false: --params as given)

    def __post_init__(self) -> None:
        if self.params is None:
            attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
            mlp = 3 * self.hidden * self.intermediate
            per_layer = attn + mlp + 2 * self.hidden
            emb = self.vocab * self.hidden * (1 if self.tied else 2)
            self.params = float(self.layers * per_layer + emb + self.hidden)
        if self.active_params is None:
            self.active_params = self.params

    @property
    def step_params(self) -> float:
        """The weights a decode step reads and multiplies: the active ones but the input embedding
        table, of which a step looks up a row per token (tied, it is the LM head: read whole)."""
        return self.active_params - (self.vocab * self.hidden if self.split_embedding and not self.tied else 0)

    def attn_flops_per_token(self, prefill: bool = False) -> float:
        """FLOPs of one query token against one kept context token in one layer: q.k and the weighted
        value sum over every head. MLA decodes absorbed (over the latent + rope key, then the latent)
        and prefills expanded (q.k over nope + rope, values of head_dim)."""
        if self.mla_latent is None:
            return 4 * self.heads * self.head_dim
        if prefill:
            return 2 * self.heads * (self.mla_nope + self.mla_rope + self.head_dim)
        return 2 * self.heads * (2 * self.mla_latent + self.mla_rope)

    def decode_flops(self, batch: int, seq_len: int) -> float:
        """One decode step's FLOPs: the weights it reads, and attention over the tokens each layer keeps."""
        return 2 * self.step_params * batch + batch * self.attn_flops_per_token() * self.kept_layer_tokens(seq_len)

    def causal_pairs(self, seq_len: int) -> int:
        """Sum over layers of the (query, key) pairs a causal prefill of seq_len tokens computes (a
        sliding-window layer: at most its window a query)."""
        def pairs(w: int | None) -> int:
            w = seq_len if w is None else min(w, seq_len)
            return w * (w + 1) // 2 + (seq_len - w) * w
        return sum(pairs(w) for w in (self.windows or (None,) * self.layers))

    @property
    def kv_elems_per_token(self) -> int:
        if self.mla_latent is not None:
            return self.layers * (self.mla_latent + self.mla_rope)
        return 2 * self.layers * self.kv_heads * self.head_dim

    @property
    def kv_scales_per_token(self) -> int:
        """Scales a quantized cache keeps per token: one per KV_SCALE_GROUP channels of each K/V row
        (head) of each layer, one per row when head_dim is not a multiple of it."""
        if self.mla_latent is not None:
            return self.layers
        groups = self.head_dim // KV_SCALE_GROUP if self.head_dim % KV_SCALE_GROUP == 0 else 1
        return 2 * self.layers * self.kv_heads * groups

    @property
    def mha_kv_elems_per_token(self) -> int:
        """What full multi-head attention (kv_heads = heads) would cache."""
        return 2 * self.layers * self.heads * self.head_dim

    def gqa_kv_elems_per_token(self, kv_heads: int = 8) -> int:
        """What grouped-query attention with `kv_heads` K/V heads of head_dim would cache."""
        return 2 * self.layers * kv_heads * self.head_dim

    def kept_layer_tokens(self, seq_len: int) -> int:
        """Sum over layers of the tokens of a seq_len-token sequence each layer keeps in its cache."""
        return sum(seq_len if w is None else min(seq_len, w) for w in (self.windows or (None,) * self.layers))


def model_from_name(name: str) -> PlanModel:
    from lmserve.models.shapes import MLA_SHAPES, SHAPES
    if name in MLA_SHAPES:
        s = MLA_SHAPES[name]
        return PlanModel(name, s["num_layers"], s["num_heads"], s["num_heads"], s["v_head_dim"], s["hidden_size"], 0,
                         s["vocab_size"], params=s["params"], active_params=s["active_params"],
                         mla_latent=s["kv_lora_rank"], mla_rope=s["qk_rope_head_dim"], mla_nope=s["qk_nope_head_dim"])
    if name in SHAPES:
        from lmserve.config import ModelConfig
        cfg = ModelConfig(**SHAPES[name])
    else:
        try:
            cfg = _config_from_path(name)
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(f"--model: {name!r} is not a planner shape ({', '.join(sorted([*SHAPES, *MLA_SHAPES]))}) "
                             f"nor a model lmserve loads ({e})") from None
    windows = tuple(cfg.layer_window(i) for i in range(cfg.num_layers))
    mla = dict(mla_latent=cfg.kv_lora_rank, mla_rope=cfg.qk_rope_head_dim, mla_nope=cfg.qk_nope_head_dim) if cfg.is_mla else {}
    params, active = cfg.param_counts()
    return PlanModel(name, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.v_head_dim if cfg.is_mla else cfg.head_dim,
                     cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings, params=params,
                     active_params=active, windows=windows if any(w is not None for w in windows) else None, **mla)


def _config_from_path(name: str):  # type: ignore[no-untyped-def]
    from lmserve.models.gguf_file import GGUFFile
    from lmserve.models.loader import hf_config, resolve_model
    p = Path(name)
    if p.is_file() and p.name.endswith(".json"):
        from lmserve.config import ModelConfig
        return ModelConfig.from_hf(json.loads(p.read_text()))
    src = resolve_model(name)
    return GGUFFile(src.path).config() if src.kind == "gguf" else hf_config(src.path)


def plan(m: PlanModel, device: tuple[float, float, float], dtype: str = "bf16", kv_dtype: str | None = None,
         batch: int = 1, seq_len: int = 1024, mem_util: float = 0.9,
         batches: tuple[int, ...] = (1, 8, 32, 64, 128, 256, 512), tp: int = 1,
         link: tuple[float, float] = LINKS["h100"], act_bytes: int | None = None) -> dict[str, Any]:
    """Every figure of the cost model, as a dict (the CLI prints it; tests assert on it). tp: tensor-
    parallel ranks (memory and bounds per rank); link: (GB/s, us per collective) between them; act_bytes:
    an activation's bytes (default 4 with fp32 weights, else 2; lmserve on a CPU computes in fp32)."""
    mem_gb, bw_tbs, tflops = device
    wb = DTYPE_BYTES[dtype]
    if kv_dtype is None:  # the cache follows the compute dtype: quantized weights keep a float cache
        kv_dtype = dtype if wb >= 2 else ("fp32" if act_bytes == 4 else "bf16")
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype: {kv_dtype!r} is no KV cache lmserve has ({', '.join(sorted(KV_DTYPES))})")
    kb = DTYPE_BYTES[kv_dtype]
    if m.mla_latent is not None and kb < 2:
        raise ValueError(f"kv_dtype: {kv_dtype} is refused with MLA (lmserve keeps the latent cache in the model's dtype)")
    bw, peak = bw_tbs * 1e12, tflops * 1e12
    weight_bytes = m.params * wb
    kv_scales = m.kv_scales_per_token * KV_SCALE_BYTES if kb < 2 else 0  # quantized KV: its scales
    kv_tok = m.kv_elems_per_token * kb + kv_scales
    kv_seq_blind = kv_tok * seq_len  # every layer keeps every token
    kv_seq = kv_tok / m.layers * m.kept_layer_tokens(seq_len)  # sliding-window layers keep their window
    usable = mem_gb * 1e9 * mem_util - weight_bytes
    fit = max(0, int(usable // kv_seq)) if kv_seq else 0
    fit_blind = max(0, int(usable // kv_seq_blind)) if kv_seq_blind else 0
    ridge = peak / bw

    def step(b: int) -> dict[str, Any]:
        kv_read = b * kv_seq  # a sliding-window layer reads its window only
        bytes_moved = m.step_params * wb + kv_read
        flops = m.decode_flops(b, seq_len)
        t_mem, t_cmp = bytes_moved / bw, flops / peak
        t = max(t_mem, t_cmp)
        return {"batch": b, "kv_gb": b * kv_seq / 1e9, "fits": b * kv_seq <= max(usable, 0),
                "bytes_moved_gb": bytes_moved / 1e9, "gflops": flops / 1e9, "step_ms": t * 1e3,
                "tokens_per_s": b / t, "bound": "memory" if t_mem >= t_cmp else "compute"}

    prefill_flops = 2 * m.step_params * batch * seq_len + batch * m.attn_flops_per_token(True) * m.causal_pairs(seq_len)
    prefill_bytes = m.step_params * wb + batch * kv_seq
    t_pre = max(prefill_flops / peak, prefill_bytes / bw)
    mlp_intensity = (2 * batch * m.hidden * m.intermediate) / (
        wb * (m.hidden * m.intermediate + batch * (m.hidden + m.intermediate))) if m.intermediate else None
    return {
        "model": m.name, "params": m.params, "active_params": m.active_params,
        "dtype": dtype, "kv_dtype": kv_dtype,
        "device": {"mem_gb": mem_gb, "bandwidth_tbs": bw_tbs, "tflops": tflops},
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_tok,
        "kv_scale_bytes_per_token": kv_scales,
        "kv_bytes_per_seq": kv_seq,
        "seq_len": seq_len,
        "max_seqs_that_fit": fit,
        "kv_bytes_per_seq_window_blind": kv_seq_blind,
        "max_seqs_that_fit_window_blind": fit_blind,
        "layer_kinds": None if not m.windows else {
            "full": sum(w is None for w in m.windows), "sliding": sum(w is not None for w in m.windows),
            "windows": sorted({w for w in m.windows if w is not None})},
        "kv_saving_vs_mha": m.mha_kv_elems_per_token / m.kv_elems_per_token,
        "mla_equivalents": None if m.mla_latent is None else {  # bytes/token of the same model's heads cached as
            "mha": m.mha_kv_elems_per_token * kb, "gqa8": m.gqa_kv_elems_per_token(8) * kb},
        "attention_kind": "MLA" if m.mla_latent is not None else ("MQA" if m.kv_heads == 1 else
                                                                   "GQA" if m.kv_heads < m.heads else "MHA"),
        "ridge_flop_per_byte": ridge,
        "mlp_arithmetic_intensity": mlp_intensity,
        "decode_attention_intensity": m.attn_flops_per_token() * m.layers / kv_tok,  # FLOPs per KV byte read
        "prefill_attention_intensity": seq_len * seq_len / (seq_len + seq_len),
        "decode": step(batch),
        "prefill_ms_lower_bound": t_pre * 1e3,
        "prefill_bound": "compute" if prefill_flops / peak >= prefill_bytes / bw else "memory",
        "table": [step(b) for b in batches],
        "tensor_parallel": None if tp == 1 else tensor_parallel(m, tp, wb, kv_tok, kv_seq, bw, peak, link, batch, seq_len,
                                                          act_bytes or (4 if wb >= 4 else 2)),
    }


def tensor_parallel(m: PlanModel, tp: int, wb: float, kv_tok: float, kv_seq: float, bw: float, peak: float,
                    link: tuple[float, float], batch: int, seq_len: int, act_bytes: int) -> dict[str, Any]:
    """Per-rank memory and the decode step bound over `tp` ranks (see the module docstring). kv_seq: one
    sequence's KV bytes (sliding-window layers keep their window), as the one-process bound reads them."""
    if m.mla_latent is not None:  # one latent per token, not per head: every rank caches all of it (vLLM's TP)
        kv_heads, share = m.kv_heads, 1.0
    else:
        kv_heads = max(1, -(-m.kv_heads // tp))  # the most any rank holds; one replicated when fewer than ranks
        share = kv_heads / m.kv_heads
    kv_rank_tok = kv_tok * share
    link_bw, latency = link[0] * 1e9, link[1] * 1e-6
    msg = batch * m.hidden * act_bytes  # one all-reduce's activations
    reduces = 2 * m.layers + 1
    ring = 2 * (tp - 1) / tp * msg  # bytes over each rank's link per all-reduce
    gather = batch * m.vocab * 4 * (tp - 1) / tp  # float32 logits slices to rank 0
    t_comm = reduces * (latency + ring / link_bw) + latency + gather / link_bw

    def bound(ranks: int) -> float:
        moved = m.step_params * wb / ranks + batch * kv_seq * (share if ranks > 1 else 1)
        return max(moved / bw, m.decode_flops(batch, seq_len) / ranks / peak)

    t1, tn = bound(1), bound(tp) + t_comm
    return {"size": tp, "weight_bytes_per_rank": m.params * wb / tp, "kv_heads_per_rank": kv_heads,
            "kv_replicated": m.kv_heads < tp or m.mla_latent is not None,
            "kv_bytes_per_token_per_rank": kv_rank_tok, "all_reduces_per_step": reduces,
            "all_reduce_bytes": msg, "link_bytes_per_step": reduces * ring + gather,
            "link_gbs": link[0], "collective_latency_us": link[1], "comm_ms": t_comm * 1e3,
            "step_ms_tp1": t1 * 1e3, "step_ms": tn * 1e3, "speedup": t1 / tn}


def _fmt_bytes(n: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= div:
            return f"{n / div:,.2f} {unit}"
    return f"{n:,.0f} B"


def render(r: dict[str, Any]) -> str:
    d = r["device"]
    scales = f" ({r['kv_scale_bytes_per_token']:,} of them scales)" if r["kv_scale_bytes_per_token"] else ""
    lines = [
        f"model {r['model']}: {r['params'] / 1e9:.3f} B params ({_fmt_bytes(r['weight_bytes'])} in {r['dtype']}), "
        f"{r['attention_kind']}",
        f"device: {d['mem_gb']} GB, {d['bandwidth_tbs']} TB/s, {d['tflops']} TFLOP/s -> ridge point "
        f"{r['ridge_flop_per_byte']:.0f} FLOP/byte",
        f"KV cache ({r['kv_dtype']}): {r['kv_bytes_per_token']:,.0f} bytes/token{scales}; "
        f"{_fmt_bytes(r['kv_bytes_per_seq'])} per {r['seq_len']}-token sequence; "
        f"{r['kv_saving_vs_mha']:.1f}x smaller than full MHA",
        *([f"MLA caches the latent and the rope key: {r['kv_bytes_per_token']:,.0f} bytes/token against "
           f"{r['mla_equivalents']['mha']:,.0f} as MHA and {r['mla_equivalents']['gqa8']:,.0f} as GQA with 8 KV heads"]
          if r["mla_equivalents"] else []),
        *([f"sliding-window layers: {r['layer_kinds']['sliding']} of {r['layer_kinds']['sliding'] + r['layer_kinds']['full']}"
           f" (window {', '.join(map(str, r['layer_kinds']['windows']))}) keep only their window: "
           f"{_fmt_bytes(r['kv_bytes_per_seq'])} per {r['seq_len']}-token sequence against "
           f"{_fmt_bytes(r['kv_bytes_per_seq_window_blind'])} window-blind"] if r["layer_kinds"] else []),
        f"sequences of {r['seq_len']} tokens that fit beside the weights: {r['max_seqs_that_fit']:,}"
        + (f" (window-blind: {r['max_seqs_that_fit_window_blind']:,})" if r["layer_kinds"] else ""),
        f"arithmetic intensity: MLP matmuls {r['mlp_arithmetic_intensity'] or 0:.1f} FLOP/byte (~batch); "
        f"decode attention {r['decode_attention_intensity']:.1f}; prefill attention {r['prefill_attention_intensity']:.0f}",
        f"decode at batch {r['decode']['batch']}: >= {r['decode']['step_ms']:.3f} ms/step, "
        f"<= {r['decode']['tokens_per_s']:,.0f} tok/s ({r['decode']['bound']}-bound)",
        f"prefill of {r['decode']['batch']} x {r['seq_len']} tokens: >= {r['prefill_ms_lower_bound']:.2f} ms "
        f"({r['prefill_bound']}-bound)",
        "",
        f"{'batch':>6} {'KV GB':>9} {'fits':>5} {'step ms':>9} {'tok/s':>12} bound",
    ]
    for row in r["table"]:
        lines.append(f"{row['batch']:>6} {row['kv_gb']:>9.2f} {'yes' if row['fits'] else 'NO':>5} "
                     f"{row['step_ms']:>9.3f} {row['tokens_per_s']:>12,.0f} {row['bound']}")
    t = r["tensor_parallel"]
    if t:
        lines += ["", f"tensor parallel over {t['size']} ranks: weights {_fmt_bytes(t['weight_bytes_per_rank'])} per rank; "
                  f"KV {t['kv_bytes_per_token_per_rank']:,.0f} bytes/token per rank ("
                  + ("MLA's latent: all of it on every rank" if r["attention_kind"] == "MLA" else
                     f"{t['kv_heads_per_rank']} KV heads{', each replicated' if t['kv_replicated'] else ''}") + ")",
                  f"  per decode step at batch {r['decode']['batch']}: {t['all_reduces_per_step']} all-reduces of "
                  f"{_fmt_bytes(t['all_reduce_bytes'])} + the logits gather = {_fmt_bytes(t['link_bytes_per_step'])} "
                  f"over each link; at {t['link_gbs']} GB/s and {t['collective_latency_us']} us a collective: "
                  f"{t['comm_ms']:.3f} ms",
                  f"  batch-{r['decode']['batch']} step bound: {t['step_ms']:.3f} ms over {t['size']} ranks against "
                  f"{t['step_ms_tp1']:.3f} ms on one ({t['speedup']:.2f}x)"]
    return "\n".join(lines)
