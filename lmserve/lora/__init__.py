"""LoRA adapters: PEFT-format adapters loaded per request and applied in the forward pass."""

from lmserve.lora.adapter import LoRAAdapter, LoRARequest, load_adapter
from lmserve.lora.layers import LoRAContext, attach_lora
from lmserve.lora.registry import LoRARegistry

__all__ = ["LoRAAdapter", "LoRAContext", "LoRARegistry", "LoRARequest", "attach_lora", "load_adapter"]
