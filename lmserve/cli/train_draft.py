"""`lmserve train-draft --method eagle`: train an EAGLE-style draft head for the target model (spec/eagle.py).

Data: the target's own answers to a prompt set (built in: PROMPTS and spec/prompts.builtin_prompts(),
3,722 requests; or --prompts-file, one per line; plus --self-prompts requests the target writes itself),
greedy by default (what a greedy draft must imitate; --sample-temperature samples them, seeded) until
--tokens tokens, the target's features caught from the steps that write them (spec/target_text.py);
10% of the sequences are held out (they get a teacher-forced pass, for the target's greedy labels).
Everything lands in --out: the collected token ids and features (data.json, features.pt, reused on a
rerun with the same model, engine options, budget, seed and prompts), the training checkpoint
(checkpoint-eagle-<hash of the run's options>.pt: resumed only by the same run on that data), the head
(model.safetensors + eagle_config.json) and the loss curve (loss.png, with matplotlib). The head drafts
from the --draft-vocab most frequent tokens of the training text (its read-out then costs that fraction
of the LM head; exactness does not depend on it), and is trained as it drafts: --chain tokens ahead from
every position, each from its own previous prediction (spec/eagle.chain_forward). The held-out report
gives the one-token agreement and the chained acceptance a greedy verification would see. Budget and
time for the default model: BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from pathlib import Path
from typing import Any

from lmserve.cli.engine_args import add_engine_args, engine_kwargs
from lmserve.utils import above, at_least

PROMPTS = [
    "Explain how a refrigerator keeps food cold.", "Write a short poem about the sea.",
    "What are three tips for learning a new language?", "Summarize the plot of a detective story you invent.",
    "How do vaccines train the immune system?", "Give me a recipe for a simple vegetable soup.",
    "Why is the sky blue?", "Describe a busy market in the morning.", "What is a prime number? Give examples.",
    "Write a polite email asking for a meeting next week.", "How does a bicycle stay upright?",
    "List some good habits for a productive day.", "Tell a short story about a lost dog finding its way home.",
    "What causes the seasons on Earth?", "Explain recursion to a beginner programmer.",
    "Compare cats and dogs as pets.", "What should I pack for a weekend hiking trip?",
    "How do plants make their food?", "Write a dialogue between a teacher and a curious student.",
    "What is the difference between weather and climate?", "Give advice for a first job interview.",
    "Describe how bread is made.", "Why do we need sleep?", "Explain what a budget is and how to make one.",
    "Write a product description for a reusable water bottle.", "How do airplanes fly?",
    "What are some ways to reduce stress?", "Explain the water cycle.", "Write a thank-you note to a friend.",
    "What makes a good story?", "How does the internet send a message from one computer to another?",
    "Describe your ideal weekend.",
]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("train-draft", help="train a draft for speculative decoding (an EAGLE-style head)")
    p.add_argument("--method", default="eagle", choices=["eagle"])
    p.add_argument("--out", required=True, help="folder for the head, its data, checkpoint and loss curve")
    p.add_argument("--steps", type=at_least(1), default=None, help="training steps, a sequence each (default: one pass)")
    p.add_argument("--lr", type=above(0), default=1e-3)
    add_data_args(p)
    p.add_argument("--draft-vocab", type=at_least(0), default=4096,
                   help="draft only from the N most frequent tokens of the collected text (0: the whole vocabulary)")
    p.add_argument("--chain", type=at_least(1), default=3,
                   help="train on this many chained drafts from every position (1: EAGLE-1's one-step loss)")
    add_engine_args(p)
    p.set_defaults(func=cmd_train_draft)


def target_text(a: argparse.Namespace, out: Path, what: str, features: bool = False
                ) -> tuple[Any, list[list[int]], float, list[Any] | None]:
    """(the target LLM, the target's own texts as token id lists, seconds spent collecting them, and with
    `features` the target's features of each text caught while it wrote it (spec/target_text.collect),
    else None): the --prompts-file (or built-in) prompts, plus --self-prompts requests the target writes itself,
    continued by the target until --tokens tokens, cached in out/data.json (and out/features.pt) (a
    rerun with the same model, budget, seed and prompts reuses them; a new collection drops
    out/checkpoint*.pt, the training checkpoints, which would not resume exactly on other data)."""
    import torch

    from lmserve.llm import LLM
    from lmserve.spec.target_text import collect, self_prompts

    if a.tensor_parallel_size > 1:
        raise ValueError(f"tensor_parallel_size: {what} reads the whole target's weights and outputs: use 1")
    from lmserve.spec.prompts import builtin_prompts, topic_prompts, vocabulary_topics
    builtin = PROMPTS + builtin_prompts()
    prompts = [p for p in (Path(a.prompts_file).read_text().splitlines() if a.prompts_file else builtin) if p.strip()]
    if not prompts:
        raise ValueError(f"prompts_file: {a.prompts_file} has no prompt")
    if a.self_prompts < 0:
        raise ValueError(f"self_prompts: must be >= 0, got {a.self_prompts}")
    if a.vocab_topics < 0:
        raise ValueError(f"vocab_topics: must be >= 0, got {a.vocab_topics}")
    out.mkdir(parents=True, exist_ok=True)
    # features are caught from the steps that write the text: every position must be computed
    llm = LLM(a.model, **{**engine_kwargs(a), **({"enable_prefix_caching": False} if features else {})})
    if llm.tokenizer is None:
        raise ValueError(f"model: {a.model!r} has no tokenizer to write prompts with")
    data, feats_file = out / "data.json", out / "features.pt"
    t0 = time.perf_counter()
    key = {"model": a.model, "tokens": a.tokens, "seed": a.train_seed, "max_new_tokens": a.max_new_tokens,
           "prompts": hashlib.sha256("\n".join(prompts).encode()).hexdigest(), "temperature": a.sample_temperature,
           "self_prompts": a.self_prompts, "vocab_topics": a.vocab_topics,
           "engine": {k: str(v) for k, v in sorted(engine_kwargs(a).items())}}  # (the dtype, quantization, ...)
    feats = None
    if data.is_file() and json.loads(data.read_text()).get("key") == key:  # a rerun: the same data
        seqs = json.loads(data.read_text())["seqs"]
        if features and feats_file.is_file():
            feats = torch.load(feats_file)
    else:
        if a.vocab_topics:  # two requests about each of N subjects read from the tokenizer's vocabulary
            topics = vocabulary_topics(llm.tokenizer.convert_ids_to_tokens(list(range(llm.tokenizer.vocab_size))))
            prompts = prompts + topic_prompts(topics[:a.vocab_topics], 2, a.train_seed)
        if a.self_prompts:
            prompts = prompts + self_prompts(llm, a.self_prompts, a.train_seed)
        feats = [] if features else None
        seqs = collect(llm, prompts, a.tokens, a.train_seed, a.max_new_tokens, not a.no_progress,
                       a.sample_temperature, features=feats)
        data.write_text(json.dumps({"key": key, "seqs": seqs}))
        if feats is not None:
            torch.save(feats, feats_file)
        for ck in out.glob("checkpoint*.pt"):
            ck.unlink()
    return llm, seqs, time.perf_counter() - t0, feats


def held_out(seqs: list[list[int]], tokens: int) -> int:
    """How many of the (shuffled) sequences are held out: a tenth, at least one, leaving some to train on."""
    held = max(1, len(seqs) // 10)
    if len(seqs) <= held:
        raise ValueError(f"tokens: {tokens} tokens gave {len(seqs)} sequence(s): too few to hold one out and "
                         f"train on the rest")
    return held


def add_data_args(p: Any) -> None:
    p.add_argument("--tokens", type=at_least(1), default=50_000,
                   help="token budget of the collected text (times of a measured run: BENCHMARKS.md)")
    p.add_argument("--max-new-tokens", type=at_least(1), default=256, help="length of each collected continuation")
    p.add_argument("--sample-temperature", type=at_least(0, float), default=0.0,
                   help="temperature of the collected answers (0: greedy, each prompt once; > 0: sampled, seeded, "
                        "prompts reused until the budget)")
    p.add_argument("--prompts-file", default=None, help="prompts, one per line (default: a built-in set)")
    p.add_argument("--self-prompts", type=int, default=0,
                   help="add this many requests the target writes itself (sampled; spec/target_text.self_prompts)")
    p.add_argument("--vocab-topics", type=int, default=0,
                   help="add two requests about each of N subjects read from the tokenizer's vocabulary "
                        "(spec/prompts.vocabulary_topics: far more subjects than the built-in 128)")
    p.add_argument("--train-seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")


def cmd_train_draft(a: argparse.Namespace) -> int:
    import torch

    from lmserve.spec import eagle

    if a.chain < 1:
        raise ValueError(f"chain: must be >= 1, got {a.chain}")
    out = Path(a.out)
    if (out / "config.json").is_file():
        raise ValueError(f"out: {out} holds a model (a distilled draft?); give the EAGLE head its own folder")
    progress = not a.no_progress
    llm, seqs, collected, feats = target_text(a, out, "train-draft", features=True)
    order = list(range(len(seqs)))
    random.Random(a.train_seed).shuffle(order)
    seqs = [seqs[i] for i in order]
    held = held_out(seqs, a.tokens)
    lm_head = eagle.float_head(llm.engine.model)  # (V, H)
    heldout = [eagle.example(llm, s) for s in seqs[:held]]  # teacher-forced: with the target's greedy labels
    if feats is not None:  # the features caught while the target wrote the text
        feats = [feats[i] for i in order]
        train_set = [eagle.Example(f, llm.engine.model.embed(torch.tensor(s[:-1])).float())
                     for s, f in zip(seqs[held:], feats[held:])]
    else:  # data collected before features were kept: a teacher-forced pass each
        train_set = [eagle.example(llm, s) for s in seqs[held:]]
    torch.manual_seed(a.train_seed)
    head = eagle.EagleHead(eagle.EagleConfig.for_target(llm.engine.model_config, a.model))
    if a.draft_vocab > 0:  # drafts (and the training read-out) from the most frequent tokens only
        head.draft_vocab = eagle.frequent_vocab(seqs[held:], a.draft_vocab, tuple(llm.tokenizer.eos_token_ids))
    readout = lm_head if head.draft_vocab is None else lm_head[head.draft_vocab]  # (V', H)
    before = eagle.agreement(head, heldout, lm_head)
    t1 = time.perf_counter()
    # a checkpoint resumes only the same run: its file is named by what shapes the run
    steps = a.steps or len(train_set)
    run = dict(steps=steps, lr=a.lr, chain=a.chain, draft_vocab=a.draft_vocab, seed=a.train_seed)
    ck = out / f"checkpoint-eagle-{hashlib.sha256(json.dumps(run, sort_keys=True).encode()).hexdigest()[:12]}.pt"
    curve = eagle.train(head, train_set, readout, steps, a.lr, a.train_seed, ck, progress, chain=a.chain)
    trained = time.perf_counter() - t1
    after = eagle.agreement(head, heldout, lm_head)
    chained = eagle.chain_acceptance(head, heldout, lm_head, max(4, a.chain))
    tokens = sum(len(s) for s in seqs[held:])
    head.cfg = eagle.EagleConfig(**{**head.cfg.__dict__, "trained_tokens": tokens, "seed": a.train_seed})
    head.save(out, {"heldout_agreement": after, "untrained_agreement": before, "heldout_chain_acceptance": chained})
    plot_curve(curve, out / "loss.png")
    print(f"eagle head for {a.model}: {tokens} training tokens ({len(train_set)} sequences), {len(curve)} steps; "
          f"collect {collected:.0f} s, train {trained:.0f} s; held-out next-token agreement with the target "
          f"{before:.1%} -> {after:.1%}; chained greedy drafts accepted (step 1..{len(chained)}) "
          + " ".join(f"{x:.1%}" for x in chained) + f", {1 + sum(chained):.2f} tokens a verification; saved to {out}")
    return 0


def plot_curve(curve: list[tuple[int, float]], path: Path, ylabel: str = "feature + 0.1 token loss") -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    steps, loss = zip(*curve) if curve else ((), ())
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, loss, lw=0.8)
    ax.set_xlabel("step (one sequence)")
    ax.set_ylabel(ylabel)
    ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
