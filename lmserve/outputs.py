"""Output processing: what the engine hands back (RequestOutput with one CompletionOutput per sample,
and metrics) and the OutputProcessor that builds it from sampled tokens (detokenization, stop
strings, logprobs)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from lmserve.sampling.beam import BeamState
from lmserve.sequence import Logprob, Sequence
from lmserve.detokenizer import IncrementalDetokenizer
from lmserve.tokenizer import Tokenizer

log = logging.getLogger("lmserve")


@dataclass
class RequestMetrics:
    """Wall-clock times (seconds since the epoch) and derived latencies of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_decode_tokens: int = 0  # the longest output's tokens (n > 1: its choices decode side by side)

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first, of one output (n > 1: the longest; its choices
        decode side by side, so their summed tokens would make it n times too small)."""
        if self.finished_time is None or self.first_token_time is None or self.num_decode_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_decode_tokens - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One generated continuation. `delta_*` hold what is new since the previous output (streaming)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    logprobs: list[Logprob] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    error: str | None = None
    error_status: int = 500  # with finish_reason "error": 500 failed inside the engine, 503 waited past max_waiting_time

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state: prompt, its outputs so far, and whether it has finished."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[Logprob | None] | None = None
    embedding: list[float] | None = None  # an embedding request's (pooling.py), once its prompt has run


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """LLM.embed's result for one prompt (vLLM's)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


