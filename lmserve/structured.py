"""Structured output: constrained decoding with xgrammar (the grammar engine vLLM, SGLang and
TensorRT-LLM use).

A request's `SamplingParams.structured_outputs` (a JSON schema, any JSON, a regex, a choice, an EBNF
grammar) is compiled once against the tokenizer's vocabulary (compiled grammars are cached by their
text, so a repeated schema costs nothing) when the request is validated, so a bad schema is a
ValueError naming the field before anything runs. Each sequence then gets its own matcher
(`GrammarState`), advanced with every token the sequence keeps. Each step, for every sequence that
samples (and every position of a speculating one), the matcher fills a row of the token bitmask
(a bit per vocabulary entry: may this token come next?), on a worker thread while the model's
forward runs; the sampler sets the logits of disallowed tokens to -inf before any other processing.
Speculative positions are filled by advancing the matcher through the drafts and rolling it back,
so a draft the grammar forbids gets probability 0 and is rejected by verification.

xgrammar is imported on first use (an optional dependency: `pip install xgrammar`); a request with
structured_outputs on an install without it is refused with a clear error.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from lmserve.layers import cpu_native
from lmserve.sequence import Sequence, StructuredOutputsParams, bad_words_next
from lmserve.tokenizer import Tokenizer

log = logging.getLogger("lmserve")

CACHE_SIZE = 64  # compiled grammars kept (LRU)
MAX_STRAGGLERS = 4  # compiles running past their timeout at once; more: a new grammar is refused
MAX_COMPILING = 8  # distinct grammars compiling at once (stragglers included); more: refused at once


class CompilerBusy(ValueError):
    """A constraint refused for now, not for what it is: the compiler has as many grammars in flight as
    it takes (the server answers 429 with Retry-After, not 400)."""


# Escapes xgrammar's regex reader does not know: it matches the letter itself (\A as "A"), where any
# other regex engine reads an anchor or refuses it. (Its known ones: a d D e f n r s S t v w W 0 x u c k
# p P b B, the last six refused or parsed on their own, and U followed by 8 hex digits, a code point.)
UNKNOWN_ESCAPES = frozenset("ghijlmoqyzACEFGHIJKLMNOQRTUVXYZ")
HEX = frozenset("0123456789abcdefABCDEF")
# JSON-schema keywords xgrammar (0.2.x) accepts and does not enforce, measured on its grammars: a schema
# holding one gets outputs that break it, so it is refused (vLLM screens the same way).
UNENFORCED = ("uniqueItems", "contains", "propertyNames", "dependentRequired", "dependentSchemas", "dependencies",
              "not", "if")  # (minContains / maxContains count only beside contains)
SUBSCHEMAS = ("items", "additionalProperties")  # a schema each (unevaluated* with a schema: refused above)
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def unenforced_regex(regex: str) -> str | None:
    """What in a regex xgrammar would not read as a regex does (None: nothing)."""
    i = 0
    while i < len(regex) - 1:
        if regex[i] == "\\":
            code_point = regex[i + 1] == "U" and len(regex) >= i + 10 and set(regex[i + 2:i + 10]) <= HEX
            if regex[i + 1] in UNKNOWN_ESCAPES and not code_point:
                hint = " (the whole output is matched: no anchors are needed)" if regex[i + 1] in "AZz" else ""
                return f"\\{regex[i + 1]} at {i} is not an escape the grammar engine knows (it would match the " \
                       f"letter {regex[i + 1]}){hint}"
            i += 2
        else:
            i += 1
    return None


def unenforced_schema(schema: Any, path: str = "", branch: bool = False) -> str | None:
    """The first part of a JSON schema the grammar engine would accept without enforcing it, with its
    path ("properties.tags.uniqueItems"); None when every part is enforced. branch: an anyOf / oneOf /
    allOf member (its `required` may name its parent's properties)."""
    if not isinstance(schema, dict):
        return None
    at = (lambda key: f"{path}.{key}" if path else key)  # noqa: E731
    for key in UNENFORCED:
        trivial = schema.get(key) in ({}, [], None) or key == "uniqueItems" and schema[key] is False
        if key in schema and not trivial:
            return f"{at(key)} is not enforced by the grammar engine"
    for key in ("unevaluatedProperties", "unevaluatedItems"):
        if isinstance(schema.get(key), dict):  # (true constrains nothing; false is the engine's default)
            return f"{at(key)} with a schema is not enforced by the grammar engine"
    types = schema.get("type") if isinstance(schema.get("type"), list) else [schema.get("type")]
    if "multipleOf" in schema and ("integer" not in types or "number" in types):
        return f"{at('multipleOf')} is enforced for integers only"
    for regex in [schema.get("pattern"), *(schema.get("patternProperties") or {})]:
        if isinstance(regex, str) and (problem := unenforced_regex(regex)):
            return f"{at('pattern')}: {problem}"
    together = [k for k in ("format", "pattern", "minLength", "maxLength") if k in schema]
    if len(together) > 1 and together[0] in ("format", "pattern"):  # (minLength + maxLength alone are enforced)
        return f"{at(together[-1])}: {' and '.join(together)} together are not enforced by the grammar engine"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"{at('allOf')} with more than one schema is not enforced by the grammar engine"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        return f"{at('$ref')}: only references inside the schema (#/...) are followed, got {ref!r}"
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    if branch and required and not props:
        return f"{at('required')} in a branch without properties of its own is not enforced by the grammar engine"
    missing = [k for k in required if isinstance(k, str) and k not in props]
    if missing:
        return f"{at('required')}: {missing[0]!r} is not in properties (the grammar engine cannot produce it)"
    for key in SUBSCHEMAS:
        found = unenforced_schema(schema.get(key), at(key)) if isinstance(schema.get(key), dict) else None
        if found:
            return found
    for key in SCHEMA_MAPS:
        for name, sub in (schema.get(key) or {}).items() if isinstance(schema.get(key), dict) else ():
            if (found := unenforced_schema(sub, at(f"{key}.{name}"))):
                return found
    for key in SCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key) or []) if isinstance(schema.get(key), list) else ():
            if (found := unenforced_schema(sub, at(f"{key}[{i}]"), key in ("anyOf", "oneOf", "allOf"))):
                return found
    return None


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row: one bit per vocabulary entry."""
    return (vocab_size + 31) // 32


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set the logits of tokens whose bit is 0 to -inf, in place. logits (B, V) float, bitmask (B, W)
    int32 with bit j of word i standing for token 32 i + j (xgrammar's layout); an all-ones row (-1)
    changes nothing."""
    b, v = logits.shape
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous()
            and cpu_native.available()):  # our C loop: the torch unpacking below costs ~10 ms at (32, 49152)
        mask = bitmask.to(torch.int32).contiguous()
        cpu_native.lib().lm_apply_bitmask(logits.data_ptr(), b, v, mask.data_ptr(), mask.shape[1],
                                           torch.get_num_threads())
        return logits
    allowed = unpack_bitmask(bitmask)[:, :v]  # (B, V)
    return logits.masked_fill_(~allowed.to(logits.device), float("-inf"))


