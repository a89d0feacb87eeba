"""Sampling: batched logit processing and token selection."""

from lmserve.sampling.sampler import Sampler, SamplerOutput

__all__ = ["Sampler", "SamplerOutput"]
