"""Engine flags: one per EngineConfig field, named as vLLM names them (block_size -> --block-size).

Built from the dataclass, so a new field is a new flag with no edit here; the parser comes from the
field's annotation, and _OVERRIDES adds what a type cannot say (help text, choices). This module imports
none of the commands: every command that loads a model takes its engine flags from here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from typing import Any

from lmserve.config import EngineConfig
from lmserve.utils import given_flags

_OVERRIDES: dict[str, dict[str, Any]] = {
    "model": {"help": "HF folder, .gguf file, or a known name (default %(default)s)"},
    "tokenizer": {"help": "a tokenizer folder (tokenizer.json / tokenizer_config.json) instead of the model's own, "
                          "for any model (HF folder, GGUF, shape:)"},
    "max_num_seqs": {"help": "default 64 on CPU, 256 on CUDA"},
    "max_num_batched_tokens": {"help": "default 512 on CPU, 8192 on CUDA"},
    "kv_cache_memory": {"help": "KV cache budget, e.g. 2GiB, 512MiB (default: 1GiB on CPU; on CUDA what "
                                "--gpu-memory-utilization leaves after a profiled step)"},
    "dtype": {"help": "auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16"},
    "enforce_eager": {"help": "CUDA: no CUDA graphs for decode steps"},
    "cuda_graph_sizes": {"help": "decode batch sizes to capture (default 1 2 4, then multiples of 8 up to max-num-seqs, at most 512)"},
    "attention_backend": {"choices": ["auto", "torch", "cpu", "triton"]},
    "quantization": {"choices": ["auto", "none", "int8", "int4", "awq", "gguf", "fp8"],
                     "help": "weights kept quantized: auto (default: a GGUF file on the CPU keeps its blocks, "
                             "as gguf; else none), none (the checkpoint's float), int8 / int4 (round to nearest "
                             "at load), awq (an AWQ checkpoint), gguf (the GGUF file's own blocks), fp8 (e4m3)"},
    "kv_cache_dtype": {"choices": ["auto", "int8", "fp8"], "help": "KV cache element type (auto: the model dtype)"},
    "disable_hybrid_kv_cache_manager": {"help": "keep every layer's KV blocks for the whole sequence (no "
                                                "freeing of out-of-window blocks for sliding-window layers)"},
    "speculative_method": {"choices": ["ngram", "draft", "eagle"]},
    "draft_model": {"help": "draft model (default: the target itself, truncated); for eagle, the head's folder"},
    "draft_num_layers": {"help": "keep only the draft's first N layers"},
    "spec_max_batch": {"help": "no speculation above this many running seqs"},
    "spec_min_acceptance": {"help": "pause a request's speculation below this running acceptance rate"},
    "spec_policy": {"choices": ["fixed", "goodput"],
                    "help": "fixed: draft num_speculative_tokens each step; goodput: the k (and the requests) "
                            "measured to give the most tokens a second here"},
    "spec_min_draft_prob": {"help": "eagle: stop a request's chain of drafts before the first whose distribution's "
                                    "top probability is below this (0: always k)"},
    "max_logprobs": {"help": "the most logprobs / top_logprobs / prompt_logprobs a request may ask (default 20, "
                             "as vLLM; -1: the whole vocabulary)"},
    "enable_lora": {"help": "serve LoRA adapters (PEFT's format) that requests name (serve: implied by --lora-modules)"},
    "max_loras": {"help": "LoRA adapters kept loaded, the least recently used let go (a batch may mix any number)"},
    "max_lora_rank": {"help": "the highest LoRA rank an adapter may have"},
    "max_waiting_time": {"help": "seconds a request may wait for its first step before it is refused (503)"},
    "chat_template": {"help": "render chats with this template (a file, or the template itself) instead of the "
                              "model's own"},
    "speculative_config": {"type": lambda s: _json_object("speculative_config", s),
                           "help": "vLLM's JSON form, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                                   "\"prompt_lookup_max\": 3}' or '{\"model\": DRAFT, \"num_speculative_tokens\": 3}'"},
    "generation_config": {"help": "sampling defaults for what a request leaves unset: auto (the model's "
                                  "generation_config.json, as vLLM), vllm (none), or a folder holding one"},
    "override_generation_config": {"type": lambda s: _json_object("override_generation_config", s),
                                   "help": "JSON object of sampling defaults over --generation-config's, e.g. "
                                           "'{\"temperature\": 0.5}' (fields: temperature, top_p, top_k, min_p, "
                                           "repetition_penalty, max_new_tokens)"},
}


def _json_object(name: str, text: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{name}: not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError(f"{name}: not a JSON object")
    return obj


def _parse_options(hint: Any) -> dict[str, Any]:
    """How argparse reads a value of this annotation: bool -> --x/--no-x, list[int] -> one or more
    ints, one plain type -> that type, a union of several (int | float | str) -> the string as given."""
    kinds = [t for t in typing.get_args(hint) if t is not type(None)] if isinstance(hint, types.UnionType) else [hint]
    if kinds == [bool]:
        return {"action": argparse.BooleanOptionalAction}
    if len(kinds) == 1 and typing.get_origin(kinds[0]) is list:
        return {"nargs": "+", "type": typing.get_args(kinds[0])[0]}
    return {"type": kinds[0] if len(kinds) == 1 else number_or_text}


def number_or_text(text: str) -> int | float | str:
    """A flag of several types (int | float | str: a byte count): a number as a number ('0', '268435456',
    '2e9' are bytes, as the library reads numbers), anything else the text as given ('2GiB')."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The "engine" argument group: a flag for every EngineConfig field, with the field's default."""
    g = p.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        g.add_argument("--" + f.name.replace("_", "-"), default=f.default,
                       **(_parse_options(hints[f.name]) | _OVERRIDES.get(f.name, {})))


# flags that do something only when a speculative method is on
SPECULATION_FLAGS = ("--num-speculative-tokens", "--draft-model", "--draft-num-layers", "--ngram-min", "--ngram-max",
                     "--spec-max-batch", "--spec-min-acceptance", "--spec-policy", "--spec-min-draft-prob")


def engine_kwargs(a: argparse.Namespace, method_per_run: bool = False) -> dict[str, Any]:
    """EngineConfig's options from parsed engine flags, all but the model (callers pass it first).
    ValueError naming the field for a speculation flag given without a method (it would do nothing),
    unless the command sets the method itself for each run (method_per_run: bench spec; and a torchrun
    follower rank, whose rank 0 checked)."""
    if not method_per_run and a.speculative_method is None and a.speculative_config is None:
        for flag in sorted(set(SPECULATION_FLAGS) & given_flags(getattr(a, "argv", []))):
            raise ValueError(f"{flag[2:].replace('-', '_')}: {flag} does nothing without --speculative-method "
                             "(or --speculative-config)")
    return {f.name: getattr(a, f.name) for f in dataclasses.fields(EngineConfig) if f.name != "model"}
