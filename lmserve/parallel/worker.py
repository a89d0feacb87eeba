"""Ranks 1..N-1 of a tensor-parallel group: load the shard, then follow rank 0 (parallel/step.py).

Started by our one-host launcher (`python -m lmserve.parallel.worker`, the config in the environment)
or by torchrun running an `lmserve` command (lmserve.cli.main hands ranks other than 0 to `run`
with the command line's engine config). Exits 0 on rank 0's STOP; 1, with the error on stderr, when a peer is lost.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys

import torch

from lmserve.config import EngineConfig
from lmserve.kv.cache import KVCache
from lmserve.models.loader import load_model
from lmserve.parallel import step
from lmserve.parallel.driver import CONFIG_ENV, INIT_ENV
from lmserve.parallel.group import RankLost, TPGroup, init_group
from lmserve.parallel.shard import shard_model

log = logging.getLogger("lmserve")


@torch.inference_mode()
def follow(config: EngineConfig, tp: TPGroup) -> None:
    """Load this rank's shard and run what rank 0 sends until STOP."""
    local = []
    cfg, model, _ = load_model(config, shard=lambda m, c: local.append(shard_model(m, c, tp)))
    kv: KVCache | None = None
    while True:
        header = step.recv_header(tp, cfg.num_layers)
        cmd = header[0]
        if cmd == step.STOP:
            return
        if cmd == step.INIT:
            kv = KVCache(local[0], header[1], config.block_size, config.torch_dtype, tp.device, config.kv_cache_dtype,
                         not config.disable_hybrid_kv_cache_manager)
        elif cmd == step.COPY:
            pairs = step.recv_payload(tp, (header[1], 2), torch.long)
            kv.copy_blocks([(int(a), int(b)) for a, b in pairs.tolist()])
        elif cmd == step.FORWARD:
            input_ids, positions, meta = step.recv_forward(tp, header, config.block_size, kv.layer_groups)
            model(input_ids, positions, kv.layers, meta)  # the hidden states stay on rank 0's side
        elif cmd == step.LOGITS:
            hidden = step.recv_payload(tp, (header[1], cfg.hidden_size), config.torch_dtype)
            tp.gather_vocab(model.compute_logits(hidden), cfg.vocab_size)


def run(config: EngineConfig, rank: int, init: str) -> int:
    if os.environ.get("LMSERVE_THREADS"):
        torch.set_num_threads(int(os.environ["LMSERVE_THREADS"]))
    tp = init_group(config.tensor_parallel_size, rank, config.device, config.distributed_timeout,
                    config.distributed_interface, init)
    try:
        follow(config, tp)
        return 0
    except RankLost as e:
        print(f"error: tensor-parallel rank {rank}: {e}", file=sys.stderr)
        return 1
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle: it stops us, or its death does
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    config = EngineConfig(**json.loads(os.environ[CONFIG_ENV]))
    return run(config, int(os.environ["RANK"]), os.environ[INIT_ENV])


if __name__ == "__main__":
    sys.exit(main())
