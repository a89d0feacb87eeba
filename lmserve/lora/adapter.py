"""LoRA adapters in PEFT's format: a folder with adapter_config.json and adapter_model.safetensors.

An adapter adds (alpha / r) * B @ A to some of the model's projections (y = x W^T + s x A^T B^T).
Ours are our fused layers (q/k/v in one qkv_proj, gate/up in one gate_up_proj), so the shards an
adapter has for one fused layer are stacked: A_cat (S*r, in) holds each shard's A, B_cat (out, S*r)
each shard's B (scale folded in) in that shard's output rows and its own r columns, zeros elsewhere.
One fused layer then takes one low-rank product per adapter, whatever shards the adapter trained. Both
are kept transposed, At = A_cat^T (in, S*r) and Bt = B_cat^T (S*r, out): delta = (x At) Bt, which the
CPU kernel (layers/csrc/fused.c: lm_lora_add) computes as axpys over contiguous rows.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# PEFT's tensor names: base_model.model.<the checkpoint's module path>.lora_A.weight (an adapter's own
# name may sit before .weight in files saved by hand)
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's LoRARequest: an adapter by name and a positive integer id, with its folder (PEFT's format)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None  # (vLLM's; not read)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_request.lora_name: must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_request.lora_int_id: must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"lora_request.lora_path: must be a string, got {type(self.lora_path).__name__}")


@dataclass(eq=False)
class LoRAAdapter:
    """A loaded adapter: per target module (our path, e.g. 'layers.3.self_attn.qkv_proj') the stacked,
    transposed factors (At (in, S*r), Bt (S*r, out)), the scale in Bt, in the model's dtype and device, and
    spans (S, 2) int64 on the host: the output columns each shard's r rows of Bt reach (the rest are zeros)."""

    name: str
    id: int
    path: str
    rank: int
    scale: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    salt: bytes  # sha256 of its files: prefix-cache blocks computed with the adapter are keyed by it

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ab in self.weights.values() for t in ab)

    def table(self, names: tuple[str, ...]) -> torch.Tensor:
        """(len(names), 5) int64: (At, Bt, S*r, spans, r) of each named module, zeros where the adapter has
        none: the CPU decode plan's view of it (memoised; the tensors live as long as the adapter)."""
        memo = self.__dict__.setdefault("_tables", {})
        if names not in memo:
            found = [self.weights.get(n) for n in names]
            memo[names] = torch.tensor([(w[0].data_ptr(), w[1].data_ptr(), w[0].shape[1], w[2].data_ptr(),
                                         w[0].shape[1] // w[2].shape[0]) if w is not None else (0,) * 5
                                        for w in found], dtype=torch.int64)
        return memo[names]


def read_config(folder: Path, max_rank: int) -> tuple[dict[str, Any], int, float]:
    """adapter_config.json -> (config, rank, scale); ValueError naming what this engine does not take."""
    path = folder / CONFIG
    if not path.is_file():
        raise ValueError(f"lora_path: {str(folder)!r} has no {CONFIG} (a PEFT LoRA adapter's folder)")
    try:
        cfg = json.loads(path.read_text())
    except (ValueError, RecursionError) as e:  # (UnicodeDecodeError is a ValueError)
        raise ValueError(f"lora_path: {CONFIG} is not JSON ({type(e).__name__}: {e})") from None
    except OSError as e:
        raise ValueError(f"lora_path: {CONFIG} cannot be read ({e.strerror or e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"lora_path: {CONFIG} must hold a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"lora_path: peft_type {cfg.get('peft_type')!r} is not LORA")
    unsupported = {"use_dora": "DoRA", "modules_to_save": "modules_to_save (whole modules, not low-rank)",
                   "rank_pattern": "per-module ranks (rank_pattern)", "alpha_pattern": "per-module alphas (alpha_pattern)",
                   "fan_in_fan_out": "fan_in_fan_out (Conv1D models)",
                   "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens: applied from those tokens on)",
                   "target_parameters": "LoRA on parameters (target_parameters)", "arrow_config": "Arrow routing",
                   "layer_replication": "layer replication (layer_replication: the base's layers stacked again)"}
    for key, what in unsupported.items():
        if cfg.get(key):
            raise ValueError(f"lora_path: the adapter uses {what}, which is not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"lora_path: bias {cfg.get('bias')!r} is not supported (only 'none')")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", 8)  # (PEFT's LoraConfig default)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"lora_path: {CONFIG}'s r must be an integer >= 1, got {r!r}")
    if r > max_rank:
        raise ValueError(f"lora_request: the adapter's rank {r} exceeds max_lora_rank ({max_rank})")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"lora_path: lora_alpha must be a number, got {alpha!r}")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return cfg, r, float(scale)


