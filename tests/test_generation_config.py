"""The model's recommended sampling defaults (lmserve/generation_config.py, vLLM's --generation-config):
read from the checkpoint's generation_config.json, applied to what a request leaves unset on the server
and to LLM.generate without SamplingParams; 'vllm' turns them off; overrides go on top."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from lmserve import LLM, SamplingParams
from lmserve.config import EngineConfig
from lmserve.generation_config import sampling_defaults
from tests.conftest import char_tokenizer_model

RECOMMENDED = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 5, "repetition_penalty": 1.1}
TPL = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<a>"


@pytest.fixture(scope="module")
def folder(tiny_models, tmp_path_factory):  # type: ignore[no-untyped-def]
    """The tiny llama (with a character tokenizer) and a generation_config.json recommending sampling."""
    path = char_tokenizer_model(tiny_models["llama"][0], tmp_path_factory.mktemp("gencfg") / "llama")
    gen = json.loads((path / "generation_config.json").read_text())
    gen |= RECOMMENDED | {"top_p": 0.95, "do_sample": True, "min_p": None, "temperature": 0.6}
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


def test_defaults_read_like_vllm(folder, tiny_models, tmp_path):  # type: ignore[no-untyped-def]
    want = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 5, "repetition_penalty": 1.1}
    cfg = EngineConfig(model=str(folder))
    assert sampling_defaults(cfg) == want
    assert sampling_defaults(dataclasses.replace(cfg, generation_config="vllm")) == {}
    assert sampling_defaults(dataclasses.replace(cfg, override_generation_config={"temperature": 0.2})) == \
        {**want, "temperature": 0.2}
    other = EngineConfig(model=str(tiny_models["qwen2"][0]))  # no sampling in its own file
    assert sampling_defaults(other) == {}
    assert sampling_defaults(dataclasses.replace(other, generation_config=str(folder))) == want
    for bad, field in (({"temprature": 1}, "override_generation_config"), ({"top_p": 2.0}, "generation_config.top_p"),
                       ({"top_k": "20"}, "generation_config.top_k")):
        with pytest.raises(ValueError, match=field):
            sampling_defaults(dataclasses.replace(cfg, override_generation_config=bad))
    with pytest.raises(ValueError, match="generation_config"):
        sampling_defaults(dataclasses.replace(cfg, generation_config=str(folder / "nowhere")))
    (tmp_path / "generation_config.json").write_text(json.dumps(  # transformers' own defaults set nothing
        {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0, "do_sample": True}))
    assert sampling_defaults(dataclasses.replace(cfg, generation_config=str(tmp_path))) == {}


def test_llm_generate_without_params_uses_them(folder):  # type: ignore[no-untyped-def]
    llm = LLM(str(folder), kv_cache_memory="64MiB")
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_p, d.top_k, d.max_tokens) == (0.6, 0.95, 20, 5)
    outs = llm.generate([[5, 17, 33], [7, 8, 9, 10], [40, 41], [100, 3, 9]], use_tqdm=False)
    lens = [len(o.outputs[0].token_ids) for o in outs]
    assert max(lens) == 5, lens  # max_new_tokens (16, SamplingParams' own default, before)
    given = llm.generate([[5, 17, 33]], SamplingParams(max_tokens=9, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(given[0].outputs[0].token_ids) == 9  # SamplingParams given: used as they are
    assert LLM(str(folder), kv_cache_memory="64MiB", generation_config="vllm").get_default_sampling_params() == \
        SamplingParams()


def test_the_server_fills_what_a_body_leaves_unset(folder):  # type: ignore[no-untyped-def]
    pytest.importorskip("fastapi")
    import httpx

    from lmserve.server.app import build_app
    from lmserve.server.async_engine import AsyncEngine
    from lmserve.server.protocol import ChatCompletionRequest, CompletionRequest
    from tests.test_server import serving
    llm = LLM(str(folder), kv_cache_memory="64MiB", chat_template=TPL)
    app = build_app(AsyncEngine(llm.engine), "tiny")
    srv = app.state.server
    p = srv.engine_request([5, 17, 33], CompletionRequest(prompt=[5, 17, 33])).params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (0.6, 0.95, 20, 0.0, 1.1, 5)
    beams = srv.engine_request([5, 17, 33], CompletionRequest(prompt=[5], use_beam_search=True, n=2, max_tokens=9))
    assert beams.params.repetition_penalty == 1.0 and beams.params.max_tokens == 5  # (beams refuse penalties)
    p = srv.engine_request([5, 17, 33], CompletionRequest(prompt=[5], temperature=1.0, top_k=-1, max_tokens=3)).params
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (1.0, -1, 0.95, 3)  # the body's, where it gave them
    p = srv.engine_request([5, 17, 33], ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                                              max_tokens=50)).params
    assert p.max_tokens == 5  # the model's max_new_tokens caps the body's, as vLLM's does
    with serving(app) as (url, _):
        r = httpx.post(url + "/v1/completions", json={"prompt": [5, 17, 33], "max_tokens": 12, "ignore_eos": True},
                       timeout=60).json()
        assert r["usage"]["completion_tokens"] == 5
        resp = httpx.post(url + "/v1/responses", json={"input": "hi", "top_p": 0.5}, timeout=60).json()
        assert (resp["temperature"], resp["top_p"]) == (0.6, 0.5)  # what ran: the model's where unset
    off = build_app(AsyncEngine(LLM(str(folder), kv_cache_memory="64MiB", generation_config="vllm").engine), "tiny")
    p = off.state.server.engine_request([5], CompletionRequest(prompt=[5])).params
    assert (p.temperature, p.top_k, p.max_tokens) == (1.0, -1, 16)


def test_chat_template_flag(tiny_models, tmp_path):  # type: ignore[no-untyped-def]
    """vLLM's --chat-template: a file or the template itself renders every chat (LLM.chat, the server's
    chat route) in place of the checkpoint's; a value that is neither, or does not compile, names the field."""
    from lmserve.server.protocol import ChatMessage
    tpl = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
    f = tmp_path / "t.jinja"
    f.write_text(tpl)
    path = char_tokenizer_model(tiny_models["llama"][0], tmp_path / "llama")  # (a tokenizer with no template)
    for source in (str(f), tpl):
        llm = LLM(str(path), kv_cache_memory="64MiB", chat_template=source)
        assert llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi<a>"
        out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2, temperature=0))
        assert out[0].prompt_token_ids == llm.tokenizer.encode("<user>hi<a>", add_special_tokens=False)
    pytest.importorskip("fastapi")
    from lmserve.server.app import build_app
    from lmserve.server.async_engine import AsyncEngine
    srv = build_app(AsyncEngine(llm.engine), "tiny").state.server
    ids = srv.chat_ids([ChatMessage(role="user", content="yo")], True)
    assert ids == llm.tokenizer.encode("<user>yo<a>", add_special_tokens=False)
    for bad, msg in ((str(tmp_path / "missing.jinja"), "neither a file nor a template"), ("{% for %}", "does not compile")):
        with pytest.raises(ValueError, match=f"chat_template: .*{msg}"):
            LLM(str(path), kv_cache_memory="64MiB", chat_template=bad)
    with pytest.raises(ValueError, match="chat_template: this model has no tokenizer"):
        LLM(str(tiny_models["llama"][0]), kv_cache_memory="64MiB", chat_template=tpl)


