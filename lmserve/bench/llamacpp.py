"""The llama.cpp baseline (`--compare llamacpp`): llama-cpp-python on the same GGUF file our engine loads,
fed the same prompt token ids (never text), greedy for latency, exactly N tokens per request (its
`generate` never stops on EOS by itself; we stop it after N tokens).

llama-cpp-python is an optional extra, imported only when asked for; it runs one sequence at a time
(no continuous batching), so a batch or a workload runs request after request."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from lmserve.bench.common import Request, percentiles

INSTALL = 'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON" pip install llama-cpp-python==0.3.36'
SEQUENTIAL = "llama-cpp-python has no continuous batching: requests ran one at a time"


def gguf_path(model: str) -> Path:
    """The GGUF file behind `model` (a known name, a .gguf file, a folder holding one); else a clear error."""
    from lmserve.models.loader import resolve_model
    src = resolve_model(model)
    if src.kind != "gguf":
        what = "a random-weight shape" if src.kind == "shape" else "an HF (safetensors) folder"
        raise ValueError(f"--compare llamacpp needs a GGUF model (llama.cpp loads GGUF files only); "
                         f"{model!r} is {what}")
    return src.path


def import_llama_cpp() -> Any:
    """`import llama_cpp`, or a clear error saying how to install it."""
    try:
        import llama_cpp
    except (ImportError, OSError, RuntimeError) as e:  # not installed, or its shared library fails to load
        raise ValueError(f"--compare llamacpp needs the optional package llama-cpp-python ({e}); "
                         f"install it with: {INSTALL}") from e
    return llama_cpp


def check(model: str) -> tuple[Any, Path]:
    """Everything that can fail before a long run does: the model is a GGUF, llama_cpp imports."""
    path = gguf_path(model)
    return import_llama_cpp(), path


def library_info(llama_cpp: Any) -> dict[str, str]:
    info = llama_cpp.llama_print_system_info()
    return {"llama_cpp_version": llama_cpp.__version__,
            "system_info": (info.decode() if isinstance(info, bytes) else str(info)).strip()}


def _open(llama_cpp: Any, path: Path, n_ctx: int, n_threads: int, seed: int) -> tuple[Any, float]:
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                          n_batch=512, seed=seed, verbose=False, logits_all=False)
    return llm, time.perf_counter() - t0


def _check_vocab(llm: Any, prompts: list[list[int]]) -> None:
    top = max((max(p) for p in prompts if p), default=-1)
    if top >= llm.n_vocab():
        raise ValueError(f"llama.cpp's vocabulary has {llm.n_vocab()} tokens but a prompt holds id {top}")


def _close(llm: Any) -> None:
    if hasattr(llm, "close"):
        llm.close()


def generate_timed(llm: Any, prompt: list[int], max_tokens: int, temperature: float = 0.0
                   ) -> tuple[float, float, int]:
    """One request: (seconds to the first token, seconds to the last, tokens generated). The whole prompt
    is evaluated (reset: no prefix reuse from the request before); EOS does not stop it."""
    llm.reset()
    t0 = time.perf_counter()
    first = 0.0
    n = 0
    if max_tokens > 0:
        for _ in llm.generate(prompt, temp=temperature, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                              repeat_penalty=1.0):
            n += 1
            if n == 1:
                first = time.perf_counter() - t0
            if n >= max_tokens:
                break
    return first, time.perf_counter() - t0, n


def latency(llama_cpp: Any, path: Path, rounds: list[list[list[int]]], output_len: int, n_threads: int,
            seed: int = 0) -> dict[str, Any]:
    """`bench latency` on llama.cpp: rounds[0] warms up, each later round is a batch of prompts, run one
    prompt after another (greedy, output_len tokens each). TTFT, TPOT and tokens/s as the HF row has
    them (p50 over all measured prompts), with the percentiles beside."""
    n_ctx = max(len(p) for r in rounds for p in r) + output_len + 1
    llm, load_s = _open(llama_cpp, path, n_ctx, n_threads, seed)
    try:
        _check_vocab(llm, [p for r in rounds for p in r])
        for p in rounds[0]:
            generate_timed(llm, p, min(output_len, 4))
        ttfts: list[float] = []
        tpots: list[float] = []
        batch_s: list[float] = []
        tokens = 0
        for batch in rounds[1:]:
            total = 0.0
            for p in batch:
                ttft, e2e, n = generate_timed(llm, p, output_len)
                ttfts.append(ttft)
                tpots.append((e2e - ttft) / max(1, n - 1))
                total += e2e
                tokens += n
            batch_s.append(total)
    finally:
        _close(llm)
    batch_size = len(rounds[-1])
    total_p50 = percentiles(batch_s)["p50"]
    tpot = percentiles(tpots)["p50"]
    return {"ttft_s": percentiles(ttfts)["p50"], "tpot_s": tpot, "total_s": total_p50,
            "tokens_per_s": batch_size * output_len / total_p50, "decode_tokens_per_s": 1 / tpot,
            "ttft_percentiles_s": percentiles(ttfts), "tpot_percentiles_s": percentiles(tpots),
            "output_tokens": tokens, "batch_size": batch_size, "sequential": batch_size > 1,
            "note": SEQUENTIAL if batch_size > 1 else "batch 1", "load_time_s": load_s,
            "n_threads": n_threads, "n_ctx": n_ctx, "model_path": str(path)} | library_info(llama_cpp)


def throughput(llama_cpp: Any, path: Path, requests: list[Request], temperature: float, n_threads: int,
               seed: int = 0, progress: bool = False) -> dict[str, Any]:
    """`bench throughput` on llama.cpp: the workload's requests one at a time, each exactly its max_tokens
    (the same sampling as ours: temperature, no top-k / top-p / min-p)."""
    n_ctx = max(len(r.prompt) + r.max_tokens for r in requests) + 1
    llm, load_s = _open(llama_cpp, path, n_ctx, n_threads, seed)
    bar = None
    try:
        _check_vocab(llm, [r.prompt for r in requests])
        generate_timed(llm, requests[0].prompt[:16], 2, temperature)  # warm-up
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(requests), desc="llama.cpp", unit="req", leave=False)
        ttfts: list[float] = []
        tpots: list[float] = []
        out_tokens = 0
        t0 = time.perf_counter()
        for r in requests:
            ttft, e2e, n = generate_timed(llm, r.prompt, r.max_tokens, temperature)
            out_tokens += n
            ttfts.append(ttft)
            if n > 1:
                tpots.append((e2e - ttft) / (n - 1))
            if bar is not None:
                bar.update(1)
        wall = time.perf_counter() - t0
    finally:
        if bar is not None:
            bar.close()
        _close(llm)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    return {"wall_s": wall, "num_requests": len(requests), "prompt_tokens": prompt_tokens,
            "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / wall,
            "total_tokens_per_s": (out_tokens + prompt_tokens) / wall, "requests_per_s": len(requests) / wall,
            "ttft_s": percentiles(ttfts), "tpot_s": percentiles(tpots), "sequential": True, "note": SEQUENTIAL,
            "load_time_s": load_s, "n_threads": n_threads, "n_ctx": n_ctx, "model_path": str(path)
            } | library_info(llama_cpp)