def load_adapter(req: LoRARequest, targets: dict[str, tuple[int, list[int]]], stacked: dict[str, tuple[str, Any]],
                 max_rank: int, dtype: torch.dtype, device: str | torch.device) -> LoRAAdapter:
    """Read the adapter of `req` for a model whose LoRA targets are `targets` (our module path ->
    (in_features, shard sizes)); `stacked` maps a checkpoint leaf to (our leaf, shard) as the model's
    loader does. ValueError naming the problem (a module with no place here, a shape that does not fit)."""
    from safetensors.torch import load_file

    folder = Path(req.lora_path)
    if not req.lora_path or not folder.is_dir():
        raise ValueError(f"lora_path: {req.lora_path!r} is not a folder")
    cfg, r, scale = read_config(folder, max_rank)
    if not (folder / WEIGHTS).is_file():
        raise ValueError(f"lora_path: {str(folder)!r} has no {WEIGHTS} (a .bin adapter is a pickle; "
                         f"save it with safe_serialization)")
    try:
        raw = (folder / WEIGHTS).read_bytes()
        tensors = load_file(str(folder / WEIGHTS))
    except Exception as e:  # noqa: BLE001 - a damaged or unreadable file: the caller's error, not the engine's
        raise ValueError(f"lora_path: {WEIGHTS} cannot be read ({e})") from None
    parts: dict[str, dict[Any, dict[str, torch.Tensor]]] = {}  # target -> shard -> {"A", "B"}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"lora_path: tensor {key!r} is not a LoRA A / B weight (embedding or other "
                             f"adapters are not supported)")
        parent, _, leaf = m["module"].rpartition(".")
        ours, shard = stacked.get(leaf, (leaf, None))
        target = f"{parent}.{ours}" if parent else ours
        if target not in targets:
            raise ValueError(f"lora_path: the adapter's module {m['module']!r} has no place in this model "
                             f"(LoRA applies to the decoder layers' attention and MLP projections)")
        parts.setdefault(target, {}).setdefault(shard, {})[m["ab"]] = t
    weights = {}
    for target, shards in parts.items():
        in_features, sizes = targets[target]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        order = sorted(shards, key=lambda s: -1 if s is None else s)
        a_cat = torch.zeros(len(order) * r, in_features, dtype=torch.float32)  # (S*r, in)
        b_cat = torch.zeros(sum(sizes), len(order) * r, dtype=torch.float32)  # (out, S*r)
        for j, shard in enumerate(order):
            ab = shards[shard]
            if set(ab) != {"A", "B"}:
                raise ValueError(f"lora_path: {target} shard {shard} has lora_{'B' if 'A' in ab else 'A'} missing")
            rows = slice(0, sum(sizes)) if shard is None else slice(offsets[shard], offsets[shard] + sizes[shard])
            want_a, want_b = (r, in_features), (rows.stop - rows.start, r)
            if tuple(ab["A"].shape) != want_a or tuple(ab["B"].shape) != want_b:
                raise ValueError(f"lora_path: {target} shard {shard}: A {tuple(ab['A'].shape)} / B "
                                 f"{tuple(ab['B'].shape)} do not fit {want_a} / {want_b}")
            a_cat[j * r:(j + 1) * r] = ab["A"].float()
            b_cat[rows, j * r:(j + 1) * r] = ab["B"].float() * scale
        spans = torch.tensor([(0, sum(sizes)) if s is None else (offsets[s], offsets[s] + sizes[s]) for s in order],
                             dtype=torch.int64)  # (S, 2)
        weights[target] = (a_cat.t().contiguous().to(device=device, dtype=dtype),  # At (in, S*r)
                           b_cat.t().contiguous().to(device=device, dtype=dtype), spans)  # Bt (S*r, out)
    if not weights:
        raise ValueError(f"lora_path: {WEIGHTS} holds no LoRA weights")
    salt = hashlib.sha256(b"lora\0" + json.dumps(cfg, sort_keys=True).encode() + b"\0" + raw).digest()
    return LoRAAdapter(req.lora_name, req.lora_int_id, req.lora_path, r, scale, weights, salt)
