"""OpenAI response bodies: whole responses, stream chunks, choices, logprobs and usage.

A Formatter holds one response's envelope (id, object, created, model); its subclasses turn engine
outputs into choices, whole (`response`) or one stream step at a time (`delta`). `sse_events` is the
one streaming loop every generating endpoint shares."""

from __future__ import annotations

import json
import random
import time
from collections.abc import AsyncIterator
from typing import Any

from lmserve.outputs import CompletionOutput, RequestOutput
from lmserve.sequence import Logprob
from lmserve.server import logprob_json as lj
from lmserve.server.errors import ApiError
from lmserve.server.protocol import ChatCompletionRequest, CompletionRequest
from lmserve.server.tool_parsers import (ContentDelta, Delta, HermesToolParser, ToolCall, ToolCallDelta, ToolCallStream,
                                         ToolParser, parse_forced_calls)
from lmserve.tokenizer import Tokenizer

DONE = "data: [DONE]\n\n"


# characters JSON leaves raw that line readers built on str.splitlines (httpx's aiter_lines, so many
# Python SSE clients) take for line ends: escaped, so one event's data stays one line
_LINE_BREAKERS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def sse_json(obj: Any) -> str:
    """obj as JSON for an SSE data line: UTF-8 text kept, but no character that splits a line."""
    return json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKERS)


def sse(obj: Any) -> str:
    """One server-sent event carrying obj as JSON."""
    return f"data: {sse_json(obj)}\n\n"


def usage(outs: list[RequestOutput], drop_generated: bool = False, details: bool = False) -> dict[str, Any]:
    """Token counts of the requests behind one response; details: the prompt tokens the prefix cache
    served too (OpenAI's prompt_tokens_details.cached_tokens; vLLM's --enable-prompt-tokens-details)."""
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = 0 if drop_generated else sum(len(c.token_ids) for o in outs for c in o.outputs)
    u: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if details:
        u["prompt_tokens_details"] = {"cached_tokens": sum(o.metrics.num_cached_tokens for o in outs)}
    return u


class Formatter:
    """One response: its envelope, and how the engine's outputs become its choices."""

    object = ""
    chunk_object = ""
    details = False  # usage with prompt_tokens_details (the server's --enable-prompt-tokens-details)

    def __init__(self, rid: str, model: str, tokenizer: Tokenizer | None) -> None:
        self.rid, self.model, self.tok = rid, model, tokenizer
        self.created = int(time.time())

    def piece(self, tid: int) -> str:
        """A token's text as logprobs show it."""
        return lj.piece(self.tok, tid)

    def prompt_logprobs(self, out: RequestOutput, k: int) -> list[dict[str, dict[str, Any]] | None]:
        return lj.prompt_logprobs(self.tok, out.prompt_logprobs, k)

    def response(self, outs: list[RequestOutput]) -> dict[str, Any]:
        """The whole response, once every request finished (outs in job order)."""
        return {"id": self.rid, "object": self.object, "created": self.created, "model": self.model,
                "choices": [self.choice(i, o, c) for i, o in enumerate(outs) for c in o.outputs],
                "usage": self.usage(outs)}

    def usage(self, outs: list[RequestOutput]) -> dict[str, int]:
        """The token counts this response reports, whole or streamed."""
        return usage(outs, details=self.details)

    def chunk(self, choices: list[dict[str, Any]], usage_: dict[str, int] | None = None) -> dict[str, Any]:
        """A stream chunk: some choices' deltas, and usage if given."""
        c: dict[str, Any] = {"id": self.rid, "object": self.chunk_object, "created": self.created,
                             "model": self.model, "choices": choices}
        if usage_ is not None:
            c["usage"] = usage_
        return c

    def head(self) -> list[dict[str, Any]]:
        """Chunks sent before any output."""
        return []

    def choice(self, i: int, out: RequestOutput, c: CompletionOutput) -> dict[str, Any]:
        """Output c of job i as a finished choice."""
        raise NotImplementedError

    def delta(self, i: int, c: CompletionOutput) -> dict[str, Any] | None:
        """What output c of job i added in this stream step as a choice; None when there is nothing to send."""
        raise NotImplementedError

    def seen(self, i: int, out: RequestOutput) -> None:
        """Job i's output of this stream step, before its choices' deltas (what a delta needs beyond its
        choice: the prompt's logprobs)."""

    def deltas(self, i: int, c: CompletionOutput) -> list[dict[str, Any]]:
        """The stream step as one or more choices, each its own chunk (a chat step may add content and
        tool-call deltas)."""
        d = self.delta(i, c)
        return [] if d is None else [d]

    def events(self, outputs: AsyncIterator[tuple[int, RequestOutput | BaseException]], include_usage: bool,
               continuous: bool) -> AsyncIterator[str]:
        """The response streamed: OpenAI's chunks (`sse_events`); another API's formatter has its events."""
        return sse_events(self, outputs, include_usage, continuous)