class OutputProcessor:
    """Turns sampled tokens into what callers see. Owns each sequence's `output` state: incremental
    detokenization, stop strings, the logprobs of the tokens that stay, and the RequestOutputs built
    from them (full text plus the delta since the last one, for streaming)."""

    def __init__(self, tokenizer: Tokenizer | None, finish: Callable[..., None]) -> None:
        self.tokenizer = tokenizer
        self.finish = finish  # Scheduler.finish: ends a sequence and frees its blocks

    def start(self, seq: Sequence) -> None:
        if self.tokenizer is not None:
            seq.output.detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids,
                                                      seq.params.skip_special_tokens)

    def fail(self, seq: Sequence, error: str, status: int = 500) -> None:
        """End a sequence with finish_reason 'error' and its reason (what the server answers with
        `status`: 500 for a failure inside the engine, 503 for a request that waited too long, 400 for
        one the model cannot serve)."""
        out = seq.output
        if out.detok is not None and not seq.is_finished:  # the whole characters held back are its text too
            out.text += out.detok.flush()
        out.error, out.error_status = error, status
        self.finish(seq, "error", override=True)

    def process(self, seq: Sequence, new_tokens: list[int], logprobs: list[Logprob]) -> None:
        """Text and stop strings for the tokens a step delivered, then the kept tokens' logprobs. A
        sequence whose grammar refused a token (StructuredOutputs.keep dropped it and what followed: every
        token here is text, none ended it) then fails with the grammar's reason, unless a stop string
        came first. A failure here ends this sequence alone (finish_reason 'error'), never the engine."""
        refused = seq.grammar is not None and seq.grammar.failed
        try:
            kept = self._text(seq, new_tokens)
        except Exception as e:  # one request's failure must not reach the others
            log.exception("output processing failed for %s", seq.request_id)
            self.fail(seq, f"{type(e).__name__}: {e}")
            return
        out = seq.output
        for lp in logprobs[:kept]:  # only the tokens that stayed
            if seq.params.logprobs is not None:
                out.logprobs.append(lp)
            out.cumulative_logprob += lp.logprob
        if refused and not isinstance(seq.stop_reason, str):
            self.fail(seq, seq.grammar.why, status=seq.grammar.status)  # type: ignore[union-attr]

    def _text(self, seq: Sequence, new_tokens: list[int]) -> int:
        """Detokenize the new tokens one by one and apply stop strings (the stop string itself is not
        emitted, nor the text of an EOS or stop token that ended the sequence, unless
        include_stop_str_in_output). Tokens after a stop string (possible when several arrive at once) are dropped.
        Returns how many of new_tokens the sequence keeps.

        Several tokens arrive at once from speculation; they are checked in order, exactly as if each
        had come in its own step: a stop string completed by an earlier token wins over an EOS or
        stop token that comes after it (which ended the sequence in the scheduler already), while a
        token-level stop on the last token wins over a stop string on that same token, as it does
        one token at a time.
        """
        out = seq.output
        if out.detok is None:
            return len(new_tokens)
        p = seq.params
        last = len(new_tokens) - 1
        refused = seq.grammar is not None and seq.grammar.failed  # (then none of these ended it: all text)
        ender = -1 if refused else last  # the token that ended the sequence, if one of these did
        for i, tok in enumerate(new_tokens):
            before = len(out.text)
            if i == ender and seq.finish_reason == "stop" and not p.include_stop_str_in_output:
                break  # the EOS / stop token that ended it: its id stays, its text does not (vLLM's rule)
            out.text += out.detok.step([tok])
            if not p.stop or (i == ender and seq.finish_reason not in (None, "length")):
                continue
            if seq.num_output_tokens - (last - i) <= p.min_tokens:  # as stop tokens: none before min_tokens
                continue  # (vLLM's rule: a stop string counts from the token after the min_tokens-th)
            if self._stop_string(seq, before):
                if i < last:
                    del seq.token_ids[len(seq.token_ids) - (last - i):]
                return i + 1
        if seq.is_finished:  # the whole characters the detokenizer still held back
            before = len(out.text)
            out.text += out.detok.flush()
            if p.stop and seq.finish_reason in ("stop", "length") and seq.num_output_tokens > p.min_tokens:
                self._stop_string(seq, before)
        return len(new_tokens)

    def _stop_string(self, seq: Sequence, before: int) -> bool:
        """Whether the text added after `before` completes a stop string; if so the text ends there (the
        stop kept with include_stop_str_in_output) and the sequence finishes with it as the reason (a
        later token that had ended it already, EOS or length, gives way: the stop string came first)."""
        out, p = seq.output, seq.params
        for stop in p.stop or ():
            idx = out.text.find(stop, max(0, before - len(stop) + 1))
            if idx != -1:
                out.text = out.text[:idx + len(stop)] if p.include_stop_str_in_output else out.text[:idx]
                self.finish(seq, "stop", stop_reason=stop, override=True)
                return True
        return False

    def make(self, rid: str, seqs: list[Sequence], beam: BeamState | None = None) -> RequestOutput:
        """The request's output now: every sample (best_of: the n most likely, once finished)."""
        if beam is not None:
            return self._beam_output(rid, seqs, beam)
        outs = []
        s0 = seqs[0]
        finished = all(s.is_finished for s in seqs)
        ranked = finished and s0.params.num_samples > s0.params.n  # best_of: the n most likely, re-indexed
        shown = (sorted(seqs, key=lambda s: -s.output.cumulative_logprob)[:s0.params.n] if ranked
                 else sorted(seqs, key=lambda s: s.index))
        for rank, s in enumerate(shown):
            o = s.output
            hold = 0 if s.is_finished or not s.params.stop else max(map(len, s.params.stop)) - 1
            visible = max(o.num_emitted_chars, len(o.text) - hold)
            delta = o.text[o.num_emitted_chars:visible]
            o.num_emitted_chars = visible
            out_ids = s.output_token_ids
            delta_ids = out_ids[o.num_emitted_tokens:]
            o.num_emitted_tokens = len(out_ids)
            outs.append(CompletionOutput(
                index=rank if ranked else s.index, text=o.text, token_ids=out_ids,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                cumulative_logprob=o.cumulative_logprob if s.params.needs_logprob else None,
                logprobs=list(o.logprobs) if s.params.logprobs is not None else None,
                delta_text=delta, delta_token_ids=delta_ids, error=o.error,
                error_status=o.error_status))
        metrics = request_metrics(seqs, finished, sum(s.num_output_tokens for s in seqs))
        return RequestOutput(rid, s0.prompt, s0.prompt_token_ids, outs, finished,
                             metrics, list(s0.prompt_logprobs) if s0.params.prompt_logprobs is not None else None,
                             s0.pooled.embedding if s0.pooled is not None else None)

    def _beam_output(self, rid: str, seqs: list[Sequence], beam: BeamState) -> RequestOutput:
        """A beam search shows nothing until it ends; then its n best hypotheses."""
        s0 = seqs[0]
        finished = all(s.is_finished for s in seqs)
        outs = []
        failed = next((s for s in seqs if s.finish_reason == "error"), None)
        if finished and failed is not None:  # the search could not go on: its error, not a partial result
            o = failed.output
            outs.append(CompletionOutput(index=0, text="", token_ids=[], finish_reason="error", error=o.error,
                                         error_status=o.error_status))
        elif finished:
            p = s0.params
            for i, h in enumerate(beam.best(p.n)):
                text = self.tokenizer.decode(h.tokens, p.skip_special_tokens) if self.tokenizer else ""
                # a stop_token_ids token is the stop reason (an EOS is not, unless EOS is ignored: vLLM's rule)
                end = h.tokens[-1] if h.ended_by_eos and h.tokens else None
                why = end if end in (p.stop_token_ids or ()) and (p.ignore_eos or end not in s0.eos_token_ids) else None
                outs.append(CompletionOutput(index=i, text=text, token_ids=h.tokens, cumulative_logprob=h.logprob,
                                             finish_reason="stop" if h.ended_by_eos else "length", stop_reason=why,
                                             delta_text=text, delta_token_ids=h.tokens))
        metrics = request_metrics(seqs, finished, sum(len(o.token_ids) for o in outs),
                                  max((len(o.token_ids) for o in outs), default=0))
        return RequestOutput(rid, s0.prompt, s0.prompt_token_ids, outs, finished, metrics)


def request_metrics(seqs: list[Sequence], finished: bool, num_output_tokens: int,
                    num_decode_tokens: int | None = None) -> RequestMetrics:
    """A request's metrics from its sequences (the first holds the prompt-side facts)."""
    s0 = seqs[0]
    return RequestMetrics(
        arrival_time=s0.arrival_time,
        first_scheduled_time=min((s.first_scheduled_time for s in seqs if s.first_scheduled_time), default=None),
        first_token_time=min((s.first_token_time for s in seqs if s.first_token_time), default=None),
        finished_time=max((s.finished_time or 0) for s in seqs) if finished else None,
        num_prompt_tokens=s0.num_prompt_tokens, num_output_tokens=num_output_tokens,
        num_cached_tokens=s0.num_cached_tokens, num_preemptions=sum(s.num_preemptions for s in seqs),
        num_decode_tokens=max((s.num_output_tokens for s in seqs), default=0) if num_decode_tokens is None
        else num_decode_tokens)
