"""Sampling flags of the commands that generate text (generate, chat), and the SamplingParams they make."""

from __future__ import annotations

import argparse

from pathlib import Path

from lmserve.sequence import SamplingParams, StructuredOutputsParams
from lmserve.utils import at_least


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """The "sampling" argument group: one request's sampling options."""
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=at_least(1), default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", "--request-seed", dest="request_seed", type=int, default=None,
                   help="per-request seed (same text whatever else runs)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    c = p.add_argument_group("structured output (one of)")
    c.add_argument("--json-schema", metavar="FILE", default=None, help="output valid against this JSON schema")
    c.add_argument("--json-object", action="store_true", help="output any JSON object")
    c.add_argument("--regex", default=None, help="output matching this regular expression")
    c.add_argument("--choice", action="append", default=None, help="output one of these strings (repeatable)")
    c.add_argument("--grammar", metavar="FILE", default=None, help="output in this EBNF (GBNF) grammar")


def structured_outputs(a: argparse.Namespace) -> StructuredOutputsParams | None:
    """The output constraint the flags ask for, or None; files are read here (ValueError naming the flag)."""
    def read(flag: str, path: str | None) -> str | None:
        if path is None:
            return None
        try:
            return Path(path).read_text()
        except OSError as e:
            raise ValueError(f"{flag}: cannot read {path}: {e.strerror}") from None
    schema, grammar = read("--json-schema", a.json_schema), read("--grammar", a.grammar)
    if schema is None and grammar is None and a.regex is None and a.choice is None and not a.json_object:
        return None
    return StructuredOutputsParams(json=schema, json_object=a.json_object, regex=a.regex, choice=a.choice,
                                   grammar=grammar)


def sampling_params(a: argparse.Namespace) -> SamplingParams:
    """SamplingParams from parsed sampling flags."""
    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                          min_p=a.min_p, repetition_penalty=a.repetition_penalty, seed=a.request_seed,
                          stop=a.stop, ignore_eos=a.ignore_eos, structured_outputs=structured_outputs(a))
