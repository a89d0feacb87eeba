"""Benches run end to end on a tiny model (no timing asserted): JSON schema, HF and naive baselines, plots."""

from __future__ import annotations

import json

import pytest

from lmserve.cli import main
from tests.conftest import FailOnCall, char_tokenizer_model


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


def test_figures_are_printed_before_their_file_is_written(tiny_models, tmp_path, monkeypatch, capsys):  # type: ignore[no-untyped-def]
    """bench and eval printed their figures only after writing the JSON: a file that could not be written
    lost a whole run's figures; the default folder (bench_out/) was never checked before the run."""
    from lmserve.bench import common
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bench_out").write_text("a file where the folder would be")
    for argv in (["bench", "latency"], ["bench", "throughput"], ["eval", "perplexity", "--text", "x"]):
        assert main(argv) == 2, argv  # before any model loads
        assert "output_json (default bench_out/): bench_out is a file" in capsys.readouterr().err
    (tmp_path / "bench_out").unlink()

    def full_disk(path, payload):  # type: ignore[no-untyped-def]
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(common, "write_json", full_disk)
    assert main(["bench", "latency", "--model", str(tiny_models["llama"][0]), "--batch-size", "1", "--input-len", "4",
                 "--output-len", "3", "--repeats", "1", "--no-progress", "--kv-cache-memory", "64MiB"]) == 2
    out, err = capsys.readouterr()
    assert "TPOT p50" in out and "No space left on device" in err


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


def test_bench_serve_wall_ends_with_the_run_and_itl_is_per_choice(monkeypatch):  # type: ignore[no-untyped-def]
    """Requests answered at once: the wall time is the arrival gaps between the requests, not one more gap
    after the last (before, req/s and tok/s divided by it too); a stream whose n = 2 choices interleave
    has ITL per choice (before, the gap between two choices' chunks, ~0, counted as an ITL)."""
    import asyncio
    import random

    from lmserve.bench import serve

    async def instant(client, url, model, req, headers):  # type: ignore[no-untyped-def]
        return serve.ServeResult(ok=True, ttft=0.0, e2e=0.0, completion_tokens=1)

    monkeypatch.setattr(serve, "_one", instant)
    reqs = [serve.ServeRequest([5, 6], 4) for _ in range(3)]
    def gaps_of(seed: int) -> list[float]:  # run_serve's arrival gaps for this seed
        rng = random.Random(seed + 1)
        return [rng.expovariate(4.0) for _ in range(3)]

    seed = next(s for s in range(200) if gaps_of(s)[2] > 0.4 and sum(gaps_of(s)[:2]) < 0.6)
    gaps = gaps_of(seed)
    _, wall = asyncio.run(serve.run_serve("http://x", "m", reqs, 4.0, seed, progress=False))
    assert abs(wall - (gaps[0] + gaps[1])) < 0.1 < gaps[2] - 0.3

    # two choices' chunks, alternating, 10 ms apart per pair
    pairs = [(0.01 if i == 0 else 0.0, {"choices": [{"index": i, "text": "x"}]}) for _ in range(4) for i in (0, 1)]
    usage = (0.0, {"choices": [], "usage": {"completion_tokens": 8, "prompt_tokens": 2}})
    monkeypatch.undo()
    res = asyncio.run(serve._one(streaming_client([*pairs, usage]), "http://x", "m", serve.ServeRequest([5, 6], 4, n=2),
                                 {}))
    assert res.ok and len(res.itl) == 6 and min(res.itl) > 0.005  # 3 gaps per choice, each ~10 ms


def streaming_client(chunks: list[tuple[float, dict]]):  # type: ignore[no-untyped-def]
    """An httpx-like client whose one stream sends each chunk as an SSE data line after its delay (s),
    then [DONE]."""
    import json
    import time

    class Stream:
        status_code = 200

        async def __aenter__(self):  # type: ignore[no-untyped-def]
            return self

        async def __aexit__(self, *a):  # type: ignore[no-untyped-def]
            return None

        async def aiter_lines(self):  # type: ignore[no-untyped-def]
            for delay, chunk in chunks:
                time.sleep(delay)
                yield "data: " + json.dumps(chunk)
            yield "data: [DONE]"

    class Client:
        def stream(self, *a, **k):  # type: ignore[no-untyped-def]
            return Stream()
    return Client()


