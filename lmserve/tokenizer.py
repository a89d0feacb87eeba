"""Tokenizers (from HF folders or GGUF metadata), chat templates, and incremental detokenization.

We do not write our own BPE: HF `tokenizers` does the work. From a GGUF file we build the same
byte-level BPE the file describes (vocabulary, merges, pre-tokenizer split, control tokens).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

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

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

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

    GGUF_MODELS = ("gpt2",)  # the `tokenizer.ggml.model` kinds from_gguf builds

    @classmethod
    def from_gguf(cls, g: Any, eos_token_ids: tuple[int, ...] = ()) -> "Tokenizer":
        """Build from a parsed GGUFFile's `tokenizer.ggml.*` metadata."""
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as RawTokenizer

        kind = g.field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported yet (byte-level BPE 'gpt2' is)")
        tokens: list[str] = g.field("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in g.field("tokenizer.ggml.merges")]
        types = g.field("tokenizer.ggml.token_type") or [1] * len(tokens)
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
        raw.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == 3])  # 3 = CONTROL
        name = lambda key: tokens[g.field(key)] if g.field(key) is not None else None  # noqa: E731
        return cls(raw, bos_token=name("tokenizer.ggml.bos_token_id"), eos_token=name("tokenizer.ggml.eos_token_id"),
                   add_bos=bool(g.field("tokenizer.ggml.add_bos_token", False)),
                   chat_template=g.field("tokenizer.chat_template"), eos_token_ids=eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.raw.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.raw.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.raw.id_to_token(i) for i in ids]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render a conversation to the prompt text the model was trained on."""
        if not self.chat_template:
            raise ValueError("messages: this model's tokenizer has no chat template; use a plain prompt")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)


def _compile_template(source: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character.

    Keeps two offsets into the token list (as TGI and vLLM do): `prefix` marks tokens already fully
    emitted whose text is only decoded again as left context (byte-level BPE merges depend on it),
    `read` marks where new tokens start. A delta ending in U+FFFD means an incomplete byte sequence,
    so it is held back until the next token completes it.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-6:])
        self.prefix = 0
        self.read = len(self.ids)
        # A prompt given as token ids may end inside a UTF-8 character (its text ends in U+FFFD): its
        # last tokens count as not yet emitted, so that `read` (and later `prefix`) sits on a
        # character boundary and the character, once an output token completes it, is output text.
        while self.read > 0 and len(self.ids) - self.read < 3 and \
                self.tok.decode(self.ids[:self.read], self.skip).endswith("\ufffd"):
            self.read -= 1

    def step(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        # Emitted text still ending in U+FFFD (a prompt ending in bytes that are no character at all)
        # must not stop every later delta: compare without it.
        prev = self.tok.decode(self.ids[self.prefix:self.read], self.skip).rstrip("\ufffd")
        full = self.tok.decode(self.ids[self.prefix:], self.skip)
        if full.endswith("\ufffd") or not full.startswith(prev):
            return ""  # an unfinished UTF-8 character, or a merge that rewrote the earlier text: wait
        self.prefix, self.read = self.read, len(self.ids)
        return full[len(prev):]
