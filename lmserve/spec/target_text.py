"""The target's own text from a prompt set, the data the learned drafts train on (`lmserve train-draft`,
`lmserve distill`): `collect` has the target answer requests (and with `features`, keeps the features
of every position from the steps that wrote them, FeatureRecorder: no second pass over the text);
`self_prompts` has it write requests itself, for variety the built-in templates lack (spec/prompts.py
holds the prompt sets and the held-out benchmark prompts they leave out).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from lmserve.spec.prompts import ASKS, CHAT, TOPICS, names_a_held_out_subject


def collect(llm: Any, prompts: list[str], budget: int, seed: int, max_tokens: int = 256,
            progress: bool = True, temperature: float = 0.0, chunk: int = 128,
            features: list[torch.Tensor] | None = None) -> list[list[int]]:
    """Texts the target writes itself: each prompt (through the chat template when the tokenizer has one)
    and the target's answer, until `budget` tokens; token id lists, in a seeded order of the prompts.
    temperature 0: greedy answers, each prompt at most once (a repeat would be the same text);
    > 0: sampled (top-p 0.95, seeded per request), the prompts reused round after round until the
    budget. Generated `chunk` requests at a time, so no more is written than the budget needs.
    features: a list that receives, per text, the target's features (T - 1, H) of all its positions but
    the last (which generation never runs), caught from the steps that wrote it (FeatureRecorder): no
    second pass over the text; the engine must not serve positions from its prefix cache then."""
    from lmserve.sequence import SamplingParams
    if not temperature >= 0:
        raise ValueError(f"sample_temperature: must be >= 0, got {temperature}")
    rng = random.Random(seed)
    tok = llm.tokenizer
    out: list[list[int]] = []
    total, round_ = 0, 0
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=budget, desc="collect", unit="tok")
    recorder = FeatureRecorder(llm) if features is not None else None
    try:
        while total < budget and (temperature > 0 or round_ == 0):
            order = prompts[:]
            rng.shuffle(order)
            for lo in range(0, len(order), chunk):
                ids = [tok.request_ids(p) for p in order[lo:lo + chunk]]
                params = [SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                         top_p=0.95 if temperature else 1.0,
                                         seed=seed * 100003 + round_ * 997 + lo + i) for i in range(len(ids))]
                for prompt, o in zip(ids, llm.generate(ids, params, use_tqdm=False)):
                    seq = prompt + o.outputs[0].token_ids
                    if recorder is not None:
                        features.append(recorder.take(o.request_id, len(seq) - 1))  # type: ignore[union-attr]
                    out.append(seq)
                    total += len(seq)
                    if bar is not None:
                        bar.update(len(seq))
                    if total >= budget:
                        break
                if recorder is not None:
                    recorder.rows.clear()
                if total >= budget:
                    break
            round_ += 1
    finally:
        if recorder is not None:
            recorder.close()
        if bar is not None:
            bar.close()
    return out


class FeatureRecorder:
    """The target's features of every position an engine computes, caught from its steps (the runner's
    output carries the step's final hidden states, flattened in the step's order), kept per request by
    position: what `features` computes in a teacher-forced prefill, here from the generation itself."""

    def __init__(self, llm: Any) -> None:
        if llm.engine.config.enable_prefix_caching:
            raise ValueError("enable_prefix_caching: positions served from the prefix cache are never computed, "
                             "so their features cannot be caught: collect features with it off")
        self.runner = llm.engine.runner
        self.rows: dict[str, dict[int, torch.Tensor]] = {}  # request id -> position -> feature (H,)
        self.real = self.runner.execute

        def execute(out: Any) -> Any:
            res = self.real(out)
            start = 0
            for seq, n in out.scheduled:
                got = self.rows.setdefault(seq.request_id, {})
                rows = res.hidden[start:start + n].float().clone()  # (n, H): one copy a sequence a step
                for j in range(n):
                    got[seq.num_computed_tokens + j] = rows[j]
                start += n
            return res
        self.runner.execute = execute

    def take(self, request_id: str, n: int) -> torch.Tensor:
        """The request's features of positions 0..n-1 (n, H) (each computed: a hole is an error)."""
        got = self.rows.pop(request_id, {})
        missing = [p for p in range(n) if p not in got]
        if missing:
            raise RuntimeError(f"request {request_id}: no feature caught for positions {missing[:5]}...")
        return torch.stack([got[p] for p in range(n)])

    def close(self) -> None:
        self.runner.execute = self.real


def self_prompts(llm: Any, n: int, seed: int, batch: int = 256) -> list[str]:
    """n distinct user requests written by the target itself: ASKS (a topic filled in where asked)
    through its chat template, answers sampled (temperature 0.9, no top-p: its sort over the
    vocabulary cost ~40% more time here; seeded) up to their first line break, each kept when 15-300
    characters long, not one of the benchmark's chat prompts (CHAT) and naming none of their subjects.
    Deterministic for a model, n and seed."""
    from lmserve.sequence import SamplingParams
    tok = llm.tokenizer
    rng = random.Random(seed)
    held_out = {c.strip().lower() for c in CHAT}
    out: list[str] = []
    seen: set[str] = set()
    round_ = 0
    while len(out) < n and round_ < 50:
        asks = [rng.choice(ASKS).format(t=rng.choice(TOPICS)) for _ in range(batch)]
        ids = [tok.request_ids(a) for a in asks]
        params = [SamplingParams(max_tokens=64, temperature=0.9, stop=["\n"],  # the first line only
                                 seed=seed * 7919 + round_ * batch + i) for i in range(batch)]
        for o in llm.generate(ids, params, use_tqdm=False):
            text = o.outputs[0].text.strip().strip('"').strip()
            if 15 <= len(text) <= 300 and text.lower() not in held_out and not names_a_held_out_subject(text) \
                    and text not in seen:
                seen.add(text)
                out.append(text)
                if len(out) == n:
                    break
        round_ += 1
    return out
