"""`lmserve distill`: a small draft made from the target by pruning and distillation (spec/distill.py),
saved as an HF Llama folder for --draft-model (or for LLM() on its own).

Data as train-draft's (the target's own continuations of a prompt set, cached in --out/data.json; 10%
held out for the perplexities). The target runs with float weights (quantization none) so that what is
pruned is the real weights. Everything lands in --out: the model (config.json, model.safetensors, the
tokenizer), the training checkpoint (resumed from on a rerun), and the loss curve (loss.png).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from pathlib import Path
from typing import Any

from lmserve.cli.engine_args import add_engine_args
from lmserve.cli.train_draft import add_data_args, held_out, plot_curve, target_text
from lmserve.utils import above, at_least


def add_parser(sub: Any) -> None:
    p = sub.add_parser("distill", help="prune the target and distill it into a small draft model (HF folder)")
    p.add_argument("--out", required=True, help="folder for the model, its data, checkpoint and loss curve")
    p.add_argument("--num-layers", type=at_least(1), default=8, help="layers kept (the most influential, in order)")
    p.add_argument("--intermediate-size", type=at_least(1), default=None, help="MLP channels kept per layer (default: all)")
    p.add_argument("--num-kv-heads", type=at_least(1), default=None, help="KV-head groups kept per layer (default: all)")
    p.add_argument("--steps", type=at_least(1), default=None, help="distillation steps, a sequence each (default: one pass)")
    p.add_argument("--lr", type=above(0), default=1e-4)
    p.add_argument("--temperature", type=above(0), default=2.0, help="softmax temperature of the KL loss")
    add_data_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_distill, quantization="none")


def cmd_distill(a: argparse.Namespace) -> int:
    import torch

    from lmserve.spec import distill as D

    if a.quantization not in (None, "none"):
        raise ValueError("quantization: distill prunes the target's float weights: use none")
    if not a.temperature > 0:
        raise ValueError(f"temperature: must be > 0, got {a.temperature}")
    out = Path(a.out)
    if (out / "eagle_config.json").is_file():
        raise ValueError(f"out: {out} holds an EAGLE head; give the distilled model its own folder")
    progress = not a.no_progress
    llm, seqs, collected, _ = target_text(a, out, "distill")
    random.Random(a.train_seed).shuffle(seqs)
    held = held_out(seqs, a.tokens)
    heldout, train_set = seqs[:held], seqs[held:]
    cfg = D.StudentConfig.of(llm.engine.model_config)
    state = D.teacher_state(llm.engine.model, llm.engine.model_config)
    teacher = D.Student(cfg, state)
    t0 = time.perf_counter()
    imp = D.importance(teacher, train_set[:16])
    small, pruned, kept = D.prune(cfg, state, imp, a.num_layers,
                                  cfg.intermediate_size if a.intermediate_size is None else a.intermediate_size,
                                  a.num_kv_heads or cfg.num_kv_heads)
    del teacher
    student = D.Student(small, pruned)
    before = D.perplexity(lambda ids: student(torch.tensor(ids)), heldout)
    # a checkpoint resumes only the same run: its file is named by what shapes the run
    run = dict(layers=a.num_layers, mlp=small.intermediate_size, kv=small.num_kv_heads, steps=a.steps,
               lr=a.lr, t=a.temperature, seed=a.train_seed)
    key = hashlib.sha256(json.dumps(run, sort_keys=True).encode()).hexdigest()[:12]
    ck = out / f"checkpoint-distill-{key}.pt"
    score = lambda ids: llm.score(ids).float().cpu()  # noqa: E731 - the student trains on the CPU
    curve = D.distill(student, train_set, score, a.steps or len(train_set), a.lr, a.temperature, a.train_seed,
                      ck, progress)
    trained = time.perf_counter() - t0
    after = D.perplexity(lambda ids: student(torch.tensor(ids)), heldout)
    target_ppl = D.perplexity(score, heldout)
    params = sum(v.numel() for v in student.state().values())
    tokens = sum(len(s) for s in train_set)
    D.save_student(student, out, llm.tokenizer,
                   {"target": a.model, "kept_layers": kept, "trained_tokens": tokens, "seed": a.train_seed,
                    "heldout_ppl": after, "pruned_ppl": before, "target_ppl": target_ppl})
    plot_curve(curve, out / "loss.png", "KL(target || student) x T^2")
    print(f"distilled {a.model}: layers {kept} of {cfg.num_layers}, {small.intermediate_size} MLP channels, "
          f"{small.num_kv_heads} KV heads; {params / 1e6:.1f}M parameters; {tokens} training tokens, {len(curve)} "
          f"steps; collect {collected:.0f} s, prune + distill {trained:.0f} s; held-out perplexity: target "
          f"{target_ppl:.2f}, pruned {before:.2f}, distilled {after:.2f}; saved to {out}")
    return 0