def unpack_bitmask(bitmask: torch.Tensor) -> torch.Tensor:
    """A bitmask (..., W) int32 as a bool per token id (..., 32 W): whether it is allowed."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # (32,)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).bool().reshape(*bitmask.shape[:-1], -1)


class GrammarState:
    """One sequence's matcher: the grammar state after the tokens it has kept."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.failed = False  # a kept token the grammar did not accept (the sequence is stopped)
        self.why = "structured output: the model produced a token its grammar does not allow"  # when failed
        self.status = 500  # the HTTP status of that failure: 400 when no token could continue the grammar
        self.dead: tuple[int, str] | None = None  # of the step's bitmask rows (fill): the first no token can
        # pass, and why (a token drawn there fails the sequence with a 400)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: nothing may follow."""
        return self.matcher.is_terminated()


class StructuredOutputs:
    """Compiles grammars (cached), gives sequences matchers, fills the step's bitmask rows."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, compile_timeout: float = 10.0) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.compile_timeout = compile_timeout  # seconds; a slower grammar is refused (ValueError)
        self._inflight: dict[tuple[str, str], tuple[Future, float]] = {}  # compiles running: (job, start time)
        self._stragglers: set[tuple[str, str]] = set()  # of those, the ones past their timeout
        self.width = bitmask_width(vocab_size)
        self._compiler: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()  # compile() runs on request threads, fill() on the worker
        self._pool: ThreadPoolExecutor | None = None

    # ---------------------------------------------------------------- compiling
    def _xgr(self) -> Any:
        try:
            import xgrammar as xgr
        except ImportError:
            raise ValueError("structured_outputs: needs the xgrammar package (pip install xgrammar)") from None
        return xgr

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs: this model has no tokenizer to compile a grammar against")
            xgr = self._xgr()
            from transformers import PreTrainedTokenizerFast  # xgrammar depends on transformers
            raw = self.tokenizer.raw
            stops = list(self.tokenizer.eos_token_ids) or None
            info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=raw),
                                                      vocab_size=self.vocab_size, stop_token_ids=stops)
            # control tokens (<|im_start|>, Gemma's <pad> / <unusedN>...) keep their spelling in the
            # vocabulary, which xgrammar took for text: a JSON string could hold "<unused0>", and the
            # detokenizer then dropped it (a 12-character code came out as 3). As "" they are special:
            # never allowed, the stop tokens where the grammar may end aside.
            special = {i for i, t in raw.get_added_tokens_decoder().items() if t.special and i < self.vocab_size}
            if special - set(info.special_token_ids):
                vocab = [""] * self.vocab_size
                for text, i in raw.get_vocab(with_added_tokens=True).items():
                    if i < self.vocab_size and i not in special:
                        vocab[i] = text
                info = xgr.TokenizerInfo(vocab, vocab_type=info.vocab_type, vocab_size=self.vocab_size,
                                         stop_token_ids=stops, add_prefix_space=info.add_prefix_space)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of a constraint (cached by its text); ValueError naming the field when it
        does not compile, or takes longer than compile_timeout from its start.

        Each compile runs on a thread of its own, so one that runs past the timeout (it goes on in the
        background and its result is cached; the request is refused) never delays another. The same
        text asked again while it compiles waits on that compile, within the time left of its timeout.
        At most MAX_COMPILING grammars compile at once, and MAX_STRAGGLERS of them past their timeout;
        beyond either, a new grammar is refused at once (a ValueError saying the compiler is busy)."""
        kind, text = spec.key()
        key = (kind, text)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            running = self._inflight.get(key)
            if running is None:
                if len(self._stragglers) >= MAX_STRAGGLERS or len(self._inflight) >= MAX_COMPILING:
                    raise CompilerBusy(f"structured_outputs.{kind}: the grammar compiler is busy ({len(self._inflight)} "
                                     f"compiling, {len(self._stragglers)} past the timeout); try again later")
                compiler = self._get_compiler()
                running = self._inflight[key] = (Future(), time.monotonic())
                # not a daemon: a compile past its timeout is waited for at exit (a daemon thread killed
                # inside xgrammar's C++ aborted the process: rc 134 after a clean run)
                threading.Thread(target=self._run_compile, args=(running[0], compiler, kind, text),
                                 name="lmserve-compile").start()
        job, started = running
        try:
            return job.result(timeout=max(0.0, self.compile_timeout - (time.monotonic() - started)))
        except TimeoutError:
            with self._lock:
                if not job.done():
                    self._stragglers.add(key)
            raise ValueError(f"structured_outputs.{kind}: took longer than {self.compile_timeout:g} s to compile "
                             f"(grammar_compile_timeout)") from None

    @property
    def num_stragglers(self) -> int:
        """Compiles still running past their timeout."""
        with self._lock:
            return len(self._stragglers)

    def _run_compile(self, job: Future, compiler: Any, kind: str, text: str) -> None:
        """A compile's thread: it stops counting as in flight before its waiters hear (a waiter's next
        compile found it still counted, and under load MAX_COMPILING finished ones refused it as busy)."""
        try:
            result, error = self._compile(compiler, kind, text), None
        except BaseException as e:  # noqa: BLE001 - handed to every waiter
            result, error = None, e
        with self._lock:
            self._inflight.pop((kind, text), None)
            self._stragglers.discard((kind, text))
        job.set_exception(error) if error is not None else job.set_result(result)

    def _compile(self, compiler: Any, kind: str, text: str) -> Any:
        problem = unenforced_schema(json.loads(text)) if kind == "json" else \
            unenforced_regex(text) if kind == "regex" else None
        if problem:  # what xgrammar would take without enforcing it
            raise ValueError(f"structured_outputs.{kind}: {problem}")
        try:
            if kind == "json":
                compiled = compiler.compile_json_schema(text, any_whitespace=False)
            elif kind == "json_object":  # an object, as OpenAI's JSON mode gives (the builtin grammar takes any
                # JSON value: arrays, numbers; 9 of 12 sampled answers were arrays)
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "regex":
                compiled = compiler.compile_regex(text)
            elif kind == "choice":
                # characters kept raw: an escaped one past U+FFFF (\ud83d\ude42) is read as two surrogates,
                # each its own 3 UTF-8 bytes, so the grammar forced bytes no UTF-8 text holds
                compiled = compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                            for c in json.loads(text)))
            else:
                compiled = compiler.compile_grammar(text)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError / its own kinds
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"structured_outputs.{kind}: cannot be compiled: {msg[:500]}") from None
        with self._lock:
            self._cache[(kind, text)] = compiled
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    # ---------------------------------------------------------------- per sequence
    def start(self, seq: Sequence) -> None:
        """Give a sequence with structured_outputs its matcher (at the start of the output), from the
        grammar compiled when its request was validated (compiled here only for a Request built by
        hand; never for a request's children, which share their parent's)."""
        spec = seq.params.structured_outputs
        if spec is None:
            return
        xgr = self._xgr()
        if seq.compiled_grammar is None:
            seq.compiled_grammar = self.compile(spec)
        stops = list(seq.eos_token_ids) or None
        seq.grammar = GrammarState(xgr.GrammarMatcher(seq.compiled_grammar, override_stop_tokens=stops))

    @staticmethod
    def advance(seq: Sequence, tokens: list[int]) -> int:
        """Feed the tokens a sequence kept this step to its matcher; returns how many of them stand:
        all, or those up to the one that completed the grammar (a stop token it accepted), or those
        before one it refused (then `failed` is set). The caller drops the rest and ends the sequence."""
        g = seq.grammar
        dead, g.dead = g.dead, None
        for i, tok in enumerate(tokens):
            if g.terminated:
                return i  # a stop token ended it: nothing after it stands
            if dead is not None and i == dead[0]:  # drawn where no token could pass: nothing stands from here
                g.failed, g.why, g.status = True, dead[1], 400
                return i
            if not g.matcher.accept_token(tok):
                g.failed = True
                log.warning("structured output: token %d of request %s is not allowed by its grammar", tok,
                            seq.request_id)
                return i
        return len(tokens)

    def keep(self, seq: Sequence, new: list[int], finish: Callable[[Sequence, str], None]) -> list[int]:
        """The new tokens that stand for a structured-output sequence (advance): those after the one
        that completed the grammar, or from one it refused on, are taken back off it (never shown); a
        complete (or refused) grammar ends it with finish (Scheduler.finish)."""
        kept = self.advance(seq, new)
        if kept < len(new):
            del seq.token_ids[len(seq.token_ids) - (len(new) - kept):]
        if seq.grammar.terminated and not seq.is_finished:
            finish(seq, "stop")  # (a refused one the caller ends with the grammar's reason: OutputProcessor.fail)
        return new[:kept]

    # ---------------------------------------------------------------- the step's bitmask
    def fill(self, rows: list[tuple[Sequence, list[int]]]) -> dict[Sequence, torch.Tensor]:
        """For each (sequence, drafts): len(drafts) + 1 bitmask rows (W,) int32: the tokens allowed next,
        then after each draft in turn (a draft the grammar refuses leaves the rows after it all ones:
        verification rejects it first). A row no token can pass (the grammar's, or it with
        allowed_token_ids or bad_words) is the sequence's `dead` row: a token drawn there ends it with the
        reason (advance). The matcher is rolled back to where it was."""
        out: dict[Sequence, torch.Tensor] = {}
        for seq, drafts in rows:
            g, m = seq.grammar, seq.grammar.matcher
            g.dead = None
            mask = torch.full((len(drafts) + 1, self.width), -1, dtype=torch.int32)  # (k + 1, W)
            accepted = 0
            for i in range(len(drafts) + 1):
                if m.is_terminated():
                    break
                m.fill_next_token_bitmask(mask, i)
                why = self._dead(seq, mask[i], seq.num_output_tokens - len(drafts) + i)
                if why is not None:  # (every logit there is masked: whatever came out would be neither's)
                    g.dead = (i, why)
                    break
                if i == len(drafts) or not m.accept_token(drafts[i]):
                    break
                accepted += 1
            if accepted:
                m.rollback(accepted)
            out[seq] = mask
        return out

    @staticmethod
    def _dead(seq: Sequence, row: torch.Tensor, before: int) -> str | None:
        """Why no token can pass a bitmask row (W,) int32 with allowed_token_ids and bad_words (the
        sampler's rule, after the output's first `before` tokens), or None."""
        if not row.any():  # the vocabulary cannot write what the grammar needs (SmolLM2 has no byte 0xF1)
            return ("structured output: no token of the model's vocabulary can continue the constraint "
                    "(it needs a character the tokenizer cannot write)")
        allowed, banned = seq.params.allowed_token_ids, bad_words_next(seq.params, seq.output_token_ids[:before])
        if not allowed and not banned:
            return None
        bits = unpack_bitmask(row)  # (32 W,)
        bits[banned] = False
        if allowed:
            return None if bits[allowed].any() else \
                "allowed_token_ids: none of them can continue the structured output (bad_words aside)"
        return None if bits.any() else "bad_words: they are all the structured output allows next"

    def fill_async(self, rows: list[tuple[Sequence, list[int]]]) -> Future:
        """fill() on the worker thread (overlapping the model's forward); the Future's result is
        fill()'s."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmserve-grammar")
        return self._pool.submit(self.fill, rows)
