"""`--compare llamacpp`: the flags, the clear errors (not a GGUF model, llama-cpp-python missing) before any
model loads, and, only where llama_cpp imports, a tiny run on the default GGUF (no timing asserted)."""

from __future__ import annotations

import sys

import pytest

from lmserve.bench.common import latency_prompts, random_workload
from lmserve.cli import build_parser, main


@pytest.mark.parametrize("cmd", ["latency", "throughput"])
def test_flags(cmd):  # type: ignore[no-untyped-def]
    a = build_parser().parse_args(["bench", cmd, "--compare", "llamacpp", "--compare", "hf", "--threads", "2"])
    assert a.compare == ["llamacpp", "hf"] and a.threads == 2
    assert build_parser().parse_args(["bench", cmd]).threads is None


@pytest.mark.parametrize("cmd", ["latency", "throughput"])
def test_non_gguf_model_is_a_clear_error(cmd, tmp_path, capsys, monkeypatch):  # type: ignore[no-untyped-def]
    (tmp_path / "config.json").write_text("{}")  # an HF folder as resolve_model sees it; never loaded
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # the model check comes first, installed or not
    assert main(["bench", cmd, "--model", str(tmp_path), "--compare", "llamacpp", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--compare llamacpp needs a GGUF model" in err and "HF" in err
    assert main(["bench", cmd, "--model-shape", "qwen3-0.6b", "--compare", "llamacpp"]) == 2
    assert "random-weight shape" in capsys.readouterr().err


@pytest.mark.parametrize("cmd", ["latency", "throughput"])
def test_missing_package_is_a_clear_error(cmd, tmp_path, capsys, monkeypatch):  # type: ignore[no-untyped-def]
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")  # the check runs before anything reads the file
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    assert main(["bench", cmd, "--model", str(gguf), "--compare", "llamacpp", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "llama-cpp-python" in err and "pip install llama-cpp-python==0.3.36" in err
    assert "-DGGML_NATIVE=OFF" in err


def test_latency_prompts_are_what_the_latency_bench_drew():  # type: ignore[no-untyped-def]
    import random
    rng = random.Random(3)
    old = [[[rng.randrange(10, 500) for _ in range(5)] for _ in range(2)] for _ in range(3)]
    assert latency_prompts(500, 2, 5, 2, seed=3) == old


def test_tiny_run_on_the_default_gguf():  # type: ignore[no-untyped-def]
    llama_cpp = pytest.importorskip("llama_cpp")
    from lmserve.bench import llamacpp
    try:
        path = llamacpp.gguf_path("smollm2-135m")
    except FileNotFoundError:
        pytest.skip("the default model's wheel is not installed")
    rounds = latency_prompts(49152, 1, 8, 1)
    lat = llamacpp.latency(llama_cpp, path, rounds, output_len=5, n_threads=1)
    assert lat["output_tokens"] == 5 and lat["ttft_s"] > 0 and lat["tpot_s"] > 0 and lat["tokens_per_s"] > 0
    assert lat["llama_cpp_version"] == llama_cpp.__version__ and lat["system_info"]
    reqs = random_workload(2, (4, 8), (3, 6), 49152, seed=1)
    tp = llamacpp.throughput(llama_cpp, path, reqs, 0.6, n_threads=1)
    assert tp["output_tokens"] == sum(r.max_tokens for r in reqs) and tp["sequential"]
    assert "one at a time" in tp["note"] and tp["output_tokens_per_s"] > 0
