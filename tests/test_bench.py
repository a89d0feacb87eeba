"""Benches run end to end on a tiny model (no timing asserted): JSON schema, HF and naive baselines, plots."""

from __future__ import annotations

import json

from lmserve.cli import main


def test_throughput_json_with_hf_baseline(tiny_models, tmp_path, capsys):  # type: ignore[no-untyped-def]
    path, _ = tiny_models["qwen2"]
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--model", str(path), "--preset", "tiny", "--compare", "hf",
                 "--hf-batch-size", "4", "--output-json", str(out), "--no-progress", "--plot"]) == 0
    r = json.loads(out.read_text())
    assert r["bench"] == "throughput" and r["workload"]["num_requests"] == 6
    ours = r["lmserve"]
    for key in ("output_tokens_per_s", "total_tokens_per_s", "requests_per_s", "peak_kv_blocks_used",
                "prefix_cache_hit_rate", "preemptions", "ttft_s", "tpot_s"):
        assert key in ours
    assert ours["output_tokens"] > 0
    assert 0 < ours["peak_kv_blocks_used"] <= ours["kv_blocks_total"]
    hf = r["baselines"]["hf"]
    assert hf["output_tokens"] == ours["output_tokens"]  # same requests, same useful lengths
    assert hf["lmserve_speedup"] > 0
    meta = r["meta"]
    assert meta["versions"]["torch"] and "args" in meta and meta["args"]["model"] == str(path)
    assert out.with_suffix(".png").stat().st_size > 1000
    assert "lmserve:" in capsys.readouterr().out


def test_latency_with_naive_curve(tiny_models, tmp_path):  # type: ignore[no-untyped-def]
    path, _ = tiny_models["llama"]
    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--model", str(path), "--batch-size", "2", "--input-len", "8",
                 "--output-len", "6", "--repeats", "2", "--compare", "hf", "--compare", "naive",
                 "--naive-max-len", "48", "--output-json", str(out), "--plot", "--no-progress"]) == 0
    r = json.loads(out.read_text())
    lat = r["lmserve"]
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        assert set(lat[key]) >= {"mean", "p50", "p90", "p99"}
    assert lat["bandwidth_fraction"] > 0 and lat["weight_bytes"] > 0
    naive = r["baselines"]["naive"]
    assert len(naive["lengths"]) == len(naive["naive_s_per_token"]) == len(naive["cached_s_per_token"])
    assert r["baselines"]["hf"]["tpot_s"] > 0
    assert out.with_name(out.stem + "-naive.png").is_file()


def test_hf_latency_times_the_first_token_inside_the_run(monkeypatch):  # type: ignore[no-untyped-def]
    """TTFT comes from the measured generate() itself (a streamer at each token), so a slow separate
    1-token run cannot make TTFT exceed the whole run and TPOT negative (seen: TPOT -65 ms for a 1,024-
    token prompt). A fake model whose clock we set: prompt, first token at 50 ms, then 10 ms a token."""
    from lmserve.bench import hf as hf_bench
    now = [0.0]
    monkeypatch.setattr(hf_bench.time, "perf_counter", lambda: now[0])

    class Fake:
        calls = 0

        def generate(self, input_ids, max_new_tokens, min_new_tokens, streamer=None, **kw):  # type: ignore[no-untyped-def]
            Fake.calls += 1
            if Fake.calls == 3:  # a second, separate 1-token run would be this slow
                now[0] += 5.0
            if streamer is not None:
                streamer.put(input_ids)
            for i in range(max_new_tokens):
                now[0] += 0.05 if i == 0 else 0.01
                if streamer is not None:
                    streamer.put(None)
            if streamer is not None:
                streamer.end()

    r = hf_bench.hf_latency(Fake(), [1, 2, 3], batch_size=1, output_len=8, device="cpu")
    assert abs(r["ttft_s"] - 0.05) < 1e-9 and abs(r["tpot_s"] - 0.01) < 1e-9 and abs(r["total_s"] - 0.12) < 1e-9
    assert Fake.calls == 2  # the warm-up and the measured run: no separate 1-token run


def test_hf_latency_streams_a_batch_with_real_transformers(tiny_models):  # type: ignore[no-untyped-def]
    """transformers' generate() hands the streamer each step's tokens at any batch size: one measured
    run, no separate 1-token run (which the fallback would add as a third generate call)."""
    import transformers as tf

    from lmserve.bench.hf import hf_latency
    model = tf.AutoModelForCausalLM.from_pretrained(str(tiny_models["llama"][0])).eval()
    calls: list[int] = []
    real = model.generate
    model.generate = lambda **kw: calls.append(kw["max_new_tokens"]) or real(**kw)  # type: ignore[method-assign]
    r = hf_latency(model, [5, 9, 2, 7], batch_size=2, output_len=6, device="cpu")
    assert calls == [2, 6] and 0 < r["ttft_s"] < r["total_s"] and r["tpot_s"] > 0