def test_bench_serve_times_every_token_chunk_and_the_runs_own_hit_rate(monkeypatch):  # type: ignore[no-untyped-def]
    """A chunk whose text is empty (a special token, or text held for a character's next bytes) is a token
    step, as vLLM's benchmark times it: they were skipped (TTFT moved to the first text, a 1-token request
    with empty text failed 'no tokens streamed'). The prefix-cache hit rate is the run's own: the counters'
    difference (it was the server's lifetime rate)."""
    import asyncio

    from lmserve.bench import serve

    def client(texts: list[str]):  # type: ignore[no-untyped-def]
        return streaming_client([(0.02, {"choices": [{"index": 0, "text": t}]}) for t in texts])

    res = asyncio.run(serve._one(client(["", "a", "", "b"]), "http://x", "m", serve.ServeRequest([5], 4), {}))
    assert res.ok and len(res.itl) == 3 and res.ttft < 0.035 and min(res.itl) > 0.015, (res.ttft, res.itl)
    res = asyncio.run(serve._one(client([""]), "http://x", "m", serve.ServeRequest([5], 1), {}))
    assert res.ok and res.error is None

    text = "\n".join(['# HELP x', 'lmserve_prefix_cache_hit_tokens_total 30.0',
                      'lmserve_prefix_cache_queries_total 100.0', 'vllm:prefix_cache_hits_total{model_name="m"} 30.0'])

    class Answer:
        def __init__(self, text: str) -> None:
            self.text = text
    import httpx
    monkeypatch.setattr(httpx, "get", lambda *a, **k: Answer(text))
    before = serve._scrape_prefix_counts("http://x", {})
    assert before == (30.0, 100.0)
    text = text.replace("100.0", "140.0")  # 40 more tokens looked up, none hit
    assert serve.prefix_hit_rate(before, serve._scrape_prefix_counts("http://x", {})) == 0.0
    text = 'vllm:prefix_cache_hits_total{model_name="m"} 50.0\nvllm:prefix_cache_queries_total{model_name="m"} 150.0'
    assert serve.prefix_hit_rate((30.0, 100.0), serve._scrape_prefix_counts("http://x", {})) == 0.4  # vLLM's names


def test_bench_flags_out_of_range_are_the_flags_errors(tiny_models, tmp_path, capsys):  # type: ignore[no-untyped-def]
    """bench spec --batch-sizes 0 was a ZeroDivisionError, --threads -1 a RuntimeError out of torch, an
    --output-json under a file a FileExistsError after the whole run: each is exit status 2 naming it."""
    import pytest
    path, _ = tiny_models["llama"]
    assert main(["bench", "spec", "--model", str(path), "--methods", "none", "--batch-sizes", "0,1",
                 "--num-prompts", "1", "--max-tokens", "4"]) == 2
    assert "batch_sizes" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["bench", "throughput", "--model", str(path), "--preset", "tiny", "--threads", "-1"])
    assert e.value.code == 2 and "--threads" in capsys.readouterr().err
    blocker = tmp_path / "afile"
    blocker.write_text("")
    assert main(["bench", "throughput", "--model", str(path), "--preset", "tiny", "--no-progress",
                 "--output-json", str(blocker / "x.json")]) == 2
    assert "output_json" in capsys.readouterr().err
    assert main(["quantize", "--model", str(path), "--calib", str(blocker), "--out", str(blocker)]) == 2
    assert "out: " in capsys.readouterr().err


def test_bench_parallel_counts_the_prompt_once_when_shared(tiny_models, tmp_path):  # type: ignore[no-untyped-def]
    """n = 4 samples of a 40-token prompt: the shared request computes the prompt once (40 tokens; the
    three forked children each run the fork-point token, the prompt's last, themselves: 43), four separate
    requests four times (160); a sequence's last output token is never fed, which the count took for
    prompt tokens not computed (39 and 156 before)."""
    path, _ = tiny_models["llama"]
    out = tmp_path / "par.json"
    assert main(["bench", "parallel", "--model", str(path), "--n", "4", "--prompt-len", "40", "--max-tokens", "6",
                 "--output-json", str(out)]) == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["shared"]["prompt_tokens_computed"] == 40 + 3 and rows["separate"]["prompt_tokens_computed"] == 160


