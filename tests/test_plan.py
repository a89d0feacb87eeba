"""The planner reproduces the worked examples of the KV-cache arithmetic."""

from __future__ import annotations

import json
import math

from lmserve.cli import main
from lmserve.plan import DEVICES, PlanModel, model_from_name, plan, render


def mk(layers: int, kv_heads: int, head_dim: int = 128, heads: int | None = None) -> PlanModel:
    heads = heads or kv_heads
    return PlanModel("t", layers, heads, kv_heads, head_dim, heads * head_dim, 4 * heads * head_dim, 32000)


def test_kv_bytes_worked_examples():
    r = plan(mk(40, 40), DEVICES["h100"], "bf16", seq_len=1024)
    assert r["kv_bytes_per_token"] == 819_200
    assert math.isclose(r["kv_bytes_per_seq"] / 1e9, 0.84, abs_tol=0.01)  # ~0.8 GB per 1024 tokens
    assert math.isclose(64 * r["kv_bytes_per_seq"] / 1e9, 54, abs_tol=0.5)  # ~54 GB for 64 of them
    gqa = plan(mk(40, 8, heads=40), DEVICES["h100"], "bf16")
    assert r["kv_bytes_per_token"] / gqa["kv_bytes_per_token"] == 5
    assert gqa["kv_saving_vs_mha"] == 5 and gqa["attention_kind"] == "GQA"
    big = plan(mk(80, 64), DEVICES["h100"], "bf16", seq_len=4096)
    assert big["kv_bytes_per_token"] == 2_621_440
    assert math.isclose(big["kv_bytes_per_seq"] / 2**30, 10, abs_tol=0.05)  # ~10 GB for 4096 tokens
    assert plan(mk(96, 96), DEVICES["h100"], "bf16")["kv_bytes_per_token"] == 4_718_592


def test_ridge_point_and_mla():
    r = plan(mk(40, 40), DEVICES["h100"], "bf16")
    assert math.isclose(r["ridge_flop_per_byte"], 989 / 3.35, rel_tol=1e-9)
    assert round(r["ridge_flop_per_byte"]) == 295
    mla = plan(model_from_name("deepseek-v3"), DEVICES["h200"], "bf16")
    # 512 + 64 latent dims per layer vs 128 heads x 128 dims x 2 (K and V)
    assert math.isclose(mla["kv_saving_vs_mha"], 128 * 128 * 2 / 576, rel_tol=1e-9)
    assert round(mla["kv_saving_vs_mha"]) == 57 and mla["attention_kind"] == "MLA"
    # beside the MHA and GQA equivalents of the same 61 layers of 128-dim heads, in bf16
    assert mla["kv_bytes_per_token"] == 61 * 576 * 2
    assert mla["mla_equivalents"] == {"mha": 61 * 2 * 128 * 128 * 2, "gqa8": 61 * 2 * 8 * 128 * 2}
    assert "249,856 as GQA with 8 KV heads" in render(mla)
    assert r["mla_equivalents"] is None and "MLA caches" not in render(r)


def test_decode_bound_and_intensity():
    m = model_from_name("qwen3-0.6b")
    r = plan(m, DEVICES["h200"], "bf16", batch=1, seq_len=256)
    # batch-1 decode is memory-bound: time >= weight bytes / bandwidth
    assert r["decode"]["bound"] == "memory"
    assert r["decode"]["step_ms"] >= r["weight_bytes"] / 4.8e12 * 1e3
    assert r["decode"]["tokens_per_s"] < 4.8e12 / r["weight_bytes"]
    # MLP arithmetic intensity is about the batch size
    for b in (1, 8, 64):
        assert math.isclose(plan(m, DEVICES["h200"], "bf16", batch=b)["mlp_arithmetic_intensity"], b, rel_tol=0.1)
    # at a large enough batch decode turns compute-bound, and KV memory eventually caps the batch
    table = plan(m, DEVICES["l4"], "bf16", seq_len=4096, batches=(1, 64, 1024, 4096))["table"]
    assert table[0]["fits"] and not table[-1]["fits"]


