"""Incremental detokenization: a request's output tokens as text deltas, as they are sampled."""

from __future__ import annotations

import codecs

from lmserve.tokenizer import Tokenizer



class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character.

    Keeps two offsets into the token list (as TGI and vLLM do): `prefix` marks tokens already fully
    emitted whose text is only decoded again as left context (byte-level BPE merges depend on it),
    `read` marks where new tokens start. A delta ending in U+FFFD whose tokens' bytes end inside a
    character (`_unfinished`) is held back until the bytes that complete it come; bytes that are no
    character are text (U+FFFD), as a decode of all the tokens shows them. Byte-fallback decoders (SentencePiece: Llama 2, Gemma) turn a whole
    run of byte tokens into U+FFFD once part of it is no character, so the text of emitted tokens
    can change afterwards: the delta is then what lies past the emitted text's length (vLLM's rule),
    never a stall.
    """

    HOLD = 3  # tokens a character's first bytes span at most, where the bytes are not known (see _unfinished)

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        # The prompt's last 6 tokens as left context, widened (by up to HOLD tokens) so that it does
        # not start inside a character: a window that cut a run of byte tokens decodes as U+FFFD.
        start = max(0, len(prompt_ids) - 6)
        lo = max(0, start - self.HOLD)
        while start > lo and self.tok.decode(list(prompt_ids[start:]), self.skip).startswith("\ufffd"):
            start -= 1
        self.ids: list[int] = list(prompt_ids[start:])
        self.prefix = 0
        self.read = len(self.ids)
        # A prompt given as token ids may end inside a UTF-8 character (its text ends in U+FFFD): its
        # last tokens count as not yet emitted, so that `read` (and later `prefix`) sits on a
        # character boundary and the character, once an output token completes it, is output text.
        while self.read > 0 and len(self.ids) - self.read < self.HOLD and \
                self.tok.decode(self.ids[:self.read], self.skip).endswith("\ufffd"):
            self.read -= 1

    def step(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        end = len(self.ids)
        full = self.tok.decode(self.ids[self.prefix:end], self.skip)
        if full.endswith("\ufffd") and self._unfinished(end):
            return ""  # an unfinished UTF-8 character: wait for the bytes that complete it
        prev = self.tok.decode(self.ids[self.prefix:self.read], self.skip)
        if full.startswith(prev):
            delta = full[len(prev):]
        elif len(full) > len(prev) or end - self.read > self.HOLD:
            delta = full[len(prev):]  # the emitted text was rewritten (a byte run turned U+FFFD): go on past it
        else:
            return ""  # a merge rewrote the earlier text: wait for more
        self.prefix, self.read = self.read, end
        return delta

    def flush(self) -> str:
        """At the sequence's end: the whole characters still held back (a run of tokens that each ended one
        character and began the next holds them all), without the unfinished last one."""
        end = len(self.ids)
        if self.read == end:
            return ""
        full = self.tok.decode(self.ids[self.prefix:end], self.skip)
        pending = self._pending(end)  # the unfinished character's bytes: each at most one U+FFFD at the end
        if pending < 0:  # (bytes unknown: every U+FFFD at the end may be theirs)
            full = full.rstrip("\ufffd")
        while pending > 0 and full.endswith("\ufffd"):
            full, pending = full[:-1], pending - 1
        prev = self.tok.decode(self.ids[self.prefix:self.read], self.skip)
        if len(full) <= len(prev) or not full.startswith(prev):
            return ""
        self.prefix, self.read = self.read, end
        return full[len(prev):]

    def _unfinished(self, end: int) -> bool:
        """Whether the new tokens end inside a character (`_pending`)."""
        return self._pending(end) != 0

    def _pending(self, end: int) -> int:
        """How many of the new tokens' bytes end inside a UTF-8 character (the first 1-3 bytes of one). Bytes,
        not a count of tokens: a token of a large byte-level vocabulary may end one character and begin
        the next (Llama 3's, Qwen's), so a character may take any number of tokens to finish; and bytes
        that can begin no character are text at once (U+FFFD, as a decode of all the tokens shows them).
        A token whose bytes the vocabulary does not spell (`Tokenizer.known_bytes` None) falls back to a
        count: held for at most HOLD tokens. `_pending`: how many bytes end unfinished (-1: unknown)."""
        data = []
        for t in self.ids[self.read:end]:
            if self.skip and t in self.tok.special_ids:
                continue  # (decode leaves it out: its text lies between no bytes)
            b = self.tok.known_bytes(t)
            if b is None:
                return -1 if end - self.read <= self.HOLD else 0  # (-1: held, how many bytes unknown)
            data.append(b)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decoder.decode(b"".join(data), final=False)
        return len(decoder.getstate()[0])  # the bytes it holds back: a valid start, at most 3
