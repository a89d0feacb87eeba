"""Configuration objects: the model's shape (ModelConfig) and the engine's knobs (EngineConfig).

Both are frozen dataclasses validated on construction, so a bad option fails at start-up with a
message naming the field, never deep inside a forward pass.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch

from lmserve.config_spec import speculative_fields
from lmserve.utils import is_whole, parse_bytes  # noqa: F401 - parse_bytes: part of this module's API

DEFAULT_MODEL = "smollm2-135m"

@dataclass(frozen=True)
class ModelConfig:
    """The architecture-level facts our model code needs, from config.json or GGUF metadata."""

    architecture: str  # e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"
    # Gemma 3: which layers attend locally (sliding_window) and which globally; the local layers' rope
    # base; the attention scale query_pre_attn_scalar ** -0.5 (else head_dim ** -0.5); a soft cap
    # on the final logits (tanh(x / cap) * cap)
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    # mixture of experts (Mixtral, Qwen3-MoE): experts per sparse layer, k per token, each expert's
    # width, whether the k router weights are renormalised; which layers are sparse (every
    # decoder_sparse_step-th, except mlp_only_layers)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    # DeepSeek-V2 / V3 multi-head latent attention (MLA: kv_lora_rank > 0; models/deepseek.py): q through a
    # LoRA of rank q_lora_rank (None: one q_proj); a token caches a latent of kv_lora_rank + one rope key of
    # qk_rope_head_dim; rope on channel pairs (2i, 2i + 1) (V2; V3's rope_interleave) or (i, i + d/2)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    # DeepSeek MoE (models/moe.py): shared experts beside the routed ones; router scores softmax / sigmoid;
    # topk_method greedy, group_limited_greedy (V2) or noaux_tc (V3), topk_group of n_group groups kept;
    # sparse layers from first_k_dense_replace on, every moe_layer_freq-th
    n_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    # trained for Matryoshka embeddings (config.json's is_matryoshka / matryoshka_dimensions, as vLLM reads
    # them): an embedding may be cut to its first `dimensions` (to one of matryoshka_dimensions when given)
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("model config: num_heads must be a multiple of num_kv_heads")
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ValueError(f"model config: layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if self.is_mla:
            self._check_mla()
        if self.num_experts:
            self._check_routing()

    def _check_mla(self) -> None:
        """MLA's widths, and the rope scalings its rotary implements (none, yarn)."""
        for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0 or (name == "qk_rope_head_dim" and self.qk_rope_head_dim % 2):
                raise ValueError(f"model config: {name} must be positive (qk_rope_head_dim even) for MLA")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"model config: q_lora_rank must be positive or None, got {self.q_lora_rank}")
        if self.qkv_bias:
            raise ValueError("model config: attention_bias is not supported with MLA")
        kind = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        if kind not in ("default", "yarn"):
            raise ValueError(f"model config: rope_scaling type {kind!r} is not supported with MLA (default, yarn)")
        if kind == "yarn" and "original_max_position_embeddings" not in self.rope_scaling:  # type: ignore[operator]
            raise ValueError("model config: yarn rope_scaling needs original_max_position_embeddings")

    def _check_routing(self) -> None:
        """The router options SparseMoE implements, and group sizes that fit."""
        for name, ok in (("scoring_func", ("softmax", "sigmoid")),
                         ("topk_method", ("greedy", "group_limited_greedy", "noaux_tc"))):
            if getattr(self, name) not in ok:
                raise ValueError(f"model config: {name} must be one of {', '.join(ok)}, got {getattr(self, name)!r}")
        if self.n_group < 1 or self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"model config: n_group ({self.n_group}) must divide the {self.num_experts} experts and "
                             f"topk_group ({self.topk_group}) be in [1, n_group]")
        per_group = self.num_experts // self.n_group
        if not 1 <= self.num_experts_per_tok <= (self.num_experts if self.topk_method == "greedy"
                                                 else self.topk_group * per_group):
            raise ValueError(f"model config: num_experts_per_tok ({self.num_experts_per_tok}) must be at least 1 and "
                             f"at most the experts the kept groups hold")
        if self.topk_method == "noaux_tc" and per_group < 2:
            raise ValueError("model config: topk_method noaux_tc scores a group by its best two experts: n_group "
                             "must leave at least 2 experts a group")
        if self.n_shared_experts < 0 or self.first_k_dense_replace < 0 or self.moe_layer_freq < 1:
            raise ValueError("model config: n_shared_experts, first_k_dense_replace must be >= 0, moe_layer_freq >= 1")

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2 / V3): the cache holds a latent, not K / V per head."""
        return self.kv_lora_rank > 0

    def param_counts(self) -> tuple[float, float]:
        """(total, active per token) parameters: each layer's attention (MLA: q, possibly
        through its LoRA, the joint K/V down-projection, its up-projection, o) and MLP (a sparse layer: the
        router, every expert and the shared ones; active: k experts and the shared ones), two norms a layer,
        the final norm, the embedding and an untied LM head. Biases and q/k norms are left out."""
        h, heads = self.hidden_size, self.num_heads
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = h * heads * qk if self.q_lora_rank is None else self.q_lora_rank * (h + 1 + heads * qk)
            attn = q + h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * (
                1 + heads * (self.qk_nope_head_dim + self.v_head_dim)) + heads * self.v_head_dim * h
        else:
            attn = h * self.head_dim * (2 * heads + 2 * self.num_kv_heads)
        total = active = float(self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h)
        for i in range(self.num_layers):
            if self.layer_is_moe(i):
                expert = 3 * h * (self.moe_intermediate_size or self.intermediate_size)
                shared = self.n_shared_experts * expert + h * self.num_experts  # (and the router)
                total += attn + 2 * h + self.num_experts * expert + shared
                active += attn + 2 * h + self.num_experts_per_tok * expert + shared
            else:
                total += attn + 2 * h + 3 * h * self.intermediate_size
                active += attn + 2 * h + 3 * h * self.intermediate_size
        return total, active

    def layer_is_moe(self, i: int) -> bool:
        """Layer i's MLP is a routed mixture of experts."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
                and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0)

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer i (None: it attends to the whole context)."""
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    @property
    def kv_entry_shape(self) -> tuple[int, int, int]:
        """What one token caches in one layer: (parts, heads, width). K and V per KV head: (2, num_kv_heads,
        head_dim). A model with another cache row (MLA's latent) says so here; KVCache allocates
        (parts, slots, heads, width) per layer from it. MLA: one row of kv_lora_rank + qk_rope_head_dim."""
        if self.is_mla:
            return 1, 1, self.kv_lora_rank + self.qk_rope_head_dim
        return 2, self.num_kv_heads, self.head_dim

    @property
    def kv_elems_per_token(self) -> int:
        """Number of cached elements one token occupies across all layers (times dtype bytes = KV bytes)."""
        parts, heads, width = self.kv_entry_shape
        return self.num_layers * parts * heads * width

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from an HF config.json dict (config_hf.py reads it as transformers does)."""
        from lmserve.config_hf import model_fields
        return cls(**model_fields(cfg))


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    """'auto' -> float32 on CPU (measured faster than bf16 there for batched matmuls), bf16 on CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    if dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if dtype not in table:
        raise ValueError(f"dtype: unknown {dtype!r}; use one of auto, {', '.join(table)}")
    return table[dtype]


QUANTIZATIONS = ("auto", "none", None, "int8", "int4", "awq", "gguf", "fp8")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")


@dataclass(frozen=True)
class EngineConfig:
    """Engine options, named as vLLM names them."""

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    block_size: int = 16
    max_num_seqs: int | None = None  # None: 64 on CPU, 256 on CUDA
    max_num_batched_tokens: int | None = None  # None: 512 on CPU, 8192 on CUDA
    enable_prefix_caching: bool = True
    # one KV group for every layer, blocks kept for the whole sequence even where a layer's sliding
    # window no longer reads them (the window-blind cache; kv/groups.py, vLLM's flag of the same name)
    disable_hybrid_kv_cache_manager: bool = False
    kv_cache_memory: int | float | str | None = None  # None: 1 GiB on CPU; on CUDA measured (see below)
    gpu_memory_utilization: float = 0.9  # CUDA: share of device memory for weights + activations + KV
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    max_model_len: int | None = None
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps
    cuda_graph_sizes: list[int] | None = None  # decode batch sizes to capture; None: 1, 2, 4, multiples of 8 to max_num_seqs (<= 512)
    attention_backend: str = "auto"  # auto (triton on CUDA, cpu on the CPU, else torch) | torch | cpu | triton
    # weights: auto (a GGUF on the CPU keeps its blocks, as llama.cpp runs it: gguf; else the checkpoint's
    # own) | none / None (the checkpoint's float; an AWQ folder stays AWQ) | int8 | int4 | awq | gguf | fp8
    quantization: str | None = "auto"
    # int8 / int4 quantized at load: a scale per group of this many input columns (halved, down to 32, until
    # it divides a layer's width; else one per row). None: int8 one scale per output row, int4 128. On
    # SmolLM2-135M int8 per row costs +2.0% perplexity, per group of 64 -0.7% (+5% weight bytes)
    quantization_group_size: int | None = None
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | int8 | fp8: a scale per token, head, 32 channels
    # vLLM's speculative_config dict (method, model, num_speculative_tokens, prompt_lookup_max / _min), read
    # into the fields below: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    speculative_config: dict[str, Any] | None = None
    # speculative decoding: None | "ngram" | "draft" | "eagle" (draft_model: the head's folder)
    speculative_method: str | None = None
    num_speculative_tokens: int = 5  # measured best of 3 / 5 / 7 for n-gram on the CPU fast path (BENCHMARKS.md)
    # draft: a path or known name, by default the target itself (with draft_num_layers); eagle: a head's folder
    draft_model: str | None = None
    draft_num_layers: int | None = None  # keep only the first N layers of the draft (a truncated copy)
    ngram_min: int = 1
    ngram_max: int = 3
    spec_max_batch: int = 8  # no speculation when more sequences than this are running
    spec_min_acceptance: float = 0.1  # pause a request's speculation below this running acceptance
    spec_policy: str = "fixed"  # fixed: num_speculative_tokens | goodput: measured best k (spec/goodput.py)
    spec_min_draft_prob: float = 0.0  # eagle: a chain ends before a draft whose top probability is below (0: off)
    # structured output: seconds a grammar (JSON schema, regex, EBNF) may take to compile; slower: a 400
    grammar_compile_timeout: float = 10.0
    max_logprobs: int = 20  # most logprobs / prompt_logprobs a request may ask (vLLM's; -1: the vocabulary)
    # LoRA adapters (lmserve/lora, PEFT's format): a request may name one (LLM.generate's lora_request, the
    # server's --lora-modules); max_loras: adapters kept loaded (the least recently used let go; a step may
    # mix any number of them); max_lora_rank: the highest rank taken
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    # chats rendered with this template (a file, or the template itself) instead of the checkpoint's
    # (vLLM's --chat-template; a request's own chat_template still needs the server's trust)
    chat_template: str | None = None
    # sampling defaults for what a request leaves unset (generation_config.py, vLLM's flags): auto (the
    # checkpoint's generation_config.json) | vllm (none: the library's own) | a folder holding one; the
    # override's fields (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) go on top
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None
    # batch-invariant outputs: a request's tokens and logprobs bit-identical whatever else runs beside it,
    # however its prompt is chunked, whatever the prefix cache holds (linears over fixed row blocks,
    # attention a token at a time: our C kernel on the CPU, attention/triton_invariant.py with triton)
    deterministic: bool = False
    max_waiting_time: float | None = None  # s before a first step; past it a 503 (a started request: never cut)
    # preemption: host memory for swapped-out KV (bytes or "4GiB"; 0: recompute only); auto swaps when that
    # costs less than recomputing (kv/swap.py) and there is room, swap when there is room, recompute never
    swap_space: int | float | str = 0
    preemption_mode: str = "auto"
    # the prefix cache's second tier (kv/offload.py): evicted blocks' KV kept in host memory (bytes or
    # "4GiB"; 0: off), or with kv_offloading_dir in files there (kept across restarts)
    kv_offloading_size: int | float | str = 0
    kv_offloading_dir: str | None = None
    # tensor parallelism (lmserve/parallel): ranks sharing every layer (one process each); the network
    # interface they bind to; seconds a collective may wait before its peer counts as lost
    tensor_parallel_size: int = 1
    distributed_interface: str | None = None
    distributed_timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            for k, v in speculative_fields(self.speculative_config, self.speculative_method).items():
                object.__setattr__(self, k, v)
            object.__setattr__(self, "speculative_config", None)  # read into the fields (a replace() keeps them)
        for name, lo in (("block_size", 1), ("max_num_seqs", 1), ("max_num_batched_tokens", 1), ("max_model_len", 1),
                         ("quantization_group_size", 1), ("num_speculative_tokens", 1), ("draft_num_layers", 1),
                         ("ngram_min", 1), ("ngram_max", self.ngram_min), ("spec_max_batch", 0),
                         ("tensor_parallel_size", 1), ("seed", 0), ("max_logprobs", -1),
                         ("max_loras", 1), ("max_lora_rank", 1)):
            v = getattr(self, name)
            if v is not None and (not is_whole(v) or v < lo):
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError) as e:  # torch's message for 'tpu', an int's for None
            raise ValueError(f"device: {self.device!r} is not a torch device ({e})") from None
        on_cuda = str(self.device).startswith("cuda")
        if self.max_num_seqs is None:
            object.__setattr__(self, "max_num_seqs", 256 if on_cuda else 64)
        if self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens", 8192 if on_cuda else 512)
        if self.cuda_graph_sizes is not None and (not self.cuda_graph_sizes
                                                  or any(b < 1 for b in self.cuda_graph_sizes)):
            raise ValueError(f"cuda_graph_sizes must be positive batch sizes, got {self.cuda_graph_sizes}")
        if self.kv_cache_memory is None and not on_cuda:
            object.__setattr__(self, "kv_cache_memory", "1GiB")
        if self.kv_cache_memory is not None:
            object.__setattr__(self, "kv_cache_memory", parse_bytes(self.kv_cache_memory))
        object.__setattr__(self, "swap_space", parse_bytes(self.swap_space, "swap_space") if self.swap_space else 0)
        object.__setattr__(self, "kv_offloading_size", parse_bytes(self.kv_offloading_size, "kv_offloading_size")
                           if self.kv_offloading_size else 0)
        if self.kv_offloading_dir is not None and not self.kv_offloading_size:
            raise ValueError("kv_offloading_dir: give kv_offloading_size too (the most bytes of KV kept there)")
        if self.kv_offloading_size and self.tensor_parallel_size > 1:
            raise ValueError("kv_offloading_size: the offload tier is not mirrored across tensor-parallel ranks")
        if self.preemption_mode not in ("auto", "swap", "recompute"):
            raise ValueError(f"preemption_mode must be auto, swap or recompute, got {self.preemption_mode!r}")
        if not self.distributed_timeout > 0:
            raise ValueError(f"distributed_timeout must be > 0, got {self.distributed_timeout}")
        if self.tensor_parallel_size > 1 and (self.swap_space or self.preemption_mode == "swap"):
            raise ValueError("preemption_mode: swapping is not mirrored across tensor-parallel ranks; use recompute")
        if self.tensor_parallel_size > 1 and on_cuda and self.kv_cache_memory is None:
            raise ValueError("kv_cache_memory: give each tensor-parallel rank's KV budget (no memory profile yet)")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("enable_lora: adapters are not sharded across tensor-parallel ranks; use tensor_parallel_size=1")
        if self.max_waiting_time is not None and not self.max_waiting_time > 0:
            raise ValueError(f"max_waiting_time must be > 0, got {self.max_waiting_time}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {self.generation_config!r}")
        if self.override_generation_config is not None and not isinstance(self.override_generation_config, dict):
            raise ValueError(f"override_generation_config must be a dict, got {self.override_generation_config!r}")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be > 0, got {self.grammar_compile_timeout}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.speculative_method not in (None, "ngram", "draft", "eagle"):
            raise ValueError(f"speculative_method must be None, 'ngram', 'draft' or 'eagle', "
                             f"got {self.speculative_method!r}")
        if self.speculative_method == "eagle" and not self.draft_model:
            raise ValueError("draft_model: speculative_method='eagle' needs the head's folder (lmserve train-draft --out DIR)")
        if self.speculative_method == "eagle" and self.tensor_parallel_size > 1:
            raise ValueError("speculative_method: 'eagle' reads the whole target's features; "
                             "use it with tensor_parallel_size=1")
        if not self.spec_min_acceptance >= 0.0:  # (above 1: every request pauses after its first drafts)
            raise ValueError(f"spec_min_acceptance must be >= 0, got {self.spec_min_acceptance}")
        if not 0.0 <= self.spec_min_draft_prob < 1.0:  # (1 would never draft)
            raise ValueError(f"spec_min_draft_prob must be in [0, 1), got {self.spec_min_draft_prob}")
        if self.spec_policy not in ("fixed", "goodput") or (self.spec_policy == "goodput" and self.deterministic):
            raise ValueError(f"spec_policy must be 'fixed' or 'goodput' (not with deterministic: its k follows "
                             f"measured times, and sampled tokens the drafts), got {self.spec_policy!r}")
        resolve_dtype(self.dtype, self.device)
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(map(str, QUANTIZATIONS))}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.deterministic and self.tensor_parallel_size > 1:
            raise ValueError("deterministic: a tensor-parallel all-reduce sums in an order that follows its message "
                             "size (the batch); use tensor_parallel_size=1")
        if self.deterministic and not on_cuda and self.attention_backend != "triton" and (
                self.kv_cache_dtype == "fp8" or self.kv_cache_dtype == "auto"
                and resolve_dtype(self.dtype, self.device) == torch.float16):
            raise ValueError("deterministic: our CPU attention kernel reads float32, bf16 and int8 KV caches; an fp8 "
                             "or float16 one goes to the torch path, which is not batch-invariant (use kv_cache_dtype "
                             "int8, or auto with float32 / bf16)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype, self.device)

    @property
    def graph_sizes(self) -> list[int]:
        """Decode batch sizes captured as CUDA graphs (a live batch is padded up to the next one):
        cuda_graph_sizes, or 1, 2, 4 and multiples of 8 up to max_num_seqs (at most 512), as vLLM does."""
        if self.cuda_graph_sizes is not None:
            return sorted(set(self.cuda_graph_sizes))
        top = min(self.max_num_seqs, 512)
        return sorted({b for b in (1, 2, 4, *range(8, top + 1, 8)) if b <= top} | {top})

    def replace(self, **kw: Any) -> "EngineConfig":
        return dataclasses.replace(self, **kw)
