"""Incremental detokenization with a byte-fallback tokenizer (SentencePiece's shape: Llama 2, Gemma), whose
decoder turns a whole run of byte tokens into U+FFFD once part of the run is no character."""

from __future__ import annotations

import random

import pytest

from lmserve.detokenizer import IncrementalDetokenizer
from lmserve.sequence import SamplingParams
from lmserve.tokenizer import Tokenizer

WORDS = ["ousands", "\u2581Stimmung", "\u2581Dye", "\u2581Juggling", "\u2581emoji:", "\n", "\u2581ok"]


@pytest.fixture(scope="module")
def bf():  # type: ignore[no-untyped-def]
    """A byte-fallback BPE tokenizer (a few words, every byte as <0xNN>), decoded as Gemma's is."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + WORDS)}
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    raw.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return Tokenizer(raw, eos_token="</s>"), vocab


def _ids(vocab, *tokens: str) -> list[int]:  # type: ignore[no-untyped-def]
    return [vocab[t] for t in tokens]


def _bytes(vocab, data: bytes) -> list[int]:  # type: ignore[no-untyped-def]
    return [vocab[f"<0x{b:02X}>"] for b in data]


def test_a_byte_run_that_turns_invalid_does_not_stop_the_text(bf):  # type: ignore[no-untyped-def]
    """'7' is emitted, then <0xE4> starts a character that never comes: the decoder renders the run
    '7\\xe4' as two U+FFFD, so the emitted '7' is no longer a prefix of the text. Before, every later
    delta was empty (the output text stopped for good and each step re-decoded a growing window)."""
    tok, vocab = bf
    out = _ids(vocab, "ousands") + _bytes(vocab, b"7\xe4") + _ids(vocab, "\u2581Stimmung", "\u2581Dye") * 20
    d = IncrementalDetokenizer(tok, [])
    text = "".join(d.step([i]) for i in out)
    assert text == "ousands7\ufffd" + " Stimmung Dye" * 20  # vLLM's rule: what lies past the emitted length
    assert len(text) == len(tok.decode(out))
    assert len(d.ids) - d.prefix <= 2  # the window stays short


def test_a_prompt_ending_in_byte_characters_gives_none_of_them_as_output(bf):  # type: ignore[no-untyped-def]
    """The prompt's last 6 tokens are the detokenizer's left context; 🤹🤹 is 8 byte tokens, so the window
    started inside a character and decoded as six U+FFFD, which came out as output text."""
    tok, vocab = bf
    prompt = _ids(vocab, "\u2581Juggling", "\u2581emoji:") + _bytes(vocab, "🤹🤹".encode())
    out = _ids(vocab, "\n", "\n", "\u2581ok")
    d = IncrementalDetokenizer(tok, prompt)
    assert "".join(d.step([i]) for i in out) == "\n\n ok" == tok.decode(prompt + out)[len(tok.decode(prompt)):]


def test_bytes_that_are_no_character_are_text_at_once(bf):  # type: ignore[no-untyped-def]
    """Bytes that can begin no character come out as U+FFFD (as a decode of all shows them) at once,
    holding nothing back (before, each was held three tokens); a real character split over three tokens
    is still held whole."""
    tok, vocab = bf
    d = IncrementalDetokenizer(tok, [])
    pieces = [d.step([i]) for i in _bytes(vocab, b"\xff" * 8)]
    assert pieces == ["\ufffd"] * 8 and len(d.ids) == d.read
    d = IncrementalDetokenizer(tok, _ids(vocab, "\u2581ok"))
    pieces = [d.step([i]) for i in _bytes(vocab, "🤹".encode()) + _ids(vocab, "\u2581Dye")]
    assert pieces == ["", "", "", "🤹", " Dye"]


def test_random_mixes_of_bytes_and_words_never_stall(bf):  # type: ignore[no-untyped-def]
    """Whatever bytes come first, the words after them are all output text."""
    tok, vocab = bf
    pieces = ["é".encode(), "🤹".encode(), b"\xe4", b"\xff", b"7", "日".encode()[:2]]
    tail = _ids(vocab, "\u2581Dye", "\u2581ok") * 2
    for trial in range(400):
        r = random.Random(trial)
        seq: list[int] = []
        for _ in range(r.randint(1, 12)):
            seq += _bytes(vocab, r.choice(pieces)) if r.random() < 0.5 else _ids(vocab, r.choice(WORDS))
        d = IncrementalDetokenizer(tok, [])
        text = "".join(d.step([i]) for i in seq + tail)
        assert text.endswith(" Dye ok Dye ok"), (trial, text)
        valid = tok.decode(seq + tail)
        if "\ufffd" not in valid:  # all characters whole: exactly the decode
            assert text == valid, trial


def _byte_level(chunks: list[bytes]) -> tuple[Tokenizer, dict[bytes, int]]:
    """A byte-level BPE tokenizer (GPT-2's byte alphabet, as Llama 3's and Qwen's) whose vocabulary is
    every single byte and the given byte strings: its ids by bytes."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models

    from lmserve.tokenizer import _BYTE_OF
    char = {b: c for c, b in _BYTE_OF.items()}
    spell = lambda data: "".join(char[b] for b in data)  # noqa: E731
    pieces = list(dict.fromkeys([bytes([b]) for b in range(256)] + chunks))
    raw = RawTokenizer(models.BPE(vocab={spell(p): i for i, p in enumerate(pieces)}, merges=[]))
    raw.decoder = decoders.ByteLevel()
    return Tokenizer(raw), {p: i for i, p in enumerate(pieces)}


def test_a_token_that_ends_one_character_and_begins_the_next():  # type: ignore[no-untyped-def]
    """本😀 as [E6] [9C AC F0] [9F] [98] [80]: the second token finishes 本 and begins 😀 (large byte-level
    vocabularies hold such tokens). Before, the detokenizer held at most three tokens, then emitted 本's
    first byte as U+FFFD and lost the character: '\ufffd😀'."""
    tok, ids = _byte_level([b"\x9c\xac\xf0"])
    out = [ids[b"\xe6"], ids[b"\x9c\xac\xf0"], ids[b"\x9f"], ids[b"\x98"], ids[b"\x80"]]
    d = IncrementalDetokenizer(tok, [ids[b"H"], ids[b"i"]])
    assert [d.step([i]) for i in out] == ["", "", "", "", "本😀"] and tok.decode(out) == "本😀"


def test_text_cut_into_random_byte_chunks_comes_out_whole():  # type: ignore[no-untyped-def]
    """Random text of 1- to 4-byte characters, its UTF-8 cut anywhere into tokens of 1-5 bytes: the deltas
    join to the text itself (the independent reference), and each delta is whole characters."""
    alphabet = "aZ é日本語🤹😀€\n"
    trials = []
    for trial in range(300):
        r = random.Random(trial)
        data = "".join(r.choice(alphabet) for _ in range(r.randint(1, 20))).encode()
        cuts, at = [], 0
        while at < len(data):
            n = r.randint(1, 5)
            cuts.append(data[at:at + n])
            at += n
        trials.append((data.decode(), cuts))
    tok, ids = _byte_level([c for _, cuts in trials for c in cuts])
    for trial, (text, cuts) in enumerate(trials):
        d = IncrementalDetokenizer(tok, [ids[b"x"]])
        deltas = [d.step([ids[c]]) for c in cuts]
        assert "".join(deltas) == text and "\ufffd" not in "".join(deltas), (trial, cuts, deltas)


def _finish(seq, reason, stop_reason=None, override=False):  # type: ignore[no-untyped-def]
    """Scheduler.finish's effect on the sequence alone."""
    from lmserve.sequence import Status
    if seq.status is not Status.FINISHED or override:
        seq.status, seq.finish_reason, seq.stop_reason = Status.FINISHED, reason, stop_reason


def test_a_sequence_ending_on_held_characters_keeps_the_whole_ones():  # type: ignore[no-untyped-def]
    """[E6] [9C AC F0] [9F] and max_tokens reached: 本 is whole, 😀 is not. The output text keeps 本
    (the detokenizer held both while the bytes ended inside 😀, and the end dropped what it held)."""
    from lmserve.outputs import OutputProcessor
    from lmserve.sequence import Sequence, Status
    tok, ids = _byte_level([b"\x9c\xac\xf0"])
    held = [ids[b"\xe6"], ids[b"\x9c\xac\xf0"], ids[b"\x9f"]]
    # ended by length on the last held token, or by an EOS after them (a stop string among the held
    # characters still cuts, and is the reason: it came before the EOS)
    for out, end in ((held, "length"), (held + [0], "stop")):
        for stop, want in (([], "本"), (["本"], "")):
            proc = OutputProcessor(tok, _finish)
            seq = Sequence("r", [ids[b"H"], ids[b"i"]], SamplingParams(max_tokens=4, stop=stop), eos_token_ids=(0,))
            seq.status = Status.RUNNING
            proc.start(seq)
            for i, t in enumerate(out):
                seq.token_ids.append(t)
                if i == len(out) - 1:
                    _finish(seq, end)
                proc.process(seq, [t], [])
            assert seq.output.text == want, (end, stop)
            assert (seq.finish_reason, seq.stop_reason) == (("stop", "本") if stop else (end, None)), (end, stop)


def test_a_real_replacement_character_token_is_text_at_once():  # type: ignore[no-untyped-def]
    """A byte-level vocabulary's token for "\ufffd" itself (its bytes EF BF BD) is a whole character: out at
    once and kept at the end (it was held three tokens, and the end's flush dropped it)."""
    tok, ids = _byte_level(["\ufffd".encode()])
    d = IncrementalDetokenizer(tok, [ids[b"x"]])
    assert [d.step([ids[b"a"]]), d.step([ids["\ufffd".encode()]])] == ["a", "\ufffd"] and d.flush() == ""


def test_a_skipped_special_token_between_bytes_holds_no_byte_back(bf):  # type: ignore[no-untyped-def]
    """[E6] <s> [9C] [AC] with special tokens skipped: decode leaves <s> out and gives 本; the hold test
    must leave out its text too (it counted <s>'s bytes, so the character's first byte came out as U+FFFD)."""
    from tokenizers import Tokenizer as RawTokenizer
    vocab = bf[1]
    raw = RawTokenizer.from_str(bf[0].raw.to_str())  # (a copy: the module's tokenizer stays as it is)
    raw.add_special_tokens(["<s>"])
    tok = Tokenizer(raw, eos_token="</s>")
    d = IncrementalDetokenizer(tok, _ids(vocab, "\u2581ok"))
    out = _bytes(vocab, b"\xe6") + _ids(vocab, "<s>") + _bytes(vocab, b"\x9c\xac")
    assert "".join(d.step([i]) for i in out) == "本" == tok.decode(out)
