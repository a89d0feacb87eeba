"""Tokenizers (from HF folders or GGUF metadata), chat templates, and incremental detokenization.

We do not write our own BPE: HF `tokenizers` does the work. From a GGUF file we build the tokenizer
the file describes: byte-level BPE ('gpt2': vocabulary, merges, pre-tokenizer split, control tokens),
or SentencePiece BPE ('llama' with byte fallback, as Gemma's files hold it: merges recovered from the
vocabulary order).
"""

from __future__ import annotations

import functools
import json
import threading
from pathlib import Path
from typing import Any

from lmserve.chat_template import GGUF_TEMPLATES, compile_template, render, text_messages

# llama.cpp pre-tokenizer names -> the split regex the vocabulary was trained with
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}



class Tokenizer:
    """An HF `tokenizers` tokenizer plus the facts around it: BOS/EOS, and the chat template.

    The chat template is rendered with jinja2 the way transformers renders it (sandboxed, trimmed
    blocks, `raise_exception`, `strftime_now`), so we need no transformers import at run time.
    """

    def __init__(self, raw: Any, *, bos_token: str | None = None, eos_token: str | None = None,
                 add_bos: bool = False, chat_template: str | None = None,
                 eos_token_ids: tuple[int, ...] = ()) -> None:
        self.raw = raw
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = raw.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = raw.token_to_id(eos_token) if eos_token else None
        self.add_bos = add_bos and self.bos_token_id is not None
        self.chat_template = chat_template
        ids = set(eos_token_ids)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        self.eos_token_ids = tuple(sorted(ids))
        self.vocab_size = raw.get_vocab_size(with_added_tokens=True)
        self._template = None
        self._templates: dict[str, Any] = {}  # requests' own chat templates, compiled (insertion order: oldest first)
        self._templates_lock = threading.Lock()

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def use_chat_template(self, source: str) -> None:
        """Render chats with `source` instead of the checkpoint's template (vLLM's --chat-template: a
        file, or the template itself); ValueError naming chat_template when it is neither, or does not
        compile."""
        path = Path(source)
        try:
            is_file = path.is_file()
        except OSError:  # (a long inline template is no path)
            is_file = False
        if is_file:
            source = path.read_text()
        elif not any(c in source for c in "{}\n"):
            raise ValueError(f"chat_template: {source!r} is neither a file nor a template")
        self.chat_template, self._template = source, _compile_checked(source)

    def request_ids(self, message: str) -> list[int]:
        """One user message as the model's prompt token ids: through the chat template when the
        tokenizer has one, else the text itself."""
        text = self.apply_chat_template([{"role": "user", "content": message}]) if self.has_chat_template else message
        return self.encode(text, add_special_tokens=False)

    @classmethod
    def from_hf_dir(cls, path: Path, eos_token_ids: tuple[int, ...] = ()) -> "Tokenizer":
        """tokenizer.json + tokenizer_config.json (+ chat_template.jinja) of an HF folder."""
        from tokenizers import Tokenizer as RawTokenizer
        path = Path(path)
        cfg: dict[str, Any] = {}
        if (path / "tokenizer_config.json").is_file():
            cfg = json.loads((path / "tokenizer_config.json").read_text())
        if (path / "tokenizer.json").is_file():
            raw = RawTokenizer.from_file(str(path / "tokenizer.json"))
        else:  # slow-tokenizer-only folder: let transformers convert it
            from transformers import AutoTokenizer
            raw = AutoTokenizer.from_pretrained(str(path), local_files_only=True).backend_tokenizer
        template = cfg.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: take the default
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        tok = lambda v: v.get("content") if isinstance(v, dict) else v  # noqa: E731
        return cls(raw, bos_token=tok(cfg.get("bos_token")), eos_token=tok(cfg.get("eos_token")),
                   add_bos=bool(cfg.get("add_bos_token", False)), chat_template=template,
                   eos_token_ids=eos_token_ids)

    GGUF_MODELS = ("gpt2", "llama")  # the `tokenizer.ggml.model` kinds from_gguf builds

    @classmethod
    def from_gguf(cls, g: Any, eos_token_ids: tuple[int, ...] = ()) -> "Tokenizer":
        """Build from a parsed GGUFFile's `tokenizer.ggml.*` metadata."""
        from tokenizers import AddedToken

        kind = g.field("tokenizer.ggml.model")
        if kind not in cls.GGUF_MODELS:
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported ({', '.join(cls.GGUF_MODELS)} are)")
        tokens: list[str] = g.field("tokenizer.ggml.tokens")
        types = g.field("tokenizer.ggml.token_type") or [1] * len(tokens)
        cached = _built_path(g) if kind == "llama" else None  # recovering its merges takes seconds: once
        if cached is not None and cached.is_file():
            from tokenizers import Tokenizer as RawTokenizer
            raw = RawTokenizer.from_file(str(cached))
        else:
            raw = _byte_level_bpe(g, tokens) if kind == "gpt2" else _sentencepiece_bpe(g, tokens)
            raw.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, ty in zip(tokens, types) if ty == 3])  # 3 = CONTROL
            # 4 = USER_DEFINED (llama.cpp's converter writes every added token that is not special so: Qwen's
            # <think>, <tool_call>): matched whole in text, as llama.cpp and HF do, but not special
            raw.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types)
                            if ty == 4 and raw.token_to_id(t) is not None])  # (not SentencePiece's respelled space runs)
            if cached is not None:
                _save(raw, cached)
        name = lambda key: tokens[g.field(key)] if g.field(key) is not None else None  # noqa: E731
        template = g.field("tokenizer.chat_template") or GGUF_TEMPLATES.get(g.field("general.architecture"))
        return cls(raw, bos_token=name("tokenizer.ggml.bos_token_id"), eos_token=name("tokenizer.ggml.eos_token_id"),
                   add_bos=bool(g.field("tokenizer.ggml.add_bos_token", False)),
                   chat_template=template, eos_token_ids=eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; ValueError naming the prompt for text that is not Unicode a tokenizer can
        take (a lone surrogate, which JSON's \\ud800 escapes can carry)."""
        try:
            ids = self.raw.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            raise ValueError("prompt: the text is not valid Unicode (a lone surrogate)") from None
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.raw.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.raw.id_to_token(i) for i in ids]

    def token_bytes(self, tid: int) -> bytes:
        """A token's own bytes, as chat logprobs give them: a token holding part of a multi-byte
        character is that part (decoded alone it is U+FFFD), so a client can join a character again.
        Byte-level BPE spells bytes as characters; SentencePiece's byte fallback as <0xAB>."""
        known = self.known_bytes(tid)
        return known if known is not None else self.decode([tid], skip_special_tokens=False).encode("utf-8")

    def known_bytes(self, tid: int) -> bytes | None:
        """A token's own bytes where the vocabulary spells them (byte-level BPE, <0xAB> byte tokens) or its
        text is whole characters; None where its text holds U+FFFD that it does not spell (bytes unknown)."""
        tok = self.raw.id_to_token(tid)
        if tok is not None and self._byte_level and tid not in self._added and all(ch in _BYTE_OF for ch in tok):
            return bytes(_BYTE_OF[ch] for ch in tok)
        if tok is not None and len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
            try:
                return bytes([int(tok[3:5], 16)])
            except ValueError:
                pass
        text = self.decode([tid], skip_special_tokens=False)
        return None if "\ufffd" in text and "\ufffd" not in (tok or "") else text.encode("utf-8")

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The special tokens' ids (what decode's skip_special_tokens leaves out)."""
        return frozenset(i for i, t in self.raw.get_added_tokens_decoder().items() if t.special)

    @functools.cached_property
    def _added(self) -> frozenset[int]:  # added tokens are spelled as their text, not in the byte alphabet
        return frozenset(self.raw.get_added_tokens_decoder())

    @functools.cached_property
    def _byte_level(self) -> bool:
        d = json.loads(self.raw.to_str()).get("decoder") or {}
        return "ByteLevel" in [d.get("type")] + [x.get("type") for x in d.get("decoders") or []]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            template: str | None = None, max_chars: int = 0, max_seconds: float = 0.0,
                            continue_final_message: bool = False, **kwargs: Any) -> str:
        """Render a conversation to the prompt text the model was trained on (or with `template`, a
        request's own, compiled in the same sandbox). The output is bounded to max_chars characters and
        max_seconds of rendering (0: TEMPLATE_MAX_CHARS / TEMPLATE_MAX_SECONDS); ValueError past either.
        A message's content may be a list of text parts (joined with newlines, as vLLM does);
        continue_final_message leaves the last message open, cut after its text (HF's and vLLM's rule)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message: cannot be combined with add_generation_prompt (set it to false)")
        messages = text_messages(messages)
        rendered = self._render(messages, add_generation_prompt, template, max_chars, max_seconds, kwargs)
        if not continue_final_message:
            return rendered
        last = messages[-1]["content"].strip() if messages else ""
        if not last or last not in rendered:
            raise ValueError("continue_final_message: the last message's text is not in the rendered chat")
        return rendered[:rendered.rindex(last) + len(last)]

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, template: str | None,
                max_chars: int, max_seconds: float, kwargs: dict[str, Any]) -> str:
        if template is not None:
            compiled = self._request_template(template)
        else:
            if not self.chat_template:
                raise ValueError("messages: this model's tokenizer has no chat template; use a plain prompt")
            if self._template is None:
                self._template = compile_template(self.chat_template)
            compiled = self._template
        return render(compiled, max_chars, max_seconds, messages=messages, add_generation_prompt=add_generation_prompt,
                      bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)

    def _request_template(self, source: str) -> Any:
        """A request's chat template, compiled once per text (a few kept); ValueError naming the field
        when it does not compile."""
        with self._templates_lock:
            hit = self._templates.get(source)
            if hit is not None:
                return hit
        compiled = _compile_checked(source)
        with self._templates_lock:
            self._templates[source] = compiled
            while len(self._templates) > 16:
                self._templates.pop(next(iter(self._templates)))
        return compiled