def test_a_pool_smaller_than_the_context_still_serves_requests_without_max_tokens(tiny_models, tmp_path):  # type: ignore[no-untyped-def]
    """The default max_tokens is what the context and the KV pool leave (the context's rest alone asked
    for more blocks than the cache has: with a pool smaller than the context every request that left
    max_tokens unset was a 400, chat and Responses included); beams count each of theirs."""
    pytest.importorskip("fastapi")
    import httpx

    from lmserve.kv.cache import KVCache
    from lmserve.models.loader import hf_config
    from lmserve.server.app import build_app
    from lmserve.server.async_engine import AsyncEngine
    from tests.test_server import serving
    path = char_tokenizer_model(tiny_models["llama"][0], tmp_path / "llama")
    per_block = KVCache.bytes_per_block(hf_config(path), 16, torch.float32)
    tpl = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<a>"
    llm = LLM(str(path), kv_cache_memory=per_block * 10, chat_template=tpl, generation_config="vllm")
    eng = llm.engine
    assert eng.max_model_len == 2048 and eng.block_manager.num_blocks == 10  # a pool of 160 tokens
    room = eng.inputs.room
    # the last token generated is never run: 20 + 141 tokens need KV for 160 (before: 140, one short)
    assert room(20) == 141 and room(20, family=2) == 61 and room(160) == 1 and room(161) == 0
    ae = AsyncEngine(eng)
    with serving(build_app(ae, "tiny")) as (url, _):
        r = httpx.post(url + "/v1/completions", json={"prompt": "hello there", "max_tokens": None,
                                                      "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == 161, r.text
        c = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "ignore_eos": True}, timeout=60)
        assert c.status_code == 200 and c.json()["usage"]["total_tokens"] == 161, c.text
        too_long = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 500}, timeout=60)
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
        # a prompt the pool cannot hold at all names the prompt (it named max_tokens, which cannot help)
        big = httpx.post(url + "/v1/completions", json={"prompt": "x" * 161, "max_tokens": 1}, timeout=60)
        assert big.status_code == 400 and big.json()["error"]["param"] == "prompt", big.text
        fits = httpx.post(url + "/v1/completions", json={"prompt": "x" * 159, "max_tokens": 2, "ignore_eos": True},
                          timeout=60)  # 159 + 2 tokens in 160 slots (before: a 400, one block short)
        assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 2, fits.text
    assert eng.block_manager.num_free_blocks == 10


