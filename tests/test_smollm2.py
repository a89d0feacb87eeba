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


PREFILL = [{"role": "user", "content": "Write the word hello."}, {"role": "assistant", "content": "Sure, the word is"}]


def test_continue_final_message_renders_as_hf(hf_ref, llm):  # type: ignore[no-untyped-def]
    """vLLM's continue_final_message (an assistant prefill) renders as HF's apply_chat_template does,
    in LLM.chat, /tokenize and /v1/chat/completions (it was ignored: the prefill was closed with
    <|im_end|>, or a new assistant turn opened after it); with add_generation_prompt it is refused."""
    from starlette.testclient import TestClient

    from lmserve.server.app import build_app
    from lmserve.server.async_engine import AsyncEngine
    hf_tok = hf_ref[0]
    want = hf_tok.apply_chat_template(PREFILL, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert want.endswith("Sure, the word is")
    ids = llm.tokenizer.encode(want, add_special_tokens=False)
    out = llm.chat(PREFILL, SamplingParams(max_tokens=1), add_generation_prompt=False, continue_final_message=True)
    assert out[0].prompt_token_ids == ids
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(PREFILL, SamplingParams(max_tokens=1), continue_final_message=True)
    with TestClient(build_app(AsyncEngine(llm.engine), "smollm2-135m")) as c:
        flags = {"add_generation_prompt": False, "continue_final_message": True}
        assert c.post("/tokenize", json={"messages": PREFILL, **flags}).json()["tokens"] == ids
        r = c.post("/v1/chat/completions", json={"messages": PREFILL, "max_tokens": 3, **flags})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids)
        r = c.post("/v1/chat/completions", json={"messages": PREFILL, "max_tokens": 3, "continue_final_message": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_text_parts_are_joined_with_newlines(llm):  # type: ignore[no-untyped-def]
    """Content given as text parts is the parts joined with newlines (vLLM's rule) in LLM.chat (a raw
    jinja TypeError before; Gemma's template printed the Python list) and on the server (joined with
    nothing before); a part that is not text is a ValueError naming the message."""
    from starlette.testclient import TestClient

    from lmserve.server.app import build_app
    from lmserve.server.async_engine import AsyncEngine
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}]
    joined = [{"role": "user", "content": "Hello\nworld"}]
    want = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(joined), add_special_tokens=False)
    assert llm.chat(parts, SamplingParams(max_tokens=1))[0].prompt_token_ids == want
    with pytest.raises(ValueError, match=r"messages\[0\].content"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with TestClient(build_app(AsyncEngine(llm.engine), "smollm2-135m")) as c:
        assert c.post("/tokenize", json={"messages": parts}).json()["tokens"] == want


def test_llm_chat_takes_chat_template_kwargs(llm):  # type: ignore[no-untyped-def]
    """vLLM's LLM.chat(chat_template_kwargs={...}) gives the template those variables (they reached it
    as one variable named chat_template_kwargs)."""
    tpl = "{% for m in messages %}{{ m['content'] }}{% endfor %}[flag={{ flag }}]"
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=1), chat_template=tpl,
                   chat_template_kwargs={"flag": "X"})[0]
    assert llm.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False) == "Hi[flag=X]"
