"""What rank 0 sends the other ranks, as tensors only (a broadcast of int64 / float buffers; nothing is
ever pickled, so no rank can be made to run code by what arrives: the vLLM / SGLang class of
CVE-2025-30165, CVE-2025-47277).

Each message is a fixed-length int64 header [command, a, b, c, m_0 .. m_{L-1}] (L: the
model's layers, the most KV groups there can be) and, for most commands, one payload tensor whose
shape the header gives:

    INIT     [_, num_blocks]                    build the KV cache (after rank 0 sized its own)
    COPY     [_, C]          int64 (C, 2)        copy-on-write block copies (src, dst)
    FORWARD  [_, N, B, G, M_g..]  int64 flat    input_ids (N), positions (N), query_start_loc (B+1),
                                                 seq_lens (B), slot_mapping per KV group (G x N),
                                                 block tables per group (B x M_g each)
    LOGITS   [_, B]          float (B, hidden)   rows to run the LM head on (the vocab slices meet
                                                 on rank 0)
    NOOP     heartbeat while rank 0 is idle (a peer that waits longer than the timeout gives up)
    STOP     leave the loop and exit 0
"""

from __future__ import annotations

import torch

from lmserve.attention import AttentionMetadata
from lmserve.parallel.group import TPGroup

NOOP, INIT, COPY, FORWARD, LOGITS, STOP = range(6)
HEADER = 4  # + one block-table width per KV group: `slots` of them, one per layer


def send(tp: TPGroup, slots: int, cmd: int, *fields: int, widths: tuple[int, ...] = (),
         payload: torch.Tensor | None = None) -> None:
    """Rank 0: a header (and its payload) to every rank."""
    header = torch.zeros(HEADER + slots, dtype=torch.long)
    header[0] = cmd
    header[1:1 + len(fields)] = torch.tensor(fields, dtype=torch.long)
    header[HEADER:HEADER + len(widths)] = torch.tensor(widths, dtype=torch.long)
    tp.broadcast(header.to(tp.device))
    if payload is not None:
        tp.broadcast(payload.contiguous().to(tp.device))


def recv_header(tp: TPGroup, slots: int) -> list[int]:
    return tp.broadcast(torch.zeros(HEADER + slots, dtype=torch.long, device=tp.device)).tolist()


def recv_payload(tp: TPGroup, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return tp.broadcast(torch.empty(shape, dtype=dtype, device=tp.device))


def send_forward(tp: TPGroup, slots: int, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> None:
    """Rank 0: one step's flattened inputs and attention metadata (the tensors ModelRunner.build_inputs
    made; the host lists are rebuilt from them on the other side)."""
    per_group = [(meta.slot_mapping, meta.block_tables)] if not meta.groups else list(meta.groups)
    flat = torch.cat([input_ids, positions, meta.query_start_loc, meta.seq_lens,
                      *(s for s, _ in per_group), *(t.reshape(-1) for _, t in per_group)]).long()
    send(tp, slots, FORWARD, input_ids.shape[0], meta.seq_lens.shape[0], len(per_group),
         widths=tuple(t.shape[1] for _, t in per_group), payload=flat)


def recv_forward(tp: TPGroup, header: list[int], block_size: int, layer_groups: tuple[int, ...]
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Other ranks: the step's input_ids (N,), positions (N,) and AttentionMetadata, as rank 0 has them."""
    n, b = header[1], header[2]
    groups = header[3]
    widths = header[HEADER:HEADER + groups]
    flat = recv_payload(tp, (2 * n + 2 * b + 1 + groups * n + b * sum(widths),), torch.long)
    input_ids, positions, qsl, seq_lens, *rest = flat.split([n, n, b + 1, b, *[n] * groups, *[b * w for w in widths]])
    slots, tables = rest[:groups], [t.view(b, w) for t, w in zip(rest[groups:], widths)]
    qsl_host, seq_host = qsl.tolist(), seq_lens.tolist()
    meta = AttentionMetadata(
        slot_mapping=slots[0], query_start_loc=qsl, seq_lens=seq_lens, block_tables=tables[0], positions=positions,
        block_size=block_size, query_lens_host=[qsl_host[i + 1] - qsl_host[i] for i in range(b)],
        seq_lens_host=seq_host, groups=tuple(zip(slots, tables)) if groups > 1 else (),
        layer_groups=layer_groups if groups > 1 else ())
    return input_ids, positions, meta