class CompletionFormatter(Formatter):
    """/v1/completions: text choices (with the prompt when echoed), OpenAI's legacy logprobs."""

    object = chunk_object = "text_completion"

    def __init__(self, rid: str, model: str, tokenizer: Tokenizer | None, body: CompletionRequest,
                 prompts: list[str | list[int]]) -> None:
        super().__init__(rid, model, tokenizer)
        self.body, self.prompts = body, prompts
        self.echoed: set[tuple[int, int]] = set()  # (job, choice) whose prompt the stream has sent
        self.offset: dict[tuple[int, int], int] = {}  # (job, choice): the stream's next text_offset
        self.prompts_seen: dict[int, RequestOutput] = {}  # job -> an output of it (its prompt's logprobs)
        self.ids_started: set[tuple[int, int]] = set()  # (job, choice) sent its prompt_token_ids
        self.held_ids: dict[tuple[int, int], list[int]] = {}  # return_token_ids, (job, choice): ids not yet sent

    def prompt_text(self, i: int) -> str:
        """Job i's prompt as text (echo)."""
        p = self.prompts[i]
        return p if isinstance(p, str) else (self.tok.decode(p, skip_special_tokens=False) if self.tok else "")

    def logprobs(self, ids: list[int], lps: list[Logprob | None], off: int = 0) -> dict[str, Any]:
        return lj.legacy(self.tok, ids, lps, self.body.logprobs or 0, off)

    def usage(self, outs: list[RequestOutput]) -> dict[str, int]:
        return usage(outs, drop_generated=self.body.echo_only, details=self.details)  # scoring: the throw-away token is no output

    def choice(self, i: int, out: RequestOutput, c: CompletionOutput) -> dict[str, Any]:
        body = self.body
        text, ids, lps = ("", [], []) if body.echo_only else (c.text, c.token_ids, list(c.logprobs or []))
        lp_obj = None
        if body.echo:
            if body.logprobs is not None:
                lp_obj = self.logprobs(out.prompt_token_ids + ids, list(out.prompt_logprobs or []) + lps)
            text = self.prompt_text(i) + text
        elif body.logprobs is not None:
            lp_obj = self.logprobs(ids, lps)
        choice = {"index": i * body.n + c.index, "text": text, "logprobs": lp_obj,
                  "finish_reason": "length" if body.echo_only else c.finish_reason, "stop_reason": c.stop_reason}
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs(out, body.prompt_logprobs)
        if body.return_token_ids:
            choice.update(token_ids=ids, prompt_token_ids=out.prompt_token_ids)
        return choice

    def seen(self, i: int, out: RequestOutput) -> None:
        self.prompts_seen[i] = out

    def delta(self, i: int, c: CompletionOutput) -> dict[str, Any] | None:
        key, body = (i, c.index), self.body
        text = "" if body.echo_only else c.delta_text  # scoring streams the prompt alone, as its response has it
        ids, lps = ([], []) if body.echo_only else (c.delta_token_ids, lj.new_logprobs(c))
        if body.return_token_ids and ids:  # (a step whose text is held back sends them with the next chunk)
            self.held_ids.setdefault(key, []).extend(ids)
        if body.echo and key not in self.echoed and (c.token_ids or c.finished):  # the prompt first (once it
            # is computed: its logprobs whole), with its logprobs, as the response has it
            self.echoed.add(key)
            text = self.prompt_text(i) + text
            out = self.prompts_seen.get(i)
            if out is not None:
                ids, lps = out.prompt_token_ids + ids, list(out.prompt_logprobs or []) + lps
        lp_obj = None
        if body.logprobs is not None and ids:
            start = self.offset.get(key, 0)  # offsets run on over the whole choice, as in the response
            lp_obj = self.logprobs(ids, lps, start)
            self.offset[key] = start + sum(map(len, lp_obj["tokens"]))
        if not text and not c.finished and lp_obj is None:
            return None
        choice = {"index": i * body.n + c.index, "text": text, "logprobs": lp_obj,
                  "finish_reason": ("length" if body.echo_only else c.finish_reason) if c.finished else None,
                  "stop_reason": c.stop_reason if c.finished else None}
        if body.return_token_ids:
            choice["token_ids"] = self.held_ids.pop(key, [])
            if key not in self.ids_started and i in self.prompts_seen:  # the prompt's ids on a choice's first chunk
                self.ids_started.add(key)
                choice["prompt_token_ids"] = self.prompts_seen[i].prompt_token_ids
        return choice


