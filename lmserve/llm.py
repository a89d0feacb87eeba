"""LLM: the offline batch API over Engine (what `from lmserve import LLM` gives you)."""

from __future__ import annotations

import dataclasses
import itertools
import numbers
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lmserve.config import DEFAULT_MODEL, EngineConfig
from lmserve.engine import Engine, EngineStats
from lmserve.generation_config import sampling_defaults
from lmserve.inputs import dict_prompt, with_salt
from lmserve.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from lmserve.pooling import PoolingParams
from lmserve.sequence import SamplingParams, Sequence


class LLM:
    """Load a model once, then generate for many prompts with continuous batching.

    >>> llm = LLM()                                    # the default SmolLM2-135M-Instruct
    >>> out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
    >>> out[0].outputs[0].text
    """

    def __init__(self, model: str = DEFAULT_MODEL, **engine_options: Any) -> None:
        known = set(EngineConfig.__dataclass_fields__)
        unknown = sorted(set(engine_options) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown engine option(s) {', '.join(map(repr, unknown))}; "
                            f"see EngineConfig for the options")
        self.engine = Engine(EngineConfig(model=model, **engine_options))
        self._defaults = sampling_defaults(self.engine.config)  # the model's (generation_config.json)
        self._ids = itertools.count()
        self._lock = threading.Lock()  # held by the generate() / score() running (_alone)
        self._owner: int | None = None  # the thread holding it

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """The model's recommended sampling (generation_config.json, --override-generation-config), only
        the fields it sets: what a request's unset fields take (max_tokens: a cap, as on the server)."""
        return dict(self._defaults)

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() use without SamplingParams: the model's recommended sampling
        (its generation_config.json's temperature, top_p, top_k, min_p, repetition_penalty and
        max_new_tokens, as vLLM reads them; `generation_config="vllm"`: none), else SamplingParams()'s."""
        return SamplingParams(**self._defaults)

    @property
    def tokenizer(self):  # type: ignore[no-untyped-def]
        return self.engine.tokenizer

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None, lora_request: Any = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids: a list, tuple, numpy array or tensor of them, or
        vLLM's {"prompt": text} / {"prompt_token_ids": ids}); outputs come back in input order.

        All requests are validated before any is queued, so one bad prompt raises and runs nothing.
        priority: one per prompt, lower first (admitted before, preempted after, higher ones).
        lora_request: a LoRARequest for every prompt, or a list of them (None: the base model). One call
        at a time: another thread's call waits for this one to end; one from inside it is a RuntimeError.
        """
        prompts = prompt_list(prompts)
        if not prompts:
            return []
        plist = params if isinstance(params, list) else [params or self.get_default_sampling_params()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params: got {len(plist)} SamplingParams for {len(prompts)} prompts")
        if priority is not None and (len(priority) != len(prompts) or
                                     any(isinstance(x, bool) or not isinstance(x, int) for x in priority)):
            raise ValueError(f"priority: one integer per prompt ({len(prompts)})")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request: got {len(loras)} for {len(prompts)} prompts")
        requests = [self.engine.process_request(p, sp, lr)  # all, before any runs
                    for p, sp, lr in zip(prompts, plist, loras)]
        if priority is not None:
            requests = [dataclasses.replace(r, priority=x) for r, x in zip(requests, priority)]
        with self._alone():
            ids = [f"gen-{next(self._ids)}" for _ in prompts]
            try:
                for rid, req in zip(ids, requests):
                    self.engine.add_request(rid, req, final_only=True)
            except BaseException:  # (Ctrl-C between two adds): none of this call's requests stays queued
                for rid in ids:
                    self.engine.abort_request(rid)
                raise
            return self._run(ids, use_tqdm)

    def embed(self, prompts: Any,
              pooling_params: PoolingParams | list[PoolingParams] | tuple[PoolingParams, ...] | None = None,
              use_tqdm: bool = True, lora_request: Any = None,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """An embedding per prompt (vLLM's LLM.embed): the final hidden states pooled (PoolingParams: the last
        token's by default, or the mean), cut to `dimensions`, L2-normalised; prompts as generate() takes them
        (truncate_prompt_tokens: each prompt's last k tokens, as PoolingParams' field)."""
        n = len(prompt_list(prompts))
        one = pooling_params if pooling_params is not None else PoolingParams()
        pp = list(pooling_params) if isinstance(pooling_params, (list, tuple)) else [one] * n
        if len(pp) != n or not all(isinstance(p, PoolingParams) for p in pp):
            raise ValueError(f"pooling_params: one PoolingParams, or one per prompt ({n}), got {pooling_params!r}")
        if truncate_prompt_tokens is not None:
            pp = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in pp]
        outs = self.generate(prompts, pp, use_tqdm=use_tqdm, lora_request=lora_request)  # type: ignore[arg-type]
        for o in outs:
            if o.embedding is None:  # (a failed step: its error)
                raise RuntimeError(f"embed: request {o.request_id} failed: {o.outputs[0].error}")
        return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.embedding), o.prompt_token_ids)  # type: ignore[arg-type]
                for o in outs]

    @contextmanager
    def _alone(self) -> Iterator[None]:
        """The engine for this call alone: other threads' calls wait for it (two at once interleaved their
        steps and took each other's outputs: one caller waited forever, the other's step failed); a call
        from inside it (a callback) is refused; requests added to the engine by hand would lose theirs."""
        if self._owner == threading.get_ident():
            raise RuntimeError("LLM: generate() / score() called from inside a running one on this thread")
        with self._lock:
            self._owner = threading.get_ident()
            try:
                if self.engine.has_unfinished_requests():
                    raise RuntimeError("LLM: the engine holds requests added outside LLM (engine.add_request): step "
                                       "them to their end or abort them first; their outputs would be lost")
                yield
            finally:
                self._owner = None

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             params: SamplingParams | None = None, use_tqdm: bool = False, lora_request: Any = None,
             **template_kwargs: Any) -> list[RequestOutput]:
        """Apply the model's chat template (or `chat_template`, vLLM's name; `template`) to one conversation
        (or a list of them) and generate; other keywords (and `chat_template_kwargs`, vLLM's dict of them)
        are the template's variables, `add_generation_prompt` and `continue_final_message` among them."""
        if "chat_template" in template_kwargs:
            template_kwargs["template"] = template_kwargs.pop("chat_template")
        template_kwargs |= template_kwargs.pop("chat_template_kwargs", None) or {}  # vLLM's name for them
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        if not convs or any(not c for c in convs):
            raise ValueError("messages: must not be empty")
        if self.tokenizer is None:
            raise ValueError("messages: this model has no tokenizer")
        prompts = [self.tokenizer.apply_chat_template(c, **template_kwargs) for c in convs]  # type: ignore[arg-type]
        ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(ids, params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="generate", unit="req", leave=False)
        try:
            while len(done) < len(ids):
                if not self.engine.has_unfinished_requests():  # (never: _alone keeps other callers out)
                    raise RuntimeError(f"LLM: {len(ids) - len(done)} requests left the engine without an output")
                for out in self.engine.step():
                    if out.finished and out.request_id in ids:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:  # an engine error or Ctrl-C: this call's requests leave the engine with it
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]

    def score(self, prompt: str | list[int], last_only: bool = False, decode_from: int | None = None,
              lora_request: Any = None) -> torch.Tensor:
        """Logits (T, V) float32 at every position of the prompt (or (1, V) for the last), teacher-
        forced through the paged cache: one prefill, or with decode_from=P a prefill of P tokens and
        one decode step per later token (with a LoRARequest: its adapter's). For checks against a
        reference and the no-cache baseline. (Not vLLM's LLM.score, which pairs texts: the server's /score.)"""
        if not isinstance(last_only, bool):  # (vLLM's score(text, [texts]) put its texts here)
            raise TypeError(f"last_only: must be a bool, got {type(last_only).__name__}; LLM.score gives a prompt's "
                            f"logits: to score texts against each other, compare LLM.embed vectors (or POST /score)")
        ids = self.engine.tokenize_prompt(prompt)
        if len(ids) > self.engine.max_model_len:  # (past the rotary table: an IndexError, on CUDA a device assert)
            raise ValueError(f"prompt: {len(ids)} tokens, past max_model_len ({self.engine.max_model_len})")
        seq = Sequence("__score__", ids, SamplingParams(max_tokens=1), lora=self.engine.inputs.adapter(lora_request))
        with self._alone():
            return self.engine.runner.score(seq, self.engine.block_manager, last_only, decode_from)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (the next prompts compute every token), as vLLM's LLM.reset_prefix_cache:
        False, and nothing forgotten, while the engine holds any block (requests added by hand)."""
        if self._owner == threading.get_ident():
            raise RuntimeError("LLM: reset_prefix_cache() called from inside a running generate() / score()")
        with self._lock:  # (not while another thread's call runs)
            done = self.engine.block_manager.reset_prefix_cache()
            if done and self.engine.offload is not None:  # its second tier too (a directory's files)
                self.engine.offload.clear()
            return done

    def stats(self) -> EngineStats:
        """Cache and scheduler counters: blocks total/free/cached, prefix hits, preemptions."""
        return self.engine.stats()

    def close(self) -> None:
        """Stop the engine's other processes (tensor-parallel ranks); also at interpreter exit, or `with LLM(...)`."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def prompt_list(prompts: Any) -> list[str | list[int] | dict[str, Any]]:
    """generate()'s prompts as a list of texts and token-id lists: one prompt (a text, a dict, a flat
    sequence of integers) or many; numpy / torch integers become ints; a dict with a `cache_salt` stays a
    dict (vLLM's, the input processor reads it). ValueError naming prompts[i]."""
    if isinstance(prompts, (str, dict)) or _ids(prompts) is not None:
        prompts = [prompts]
    out: list[str | list[int] | dict[str, Any]] = []
    for i, p in enumerate(list(prompts.tolist() if hasattr(prompts, "tolist") else prompts)):
        salt = None
        if isinstance(p, dict):
            try:
                key, salt = dict_prompt(p)
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
            p = p[key]
        ids = _ids(p)
        out.append(with_salt(p if isinstance(p, str) or ids is None else ids, salt))  # (else: validation names it)
    return out


def _ids(p: Any) -> list[int] | None:
    """p as a list of ints when it is a flat sequence of integers (a list, tuple, 1-D array or tensor)."""
    if isinstance(p, (str, bytes, dict)):
        return None
    seq = p.tolist() if hasattr(p, "tolist") else p
    if not isinstance(seq, (list, tuple)) or not seq:
        return None
    if all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in seq):
        return [int(t) for t in seq]
    return None
