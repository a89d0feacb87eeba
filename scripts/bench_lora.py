"""What LoRA adapters cost: output tokens/s of the base model, of every request on one adapter, and of
requests spread over four adapters, at batch 1 and 8, in one process, the cases interleaved round
after round (a noisy machine's drift lands on all alike); per case the median over rounds and the
median of each round's ratio to the base model. The adapters are random (PEFT's file format written
directly: rank --rank on q/k/v/o/gate/up/down), since only their shapes decide the cost.

    python scripts/bench_lora.py [--model smollm2-135m] [--rank 16] [--rounds 3] [--output-len 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmserve import LLM, LoRARequest, SamplingParams  # noqa: E402

TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(folder: Path, cfg, rank: int, seed: int) -> None:  # type: ignore[no-untyped-def]
    """A random rank-`rank` adapter for a Llama-shaped model of config cfg (ModelConfig), in PEFT's files."""
    from safetensors.torch import save_file
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    dims = {"q_proj": (cfg.hidden_size, q), "k_proj": (cfg.hidden_size, kv), "v_proj": (cfg.hidden_size, kv),
            "o_proj": (q, cfg.hidden_size), "gate_proj": (cfg.hidden_size, inter), "up_proj": (cfg.hidden_size, inter),
            "down_proj": (inter, cfg.hidden_size)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg.num_layers):
        for name, (fan_in, fan_out) in dims.items():
            base = f"base_model.model.model.layers.{i}.{TARGETS[name]}.{name}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.01
            tensors[f"{base}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                                                            "target_modules": list(TARGETS)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output-len", type=int, default=64)
    a = p.parse_args()
    llm = LLM(**({"model": a.model} if a.model else {}), enable_lora=True, max_lora_rank=a.rank)
    tmp = Path(tempfile.mkdtemp())
    ads = []
    for i in range(4):
        write_adapter(tmp / f"a{i}", llm.engine.model_config, a.rank, seed=i)
        ads.append(LoRARequest(f"a{i}", i + 1, str(tmp / f"a{i}")))
    params = SamplingParams(max_tokens=a.output_len, temperature=0, ignore_eos=True)
    cases = {(b, name): loras for b in (1, 8) for name, loras in
             (("base", None), ("1 adapter", ads[0]), ("4 adapters", [ads[i % 4] for i in range(b)]))
             if not (b == 1 and name == "4 adapters")}
    rates: dict[tuple[int, str], list[float]] = {c: [] for c in cases}
    for r in range(a.rounds + 1):  # the first round warms up (adapters loaded, kernels built)
        for (b, name), loras in cases.items():
            prompts = [f"Round {r}, request {i}: the capital of France is" for i in range(b)]
            t = time.perf_counter()
            llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
            if r:
                rates[(b, name)].append(b * a.output_len / (time.perf_counter() - t))
    print(f"| batch | case | output tok/s (median of {a.rounds}) | vs base (median of ratios) |")
    print("|---|---|---|---|")
    for (b, name), xs in rates.items():
        ratio = statistics.median(x / y for x, y in zip(xs, rates[(b, "base")]))
        print(f"| {b} | {name} | {statistics.median(xs):.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
