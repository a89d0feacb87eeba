"""Input processing: a request (prompt text or token ids, SamplingParams) -> a tokenized, validated
Request, once, before it reaches the engine's queues. Every error is a ValueError whose message starts
with the field it is about, which the server turns into a 400 naming that field."""

from __future__ import annotations

import dataclasses

import hashlib
import random
from typing import Any

from lmserve.config import ModelConfig
from lmserve.kv.block_manager import BlockManager
from lmserve.lora import LoRAAdapter, LoRARegistry
from lmserve.outputs import OutputProcessor
from lmserve.pooling import PoolingParams
from lmserve.sequence import Request, SamplingParams, Sequence
from lmserve.structured import StructuredOutputs
from lmserve.tokenizer import Tokenizer


class InputProcessor:
    """Tokenizes prompts and checks requests against the model and the KV pool. Reads only state that
    never changes after start-up (the pool's size, not its contents), so any thread may use it."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, max_model_len: int, max_num_seqs: int,
                 block_manager: BlockManager, structured: StructuredOutputs | None = None, max_logprobs: int = 20,
                 lora: LoRARegistry | None = None, model: ModelConfig | None = None) -> None:
        self.tokenizer = tokenizer
        # an embedding's length, and whether (and to what) it may be cut: PoolingParams.validate's arguments
        self.embedding_shape = (model.hidden_size, model.is_matryoshka, model.matryoshka_dimensions) if model \
            else (0, False, ())
        self.lora = lora  # the engine's adapters (enable_lora), loaded here on a request's first use
        # the most logprobs / prompt_logprobs a request may ask (EngineConfig.max_logprobs; -1: all)
        self.max_logprobs = vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)
        self.structured = structured  # compiles (and caches) structured-output grammars
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.bm = block_manager

    def process(self, prompt: str | list[int] | dict[str, Any], params: SamplingParams | None = None,
                lora_request: Any = None) -> Request:
        """Tokenize and validate a request once; ValueError naming the field if it is bad. The prompt: text, token
        ids, or vLLM's {"prompt" | "prompt_token_ids": ..., "cache_salt": str} (only requests with the same salt
        share prefix-cache blocks). Reads only what never changes after start-up (and the adapter registry,
        which locks), so any thread may call it."""
        prompt, salt = salted(prompt)
        adapter = self.adapter(lora_request)
        pooling = params if isinstance(params, PoolingParams) else None
        if pooling is not None:  # an embedding: the prompt runs, then one throw-away step ends it
            pooling.validate(*self.embedding_shape)
            params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                    truncate_prompt_tokens=pooling.truncate_prompt_tokens)
        params = params or SamplingParams()
        ids = self.tokenize(prompt)
        if isinstance(params, SamplingParams) and params.truncate_prompt_tokens is not None:
            params.validate()  # (the value is checked before it is used)
            ids = self.truncate(prompt, ids, params.truncate_prompt_tokens, pooling is not None)
        if isinstance(params, SamplingParams) and params.max_tokens is None:  # (a copy: one may serve many prompts)
            params.validate()
            params = dataclasses.replace(params, max_tokens=max(1, self.room(len(ids), params.max_running)))
        grammar = self.validate(ids, params, pooling is not None)
        return Request(ids, params, prompt if isinstance(prompt, str) else None, grammar=grammar,  # (the text given)
                       lora=adapter, pooling=pooling, cache_salt=salt)

    def adapter(self, lora_request: Any) -> LoRAAdapter | None:
        """The loaded adapter of a LoRARequest (None: the base model); ValueError naming the problem."""
        if lora_request is None:
            return None
        if self.lora is None:
            raise ValueError("lora_request: this engine serves no LoRA adapters (start it with enable_lora)")
        return self.lora.get(lora_request)

    def truncate(self, prompt: str | list[int], ids: list[int], keep: int | None, fill: bool = False) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's (tokenized as `ids`) last `keep` tokens (None: all;
        -1: the model's context length, vLLM's meaning); a text prompt keeps the special tokens its
        tokenization put first (a BOS), as HF's truncation does, and `keep` counts them. ValueError naming
        the field when `keep` is more than the context, or when what it keeps fills the context (no room
        to generate)."""
        if keep is None:
            return ids
        if keep == 0 or keep < -1:  # (the server's value: SamplingParams checks the library's)
            raise ValueError(f"truncate_prompt_tokens: must be -1 (the model's context) or an integer >= 1, got {keep}")
        keep = self.max_model_len if keep == -1 else keep
        if keep > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens: {keep} is more than the model's context "
                             f"({self.max_model_len})")
        if len(ids) <= keep:
            return ids
        if keep >= self.max_model_len and not fill:  # (an embedding may fill it: it generates nothing)
            raise ValueError(f"truncate_prompt_tokens: keeping {keep} tokens fills the model's context "
                             f"({self.max_model_len}) and leaves no room to generate; keep fewer")
        front = 0
        if isinstance(prompt, str) and self.tokenizer is not None:
            plain = self.tokenizer.encode(prompt, add_special_tokens=False)
            front = min(keep, len(ids) - len(plain)) if ids[len(ids) - len(plain):] == plain else 0
        return ids[:front] + ids[len(ids) - (keep - front):]

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """A prompt (text or token ids) -> validated token ids; ValueError naming the problem. Text gets
        the tokenizer's special tokens (a BOS) unless add_special_tokens is false."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            ids = list(prompt)
            if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
                raise ValueError("prompt_token_ids: must be a list of integers")
        if not ids:
            raise ValueError("prompt: must not be empty")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def room(self, prompt_len: int, family: int = 1) -> int:
        """The most tokens a request may generate after a prompt of prompt_len tokens, `family` sequences
        at once (beams): what the context leaves, within what the KV pool can hold (the server's default
        max_tokens: with a pool smaller than the context, the context's rest was refused as more blocks
        than the cache has, so every request that left max_tokens unset got a 400). 0 when the prompt
        alone does not fit."""
        def fits(t: int) -> bool:  # (the last token generated is never run: t tokens hold prompt_len + t - 1)
            return family * self.bm.max_blocks(prompt_len + max(t - 1, 0)) <= self.bm.num_blocks

        lo, hi = 0, max(0, self.max_model_len - prompt_len)
        if fits(hi):
            return hi
        while lo < hi:  # the largest t in [0, hi] that fits (max_blocks grows with the tokens)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    def bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as the token ids that spell it, as vLLM bans them: the word (leading spaces
        dropped), and after a space where that spelling is a word token of its own (as many tokens, a
        different first one: the word mid-text); ValueError without a tokenizer."""
        if self.tokenizer is None:
            raise ValueError("bad_words: this model has no tokenizer to spell them with")
        out: list[list[int]] = []
        for w in words:
            try:
                bare = self.tokenizer.encode(w.lstrip(), add_special_tokens=False)
                spaced = self.tokenizer.encode(" " + w.lstrip(), add_special_tokens=False)
            except ValueError:  # (a lone surrogate)
                raise ValueError("bad_words: not valid Unicode (a lone surrogate)") from None
            out.append(bare)
            if len(spaced) == len(bare) and spaced[0] != bare[0]:
                out.append(spaced)
        return out

    def validate(self, prompt_ids: list[int], params: SamplingParams, pooling: bool = False) -> Any:
        """The request's options, then the checks that need the model: lengths, vocabulary, KV capacity
        (an embedding's prompt may fill the context: its one sampled token is never computed). Returns the
        compiled grammar of a structured-output request (else None)."""
        if not isinstance(params, SamplingParams):
            raise ValueError("params: must be a SamplingParams")
        params.validate()
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.max_logprobs:
                raise ValueError(f"{name}: at most {self.max_logprobs} (the engine's max_logprobs), got {k}")
        n, after = len(prompt_ids), 0 if pooling else params.max_tokens  # tokens it needs room for
        if n > self.max_model_len or (n == self.max_model_len and not pooling):
            raise ValueError(f"prompt: {n} tokens, but the model's context is {self.max_model_len}")
        if n + after > self.max_model_len:
            raise ValueError(f"max_tokens: prompt ({n}) + max_tokens ({params.max_tokens}) exceeds the "
                             f"model's context ({self.max_model_len})")
        for name, ids in (("logit_bias", list(params.logit_bias or {})), ("stop_token_ids", params.stop_token_ids),
                          ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        grammar = None
        if params.structured_outputs is not None:  # a bad schema / regex / grammar fails here, naming the field
            if self.structured is None:
                raise ValueError("structured_outputs: not available in this engine")
            grammar = self.structured.compile(params.structured_outputs)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: this model has no tokenizer, so stop strings cannot be matched; "
                             "use stop_token_ids")
        params.bad_words_token_ids = self.bad_words_ids(params.bad_words) if params.bad_words else None
        if params.allowed_token_ids is not None:  # (at most the vocabulary: each step masks with the list)
            params.allowed_token_ids = sorted(set(params.allowed_token_ids))
            banned = {w[0] for w in params.bad_words_token_ids or () if len(w) == 1}
            if banned.issuperset(params.allowed_token_ids):
                raise ValueError("allowed_token_ids: every one of them is a bad word")
        # beams are scheduled and preempted as a whole, so all of them must fit at once, each at its
        # longest (shared blocks are not counted on: a readmitted beam recomputes its own copy)
        family = params.beam_width if params.use_beam_search else 1
        field = "max_tokens" if family == 1 else ("best_of" if params.best_of else "n")
        if family > self.max_num_seqs:
            raise ValueError(f"{field}: {family} sequences for one request, but max_num_seqs is "
                             f"{self.max_num_seqs}")
        alone = self.bm.max_blocks(n)
        if alone > self.bm.num_blocks:  # no max_tokens could help
            raise ValueError(f"prompt: {n} tokens need {alone} KV blocks but the cache has {self.bm.num_blocks}; "
                             "raise kv_cache_memory or send a shorter prompt")
        # KV for every token but the last one generated, which the request ends on without running it
        need = family * self.bm.max_blocks(n + max(after - 1, 0))
        if need > self.bm.num_blocks:
            raise ValueError(f"{field}: the request needs {need} KV blocks"
                             f"{f' ({family} sequences)' if family > 1 else ''} but the cache has "
                             f"{self.bm.num_blocks}; raise kv_cache_memory or lower max_tokens")
        return grammar