def test_bench_serve_says_why_its_server_did_not_start(capsys):  # type: ignore[no-untyped-def]
    """A launched server that exits (a bad --launch-args flag) was 'did not become healthy' with its
    stderr thrown away; the error now names the flag and shows the server's last lines."""
    assert main(["bench", "serve", "--launch-args=--bogus-flag", "--num-requests", "1"]) == 2
    err = capsys.readouterr().err
    assert "launch_args" in err and "exited with status 2" in err and "--bogus-flag" in err


def test_bench_serve_launch_args_split_as_a_shell_does(monkeypatch):  # type: ignore[no-untyped-def]
    """--launch-args was split on spaces: a quoted value (a chat template, a path with a space) reached
    the server in pieces. Unbalanced quotes are an error naming the flag."""
    from lmserve.bench import serve as bench_serve
    seen = []

    class Exited:  # a server that exits at once: launch_server raises, after the command is made
        returncode = 2

        def __init__(self, cmd, **kw):  # type: ignore[no-untyped-def]
            seen.append(cmd)

        def poll(self):  # type: ignore[no-untyped-def]
            return 2

        def kill(self):  # type: ignore[no-untyped-def]
            pass

        def wait(self):  # type: ignore[no-untyped-def]
            return 2
    monkeypatch.setattr(bench_serve.subprocess, "Popen", Exited)
    with pytest.raises(ValueError, match="exited with status 2"):
        bench_serve.launch_server("m", "--chat-template '{{ a }} {{ b }}' --max-num-seqs 4")
    assert seen[0][-4:] == ["--chat-template", "{{ a }} {{ b }}", "--max-num-seqs", "4"]
    with pytest.raises(ValueError, match="launch_args: No closing quotation"):
        bench_serve.launch_server("m", "--chat-template '{{ a }}")


def test_a_benchmark_whose_requests_fail_raises(tiny_models):  # type: ignore[no-untyped-def]
    """A step that raises ends its requests with finish_reason 'error' and generate returns normally: the
    throughput and latency runs counted them (a tiny or zero tok/s reported as a result; latency died
    later with a KeyError). Now they raise with the error, and the engine is left empty."""
    from lmserve import LLM
    from lmserve.bench.common import random_workload
    from lmserve.bench.offline import run_latency, run_throughput
    path, _ = tiny_models["llama"]
    llm = LLM(str(path))
    boom = llm.engine.runner.forward = FailOnCall(llm.engine.runner.forward, 3, RuntimeError("injected fault"))
    work = random_workload(num_requests=4, input_len=(4, 8), output_len=(4, 8), vocab_size=100, seed=0)
    with pytest.raises(RuntimeError, match="injected fault"):
        run_throughput(llm, work, progress=False)
    boom.calls = 0
    with pytest.raises(RuntimeError, match="injected fault"):
        run_latency(llm, 2, 8, 8, repeats=1, peak_bandwidth=1e9)
    assert not llm.engine.has_unfinished_requests() and llm.stats().used_blocks == 0


def test_bench_spec_acceptance_by_position_is_each_rows_own(tiny_models, tmp_path):  # type: ignore[no-untyped-def]
    """bench spec's per-position acceptance of a row counts that row's runs alone: the batch-2 row of a
    "1,2" run (two prompts; the batch-1 row ran one) equals the one row of a "2" run
    (before, every row reported the engine's cumulative figures since its start); a model without a
    tokenizer is refused naming it (it was an AttributeError)."""
    path = char_tokenizer_model(tiny_models["llama"][0], tmp_path / "chars")
    assert main(["bench", "spec", "--model", str(tiny_models["llama"][0]), "--methods", "none",
                 "--batch-sizes", "1", "--num-prompts", "1", "--max-tokens", "4"]) == 2

    def rows(sizes: str) -> list[dict]:
        out = tmp_path / f"spec-{sizes}.json"
        assert main(["bench", "spec", "--model", str(path), "--methods", "ngram", "--batch-sizes", sizes,
                     "--num-prompts", "1", "--max-tokens", "24", "--kv-cache-memory", "16MiB",
                     "--spec-min-acceptance", "0", "--output-json", str(out)]) == 0
        return json.loads(out.read_text())["rows"]
    both, alone = rows("1,2"), rows("2")
    assert [r["batch"] for r in both] == [1, 2] and alone[0]["proposed"] > 0
    assert both[1]["acceptance_by_position"] == pytest.approx(alone[0]["acceptance_by_position"])