def test_cli_json(capsys):  # type: ignore[no-untyped-def]
    assert main(["plan", "--layers", "40", "--kv-heads", "40", "--head-dim", "128", "--device", "h100",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["kv_bytes_per_token"] == 819_200
    assert main(["plan", "--model", "smollm2-135m", "--device", "cpu", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "46,080 bytes/token" in out  # 2 x 30 layers x 3 kv heads x 64 x 4 bytes


def test_sliding_window_layers_are_counted_by_their_window():
    """Gemma 3 270M (15 of 18 layers local, window 512): a 4096-token sequence keeps 3 x 4096 + 15 x 512
    layer-tokens, not 18 x 4096; more sequences fit than a window-blind cache would hold, and the
    rendered plan says both."""
    m = model_from_name("gemma-3-270m")
    r = plan(m, DEVICES["l4"], "bf16", seq_len=4096)
    per_layer_token = 2 * 1 * 256 * 2  # K and V, one KV head of 256, bf16
    assert r["kv_bytes_per_token"] == 18 * per_layer_token
    assert r["kv_bytes_per_seq"] == per_layer_token * (3 * 4096 + 15 * 512)
    assert r["kv_bytes_per_seq_window_blind"] == per_layer_token * 18 * 4096
    assert r["layer_kinds"] == {"full": 3, "sliding": 15, "windows": [512]}
    assert r["max_seqs_that_fit"] > 2.5 * r["max_seqs_that_fit_window_blind"] > 0
    short = plan(m, DEVICES["l4"], "bf16", seq_len=256)  # shorter than the window: no saving
    assert short["kv_bytes_per_seq"] == short["kv_bytes_per_seq_window_blind"]
    text = render(r)
    assert "window 512" in text and f"window-blind: {r['max_seqs_that_fit_window_blind']:,}" in text
    assert plan(mk(40, 40), DEVICES["h100"])["layer_kinds"] is None


def test_a_deepseek_config_is_planned_as_mla(tmp_path):
    """A DeepSeek config.json (not a named shape): the planner counts its latent cache, as the engine
    allocates it, not per-head K / V."""
    from lmserve.config import ModelConfig
    cfg = {"architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
           "moe_intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
           "kv_lora_rank": 64, "q_lora_rank": None, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
           "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    m = model_from_name(str(path))
    r = plan(m, DEVICES["h100"], "bf16")
    assert r["attention_kind"] == "MLA" and r["kv_bytes_per_token"] == 4 * (64 + 16) * 2
    assert r["kv_bytes_per_token"] == ModelConfig.from_hf(cfg).kv_elems_per_token * 2


def test_tensor_parallel_worked_example(capsys):
    # Llama-3.1-8B over 4 H100s, bf16, batch 1, 1024 tokens: by hand from the published shape
    m = model_from_name("llama-3.1-8b")
    r = plan(m, DEVICES["h100"], "bf16", tp=4, link=(450, 10))
    t = r["tensor_parallel"]
    assert t["weight_bytes_per_rank"] == m.params * 2 / 4
    assert t["kv_heads_per_rank"] == 2 and not t["kv_replicated"]  # 8 KV heads over 4 ranks
    assert t["kv_bytes_per_token_per_rank"] == 2 * 32 * 2 * 128 * 2  # K and V x layers x 2 heads x 128 x bf16
    assert t["all_reduces_per_step"] == 2 * 32 + 1 and t["all_reduce_bytes"] == 4096 * 2
    comm = 65 * (10e-6 + 1.5 * 8192 / 450e9) + 10e-6 + 128256 * 4 * 0.75 / 450e9  # ring: 2 (N - 1) / N
    assert math.isclose(t["comm_ms"], comm * 1e3, rel_tol=1e-9)
    read = m.params - 128256 * 4096  # a step reads every weight but the (untied) input embedding table
    one = read * 2 / 3.35e12 + 1024 * r["kv_bytes_per_token"] / 3.35e12  # memory-bound at batch 1
    assert math.isclose(t["step_ms_tp1"], one * 1e3, rel_tol=1e-9)
    quarter = read * 2 / 4 / 3.35e12 + 1024 * r["kv_bytes_per_token"] / 4 / 3.35e12
    assert math.isclose(t["step_ms"], (quarter + comm) * 1e3, rel_tol=1e-9)
    assert 2 < t["speedup"] < 4  # less than 4x: the collectives' latency
    # fewer KV heads than ranks: one replicated per rank
    mqa = plan(mk(4, 1, heads=8), DEVICES["h100"], "bf16", tp=4)["tensor_parallel"]
    assert mqa["kv_heads_per_rank"] == 1 and mqa["kv_replicated"]
    assert main(["plan", "--model", "llama-3.1-8b", "--tensor-parallel-size", "4", "--link-gbs", "450",
                 "--link-latency-us", "10"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel over 4 ranks" in out and f"{t['speedup']:.2f}x" in out


def test_the_tensor_parallel_bound_reads_a_windowed_model_as_one_process_does():
    """A sliding-window model (5 of 6 layers keep 512 tokens), batch 64 at 8k tokens: the tensor-parallel
    section's one-rank bound is the decode bound above it (before, it read every layer's whole 8k
    tokens: 3.0 ms against 0.8 ms for gemma-3-270m)."""
    from dataclasses import replace
    m = replace(mk(6, 2, heads=8), windows=(512, 512, 512, 512, 512, None))
    r = plan(m, DEVICES["h100"], "bf16", batch=64, seq_len=8192, tp=2)
    assert math.isclose(r["tensor_parallel"]["step_ms_tp1"], r["decode"]["step_ms"], rel_tol=1e-9)
    assert r["kv_bytes_per_seq"] < r["kv_bytes_per_seq_window_blind"] / 3


def test_quantized_weights_plan_a_float_kv_cache(capsys):  # type: ignore[no-untyped-def]
    """--dtype is the weights': int4 weights planned an int4 cache (7,200 B/token for SmolLM2), which lmserve
    has not; LLM(quantization='int4') keeps the compute dtype's cache: fp32 on the CPU (46,080), bf16 on a
    GPU (23,040). An int4 cache is refused by name."""
    import pytest
    m = model_from_name("smollm2-135m")
    assert plan(m, DEVICES["cpu"], "int4", act_bytes=4)["kv_bytes_per_token"] == 46_080
    assert plan(m, DEVICES["h100"], "int4")["kv_bytes_per_token"] == 23_040
    assert plan(m, DEVICES["h100"], "int4", kv_dtype="int8")["kv_dtype"] == "int8"
    with pytest.raises(ValueError, match="kv_dtype"):
        plan(m, DEVICES["h100"], "bf16", kv_dtype="int4")
    assert main(["plan", "--device", "cpu", "--dtype", "int4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_bytes_per_token"] == 46_080


def test_shapes_and_links_out_of_range_are_refused(capsys):  # type: ignore[no-untyped-def]
    """A zero KV-head count or head size divided by zero, a negative one planned negative bytes, --layers 0
    planned the default model, a negative collective latency a negative cost: each is the flag's error."""
    import pytest
    for bad in (["--layers", "4", "--kv-heads", "0", "--head-dim", "64"], ["--layers", "4", "--head-dim", "0"],
                ["--layers", "4", "--kv-heads", "-2"], ["--layers", "0", "--kv-heads", "2"],
                ["--tensor-parallel-size", "2", "--link-latency-us", "-5"], ["--link-gbs", "0"]):
        with pytest.raises(SystemExit) as e:
            main(["plan", *bad])
        assert e.value.code == 2
        assert bad[-2] in capsys.readouterr().err
    assert main(["plan", "--tensor-parallel-size", "2", "--device", "cpu", "--link-latency-us", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tensor_parallel"]["collective_latency_us"] == 0


QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
             "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
             "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
             "num_experts_per_tok": 8, "tie_word_embeddings": False}  # Qwen3-30B-A3B's published shape
DEEPSEEK_V2_LITE = {"architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400, "hidden_size": 2048,
                    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
                    "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2,
                    "n_routed_experts": 64, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
                    "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                    "v_head_dim": 128, "tie_word_embeddings": False}


def test_moe_and_mla_configs_count_every_expert(tmp_path):  # type: ignore[no-untyped-def]
    """A config.json's experts and MLA projections are counted (a dense MLP a layer was: Qwen3-30B-A3B
    planned as 3.3 B parameters, 162 sequences of 4096 beside them on an H100 where 27 fit): totals
    and active counts as published (30.5 B / 3.3 B; DeepSeek-V2-Lite 15.7 B, its named shape's)."""
    for cfg, total, active in ((QWEN3_MOE, 30.5e9, 3.3e9), (DEEPSEEK_V2_LITE, 15.7e9, 2.4e9 + 102400 * 2048)):
        path = tmp_path / f"{cfg['architectures'][0]}.json"
        path.write_text(json.dumps(cfg))
        m = model_from_name(str(path))
        assert math.isclose(m.params, total, rel_tol=0.01) and math.isclose(m.active_params, active, rel_tol=0.03)
    qwen = plan(model_from_name(str(tmp_path / "Qwen3MoeForCausalLM.json")), DEVICES["h100"], "bf16", seq_len=4096)
    assert qwen["max_seqs_that_fit"] == int((80e9 * 0.9 - qwen["weight_bytes"]) // (48 * 2 * 4 * 128 * 2 * 4096)) == 27
    lite = plan(model_from_name(str(tmp_path / "DeepseekV2ForCausalLM.json")), DEVICES["h100"], "bf16")
    named = plan(model_from_name("deepseek-v2-lite"), DEVICES["h100"], "bf16")
    assert lite["kv_saving_vs_mha"] == named["kv_saving_vs_mha"] and lite["max_seqs_that_fit"] == named["max_seqs_that_fit"]


def test_roofline_against_hand_computations():  # type: ignore[no-untyped-def]
    """Decode attention FLOPs follow the window as the KV reads do (gemma-3-270m at 32k: 0.43 GFLOP a
    token, not 2.42), prefill counts causal pairs within windows; the attention intensity is FLOPs per
    KV byte of the cache's dtype (it was seq / (1 + seq) x group whatever the dtype; MLA, absorbed:
    every head reads one latent row); a decode step reads no untied input-embedding table."""
    g = model_from_name("gemma-3-270m")
    r = plan(g, DEVICES["h100"], "bf16", seq_len=32768)
    per_ctx = 4 * 4 * 256  # 4 heads x 256, q.k and values
    assert g.tied and math.isclose(r["decode"]["gflops"] * 1e9 - 2 * g.active_params, per_ctx * (3 * 32768 + 15 * 512), rel_tol=1e-9)
    pairs = 3 * 32768 * 32769 // 2 + 15 * (512 * 513 // 2 + (32768 - 512) * 512)
    t_pre = max((2 * g.params * 32768 + per_ctx * pairs) / 989e12, (g.params * 2 + r["kv_bytes_per_seq"]) / 3.35e12)
    assert math.isclose(r["prefill_ms_lower_bound"], t_pre * 1e3, rel_tol=1e-9)
    smol = model_from_name("smollm2-135m")  # 9 heads, 3 KV heads of 64: group 3
    for kv, want in (("fp32", 4 * 64 * 3 / (2 * 64 * 4)), ("int8", 4 * 64 * 3 / (2 * 64 + 2 * 2 * 4))):
        assert math.isclose(plan(smol, DEVICES["h100"], "bf16", kv_dtype=kv)["decode_attention_intensity"], want)
    v3 = plan(model_from_name("deepseek-v3"), DEVICES["h100"], "bf16")
    assert math.isclose(v3["decode_attention_intensity"], 128 * 2 * (576 + 512) / (576 * 2))
    llama = model_from_name("llama-3.1-8b")
    one = plan(llama, DEVICES["h100"], "bf16", seq_len=1)
    assert math.isclose(one["decode"]["bytes_moved_gb"] * 1e9, (llama.params - 128256 * 4096) * 2 + one["kv_bytes_per_seq"])


def test_plan_flags_it_would_ignore_or_misread_are_refused(capsys):  # type: ignore[no-untyped-def]
    """--params -5 planned negative bytes and 137,329 sequences; nan / inf died in int(); 6 heads over 4
    KV heads became a group of 1; shape flags without --layers and link flags without tensor parallelism
    changed nothing; an unknown --model listed two names. A quantized MLA cache, which the engine
    refuses, was planned."""
    import pytest
    for bad, flag in ((["--params", "-5", "--layers", "2", "--kv-heads", "1", "--head-dim", "64"], "--params"),
                      (["--params", "nan", "--layers", "2", "--kv-heads", "1", "--head-dim", "64"], "--params"),
                      (["--mem-gb", "inf"], "--mem-gb"), (["--tensor-parallel-size", "2", "--link-gbs", "inf"], "--link-gbs")):
        with pytest.raises(SystemExit) as e:
            main(["plan", *bad])
        assert e.value.code == 2 and flag in capsys.readouterr().err
    for bad, said in ((["--layers", "2", "--heads", "6", "--kv-heads", "4", "--head-dim", "64"], "--heads"),
                      (["--heads", "4"], "--heads"), (["--params", "1e12"], "--params"), (["--vocab", "7"], "--vocab"),
                      (["--link-gbs", "1"], "--link-gbs"), (["--link-latency-us", "5000"], "--link-latency-us"),
                      (["--model", "nosuch"], "--model: 'nosuch' is not a planner shape (debug-tiny, deepseek-v2-lite"),
                      (["--model", "deepseek-v3", "--kv-dtype", "int8"], "kv_dtype"),
                      (["--model", "llama-3.1-8b", "--layers", "2", "--kv-heads", "1", "--head-dim", "64"],
                       "--model: an explicit shape")):  # (the model was dropped for the shape, unsaid)
        assert main(["plan", *bad]) == 2
        err = capsys.readouterr().err
        assert said in err, (bad, err)


def test_an_explicit_parameter_count_is_read_whole():  # type: ignore[no-untyped-def]
    """--params counts what the user says: a decode step reads all of it (the input embedding of the
    shape's vocabulary was taken off it: 1e6 parameters with a 32,000 x 128 table planned negative bytes)."""
    import argparse
    from lmserve.cli.plan import model_from_args
    a = argparse.Namespace(layers=2, heads=None, kv_heads=1, head_dim=64, hidden=None, intermediate=None, vocab=None,
                           params=1e6, model="smollm2-135m")
    r = plan(model_from_args(a), DEVICES["h100"], "bf16", seq_len=16)
    assert math.isclose(r["decode"]["bytes_moved_gb"] * 1e9, 1e6 * 2 + r["kv_bytes_per_seq"]) and r["decode"]["step_ms"] > 0


def test_mla_keeps_its_whole_latent_on_every_tensor_parallel_rank(capsys):  # type: ignore[no-untyped-def]
    """The per-rank KV of an MLA model was divided by its query heads (deepseek-v3 over 8 ranks: 8,784
    bytes/token per rank); the latent is one per token, not per head, and every rank caches all of it."""
    one = plan(model_from_name("deepseek-v3"), DEVICES["h200"], "bf16")
    r = plan(model_from_name("deepseek-v3"), DEVICES["h200"], "bf16", tp=8)
    t = r["tensor_parallel"]
    assert t["kv_bytes_per_token_per_rank"] == one["kv_bytes_per_token"] == 61 * 576 * 2 and t["kv_replicated"]
    assert "MLA's latent: all of it on every rank" in render(r)
    gqa = plan(model_from_name("llama-3.1-8b"), DEVICES["h200"], "bf16", tp=8)["tensor_parallel"]
    assert gqa["kv_bytes_per_token_per_rank"] == 2 * 32 * 1 * 128 * 2 and not gqa["kv_replicated"]  # 8 KV heads / 8