def dict_prompt(prompt: dict[str, Any]) -> tuple[str, Any]:
    """vLLM's dict prompt -> (the key holding the prompt, its cache_salt or None); a ValueError, for the
    caller to prefix with the field, when its keys are not one of prompt / prompt_token_ids (and cache_salt)."""
    keys = set(prompt) & {"prompt", "prompt_token_ids"}
    if len(keys) != 1 or set(prompt) - keys - {"cache_salt"}:
        raise ValueError(f"a dict prompt holds one of 'prompt' (text) or 'prompt_token_ids' (and 'cache_salt'), "
                         f"got keys {sorted(prompt)}")
    return keys.pop(), prompt.get("cache_salt")


def with_salt(prompt: str | list[int], salt: str | None) -> Any:
    """The prompt as process() takes it with a cache_salt (vLLM's dict form); unchanged without one."""
    return prompt if salt is None else {"prompt" if isinstance(prompt, str) else "prompt_token_ids": prompt,
                                        "cache_salt": salt}


def salted(prompt: Any) -> tuple[Any, bytes | None]:
    """A prompt given as vLLM's dict with a cache_salt -> (the prompt, sha256 of the salt); else (prompt, None)."""
    if not isinstance(prompt, dict):
        return prompt, None
    try:
        key, salt = dict_prompt(prompt)
    except ValueError as e:
        raise ValueError(f"prompt: {e}") from None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt: must be a non-empty string, got {salt!r}")
    digest = None if salt is None else hashlib.sha256(b"cache_salt\0" + salt.encode("utf-8", "surrogatepass")).digest()
    return prompt[key], digest


def init_sequence(rng: random.Random, output: OutputProcessor, structured: StructuredOutputs, seq: Sequence) -> None:
    """A new sequence's generator (request seed + child index, else a draw from the engine's RNG; on
    the host: a draw costs no device call), output state and, with structured_outputs, its grammar
    matcher."""
    p = seq.params
    seq.generator = random.Random((p.seed + seq.index) % 2**64 if p.seed is not None else rng.randrange(2**63))
    output.start(seq)
    structured.start(seq)