class ChatFormatter(Formatter):
    """/v1/chat/completions: assistant messages, chat logprobs; the stream opens with the role.

    With tools, the output is read for calls (body.tool_mode): "auto" by the model's tool-call parser
    (server/tool_parsers.py; streamed: content as it comes, each call as its name then its
    arguments, once the call is complete), "forced" as the JSON array of calls that constrained
    decoding produced. A choice that made calls finishes with "tool_calls" (auto, required; "stop" for a
    named function, as OpenAI has it); parallel_tool_calls false keeps the first call."""

    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, rid: str, model: str, tokenizer: Tokenizer | None, body: ChatCompletionRequest,
                 tool_parser: type[ToolParser] = HermesToolParser, prompt_ids: list[int] | None = None) -> None:
        super().__init__(rid, model, tokenizer)
        self.body = body
        self.prompt_ids = prompt_ids  # return_token_ids: the stream's first chunk carries them
        self.parser = tool_parser
        self.rng = random.Random()  # tool-call ids
        self.streams: dict[int, ToolCallStream] = {}  # auto mode, per choice
        self.forced: dict[int, str] = {}  # forced mode, per choice: the text so far
        self.called: set[int] = set()  # choices that made a call
        self.held: dict[int, tuple[list[int], list[Logprob]]] = {}  # per choice: tokens (and logprobs) not yet sent
        last = body.messages[-1]  # echo (vLLM's): an assistant's last message, which the output goes on from
        self.echo = last.text() if body.echo and last.role == "assistant" else ""

    @property
    def max_calls(self) -> int | None:
        """Calls an auto-mode output keeps: the first only with parallel_tool_calls false (vLLM's rule)."""
        return None if self.body.parallel_tool_calls else 1

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output, as the body's tool mode reads it."""
        if self.body.tool_mode == "auto":
            ex = self.parser(self.rng).extract(text)
            return (ex.content, ex.calls[:self.max_calls]) if ex.calls else (text, [])
        if self.body.tool_mode == "forced":
            try:
                return None, parse_forced_calls(text, self.rng)
            except ValueError:  # cut short (max_tokens): the text as it is
                return text, []
        return text, []

    def segments(self, text: str) -> list[str | ToolCall]:
        """A finished output as its content stretches and calls in the order the stream sends them (the
        Responses API's items, a Messages API's blocks)."""
        if self.body.tool_mode == "auto":
            ex = self.parser(self.rng).extract(text)
            if not ex.calls:
                return [text] if text else []
            keep = set(map(id, ex.calls[:self.max_calls]))
            return [p for p in ex.parts if isinstance(p, str) or id(p) in keep]
        content, calls = self.calls(text)
        return ([content] if content else []) + list(calls)

    def finish_reason(self, c: CompletionOutput, called: bool) -> str | None:
        # OpenAI (and vLLM): "tool_calls" for calls the model chose (auto, required), "stop" for a named function
        named = self.body.tool_choice not in (None, "auto", "required")
        return "tool_calls" if called and not named and c.finish_reason == "stop" else c.finish_reason

    def logprobs(self, ids: list[int], lps: list[Logprob]) -> dict[str, Any]:
        return lj.chat(self.tok, ids, lps)

    def head(self) -> list[dict[str, Any]]:  # (a chunk per choice, as OpenAI and vLLM send them)
        heads = [self.chunk([{"index": i, "delta": {"role": "assistant", "content": self.echo}, "logprobs": None,
                              "finish_reason": None}]) for i in range(self.body.n)]
        if self.body.return_token_ids:
            heads[0]["prompt_token_ids"] = self.prompt_ids
        return heads

    def response(self, outs: list[RequestOutput]) -> dict[str, Any]:
        r = super().response(outs)
        if self.body.prompt_logprobs is not None:  # vLLM's: beside the choices (a chat is one prompt)
            r["prompt_logprobs"] = self.prompt_logprobs(outs[0], self.body.prompt_logprobs)
        if self.body.return_token_ids:
            r["prompt_token_ids"] = outs[0].prompt_token_ids
        return r

    def choice(self, i: int, out: RequestOutput, c: CompletionOutput) -> dict[str, Any]:
        content, calls = self.calls(c.text)
        content = self.echo + (content or "") if self.echo else content
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.openai() for call in calls]
        choice = {"index": c.index, "message": message,
                  "logprobs": self.logprobs(c.token_ids, c.logprobs or []) if self.body.logprobs else None,
                  "finish_reason": self.finish_reason(c, bool(calls)), "stop_reason": c.stop_reason}
        if self.body.return_token_ids:
            choice["token_ids"] = c.token_ids
        return choice

    def deltas(self, i: int, c: CompletionOutput) -> list[dict[str, Any]]:
        if self.body.tool_mode == "none":
            return super().deltas(i, c)
        k = c.index
        self.hold(c)
        found: list[Delta] = []
        if self.body.tool_mode == "auto":
            stream = self.streams.setdefault(k, self.parser(self.rng).streaming())
            found = stream.feed(c.delta_text) if c.delta_text else []
            if c.finished:
                found += stream.finish()
            if self.max_calls is not None:  # the first call only, as vLLM keeps
                found = [d for d in found if not (isinstance(d, ToolCallDelta) and d.index >= self.max_calls)]
        else:  # forced: the calls are known once the array is complete
            self.forced[k] = self.forced.get(k, "") + c.delta_text
            if c.finished:
                content, calls = self.calls(self.forced[k])
                found = [ContentDelta(content)] if content else []
                for j, call in enumerate(calls):
                    found += [ToolCallDelta(j, call.id, call.name, ""), ToolCallDelta(j, arguments=call.arguments)]
        merged: list[dict[str, Any]] = []  # consecutive content pieces as one delta
        for d in found:
            if isinstance(d, ToolCallDelta):
                self.called.add(k)
            if isinstance(d, ContentDelta) and merged and "content" in merged[-1]:
                merged[-1]["content"] += d.text
            else:
                merged.append(d.openai())
        if c.finished and not merged:
            merged.append({})
        out = [{"index": k, "delta": d, "logprobs": None, "finish_reason": None, "stop_reason": None}
               for d in merged]
        if out:
            out[0].update(self.release(k))
        if c.finished:
            out[-1]["finish_reason"] = self.finish_reason(c, k in self.called)
            out[-1]["stop_reason"] = c.stop_reason
        return out

    def hold(self, c: CompletionOutput) -> None:
        """A step's tokens (and their logprobs) wait for the next chunk of their choice: its text may be
        held back (a stop string, a tool call)."""
        if (self.body.logprobs or self.body.return_token_ids) and c.delta_token_ids:
            ids, lps = self.held.setdefault(c.index, ([], []))
            ids += c.delta_token_ids
            lps += lj.new_logprobs(c)

    def release(self, k: int) -> dict[str, Any]:
        """Choice k's held tokens as its chunk's fields: `logprobs` (when asked), `token_ids` (return_token_ids)."""
        ids, lps = self.held.pop(k, ([], []))
        fields: dict[str, Any] = {"logprobs": self.logprobs(ids, lps) if self.body.logprobs and ids else None}
        if self.body.return_token_ids:
            fields["token_ids"] = ids
        return fields

    def delta(self, i: int, c: CompletionOutput) -> dict[str, Any] | None:
        self.hold(c)
        if not c.delta_text and not c.finished:
            return None
        return {"index": c.index, "delta": {"content": c.delta_text} if c.delta_text else {},
                **self.release(c.index), "finish_reason": c.finish_reason if c.finished else None,
                "stop_reason": c.stop_reason if c.finished else None}


