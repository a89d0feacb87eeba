"""Sampling flags of the commands that generate text (generate, chat), and the SamplingParams they make."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from lmserve.sequence import SamplingParams, StructuredOutputsParams
from lmserve.utils import at_least


# what a command uses for a flag not given, unless the model recommends otherwise (its
# generation_config.json, --generation-config, --override-generation-config); a command's own set
# (chat's `command_sampling`) goes over these
DEFAULTS = dict(max_tokens=64, temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """The "sampling" argument group: one request's sampling options. The ones DEFAULTS names are None
    when not given: flag, then the model's generation config, then the command's default."""
    g = p.add_argument_group("sampling", "a flag not given: the model's generation config "
                                         "(--generation-config), else the value shown")
    g.add_argument("--max-tokens", type=at_least(1), default=None, help="default 64 (chat: 256)")
    g.add_argument("--temperature", type=float, default=None, help="default 0: greedy (chat: 0.7)")
    g.add_argument("--top-p", type=float, default=None, help="default 1.0")
    g.add_argument("--top-k", type=int, default=None, help="default -1: off")
    g.add_argument("--min-p", type=float, default=None, help="default 0.0")
    g.add_argument("--repetition-penalty", type=float, default=None, help="default 1.0")
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


def sampling_params(a: argparse.Namespace, model_defaults: dict[str, Any] | None = None) -> SamplingParams:
    """SamplingParams from parsed sampling flags: each flag given, else `model_defaults` (the model's
    generation config: LLM.sampling_defaults), else the command's default; the model's max_new_tokens
    caps max_tokens, as on the server (and in vLLM)."""
    given = {k: getattr(a, k) for k in DEFAULTS if getattr(a, k, None) is not None}
    model_defaults = model_defaults or {}
    fields = {**DEFAULTS, **getattr(a, "command_sampling", {}), **model_defaults, **given}
    fields["max_tokens"] = min(fields["max_tokens"], model_defaults.get("max_tokens", fields["max_tokens"]))
    return SamplingParams(**fields, seed=a.request_seed, stop=a.stop, ignore_eos=a.ignore_eos,
                          structured_outputs=structured_outputs(a))
