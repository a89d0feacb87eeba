"""Embeddings (pooling.py, LLM.embed, POST /v1/embeddings) against HF's own final hidden states."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from lmserve import LLM, PoolingParams, SamplingParams

PROMPTS = [[5, 17, 33, 9, 100, 3, 44, 12, 70, 71, 72, 20], [9, 8, 7], list(range(20, 50)), list(range(20, 44)) + [5]]


def hf_states(hf, prompt: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """HF's last_hidden_state (after the final norm) for one prompt: (T, H)."""
    with torch.no_grad():
        return hf.model(torch.tensor([prompt])).last_hidden_state[0].float()


def unit(v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(v, dim=0)


def matryoshka(src: Path, dst: Path, **fields) -> Path:  # type: ignore[no-untyped-def]
    """A copy of a model folder whose config.json says it was trained for Matryoshka embeddings (vLLM's
    is_matryoshka, or the fields given: matryoshka_dimensions=[...])."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(cfg | (fields or {"is_matryoshka": True})))
    return dst


@pytest.mark.parametrize("family", ["llama", "qwen3", "llama_mqa"])
def test_embeddings_match_hf_hidden_states(tiny_models, family, tmp_path):  # type: ignore[no-untyped-def]
    """Last-token and mean pooling, normalised or not, cut to `dimensions`, equal HF's final hidden states
    pooled in float64; prompts prefilled in chunks of 8 tokens, the last two sharing a cached prefix."""
    path, hf = tiny_models[family]
    path = matryoshka(path, tmp_path / family)
    llm = LLM(str(path), kv_cache_memory="64MiB", max_num_batched_tokens=8, block_size=4)
    cases = [PoolingParams(), PoolingParams(pooling_type="mean"), PoolingParams(normalize=False),
             PoolingParams(pooling_type="mean", dimensions=20, normalize=False), PoolingParams(dimensions=16)]
    for pp in cases:
        outs = llm.embed(PROMPTS, pp, use_tqdm=False)
        for prompt, out in zip(PROMPTS, outs):
            h = hf_states(hf, prompt).double()
            v = h[-1] if pp.pooling_type == "last" else h.mean(dim=0)
            v = v[:pp.dimensions] if pp.dimensions else v
            want = unit(v) if pp.normalize else v
            got = torch.tensor(out.outputs.embedding, dtype=torch.float64)
            assert got.shape == want.shape and (got - want).abs().max() < 1e-5, (pp, prompt)
            assert out.prompt_token_ids == prompt
    assert llm.stats().prefix_hit_tokens > 0 and llm.stats().used_blocks == 0


def test_embeddings_and_generation_share_batches(tiny_models):  # type: ignore[no-untyped-def]
    """Embedding and generating requests in the same steps: each gets what it gets alone."""
    path, hf = tiny_models["llama"]
    llm = LLM(str(path), kv_cache_memory="64MiB", max_num_batched_tokens=16, block_size=4)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    alone_gen = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    gen_tokens = llm.stats().generation_tokens
    alone_emb = [o.outputs.embedding for o in llm.embed(PROMPTS, PoolingParams(pooling_type="mean"), use_tqdm=False)]
    st = llm.stats()  # an embedding's throw-away token is no generated token (it counted one each before)
    assert gen_tokens == 8 * len(PROMPTS) and st.generation_tokens == gen_tokens
    assert st.prompt_tokens == 2 * sum(len(p) for p in PROMPTS)
    eng = llm.engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"g{i}", p, params)
        eng.add_request(f"e{i}", p, PoolingParams(pooling_type="mean"))
    done = {}
    steps_with_both = 0
    while eng.has_unfinished_requests():
        kinds = {s.request_id[0] for s in eng.scheduler.running}
        outs = eng.step()
        steps_with_both += kinds == {"g", "e"}
        done.update({o.request_id: o for o in outs if o.finished})
    assert steps_with_both > 0
    for i in range(len(PROMPTS)):
        assert done[f"g{i}"].outputs[0].token_ids == alone_gen[i]
        assert done[f"e{i}"].embedding == pytest.approx(alone_emb[i], abs=1e-6)


def test_an_adapters_embedding_is_the_adapted_models(tiny_models, tmp_path):  # type: ignore[no-untyped-def]
    peft = pytest.importorskip("peft")
    from lmserve import LoRARequest
    from tests.test_lora import make_adapter
    path, hf = tiny_models["llama"]
    pm = make_adapter(hf, tmp_path / "a", seed=4)
    llm = LLM(str(path), kv_cache_memory="64MiB", enable_lora=True)
    out = llm.embed([PROMPTS[0]], lora_request=LoRARequest("a", 1, str(tmp_path / "a")), use_tqdm=False)[0]
    with torch.no_grad():
        h = pm.base_model.model.model(torch.tensor([PROMPTS[0]])).last_hidden_state[0].double()
    assert (torch.tensor(out.outputs.embedding, dtype=torch.float64) - unit(h[-1])).abs().max() < 1e-5
    assert peft is not None


def test_bad_pooling_params_are_refused_naming_the_field(tiny_models, tmp_path):  # type: ignore[no-untyped-def]
    llm = LLM(str(matryoshka(tiny_models["llama"][0], tmp_path / "m")), kv_cache_memory="64MiB")
    for pp, field in ((PoolingParams(dimensions=65), "dimensions"), (PoolingParams(dimensions=0), "dimensions"),
                      (PoolingParams(pooling_type="cls"), "pooling_type"), (PoolingParams(normalize=1), "normalize"),
                      (PoolingParams(truncate_prompt_tokens=0), "truncate_prompt_tokens")):
        with pytest.raises(ValueError, match=f"^{field}"):
            llm.embed([PROMPTS[0]], pp)
    assert len(llm.embed([[1] * 30], PoolingParams(truncate_prompt_tokens=5), use_tqdm=False)[0].prompt_token_ids) == 5
    assert llm.stats().used_blocks == 0


def test_dimensions_only_for_a_model_trained_for_them(tiny_models, tmp_path):  # type: ignore[no-untyped-def]
    """`dimensions` cut any model's embedding; vLLM refuses it unless the model's config says it was trained
    for Matryoshka cuts (is_matryoshka), and keeps it to matryoshka_dimensions when that lists them."""
    plain = LLM(str(tiny_models["llama"][0]), kv_cache_memory="64MiB")
    with pytest.raises(ValueError, match="^dimensions: this model does not support Matryoshka"):
        plain.embed([PROMPTS[0]], PoolingParams(dimensions=16))
    assert len(plain.embed([PROMPTS[0]], use_tqdm=False)[0].outputs.embedding) == 64  # whole: still served
    listed = LLM(str(matryoshka(tiny_models["llama"][0], tmp_path / "m", matryoshka_dimensions=[16, 32])),
                 kv_cache_memory="64MiB")
    with pytest.raises(ValueError, match="^dimensions: this model's embeddings may be cut to 16, 32 only, got 20"):
        listed.embed([PROMPTS[0]], PoolingParams(dimensions=20))
    whole = listed.embed([PROMPTS[0]], PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding
    assert listed.embed([PROMPTS[0]], PoolingParams(dimensions=16, normalize=False), use_tqdm=False)[0] \
        .outputs.embedding == pytest.approx(whole[:16], abs=1e-6)


def test_server_embeddings_route(tiny_models, tmp_path):  # type: ignore[no-untyped-def]
    """The OpenAI SDK's embeddings.create against LLM.embed: texts and token ids, base64, dimensions,
    usage; bad inputs are 400s naming the field, an unknown model a 404."""
    pytest.importorskip("fastapi")
    import httpx
    import openai

    from lmserve.server.app import build_app
    from lmserve.server.async_engine import AsyncEngine
    from tests.conftest import char_tokenizer_model
    from tests.test_server import serving
    model = char_tokenizer_model(matryoshka(tiny_models["llama"][0], tmp_path / "mat"), tmp_path / "m")
    llm = LLM(str(model), kv_cache_memory="64MiB")
    texts = ["Hello there", "general Kenobi", "x"]
    ref = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
    ref_ids = llm.embed([PROMPTS[1]], PoolingParams(pooling_type="mean", dimensions=8), use_tqdm=False)[0].outputs.embedding
    app = build_app(AsyncEngine(llm.engine), "tiny")
    with serving(app) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        r = client.embeddings.create(model="tiny", input=texts)
        assert [d.index for d in r.data] == [0, 1, 2] and r.model == "tiny"
        for d, want in zip(r.data, ref):
            assert d.embedding == pytest.approx(want, abs=1e-6)
        assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(t) for t in texts)
        raw = httpx.post(url + "/v1/embeddings", json={"input": texts[0], "encoding_format": "base64"}).json()
        assert np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4").tolist() == \
            pytest.approx(ref[0], abs=1e-6)
        r = client.embeddings.create(model="tiny", input=PROMPTS[1], dimensions=8, extra_body={"pooling_type": "mean"})
        assert r.data[0].embedding == pytest.approx(ref_ids, abs=1e-6)
        for body, field in (({"input": []}, "input"), ({"input": ["a", ""]}, "input"),
                            ({"input": "a", "dimensions": 65}, "dimensions"), ({"input": [1000]}, "input"),
                            ({"input": "a", "encoding_format": "int8"}, "encoding_format")):
            bad = httpx.post(url + "/v1/embeddings", json=body)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == field, (body, bad.text)
        assert httpx.post(url + "/v1/embeddings", json={"input": "a", "model": "other"}).status_code == 404
        # vLLM's scoring routes on the same embeddings: cosine similarity, and documents ranked by it
        dot = [[float(np.dot(a, b)) for b in ref] for a in ref]
        r = httpx.post(url + "/score", json={"model": "tiny", "text_1": texts[0], "text_2": texts}).json()
        assert [d["index"] for d in r["data"]] == [0, 1, 2]
        assert [d["score"] for d in r["data"]] == pytest.approx(dot[0], abs=1e-5)
        assert r["data"][0]["score"] == pytest.approx(1.0, abs=1e-5)
        r = httpx.post(url + "/v1/score", json={"text_1": texts[:2], "text_2": texts[1:]}).json()
        assert [d["score"] for d in r["data"]] == pytest.approx([dot[0][1], dot[1][2]], abs=1e-5)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            r = httpx.post(url + path, json={"query": texts[1], "documents": texts, "top_n": 2}).json()
            want = sorted(range(3), key=lambda i: -dot[1][i])[:2]
            assert [x["index"] for x in r["results"]] == want and r["results"][0]["document"]["text"] == texts[want[0]]
            assert [x["relevance_score"] for x in r["results"]] == pytest.approx([dot[1][i] for i in want], abs=1e-5)
        assert "document" not in httpx.post(url + "/rerank", json={"query": "a", "documents": ["b"],
                                                                   "return_documents": False}).json()["results"][0]
        for path, body, field in (("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
                                  ("/score", {"text_1": "a", "text_2": []}, "text_2"),
                                  ("/rerank", {"query": "a", "documents": []}, "documents"),
                                  ("/rerank", {"query": "", "documents": ["b"]}, "query"),
                                  ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n")):
            bad = httpx.post(url + path, json=body)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == field, (body, bad.text)
        assert llm.stats().used_blocks == 0


def test_pooling_routes_name_the_field_and_count_as_vllm(tiny_models, tmp_path):  # type: ignore[no-untyped-def]
    """Found by the pooling hunt (each failed before): --max-prompts counts a rerank's documents (a query
    with 4 documents was refused at 4) and names input / documents / text_2 (it said prompt); a text past
    the context, or empty, is named by its own field (text_1's was text_2, a query's documents); a
    mixed-type input is `input` (it was input.str); normalize null is the default; usage counts each
    pair's tokens, /score and /rerank alike (vLLM's count; they disagreed). The library: pooling params as
    a tuple, truncate_prompt_tokens as embed's keyword, SamplingParams refused naming pooling_params, and
    vLLM's score(text, texts) a TypeError instead of a prompt's logits."""
    from starlette.testclient import TestClient

    from lmserve.server.app import build_app
    from lmserve.server.async_engine import AsyncEngine
    from lmserve.server.limits import ServerLimits
    from tests.conftest import char_tokenizer_model
    llm = LLM(str(char_tokenizer_model(tiny_models["llama"][0], tmp_path / "m")), kv_cache_memory="64MiB",
              max_model_len=64)
    long = "w" * 80
    with TestClient(build_app(AsyncEngine(llm.engine), "tiny", limits=ServerLimits(max_prompts=4))) as c:
        assert c.post("/rerank", json={"query": "q", "documents": ["a", "b", "c", "d"]}).status_code == 200
        for path, body, field in (
                ("/v1/embeddings", {"input": ["a", "b", "c", "d", "e"]}, "input"),
                ("/rerank", {"query": "q", "documents": ["a", "b", "c", "d", "e"]}, "documents"),
                ("/score", {"text_1": "q", "text_2": ["a", "b", "c", "d", "e"]}, "text_2"),
                ("/score", {"text_1": "a", "text_2": [long]}, "text_2"), ("/score", {"text_1": long, "text_2": "a"}, "text_1"),
                ("/rerank", {"query": long, "documents": ["a"]}, "query"),
                ("/rerank", {"query": "a", "documents": ["b", long]}, "documents"),
                ("/score", {"text_1": "", "text_2": "b"}, "text_1"), ("/score", {"text_1": ["a", ""], "text_2": ["b", "c"]}, "text_1"),
                ("/v1/embeddings", {"input": [1, "a"]}, "input"), ("/v1/embeddings", {"input": [True]}, "input")):
            r = c.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (path, body, r.text)
        plain = c.post("/v1/embeddings", json={"input": "ab"}).json()["data"][0]["embedding"]
        assert c.post("/v1/embeddings", json={"input": "ab", "normalize": None}).json()["data"][0]["embedding"] == plain
        score = c.post("/score", json={"text_1": "ab", "text_2": ["abc", "abc"]}).json()["usage"]
        rerank = c.post("/rerank", json={"query": "ab", "documents": ["abc", "abc"]}).json()["usage"]
        assert score["prompt_tokens"] == score["total_tokens"] == rerank["total_tokens"] == 2 * (2 + 3)
    ref = llm.embed(["ab", "c"], use_tqdm=False)
    got = llm.embed(["ab", "c"], (PoolingParams(), PoolingParams(normalize=None)), use_tqdm=False)
    assert [o.outputs.embedding for o in got] == [o.outputs.embedding for o in ref]
    assert len(llm.embed(["abcdef"], truncate_prompt_tokens=2, use_tqdm=False)[0].prompt_token_ids) == 2
    for bad in (SamplingParams(max_tokens=2), [PoolingParams()]):
        with pytest.raises(ValueError, match="^pooling_params"):
            llm.embed(["a", "b"], bad, use_tqdm=False)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="^last_only"):
        llm.score("What is it?", ["a text"])  # type: ignore[arg-type]
    assert llm.stats().used_blocks == 0


def test_mean_pooling_through_preemption(tiny_models):  # type: ignore[no-untyped-def]
    """A tight pool (40 blocks of 4) preempts an embedding request mid-prompt and recomputes it: its mean
    pooling still counts each position once (HF's in float64)."""
    from lmserve.kv.cache import KVCache
    from lmserve.models.loader import hf_config
    path, hf = tiny_models["llama"]
    per_block = KVCache.bytes_per_block(hf_config(path), 4, torch.float32)
    llm = LLM(str(path), kv_cache_memory=per_block * 40, block_size=4, max_num_batched_tokens=12,
              enable_prefix_caching=False)
    eng = llm.engine
    gen = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = {f"e{i}": list(range(40 + i, 80 + i)) for i in range(4)}
    for i in range(4):
        eng.add_request(f"g{i}", list(range(10 + i, 30 + i)), gen)
        eng.add_request(f"e{i}", prompts[f"e{i}"], PoolingParams(pooling_type="mean"))
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert any(done[r].metrics.num_preemptions for r in prompts)
    for rid, prompt in prompts.items():
        want = unit(hf_states(hf, prompt).double().mean(dim=0))
        assert (torch.tensor(done[rid].embedding, dtype=torch.float64) - want).abs().max() < 1e-5, rid


def test_an_embedding_may_fill_the_context(tiny_models):  # type: ignore[no-untyped-def]
    """An embedding generates nothing, so its prompt may be max_model_len tokens (vLLM's limit too), and
    truncate_prompt_tokens -1 keeps that many; one more is refused naming the prompt."""
    path, hf = tiny_models["llama"]
    llm = LLM(str(path), kv_cache_memory="64MiB", max_model_len=32)
    full = list(range(10, 42))  # 32 tokens
    got = llm.embed([full], use_tqdm=False)[0].outputs.embedding
    assert (torch.tensor(got, dtype=torch.float64) - unit(hf_states(hf, full).double()[-1])).abs().max() < 1e-5
    cut = llm.embed([list(range(5, 45))], PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert cut.prompt_token_ids == list(range(13, 45))
    with pytest.raises(ValueError, match="^prompt"):
        llm.embed([full + [3]])
    with pytest.raises(ValueError, match="^prompt"):  # a generating request still needs room for a token
        llm.generate([full], SamplingParams(max_tokens=1))
    assert llm.stats().used_blocks == 0


def test_server_embeds_a_conversation(tiny_models, tmp_path):  # type: ignore[no-untyped-def]
    """vLLM's chat-form /v1/embeddings: `messages` go through the chat template (HF's render of the same
    template is the reference), with vLLM's defaults (no generation prompt, no added BOS) and each of them
    when asked; a body with both or neither of input and messages, or its own template on a server that
    does not trust one, is a 400 naming the field."""
    pytest.importorskip("fastapi")
    import json

    import httpx
    import transformers

    from lmserve.server.app import build_app
    from lmserve.server.async_engine import AsyncEngine
    from tests.conftest import char_tokenizer_model
    from tests.test_server import serving
    model = char_tokenizer_model(tiny_models["llama"][0], tmp_path / "m")
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "\x01",
                                                             "add_bos_token": True}))
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model / "tokenizer.json"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    llm = LLM(str(model), kv_cache_memory="64MiB")

    def want(add_generation_prompt: bool, bos: bool) -> list[float]:
        text = hf_tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                          add_generation_prompt=add_generation_prompt)
        ids = [1] * bos + hf_tok(text, add_special_tokens=False)["input_ids"]
        return llm.embed([ids], use_tqdm=False)[0].outputs.embedding
    plain, with_prompt, with_bos = want(False, False), want(True, False), want(False, True)
    assert plain != pytest.approx(with_prompt, abs=1e-4) and plain != pytest.approx(with_bos, abs=1e-4)
    app = build_app(AsyncEngine(llm.engine), "tiny")
    with serving(app) as (url, _):
        def embed(**extra):  # type: ignore[no-untyped-def]
            r = httpx.post(url + "/v1/embeddings", json={"messages": messages, **extra})
            assert r.status_code == 200, r.text
            return r.json()
        r = embed()
        assert r["data"][0]["embedding"] == pytest.approx(plain, abs=1e-6) and len(r["data"]) == 1
        assert r["usage"]["prompt_tokens"] == len(hf_tok.apply_chat_template(messages, chat_template=template,
                                                                             tokenize=False))
        assert embed(add_generation_prompt=True)["data"][0]["embedding"] == pytest.approx(with_prompt, abs=1e-6)
        assert embed(add_special_tokens=True)["data"][0]["embedding"] == pytest.approx(with_bos, abs=1e-6)
        for body, field in (({"input": "a", "messages": messages}, "input"), ({}, "input"),
                            ({"messages": []}, "messages"),
                            ({"messages": messages, "chat_template": "{{ 'x' }}"}, "chat_template"),
                            ({"messages": [{"role": "user"}]}, "messages.content")):
            bad = httpx.post(url + "/v1/embeddings", json=body)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == field, (body, bad.text)
    assert llm.stats().used_blocks == 0