async def sse_events(fmt: Formatter, outputs: AsyncIterator[tuple[int, RequestOutput | BaseException]],
                     include_usage: bool, continuous: bool) -> AsyncIterator[str]:
    """The SSE stream of one response: its head, a chunk per choice per step that added something (an
    error event for a request that failed), a usage chunk when asked, then [DONE]. outputs yields
    (job index, output) or (job index, error), which ends the stream (with the error: no usage chunk).
    continuous (vLLM's continuous_usage_stats): each chunk's usage is its own choice's, so far."""
    for c in fmt.head():
        prompt = len(getattr(fmt, "prompt_ids", None) or ())
        yield sse({**c, "usage": {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt}}
                  if continuous else c)

    def own(item: RequestOutput, c: CompletionOutput) -> dict[str, Any]:  # a choice's usage (0: echo-only scoring)
        u = fmt.usage([item])
        done = len(c.token_ids) if u["completion_tokens"] else 0
        return {**u, "completion_tokens": done, "total_tokens": u["prompt_tokens"] + done}
    last: dict[int, RequestOutput] = {}
    failed = False  # an error event went out
    ended: set[tuple[int, int]] = set()  # (job, choice) finished and sent: a request's output holds its
    # finished choices every step until its last one ends, and each must go out once (OpenAI, vLLM)
    async for i, item in outputs:
        if isinstance(item, BaseException):
            yield sse(ApiError.of(item).body())
            failed = True
            break
        last[i] = item
        fmt.seen(i, item)
        for c in item.outputs:
            if (i, c.index) in ended:
                continue
            if c.finished:
                ended.add((i, c.index))
            if c.finish_reason == "error":
                yield sse(ApiError.engine_failure(c.error, c.error_status).body())
                failed = True
                continue
            for choice in fmt.deltas(i, c):
                yield sse(fmt.chunk([choice], own(item, c) if continuous else None))
    if include_usage and last and not failed:  # (after an error event, [DONE] alone: vLLM's)
        yield sse(fmt.chunk([], fmt.usage(list(last.values()))))
    yield DONE