def test_max_tokens_none_is_what_the_context_leaves(tiny_models):  # type: ignore[no-untyped-def]
    """SamplingParams(max_tokens=None) generates up to the context, as vLLM's does (it was refused); one
    params object for prompts of different lengths gives each its own room, and is left unchanged."""
    llm = LLM(str(tiny_models["llama"][0]), kv_cache_memory="16MiB", max_model_len=40)
    params = SamplingParams(max_tokens=None, ignore_eos=True, temperature=0, min_tokens=5)
    outs = llm.generate([[5, 6, 7, 8], list(range(10, 40))], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [36, 10] and params.max_tokens is None
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    beams = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=None, use_beam_search=True, n=2,
                                                        ignore_eos=True), use_tqdm=False)[0]
    assert [len(c.token_ids) for c in beams.outputs] == [36, 36]
    with pytest.raises(ValueError, match="^max_tokens"):
        SamplingParams(max_tokens=0)


def test_generate_and_chat_take_them_under_their_flags(folder, capsys, monkeypatch):  # type: ignore[no-untyped-def]
    """`lmserve generate` / `chat` built their SamplingParams from the flags alone: the model's generation
    config, --generation-config and --override-generation-config were accepted and ignored there. Now a
    flag given wins, then the model's config, then the command's default."""
    from lmserve.cli import main
    base = ["generate", "abc", "--model", str(folder), "--kv-cache-memory", "64MiB", "--ignore-eos", "--json"]

    def length(*extra: str) -> int:
        assert main([*base, *extra]) == 0
        return len(json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"])
    assert length() == 5  # the model's max_new_tokens
    assert length("--max-tokens", "3") == 3  # the flag given
    assert length("--max-tokens", "7") == 5  # capped by the model's max_new_tokens, as on the server
    assert length("--override-generation-config", '{"max_new_tokens": 2}') == 2
    assert length("--generation-config", "vllm") == 64  # generate's own default
    made = []
    real = SamplingParams.__init__

    def spy(self, *a, **kw):  # type: ignore[no-untyped-def]
        real(self, *a, **kw)
        made.append(self)
    monkeypatch.setattr(SamplingParams, "__init__", spy)
    lines = iter(["x", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--model", str(folder), "--kv-cache-memory", "64MiB", "--chat-template", TPL,
                 "--top-k", "3"]) == 0
    p = made[-1]
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.6, 0.95, 3, 5)  # the model's, and the flag
