"""Command line: `lmserve generate | chat | serve | bench | plan | quantize | eval`. A thin layer over the library.

This is the front door: it builds the parser from each command's `add_parser` and runs the chosen
command. Below it, the commands (lmserve.cli.generate and .chat, lmserve.server.cli, lmserve.bench.cli,
lmserve.plan) take their shared flags from lmserve.cli.engine_args and .sampling_args, and none of them
imports this module.
"""

from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    """The `lmserve` parser: one subcommand per command module. They are imported here, not at the top,
    because a command importing lmserve.cli.engine_args runs this file first: it must not need them."""
    from lmserve import plan
    from lmserve.bench import cli as bench_cli
    from lmserve.cli import chat, generate, quantize
    from lmserve.cli import eval as eval_cli
    from lmserve.server import cli as server_cli

    p = argparse.ArgumentParser(prog="lmserve", description="LLM inference and serving engine")
    sub = p.add_subparsers(dest="cmd", required=True)
    for command in (generate, chat, plan, server_cli, bench_cli, quantize, eval_cli):
        command.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command; a bad option or a missing file is one `error:` line and exit status 2."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
