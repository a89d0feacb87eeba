"""The engine's loaded adapters: LoRARequest -> LoRAAdapter, loaded once, the least recently used let go
past max_loras. A sequence holds its adapter itself, so letting one go never touches a request in flight."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import torch

from lmserve.lora.adapter import LoRAAdapter, LoRARequest, load_adapter
from lmserve.lora.layers import attach_lora, lora_targets


class LoRARegistry:
    """Loads and caches adapters for one model; thread-safe (requests are processed on callers' threads)."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: str | torch.device) -> None:
        self.targets = {name: (m.in_features, list(m.sizes)) for name, m in lora_targets(model).items()}
        self.stacked: dict[str, tuple[str, Any]] = dict(getattr(model, "stacked", {}))
        self.context = attach_lora(model)
        self.max_loras, self.max_rank, self.dtype, self.device = max_loras, max_rank, dtype, device
        self._loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()  # lora_int_id -> adapter, oldest use first
        self._lock = threading.Lock()

    def get(self, req: Any) -> LoRAAdapter:
        """The adapter of a LoRARequest, loaded on first use (outside the lock: a load never holds up
        another thread's lookup); ValueError naming the problem."""
        if not isinstance(req, LoRARequest):
            raise ValueError(f"lora_request: must be a LoRARequest, got {type(req).__name__}")
        adapter = self._lookup(req)
        if adapter is not None:
            return adapter
        loaded = load_adapter(req, self.targets, self.stacked, self.max_rank, self.dtype, self.device)
        with self._lock:  # (two threads may have loaded it: the first kept wins)
            adapter = self._loaded.setdefault(req.lora_int_id, loaded)
            self._loaded.move_to_end(req.lora_int_id)
            while len(self._loaded) > self.max_loras:
                self._loaded.popitem(last=False)
        return adapter

    def _lookup(self, req: LoRARequest) -> LoRAAdapter | None:
        with self._lock:
            adapter = self._loaded.get(req.lora_int_id)
            if adapter is not None:
                if adapter.name != req.lora_name:
                    raise ValueError(f"lora_request.lora_int_id: {req.lora_int_id} is the adapter "
                                     f"{adapter.name!r}, not {req.lora_name!r}")
                self._loaded.move_to_end(req.lora_int_id)
            return adapter

    def remove(self, lora_int_id: int) -> bool:
        """Let an adapter go (requests holding it finish with it); False if it was not loaded."""
        with self._lock:
            return self._loaded.pop(lora_int_id, None) is not None

    def loaded(self) -> list[LoRAAdapter]:
        with self._lock:
            return list(self._loaded.values())
