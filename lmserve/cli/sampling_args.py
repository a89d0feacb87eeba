"""Sampling flags of the commands that generate text (generate, chat), and the SamplingParams they make."""

from __future__ import annotations

import argparse

from lmserve.sequence import SamplingParams


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """The "sampling" argument group: one request's sampling options."""
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", "--request-seed", dest="request_seed", type=int, default=None,
                   help="per-request seed (same text whatever else runs)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params(a: argparse.Namespace) -> SamplingParams:
    """SamplingParams from parsed sampling flags."""
    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                          min_p=a.min_p, repetition_penalty=a.repetition_penalty, seed=a.request_seed,
                          stop=a.stop, ignore_eos=a.ignore_eos)
