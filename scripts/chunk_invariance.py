"""How much a prompt's logprobs move between prefill chunks of 512 and 256 tokens (BENCHMARKS.md:
session 21). LMSERVE_ISA=avx2 for float inputs; edit deterministic=True into LLM() for that mode."""
import sys, os
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from lmserve import LLM, SamplingParams
p = open(__import__("pathlib").Path(__file__).resolve().parents[1] / "tests" / "data" / "declaration_gettysburg.txt").read()[:3500] + " Four score and seven years ago"
sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
res = {}
for mnbt in (512, 256):
    llm = LLM(max_num_batched_tokens=mnbt)
    res[mnbt] = [x.logprob for x in llm.generate([p], sp, use_tqdm=False)[0].prompt_logprobs[1:]]
    llm.close(); del llm
d = [abs(a - b) for a, b in zip(res[512], res[256])]
first = next((i for i, x in enumerate(d) if x > 1e-4), None)
print(os.environ.get("LMSERVE_ISA", "default"), "tokens", len(d), "max |chunk512 - chunk256|", max(d), "first position differing > 1e-4:", None if first is None else first + 1)
