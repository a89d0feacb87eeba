"""Request state: SamplingParams (what the user asked for) and Sequence (where it stands).

A Sequence owns its token ids, its block table and its progress counter (`num_computed_tokens`).
The block manager owns reference counts; the scheduler owns the queues the sequence sits in.
"""

from __future__ import annotations

import enum
import hashlib
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

from lmserve.pooling import PoolingState
from lmserve.structured_params import MAX_GRAMMAR_BYTES, StructuredOutputsParams  # noqa: F401 - re-exported
from lmserve.utils import is_whole


GREEDY_BELOW = 1e-5  # temperatures below this are greedy


def _token_id(key: object) -> int:
    """A logit_bias key: an int, or a string of one (JSON object keys are strings)."""
    if not (is_whole(key) or isinstance(key, str)):  # numpy's integers too; never a bool or a float
        raise TypeError(key)
    return int(key)


@dataclass
class SamplingParams:
    """Per-request sampling and stopping options, named as vLLM names them."""

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16  # None: as many as the context (and the KV pool) leave after the prompt, as vLLM
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: as many as the context)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    speculative: bool = True  # per-request opt-out of speculative decoding
    use_beam_search: bool = False  # beam width = best_of or n; sampling options are not used
    length_penalty: float = 1.0
    early_stopping: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # constrained decoding (lmserve/structured.py)
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens may be generated
    bad_words: list[str] | None = None  # vLLM's: words never generated (a word's last token is banned after its others)
    # bad_words as token ids (each word, and with a leading space), filled by the engine's input checks
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Normalise and check every field; ValueError naming the first bad one. Run on construction
        and again by the engine, since a dataclass can be changed after it was built."""
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name}: {why}, got {getattr(self, name)!r}")

        def whole(name: str, lo: int, hi: int | None = None) -> bool:  # an int (not a bool) in [lo, hi]
            v = getattr(self, name)
            return is_whole(v) and v >= lo and (hi is None or v <= hi)

        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop or [], (list, tuple)):
            raise bad("stop", "must be a string or a list of strings")
        self.stop = list(self.stop or [])
        if not isinstance(self.stop_token_ids or [], (list, tuple)):
            raise bad("stop_token_ids", "must be a list of token ids")
        if any(not is_whole(t) or t < 0 for t in self.stop_token_ids or []):
            raise bad("stop_token_ids", "must be a list of token ids (integers >= 0)")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids or []]  # numpy's integers become ints
        if self.top_k == 0:
            self.top_k = -1
        if not whole("n", 1):
            raise bad("n", "must be an integer >= 1")
        if self.best_of is not None and not whole("best_of", self.n):
            raise bad("best_of", "must be an integer >= n")
        if self.max_tokens is not None and not whole("max_tokens", 1):  # (None: what the context leaves)
            raise bad("max_tokens", "must be an integer >= 1 or None")
        if not whole("min_tokens", 0, self.max_tokens):
            raise bad("min_tokens", "must be an integer in [0, max_tokens]")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "length_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(name, "must be a finite number")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if self.temperature < GREEDY_BELOW:  # logits / T would overflow: the limit T -> 0 is greedy (vLLM's rule)
            self.temperature = 0.0
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not (whole("top_k", 1) or isinstance(self.top_k, int) and self.top_k == -1):
            raise bad("top_k", "must be -1 (off) or an integer >= 1")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if not -10 <= self.length_penalty <= 10:  # (length + 1) ** 400 overflowed in the beam step
            raise bad("length_penalty", "must be in [-10, 10]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(name, "must be in [-2, 2]")
        for name in ("logprobs", "prompt_logprobs"):  # (at most the engine's max_logprobs: its input checks)
            if getattr(self, name) is not None and not whole(name, 0):
                raise bad(name, "must be an integer >= 0")
        if self.truncate_prompt_tokens is not None and not (whole("truncate_prompt_tokens", 1)
                                                            or is_whole(self.truncate_prompt_tokens)
                                                            and self.truncate_prompt_tokens == -1):
            raise bad("truncate_prompt_tokens", "must be -1 (the model's context) or an integer >= 1")
        if self.seed == -1 and is_whole(self.seed):  # vLLM's (and llama.cpp's) "random": no seed
            self.seed = None
        if self.seed is not None and not whole("seed", -(2 ** 63)):
            raise bad("seed", "must be an integer >= -2**63")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if self.logit_bias is not None:
            try:  # token ids: ints, or strings of digits as JSON keys are (never floats: 1.7 is no token)
                self.logit_bias = {_token_id(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError):
                raise bad("logit_bias", "must map token ids to numbers") from None
            if any(not -100 <= v <= 100 for v in self.logit_bias.values()):
                raise bad("logit_bias", "values must be in [-100, 100]")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids
                or any(isinstance(t, bool) or not isinstance(t, int) for t in self.allowed_token_ids)):
            raise bad("allowed_token_ids", "must be a non-empty list of token ids")
        if self.bad_words is not None and (not isinstance(self.bad_words, (list, tuple)) or any(
                not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            raise bad("bad_words", "must be a list of non-empty strings")
        if self.use_beam_search:  # the beam step ranks raw log-probs: refuse what it would silently ignore
            ignored = {"logit_bias": bool(self.logit_bias), "repetition_penalty": self.repetition_penalty != 1,
                       "presence_penalty": self.presence_penalty != 0, "frequency_penalty": self.frequency_penalty != 0,
                       "min_tokens": self.min_tokens > 0, "stop": bool(self.stop), "logprobs": self.logprobs is not None,
                       "prompt_logprobs": self.prompt_logprobs is not None,
                       "allowed_token_ids": self.allowed_token_ids is not None, "bad_words": bool(self.bad_words)}
            name = next((k for k, v in ignored.items() if v), None)
            if name is not None:
                raise bad(name, "not supported with beam search")
        if self.structured_outputs is not None:
            if isinstance(self.structured_outputs, dict):
                try:
                    self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
                except TypeError as e:
                    raise ValueError(f"structured_outputs: {e}") from None
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", "must be a StructuredOutputsParams")
            self.structured_outputs.key()
            if self.use_beam_search:
                raise ValueError("structured_outputs: not supported with beam search")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def num_samples(self) -> int:
        """How many continuations to generate (best_of, else n); beams fork as they go instead."""
        return 1 if self.use_beam_search else (self.best_of or self.n)

    @property
    def beam_width(self) -> int:
        return self.best_of or self.n

    @property
    def max_running(self) -> int:
        """How many of the request's sequences run at once at most: a beam search's width (it clones as it
        goes, pruning as many before the next step), else 1 (n / best_of children stand alone)."""
        return self.beam_width if self.use_beam_search else 1

    @property
    def needs_logprob(self) -> bool:
        """Whether the chosen tokens' logprobs must be computed (asked for, or to rank best_of)."""
        return self.logprobs is not None or self.num_samples > self.n

    @property
    def has_filters(self) -> bool:
        """Whether top-k, top-p or min-p cut the distribution (sampling then needs it sorted)."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


@dataclass(frozen=True)
class Request:
    """A request as the engine accepts it: tokenized and validated once, by Engine.process_request."""

    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None  # the text, when the prompt was given as text
    grammar: Any = None  # the compiled grammar (xgrammar) of a structured-output request
    priority: int = 0  # lower is served first (vLLM's convention); equal priorities: first come, first served
    lora: Any = None  # the LoRA adapter it runs with (lora.LoRAAdapter), or None
    pooling: Any = None  # an embedding request's pooling.PoolingParams (its params then run the prompt alone)
    cache_salt: bytes | None = None  # vLLM's cache_salt (a sha256 of it): only requests with the same share its KV


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Logprob:
    """A token's log-probability and the top alternatives at that position; `rank` (1 = the most
    likely) where it was computed (prompt logprobs: vLLM's field)."""

    token_id: int
    logprob: float
    top: dict[int, float]
    rank: int | None = None


@dataclass
class OutputState:
    """What output processing (OutputProcessor) writes: the text, the logprobs of kept tokens, the
    streaming offsets."""

    text: str = ""
    num_emitted_chars: int = 0  # streaming: text already handed out
    num_emitted_tokens: int = 0
    logprobs: list[Logprob] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    error: str | None = None  # set when finish_reason == "error"
    error_status: int = 500  # what the server answers for it: 500 (failed inside), 503 (waited too long)
    detok: Any = None  # IncrementalDetokenizer


@dataclass
class SpecState:
    """What the speculation policy (spec.SpecPolicy) writes: this step's drafts and the running
    acceptance that decides whether to draft at all."""

    num_draft: int = 0  # speculative tokens at the end of token_ids this step
    draft_probs: Any = None  # (num_draft, V) draft distributions, or None (point mass)
    acceptance: float = 1.0  # running acceptance rate (EMA)
    pause: int = 0  # steps left without speculation
    hits: float = 0.0  # goodput policy: drafts accepted and drafts tested (accepted + first rejected),
    tries: float = 0.0  # exponential averages (spec/goodput.py)


@dataclass
class FamilyState:
    """What fan-out (FanOut) writes: children still to fork, and a beam's pending step."""

    forks_pending: int = 0  # children to fork once the prompt (but its last token) is computed
    pending_logprobs: Any = None  # beam search: (V,) log-softmax awaiting the beam step
    beam_score: float = 0.0  # beam search: the hypothesis' cumulative log-probability


def block_salt(lora: Any, salt: bytes | None) -> bytes | None:
    """What a request's prefix-cache block hashes start from (Sequence.cache_salt): its adapter's salt
    (LoRARequest.salt) and its cache_salt digest, combined when both are given."""
    if lora is None or salt is None:
        return salt if lora is None else lora.salt
    return hashlib.sha256(lora.salt + salt).digest()


@dataclass(eq=False)
class Sequence:
    """One generation stream: prompt + output tokens, its block table, its progress and metrics.

    The fields here are the request's (set at creation) and the progress the scheduler owns (tokens,
    blocks, counters, status, timings); `generator` is the sampler's, `prompt_logprobs` the runner's.
    Three groups belong to other owners, who alone write them: `output` (OutputProcessor), `spec`
    (spec.SpecPolicy), `family` (FanOut).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.time)
    index: int = 0  # which of the request's n outputs
    priority: int = 0  # the request's: lower is admitted first, and preempted last
    lora: Any = None  # the request's LoRA adapter (lora.LoRAAdapter), or None: the base model
    pooling: Any = None  # an embedding request's PoolingParams (pooling.py); its state in `pooled`
    salt: bytes | None = None  # the request's cache_salt (Request.cache_salt)

    token_ids: list[int] = field(init=False)
    block_tables: list[list[int]] = field(default_factory=list, init=False)  # one per KV group; [] when none held
    block_hashes: list[bytes] = field(default_factory=list, init=False)  # memo of full-block hashes (sha256)
    num_computed_tokens: int = field(default=0, init=False)
    num_cached_tokens: int = field(default=0, init=False)  # prefix-cache hit at the last admission
    status: Status = field(default=Status.WAITING, init=False)
    finish_reason: str | None = field(default=None, init=False)
    stop_reason: int | str | None = field(default=None, init=False)
    num_preemptions: int = field(default=0, init=False)
    first_scheduled_time: float | None = field(default=None, init=False)
    first_token_time: float | None = field(default=None, init=False)
    last_token_time: float | None = field(default=None, init=False)  # the step of its latest tokens (metrics)
    finished_time: float | None = field(default=None, init=False)
    generator: random.Random | None = field(default=None, init=False)  # this sequence's draws (host-side)
    prompt_logprobs: list[Logprob | None] = field(default_factory=list, init=False)
    output: OutputState = field(default_factory=OutputState, init=False)
    spec: SpecState = field(default_factory=SpecState, init=False)
    family: FamilyState = field(default_factory=FamilyState, init=False)
    compiled_grammar: Any = None  # the request's compiled grammar (structured output), shared by its children
    grammar: Any = field(default=None, init=False)  # structured.GrammarState, written by StructuredOutputs
    swapped: Any = field(default=None, init=False)  # Scheduler: its tables' shape while its KV is on the host
    pooled: PoolingState | None = field(default=None, init=False)  # an embedding request's, written by the runner

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str):  # (vLLM's rule; None and 7 were taken, a list failed as unhashable)
            raise TypeError(f"request_id: must be a str, got {type(self.request_id).__name__}")
        self.token_ids = list(self.prompt_token_ids)
        if self.pooling is not None:
            self.pooled = PoolingState(self.pooling, len(self.prompt_token_ids))

    @classmethod
    def from_request(cls, request_id: str, request: Request, eos_token_ids: tuple[int, ...], arrival_time: float
                     ) -> "Sequence":
        """A processed request's first sequence."""
        return cls(request_id, request.prompt_token_ids, request.params, prompt=request.prompt,
                   eos_token_ids=eos_token_ids, arrival_time=arrival_time, compiled_grammar=request.grammar,
                   priority=request.priority, lora=request.lora, pooling=request.pooling, salt=request.cache_salt)

    @property
    def cache_salt(self) -> bytes | None:
        """What its prefix-cache block hashes start from: its adapter's (KV is shared only between sequences
        that computed it with the same weights) and its request's cache_salt (only with the same salt)."""
        return block_salt(self.lora, self.salt)

    @property
    def block_table(self) -> list[int]:
        """The first KV group's block table (the only one, for a model of one layer kind)."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)


def bad_words_next(params: SamplingParams, output: list[int]) -> list[int]:
    """The tokens bad_words bans after `output` (vLLM's rule): each word's last token, where the output ends
    in the rest of the word (the sampler's mask, and a grammar's dead-row check, read it here)."""
    return [w[-1] for w in params.bad_words_token_ids or () if len(w) == 1 or output[-(len(w) - 1):] == w[:-1]]
