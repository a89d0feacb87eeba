"""Prefill / decode disaggregation: a prompt's KV blocks move from one engine to another as raw bytes
(kv/transfer.py) and land in the receiver's prefix cache; behind the router (`--prefill`), a request
prefilled on one process and decoded on another gives the colocated tokens, greedy and seeded."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
import torch

from lmserve import LLM
from lmserve.kv.transfer import HEADER, export_prefix, import_prefix
from lmserve.sequence import SamplingParams
from tests.test_server import free_port, wait_healthy

PROMPT = [5, 9, 13, 7, 21, 3, 44, 8, 17, 4, 99, 100, 3, 61, 62, 70, 71, 72, 30, 31, 40, 41, 50, 51, 52, 53, 54, 55,
          56, 57, 58, 59, 60, 61, 2, 3, 4, 5, 6, 7]  # 40 tokens: two full blocks and a tail
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def test_blocks_moved_between_engines_are_prefix_hits_with_the_same_tokens(tiny_models):
    folder = str(tiny_models["llama"][0])
    with LLM(folder, kv_cache_memory="16MiB") as a, LLM(folder, kv_cache_memory="16MiB") as b:
        want = a.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        payload = export_prefix(a.engine, PROMPT)
        assert len(payload) == HEADER.size + 8 * 32 + 2 * 2 * 32 * 2 * 16 * 4  # 2 layers, K/V, 32 tokens, 2 x 16 fp32
        assert import_prefix(b.engine, payload) == 2
        assert import_prefix(b.engine, payload) == 0  # already cached: nothing written twice
        out = b.generate([PROMPT], GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want
        assert b.stats().prefix_hit_tokens == 32  # the two moved blocks, not recomputed
        # the moved KV is the KV: corrupt it and the output changes
        with LLM(folder, kv_cache_memory="16MiB") as c:
            bad = bytearray(payload)
            bad[-4096:] = bytes(4096)
            import_prefix(c.engine, bytes(bad))
            assert c.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids != want


def test_a_salted_prompts_blocks_move_under_its_salt(tiny_models):
    """A cache_salt request's blocks are exported under its salted hashes and registered under them: the
    same salted request hits them on the receiver, an unsalted or other-salt one does not (before, the
    export looked the prompt up unsalted and moved nothing)."""
    from lmserve.sequence import block_salt
    folder = str(tiny_models["llama"][0])
    salted = {"prompt_token_ids": PROMPT, "cache_salt": "tenant-a"}
    with LLM(folder, kv_cache_memory="16MiB") as a, LLM(folder, kv_cache_memory="16MiB") as b:
        want = a.generate([salted], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        salt = block_salt(None, a.engine.process_request(salted).cache_salt)
        assert salt is not None and len(export_prefix(a.engine, PROMPT)) == HEADER.size + 0  # nothing unsalted
        assert import_prefix(b.engine, export_prefix(a.engine, PROMPT, salt=salt)) == 2
        other = b.generate([{"prompt_token_ids": PROMPT, "cache_salt": "tenant-b"}, PROMPT], GREEDY, use_tqdm=False)
        assert [o.metrics.num_cached_tokens for o in other] == [0, 0]
        out = b.generate([salted], GREEDY, use_tqdm=False)[0]
        assert out.metrics.num_cached_tokens == 32 and out.outputs[0].token_ids == want


def test_a_transfer_that_does_not_fit_is_refused_by_field(tiny_models):
    with LLM(str(tiny_models["llama"][0]), kv_cache_memory="16MiB") as a, \
            LLM(str(tiny_models["llama"][0]), kv_cache_memory="16MiB", block_size=32) as b, \
            LLM(str(tiny_models["qwen3"][0]), kv_cache_memory="16MiB") as q:
        a.generate([PROMPT], GREEDY, use_tqdm=False)
        payload = export_prefix(a.engine, PROMPT)
        with pytest.raises(ValueError, match="block_size 16 does not match this instance's 32"):
            import_prefix(b.engine, payload)
        with pytest.raises(ValueError, match="kv_heads 2 does not match this instance.s 1"):
            import_prefix(q.engine, payload)
        with pytest.raises(ValueError, match="payload length"):
            import_prefix(a.engine, payload[:-1])
        with pytest.raises(ValueError, match="magic"):
            import_prefix(a.engine, b"XXXX" + payload[4:])
        with pytest.raises(ValueError, match="shorter than its header"):
            import_prefix(a.engine, b"LMKV")
        poisoned = bytearray(payload)
        poisoned[-4:] = torch.tensor([float("nan")]).numpy().tobytes()
        with LLM(str(tiny_models["llama"][0]), kv_cache_memory="16MiB") as fresh:
            with pytest.raises(ValueError, match="non-finite"):
                import_prefix(fresh.engine, bytes(poisoned))
            assert fresh.stats().cached_blocks == 0  # nothing of a refused transfer is written
            assert import_prefix(fresh.engine, payload) == 2 and fresh.stats().cached_blocks == 2


# ---------------------------------------------------------------- two processes behind the router

SECRET = "test-kv-secret"


def _serve(folder: str, *flags: str, secret: str | None = SECRET) -> tuple[subprocess.Popen, str]:
    port = free_port()
    extra = ["--kv-secret", secret] if secret and "--role" in flags else []
    proc = subprocess.Popen([sys.executable, "-m", "lmserve.cli", "serve", "--model", folder, "--port", str(port),
                             "--kv-cache-memory", "16MiB", *flags, *extra], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    return proc, f"http://127.0.0.1:{port}"


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


@pytest.fixture(scope="module")
def pair(tiny_models, tmp_path_factory):  # type: ignore[no-untyped-def]
    """A decode instance and a prefill instance allowed to push to it (two processes), on the tiny Llama
    with a character tokenizer (a token is a character: text compares token for token)."""
    pytest.importorskip("uvicorn")
    from tests.conftest import char_tokenizer_model
    folder = str(char_tokenizer_model(tiny_models["llama"][0], tmp_path_factory.mktemp("disagg") / "chars"))
    dec, dec_url = _serve(folder, "--role", "decode")
    pre, pre_url = _serve(folder, "--role", "prefill", "--kv-peer", dec_url)
    try:
        wait_healthy(dec_url, dec)
        wait_healthy(pre_url, pre)
        yield folder, pre_url, dec_url
    finally:
        for p in (pre, dec):
            p.kill()
            p.wait()


def test_disaggregated_output_equals_colocated_token_for_token(pair):
    from lmserve.router.app import build_router_app
    from lmserve.router.policy import Replica, Router
    from tests.test_server import serving
    folder, pre_url, dec_url = pair
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    with LLM(folder, kv_cache_memory="16MiB") as colocated:
        outs = colocated.generate([PROMPT, PROMPT], [GREEDY, seeded], use_tqdm=False)
        want = [o.outputs[0].text for o in outs]
        assert len(set(outs[0].outputs[0].token_ids)) > 3 and want[0] != want[1]
    hits_before = _metric(httpx.get(dec_url + "/metrics").text, "lmserve_prefix_cache_hit_tokens")
    router = Router([Replica(dec_url)], "least-load")
    with serving(build_router_app(router, health_interval=0.2, prefill=Router([Replica(pre_url)], "least-load"))) \
            as (url, _):
        got = []
        for extra in ({"temperature": 0}, {"temperature": 0.9, "top_p": 0.95, "seed": 7}):
            r = httpx.post(url + "/v1/completions", timeout=60, json={
                "prompt": PROMPT, "max_tokens": 16, "ignore_eos": True, **extra})
            assert r.status_code == 200, r.text
            got.append(r.json())
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True}) as s:
            chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
        router_metrics = httpx.get(url + "/metrics").text
    decode_metrics = httpx.get(dec_url + "/metrics").text
    assert [g["choices"][0]["text"] for g in got] == want  # one character per token: token for token
    assert "".join(c["choices"][0]["text"] for c in chunks) == got[0]["choices"][0]["text"]
    assert _metric(router_metrics, 'lmserve_router_prefills_total{outcome="pushed"}') == 3
    # the decode instance computed only the tails: 2 of each prompt's 2.5 blocks came from the prefill
    assert _metric(decode_metrics, "lmserve_prefix_cache_hit_tokens") - hits_before >= 3 * 32


def test_only_peers_holding_the_secret_move_kv(pair, tiny_models):
    from lmserve.server import disagg
    folder, pre_url, dec_url = pair
    body = {"prompt": PROMPT, "max_tokens": 4}
    r = httpx.post(pre_url + "/v1/completions", json=body, headers={"x-lmserve-kv-push": "http://evil:80"})
    assert r.status_code == 403 and "--kv-peer" in r.json()["error"]["message"]
    with LLM(folder, kv_cache_memory="16MiB") as a:
        fresh = [11 + (i * 7) % 100 for i in range(36)]  # no block of it is on the decode instance yet
        a.generate([fresh], GREEDY, use_tqdm=False)
        payload = export_prefix(a.engine, fresh)
        for secret in (None, "wrong"):  # a planted block would serve every request with that prefix
            r = httpx.post(dec_url + "/v1/internal/kv", content=payload,
                           headers={"x-lmserve-kv-secret": secret} if secret else {})
            assert r.status_code == 403 and "x-lmserve-kv-secret" in r.json()["error"]["message"]
        r = httpx.post(dec_url + "/v1/internal/kv", content=payload[:-8], headers={"x-lmserve-kv-secret": SECRET})
        assert r.status_code == 400 and "payload length" in r.json()["error"]["message"]
        r = httpx.post(dec_url + "/v1/internal/kv", content=payload, headers={"x-lmserve-kv-secret": SECRET})
        assert r.status_code == 200 and r.json() == {"registered_blocks": 2}
        # an ordinary instance neither prefills for others nor takes KV; a role needs the secret
        srv = type("Srv", (), {})()
        with pytest.raises(ValueError, match="--kv-secret"):
            disagg.register(None, srv, "decode", engine=a.engine)  # type: ignore[arg-type]
        disagg.register(None, srv, "both")  # type: ignore[arg-type]
        assert srv.role == "both" and srv.kv_peers == ()


def test_kv_of_other_weights_or_a_windowed_model_is_refused(tiny_models, tmp_path):  # type: ignore[no-untyped-def]
    """A tiny Llama of the same shape with other weights, and the same checkpoint quantized to int8: the
    header's fingerprint tells them apart (before, the other model's blocks were taken: wrong tokens).
    A sliding-window model takes no part (before, a prompt past the window made a 500: its blocks out of
    the window are the null block)."""
    from tests.conftest import make_tiny
    from lmserve.kv.transfer import check_engine
    folder = str(tiny_models["llama"][0])
    make_tiny("llama", tmp_path / "other", seed=7)
    with LLM(folder, kv_cache_memory="16MiB") as a, LLM(str(tmp_path / "other"), kv_cache_memory="16MiB") as b, \
            LLM(folder, kv_cache_memory="16MiB", quantization="int8") as q:
        a.generate([PROMPT], GREEDY, use_tqdm=False)
        payload = export_prefix(a.engine, PROMPT)
        for other in (b, q):
            with pytest.raises(ValueError, match="fingerprint"):
                import_prefix(other.engine, payload)
            assert other.stats().cached_blocks == 0
        with LLM(folder, kv_cache_memory="16MiB") as same:  # a second load of the same weights: taken
            assert import_prefix(same.engine, payload) == 2
    with LLM(str(tiny_models["mistral"][0]), kv_cache_memory="16MiB") as w:
        with pytest.raises(ValueError, match="sliding window"):
            check_engine(w.engine)
