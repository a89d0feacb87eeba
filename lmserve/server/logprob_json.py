"""Logprobs as each API shows them: the legacy completions object, chat's content list, vLLM's
prompt_logprobs. Pure functions of the engine's Logprob records and the tokenizer."""

from __future__ import annotations

from typing import Any

from lmserve.outputs import CompletionOutput
from lmserve.sequence import Logprob
from lmserve.tokenizer import Tokenizer


def piece(tok: Tokenizer | None, tid: int) -> str:
    """A token's text as logprobs show it."""
    return tok.decode([tid], skip_special_tokens=False) if tok else str(tid)


def new_logprobs(c: CompletionOutput) -> list[Logprob]:
    """The logprobs of the tokens this stream step added."""
    return list((c.logprobs or [])[-len(c.delta_token_ids):]) if c.delta_token_ids else []


def legacy(tok: Tokenizer | None, ids: list[int], lps: list[Logprob | None], top_n: int, off: int = 0
           ) -> dict[str, Any]:
    """Legacy completions logprobs: tokens, their logprobs, the top_n alternatives, text offsets (from
    off). Each top_logprobs entry holds the chosen token too (OpenAI: up to logprobs + 1 entries; with
    logprobs 0, the chosen token alone), as vLLM gives it."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, lp in zip(ids, lps):
        text = piece(tok, tid)
        tokens.append(text)
        offsets.append(off)
        off += len(text)
        token_lps.append(None if lp is None else lp.logprob)
        top = None if lp is None else {piece(tok, t): v for t, v in list(lp.top.items())[:top_n]}
        if top is not None:
            top.setdefault(text, lp.logprob)  # type: ignore[union-attr]
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat(tok: Tokenizer | None, ids: list[int], lps: list[Logprob]) -> dict[str, Any]:
    """Chat logprobs: each token with its bytes and top alternatives."""
    def raw(t: int) -> list[int]:  # the token's own bytes (part of a character: not U+FFFD's)
        return list(tok.token_bytes(t) if tok else piece(tok, t).encode("utf-8"))

    content = []
    for tid, lp in zip(ids, lps):
        content.append({"token": piece(tok, tid), "logprob": lp.logprob, "bytes": raw(tid),
                        "top_logprobs": [{"token": piece(tok, t), "logprob": v, "bytes": raw(t)}
                                         for t, v in lp.top.items()]})
    return {"content": content}


def prompt_logprobs(tok: Tokenizer | None, lps: list[Logprob | None] | None, k: int
                    ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: for each prompt token (the first has none) a dict by token id of
    {logprob, rank, decoded_token}: the prompt's token, then the k most likely (ranks 1..k)."""
    def entry(v: float, rank: int | None, tid: int) -> dict[str, Any]:
        return {"logprob": max(v, -9999.0), "rank": rank, "decoded_token": piece(tok, tid)}  # (-inf: no JSON)

    rows: list[dict[str, dict[str, Any]] | None] = []
    for lp in lps or []:
        if lp is None:
            rows.append(None)
            continue
        row = {str(lp.token_id): entry(lp.logprob, lp.rank, lp.token_id)}
        for r, (t, v) in enumerate(list(lp.top.items())[:k], 1):
            row.setdefault(str(t), entry(v, r, t))
        rows.append(row)
    return rows
