"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against HF transformers loading the same file."""

from __future__ import annotations


import pytest
import torch

from lmserve import SamplingParams
from lmserve.models.loader import resolve_model

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Here is a short poem about the sea:\n",
    "Water boils at a temperature of",
]


@pytest.fixture(scope="module")
def hf_ref():  # type: ignore[no-untyped-def]
    """HF's own GGUF loader and tokenizer (dequantizes the same file; conftest.hf_from_gguf): loaded once."""
    pytest.importorskip("transformers")
    from tests.conftest import hf_from_gguf
    return hf_from_gguf(resolve_model("smollm2-135m").path, torch_dtype=torch.float32, attn_implementation="eager")


@pytest.fixture(scope="module")
def llm(smol):  # type: ignore[no-untyped-def]
    return smol


def test_tokenizer_matches_hf(hf_ref, llm):  # type: ignore[no-untyped-def]
    tok, _ = hf_ref
    texts = PROMPTS + ["Hello world 12345, héllo! 日本語 🙂\n\n  tabs\tand  spaces",
                       "<|im_start|>user\nhi<|im_end|>", " leading space", "don't won't 3.14159"]
    for t in texts:
        assert llm.tokenizer.encode(t) == tok(t).input_ids, t
        ids = tok(t).input_ids
        assert llm.tokenizer.decode(ids, skip_special_tokens=False) == tok.decode(ids), t
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert llm.tokenizer.apply_chat_template(msgs) == tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)


def test_logits_match_hf(hf_ref, llm):  # type: ignore[no-untyped-def]
    tok, model = hf_ref
    ids = tok(PROMPTS[2]).input_ids
    ours = llm.score(ids)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max().item() < 1e-3


def test_greedy_matches_hf(hf_ref, llm):  # type: ignore[no-untyped-def]
    tok, model = hf_ref
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt).input_ids
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                 eos_token_id=None, pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref, prompt
        assert out.outputs[0].text == tok.decode(ref, skip_special_tokens=True)


def test_beam_search_matches_hf(hf_ref, llm):  # type: ignore[no-untyped-def]
    tok, model = hf_ref
    for prompt in PROMPTS[:3]:
        ids = tok(prompt).input_ids
        out = llm.generate([ids], SamplingParams(use_beam_search=True, n=2, best_of=3, max_tokens=16),
                           use_tqdm=False)[0]
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), num_beams=3, num_return_sequences=2, do_sample=False,
                                 max_new_tokens=16, pad_token_id=tok.pad_token_id, early_stopping=False)
        eos = tok.eos_token_id
        rows = []
        for row in ref[:, len(ids):].tolist():
            rows.append(row[: row.index(eos) + 1] if eos in row else row)
        assert [o.token_ids for o in out.outputs] == rows, prompt
