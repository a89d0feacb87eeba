"""`lmserve chat`: an interactive chat with the model, streaming tokens as they come."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lmserve.cli.engine_args import add_engine_args, engine_kwargs
from lmserve.cli.sampling_args import add_sampling_args, sampling_params
from lmserve.engine import Engine
from lmserve.llm import LLM


def add_parser(sub: Any) -> None:
    c = sub.add_parser("chat", help="interactive chat, streaming tokens as they come")
    c.add_argument("--system", default=None, help="system message")
    add_engine_args(c)
    add_sampling_args(c)
    c.set_defaults(func=cmd_chat, command_sampling={"max_tokens": 256, "temperature": 0.7})


def cmd_chat(a: argparse.Namespace) -> int:
    sampling_params(a)  # bad flags (a schema file that does not parse) fail before the model loads
    llm = LLM(a.model, **engine_kwargs(a))
    if llm.tokenizer is None or not llm.tokenizer.has_chat_template:
        print("error: this model has no chat template", file=sys.stderr)
        return 2
    params = sampling_params(a, llm.sampling_defaults)
    history: list[dict[str, str]] = [{"role": "system", "content": a.system}] if a.system else []
    turn = 0
    print("lmserve chat: type a message, /reset to clear history, /exit or Ctrl-D to quit; "
          "Ctrl-C stops a reply.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:  # at the prompt: leave, as a shell would, without a traceback
            print()
            return 130
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = history[:1] if a.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        prompt = llm.tokenizer.apply_chat_template(history)
        rid = f"chat-{turn}"
        turn += 1
        try:
            llm.engine.add_request(rid, llm.tokenizer.encode(prompt, add_special_tokens=False), params)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            history.pop()
            continue
        try:
            history.append({"role": "assistant", "content": _stream_reply(llm.engine)})
        except KeyboardInterrupt:  # during a reply: it is dropped, with the message that asked for it
            llm.engine.abort_request(rid)
            while llm.engine.has_unfinished_requests():  # the abort lands at the next step
                llm.engine.step()
            history.pop()
            print("\n[stopped]", file=sys.stderr)


def _stream_reply(eng: Engine) -> str:
    """Step the engine until the turn's request finishes, printing each delta as it comes; the reply."""
    text = ""
    while eng.has_unfinished_requests():
        for out in eng.step():
            delta = out.outputs[0].delta_text
            text += delta
            print(delta, end="", flush=True)
    print()
    return text
