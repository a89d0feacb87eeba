"""Command line: `lmserve generate | chat | serve | router | bench | plan | quantize | eval | train-draft | distill`. A thin layer over the library.

This is the front door: it builds the parser from each command's `add_parser` and runs the chosen
command. Below it, the commands (lmserve.cli.generate, .chat and .plan, lmserve.server.cli, lmserve.bench.cli)
take their shared flags from lmserve.cli.engine_args and .sampling_args, and none of them
imports this module.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    """The `lmserve` parser: one subcommand per command module. They are imported here, not at the top,
    because a command importing lmserve.cli.engine_args runs this file first: it must not need them."""
    from lmserve.bench import cli as bench_cli
    from lmserve.cli import chat, distill, generate, plan, quantize, train_draft
    from lmserve.cli import eval as eval_cli
    from lmserve.router import cli as router_cli
    from lmserve.server import cli as server_cli

    p = argparse.ArgumentParser(prog="lmserve", description="LLM inference and serving engine")
    sub = p.add_subparsers(dest="cmd", required=True)
    for command in (generate, chat, plan, server_cli, router_cli, bench_cli, quantize, eval_cli, train_draft, distill):
        command.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command; a bad option or a missing file is one `error:` line and exit status 2."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given (serve --data-parallel passes it on)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and hasattr(args, "kv_cache_memory"):  # a command that loads a model (its engine flags);
        # torchrun: the group is WORLD_SIZE ranks
        if args.tensor_parallel_size not in (1, world):
            print(f"error: --tensor-parallel-size {args.tensor_parallel_size} but torchrun started {world} ranks",
                  file=sys.stderr)
            return 2
        args.tensor_parallel_size = world
    if world > 1 and int(os.environ.get("RANK", "0")) > 0:
        return torchrun_rank(args)
    try:
        for flag in ("out", "output_json"):  # an output path that cannot be written: refused before any work
            if getattr(args, flag, None):
                unwritable(Path(getattr(args, flag)), folder=flag == "out", name=flag)
            elif flag == "output_json" and hasattr(args, flag):  # the default: a new file in OUTPUT_DIR
                from lmserve.bench.common import OUTPUT_DIR
                unwritable(OUTPUT_DIR / "figures.json", folder=False, name=f"output_json (default {OUTPUT_DIR}/)")
        return int(args.func(args) or 0)
    except (ValueError, OSError) as e:  # OSError: a file that is missing, exists, or cannot be written
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: stopped, as a shell command is (130), without a traceback
        print(file=sys.stderr)
        return 130


def unwritable(path: Path, folder: bool, name: str) -> None:
    """ValueError naming the flag when `path` (a folder, or a file) cannot be created where it is."""
    if path.exists() and path.is_dir() != folder:
        raise ValueError(f"{name}: {path} is a {'file' if folder else 'folder'}")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{name}: {parent} is a file, so {path} cannot be written")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{name}: {parent} is not writable, so {path} cannot be written")


def torchrun_rank(args: argparse.Namespace) -> int:
    """Under torchrun every rank runs the same command: rank 0 runs it, the others follow rank 0 with
    the command line's engine config (tensor_parallel_size = WORLD_SIZE)."""
    from lmserve.cli.engine_args import engine_kwargs
    from lmserve.config import EngineConfig
    from lmserve.parallel.worker import run

    if not hasattr(args, "kv_cache_memory"):  # (plan has --tensor-parallel-size, and loads no model)
        print(f"error: `lmserve {args.cmd}` loads no model: run it without torchrun", file=sys.stderr)
        return 2
    kw = {**engine_kwargs(args, method_per_run=True),  # (rank 0 checked the flags)
          "tensor_parallel_size": int(os.environ["WORLD_SIZE"])}
    return run(EngineConfig(model=args.model, **kw), int(os.environ["RANK"]), "env://")
