"""Chat templates: the sandbox they are compiled in, their bounded rendering, the templates we ship
for GGUF files that carry none, and message contents given as text parts."""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime
from collections.abc import Iterable
from typing import Any

# Gemma 3's chat template (text turns), for GGUF files that carry none: a system message is folded
# into the first user turn; the assistant's role is "model"
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] + '\n\n' %}"
    "{% set turns = messages[1:] %}{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' + (prefix if loop.first else '')"
    " + m['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
GGUF_TEMPLATES = {"gemma3": GEMMA3_TEMPLATE}  # architecture -> template when the file has none


TEMPLATE_MAX_CHARS = 4 * 2**20  # a rendered conversation longer than this is refused
TEMPLATE_MAX_SECONDS = 2.0  # and one that takes longer to render
_render = threading.local()  # this thread's render deadline (requests render on worker threads)


def join_text(texts: Iterable[str]) -> str:
    """A message's text parts as one string, joined with newlines: vLLM's rule for templates that read
    a string (every API here: chat, Responses, Messages)."""
    return "\n".join(texts)


def text_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each content given as text parts ([{"type": "text", "text": ...}]) joined
    into one string with newlines (vLLM's rule for templates that read a string); ValueError naming
    the message for anything else in a list."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}]: must be a dict with a role and a content")
        content = m.get("content")
        if isinstance(content, (list, tuple)):
            if any(not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str)
                   for p in content):
                raise ValueError(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are "
                                 f"supported")
            m = {**m, "content": join_text(p["text"] for p in content)}
        out.append(m)
    return out


class TemplateTimeout(Exception):
    """A chat template ran past its render deadline."""


def compile_template(source: str) -> Any:
    """A chat template's source compiled in the sandbox (jinja2's immutable sandbox, with bounded
    products and powers, HF's helpers: raise_exception, tojson, strftime_now, {% generation %})."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Env(ImmutableSandboxedEnvironment):
        # `*` and `**` can build a huge value in one operation, with no call for the clock check to see
        # ({{ "x" * 10**9 }}, {{ 9**9**9 }}): their operands are bounded (and nothing is folded at compile time)
        intercepted_binops = frozenset(["*", "**"])

        def call(self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # every call the template makes
            deadline = getattr(_render, "deadline", None)
            if deadline is not None and time.monotonic() > deadline:
                raise TemplateTimeout()
            return super().call(__context, __obj, *args, **kwargs)

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            limit = getattr(_render, "max_chars", None) or TEMPLATE_MAX_CHARS
            ints = isinstance(left, int) and isinstance(right, int)
            if operator == "**" and ints and abs(left) > 1 and right * abs(left).bit_length() > 4096:
                raise jinja2.exceptions.SecurityError("chat template: a power too large")
            if operator == "*":
                if ints and left.bit_length() + right.bit_length() > 4096:
                    raise jinja2.exceptions.SecurityError("chat template: a product too large")
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and n * len(seq) > limit:
                        raise jinja2.exceptions.SecurityError(f"chat template: a repetition past {limit} items")
            return super().call_binop(context, operator, left, right)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Generation(jinja2.ext.Extension):
        """transformers' {% generation %} ... {% endgeneration %} (it marks the assistant's text for
        training masks; TRL saves templates with it): rendered as its body."""
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = Env(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, Generation])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render(compiled: Any, max_chars: int = 0, max_seconds: float = 0.0, **variables: Any) -> str:
    """A compiled template rendered with `variables`, its output bounded to max_chars characters and
    max_seconds of rendering (0: TEMPLATE_MAX_CHARS / TEMPLATE_MAX_SECONDS); ValueError past either. A
    template is code (from the model's files, or a request): the sandbox checks the clock at every
    call the template makes, loops' range() included."""
    max_chars = max_chars or TEMPLATE_MAX_CHARS
    max_seconds = max_seconds or TEMPLATE_MAX_SECONDS
    deadline = time.monotonic() + max_seconds
    _render.deadline, _render.max_chars = deadline, max_chars
    try:
        out, size = [], 0
        for piece in compiled.generate(**variables):
            size += len(piece)
            if size > max_chars:
                raise ValueError(f"messages: the chat template's output passed {max_chars} characters")
            if time.monotonic() > deadline:
                raise TemplateTimeout()
            out.append(piece)
    except TemplateTimeout:
        raise ValueError(f"messages: the chat template took longer than {max_seconds:g} s to render") from None
    finally:
        _render.deadline = None
    return "".join(out)
