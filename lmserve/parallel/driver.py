"""Rank 0 of a tensor-parallel group: the model the engine's runner calls, and the ranks it starts.

`load_tensor_parallel(config)` replaces models/loader.load_model for tensor_parallel_size > 1. On one
host it starts ranks 1..N-1 itself (`python -m lmserve.parallel.worker`, the config handed over as
JSON in the environment); under torchrun (RANK / WORLD_SIZE set) the other ranks are torchrun's
processes running the same command (lmserve.cli.main turns them into workers). Either way every rank
loads the checkpoint, keeps its shard (parallel/shard.py) and then follows rank 0 step by step.

TPModel is what the engine holds as its model: `forward` and `compute_logits` first send the step to
the other ranks (parallel/step.py), then run rank 0's shard, whose collectives meet theirs. One lock
orders every message; while the engine is idle a heartbeat goes out, so a rank waiting for the next
step can tell a quiet rank 0 from a dead one. A failed collective raises RankLost (fatal).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lmserve.config import EngineConfig, ModelConfig
from lmserve.parallel import step
from lmserve.parallel.group import RankLost, TPGroup, init_group, refuse_a_running_group
from lmserve.parallel.shard import shard_model

log = logging.getLogger("lmserve")
CONFIG_ENV = "LMSERVE_TP_CONFIG"  # the engine config, JSON, for ranks started by our launcher
INIT_ENV = "LMSERVE_TP_INIT"  # their rendezvous (tcp://127.0.0.1:PORT)


class TPModel(nn.Module):
    """Rank 0's shard behind the model interface ModelRunner uses (forward, compute_logits), each call
    mirrored on the other ranks. Other attributes are the shard's (cfg, parameters)."""

    def __init__(self, inner: nn.Module, tp: TPGroup, cfg: ModelConfig, local_config: ModelConfig,
                 workers: list[subprocess.Popen], heartbeat_s: float) -> None:
        super().__init__()
        self.inner = inner
        self.tp, self.full_config, self.local_config = tp, cfg, local_config
        self.slots = cfg.num_layers  # header slots for block-table widths (step.py)
        self.workers = workers
        self.lost: RankLost | None = None
        self.on_lost: Callable[[RankLost], None] | None = None  # the server: stop the process
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, args=(heartbeat_s,), name="tp-heartbeat", daemon=True)
        self._closed = False

    def start_heartbeat(self) -> None:
        """From now on an idle rank 0 keeps the other ranks' watchdogs fed (load_tensor_parallel calls it)."""
        self._beat.start()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "inner" or "inner" not in self._modules:
                raise
            value = getattr(self._modules["inner"], name)
            if callable(value) and not isinstance(value, nn.Module):  # a shard's method would skip the other ranks
                raise AttributeError(f"{name}: not available through tensor parallelism") from None
            return value

    def _send(self, cmd: int, *fields: int, widths: tuple[int, ...] = (), payload: torch.Tensor | None = None) -> None:
        if self.lost is not None:
            raise self.lost
        try:
            step.send(self.tp, self.slots, cmd, *fields, widths=widths, payload=payload)
        except RankLost as e:
            self.lost = e
            raise
        self._last = time.monotonic()

    def attach(self, kv_cache: Any) -> None:
        """The engine sized its KV cache: the other ranks build theirs with as many blocks, and every
        copy-on-write block copy is mirrored to them."""
        with self.tp.lock:
            self._send(step.INIT, kv_cache.num_blocks)
        kv_cache.mirror = self.copy_blocks

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        with self.tp.lock:
            self._send(step.COPY, len(copies), payload=torch.tensor(copies, dtype=torch.long).view(-1, 2))

    def _fail(self, e: BaseException) -> RankLost:
        """A mirrored call that did not finish leaves the ranks at different collectives: fatal."""
        self.lost = e if isinstance(e, RankLost) else RankLost(f"rank 0 failed mid-step ({type(e).__name__}: {e}); "
                                                                f"the ranks are out of step")
        return self.lost

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: Any) -> torch.Tensor:
        with self.tp.lock:
            if self.lost is not None:
                raise self.lost
            try:
                step.send_forward(self.tp, self.slots, input_ids, positions, meta)
                return self.inner(input_ids, positions, kv_caches, meta)  # (N, hidden); all-reduces inside
            except BaseException as e:
                raise self._fail(e) from e

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, hidden) -> (B, vocab) float32: every rank's vocab slice, gathered here."""
        with self.tp.lock:
            self._send(step.LOGITS, hidden.shape[0], payload=hidden)
            try:
                return self.tp.gather_vocab(self.inner.compute_logits(hidden), self.full_config.vocab_size)
            except BaseException as e:
                raise self._fail(e) from e

    def _heartbeat(self, every: float) -> None:
        while not self._stop.wait(every):
            if time.monotonic() - self._last < every or not self.tp.lock.acquire(blocking=False):
                continue
            try:
                self._send(step.NOOP)
            except RankLost as e:
                log.error("tensor parallel: %s", e)
                if self.on_lost is not None:
                    self.on_lost(e)
                return
            finally:
                self.tp.lock.release()

    def close(self) -> None:
        """Tell the other ranks to exit, wait for those we started, leave the group (once)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        with self.tp.lock:
            try:
                self._send(step.STOP)
            except RankLost:
                pass
        for w in self.workers:
            try:
                if self.lost is not None:  # the group is broken: they may be waiting in a collective
                    w.kill()
                w.wait(timeout=10)
            except subprocess.TimeoutExpired:
                w.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_workers(config: EngineConfig, init: str) -> list[subprocess.Popen]:
    """Ranks 1..N-1 on this host: `python -m lmserve.parallel.worker`, told the config (JSON) and the
    rendezvous through their environment."""
    size = config.tensor_parallel_size
    blob = json.dumps(dataclasses.asdict(config))
    threads = max(1, torch.get_num_threads() // size)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # where lmserve is
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    procs = []
    for rank in range(1, size):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank), "PYTHONPATH": path,
               CONFIG_ENV: blob, INIT_ENV: init, "LMSERVE_THREADS": str(threads)}
        procs.append(subprocess.Popen([sys.executable, "-m", "lmserve.parallel.worker"], env=env))
    return procs


def load_tensor_parallel(config: EngineConfig) -> tuple[ModelConfig, TPModel, Any]:
    """Start (or, under torchrun, join) the group as rank 0, load this rank's shard: (the whole model's
    config, the TPModel, the tokenizer)."""
    from lmserve.models.loader import load_model  # the loader imports the models; kept off this module's import

    size = config.tensor_parallel_size
    refuse_a_running_group()  # before anything starts: the failure path below destroys the group it finds
    workers: list[subprocess.Popen] = []
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun started every rank
        if int(os.environ.get("RANK", "0")) != 0 or int(os.environ["WORLD_SIZE"]) != size:
            raise ValueError(f"tensor_parallel_size={size} but torchrun gave WORLD_SIZE={os.environ['WORLD_SIZE']}")
        init = "env://"
    else:
        init = f"tcp://127.0.0.1:{_free_port()}"
        workers = spawn_workers(config, init)
        torch.set_num_threads(max(1, torch.get_num_threads() // size))  # the host's cores, split between ranks
    try:
        tp = init_group(size, 0, config.device, config.distributed_timeout, config.distributed_interface, init)
        local: list[ModelConfig] = []
        cfg, model, tokenizer = load_model(config, shard=lambda m, c: local.append(shard_model(m, c, tp)))
    except BaseException as e:
        gone = [(rank, w.poll()) for rank, w in enumerate(workers, 1) if w.poll() is not None]
        for w in workers:
            w.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        if gone and isinstance(e, Exception):  # (rank 0 waited for it until the timeout: a rendezvous error)
            raise RuntimeError(f"tensor parallelism: rank {gone[0][0]} exited (status {gone[0][1]}) before the group "
                               f"formed; its own error is in its output above") from e
        raise
    proxy = TPModel(model, tp, cfg, local[0], workers, min(1.0, config.distributed_timeout / 4))
    proxy.start_heartbeat()  # from now on: the other ranks wait for INIT while the engine sizes its cache
    atexit.register(proxy.close)
    return cfg, proxy, tokenizer
