"""Offline chained acceptance of EAGLE heads on the speculation benchmark's held-out chat prompts: the
target's greedy answers (96 tokens) to spec/prompts.CHAT, then eagle.chain_acceptance over the answer
rows (drafts 1..4 all accepted), for each head given. BENCHMARKS.md, issue #21.

    python scripts/eagle_chat_acceptance.py HEAD [HEAD ...]
"""

from __future__ import annotations

import sys

from lmserve import LLM, SamplingParams
from lmserve.bench.spec import task_prompts
from lmserve.spec import eagle


def main(heads: list[str]) -> None:
    llm = LLM()
    prompts = task_prompts(llm.tokenizer, 16, "chat")
    outs = llm.generate(prompts, SamplingParams(max_tokens=96, temperature=0), use_tqdm=False)
    lm = eagle.float_head(llm.engine.model)
    examples = []
    for p, o in zip(prompts, outs):
        e = eagle.example(llm, list(p) + list(o.outputs[0].token_ids))
        a = len(p) - 1  # the row whose next token is the answer's first
        examples.append(eagle.Example(e.feats[a:], e.embeds[a:], e.labels[a:], e.tokens[a:]))
    for h in heads:
        acc = eagle.chain_acceptance(eagle.load_head(h), examples, lm, 4)
        print(h, "drafts 1..s accepted:", " / ".join(f"{x:.1%}" for x in acc))


if __name__ == "__main__":
    main(sys.argv[1:])