def _compile_checked(source: str) -> Any:
    """compile_template, or a ValueError naming chat_template when the source does not compile."""
    import jinja2
    try:
        return compile_template(source)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat_template: does not compile: {e}") from None


SPM_BUILD = "1"  # bump when _sentencepiece_bpe changes: cached tokenizers of older builds are not read


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): each byte as a printable character -> the byte."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)}
    chars, moved = {}, 0
    for b in range(256):  # a byte without a printable character of its own takes 256, 257, ... in order
        chars[b] = b if b in keep else 256 + moved
        moved += b not in keep
    return {chr(c): b for b, c in chars.items()}


_BYTE_OF = _byte_alphabet()


def _built_path(g: Any) -> Path | None:
    """Where the tokenizer built from this GGUF file is cached (keyed by the file's path, size and
    modification time, and SPM_BUILD); None when the file cannot be stat'ed."""
    import hashlib

    from lmserve.utils import cache_root
    try:
        st = Path(g.path).stat()
    except (OSError, AttributeError, TypeError):
        return None
    key = f"{Path(g.path).resolve()}|{st.st_size}|{st.st_mtime_ns}|{SPM_BUILD}"
    return cache_root() / "tokenizers" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _save(raw: Any, path: Path) -> None:
    """Write atomically (another process may be reading or writing the same file)."""
    import os
    import tempfile
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.close(fd)
        raw.save(tmp)
        os.replace(tmp, path)
    except OSError:  # a read-only cache: build each time
        pass


