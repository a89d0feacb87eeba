"""The training loop both learned drafts use (spec/eagle.py's head, spec/distill.py's student).

AdamW with a cosine schedule over `steps` items drawn in a seeded order (one item a step); a checkpoint
(weights, optimizer, step, loss curve) every 50 steps and where it stops, resumed from when present, so
a stopped run continues exactly as if it never stopped. `until` stops after that many of the steps.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn


def train_loop(module: nn.Module, num_items: int, item_loss: Callable[[int], torch.Tensor], steps: int, lr: float,
               seed: int = 0, checkpoint: Path | None = None, progress: bool = True, until: int | None = None,
               desc: str = "train") -> list[tuple[int, float]]:
    """item_loss(i): the loss of item i (a scalar with a graph to module's parameters). Returns the loss
    curve [(step, loss)], resumed steps included."""
    opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.0)
    start, curve = 0, []
    if checkpoint is not None and checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=True)
        module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start, curve = int(state["step"]), [tuple(x) for x in state["curve"].tolist()]
    order = random.Random(seed)
    schedule = [order.randrange(num_items) for _ in range(steps)]
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=steps, initial=start, desc=desc)
    end = steps if until is None else min(until, steps)
    for step in range(start, end):
        for g in opt.param_groups:
            g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        loss = item_loss(schedule[step])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        curve.append((step, loss.item()))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.4f}")
        if checkpoint is not None and ((step + 1) % 50 == 0 or step + 1 == end):
            torch.save({"model": module.state_dict(), "opt": opt.state_dict(), "step": step + 1,
                        "curve": torch.tensor(curve)}, checkpoint)
    if bar is not None:
        bar.close()
    return curve
