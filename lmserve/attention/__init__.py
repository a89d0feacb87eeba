"""Attention over the paged KV cache: metadata built once per step, and the backends that read it."""

from lmserve.attention.backend import AttentionBackend, AttentionMetadata, pack_block_tables
from lmserve.attention.registry import get_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend", "pack_block_tables"]