def _byte_level_bpe(g: Any, tokens: list[str]) -> Any:
    """GPT-2-style byte-level BPE: the file's merges and pre-tokenizer split."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    merges = [tuple(m.split(" ", 1)) for m in g.field("tokenizer.ggml.merges")]
    raw = RawTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    pre = g.field("tokenizer.ggml.pre", "default")
    steps = []
    if pre in _SPLITS:
        steps.append(pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"))
    elif pre == "smollm":
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in _SPLITS))
    raw.pre_tokenizer = pre_tokenizers.Sequence(steps)
    raw.decoder = decoders.ByteLevel()
    return raw


def _sentencepiece_bpe(g: Any, tokens: list[str]) -> Any:
    """SentencePiece BPE with byte fallback ('llama' files; Gemma's shape: spaces as U+2581 with no
    prefix space, since add_space_prefix is false in them). The files list no merges: they are
    recovered from the vocabulary, every split of a token into two tokens, best first by the order
    the tokens appear in the file (for Gemma the order, not the scores, follows the merge order)."""
    from tokenizers import decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    if g.field("tokenizer.ggml.add_space_prefix", True):
        raise ValueError("GGUF SentencePiece tokenizers with add_space_prefix are not supported yet (Gemma's are not)")
    # a token of two or more spaces is stored with real spaces; the text side sees U+2581
    tokens = ["\u2581" * len(t) if len(t) > 1 and not t.strip(" ") else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []  # (rank of the merged token, -len(left), -len(right), id left, id right, left, right)
    for rank, tok in enumerate(tokens):
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in vocab and right in vocab:
                merges.append((rank, -len(left), -len(right), vocab[left], vocab[right], left, right))
    merges.sort()
    unk = g.field("tokenizer.ggml.unknown_token_id")
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[(m[5], m[6]) for m in merges], byte_fallback=True,
                                  fuse_unk=True, unk_token=tokens[unk] if unk is not None else None))
    raw.normalizer = normalizers.Replace(" ", "\u2581")
    raw.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    raw.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return raw
