"""AWQ int4 by our own calibration: the scale search on a synthetic layer with planted outlier channels
(the grid's minimum, checked by brute force, and better than round-to-nearest int4), the scales folded
into the float model without changing its logits, AutoAWQ's GEMM packing against a hand-packed word,
and the checkpoint's save -> load round trip, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmserve import LLM
from lmserve.quant.awq import (awq_calibrate, capture_inputs, default_group_size, dequantize_int4,
                               fake_quantize_model, quantize_int4, scale_groups, search_scale)
from lmserve.quant.checkpoint import (AWQ_ORDER, check_awq_config, dequantized_weights, group_awq_tensors, hf_config_dict,
                                      load_awq_tensors, pack_awq, read_quantization_config, save_awq_checkpoint,
                                      unpack_awq)
from tests.conftest import char_tokenizer_model

KV = "16MiB"


# ---------------------------------------------------------------- an independent int4 reference

def rtn_reference(w: torch.Tensor, group: int) -> torch.Tensor:
    """Round to nearest, zero point, from each group's min/max, written out row by row and group by
    group (fp16 scales, as an AWQ checkpoint stores them): the spec the fast code must meet."""
    out = torch.empty_like(w)
    for r in range(w.shape[0]):
        for c in range(0, w.shape[1], group):
            g = w[r, c:c + group]
            scale = float(torch.tensor(max(float(g.max() - g.min()), 1e-5) / 15).half())
            zero = min(max(-round(float(g.min()) / scale), 0), 15)
            q = torch.clamp(torch.round(g / scale) + zero, 0, 15)
            out[r, c:c + group] = (q - zero) * scale
    return out


def outlier_layer(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """W [48, 128] ~ N(0, 0.05); inputs X [384, 128] ~ N(0, 1) with four planted outlier channels (x25)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(48, 128, generator=g) * 0.05
    x = torch.randn(384, 128, generator=g)
    outliers = [5, 40, 77, 120]
    x[:, outliers] *= 25
    return w, x, outliers


def test_quantize_int4_is_round_to_nearest_from_min_max():
    w, _, _ = outlier_layer()
    q, scales, zeros = quantize_int4(w, 32)
    assert q.dtype == torch.uint8 and q.shape == (48, 128) and int(q.max()) <= 15
    assert scales.shape == zeros.shape == (48, 4) and scales.dtype == zeros.dtype == torch.float32
    assert torch.equal(zeros, zeros.round()) and torch.equal(scales, scales.half().float())
    assert torch.allclose(dequantize_int4(q, scales, zeros), rtn_reference(w, 32), atol=1e-7, rtol=0)
    err = (dequantize_int4(q, scales, zeros) - w).abs().reshape(48, 4, 32).amax(-1)
    assert bool((err <= scales + 1e-6).all())  # within a step (half a step, plus the zero point's rounding)


def test_search_picks_the_grid_minimum_and_beats_rtn_on_planted_outliers():
    w, x, outliers = outlier_layer()
    group = 32
    found = search_scale(w, x, group)
    # brute force: every alpha on the grid, scales and error computed from the definition
    x_mean = x.abs().mean(0)
    brute = []
    for i in range(20):
        alpha = i / 20
        s = x_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        wq = rtn_reference(w * s, group) / s
        brute.append((alpha, float(((x @ w.T) - (x @ wq.T)).pow(2).mean())))
    best_alpha = min(brute, key=lambda t: t[1])[0]
    assert found.alpha == best_alpha
    for (a1, e1), (a2, e2) in zip(found.errors, brute):
        assert a1 == a2 and e1 == pytest.approx(e2, rel=1e-4)
    rtn = float(((x @ w.T) - (x @ rtn_reference(w, group).T)).pow(2).mean())
    assert found.rtn_error == pytest.approx(rtn, rel=1e-4)  # alpha = 0 is plain RTN
    assert found.alpha > 0 and found.error < 0.6 * rtn  # AWQ clearly beats RTN here
    assert float(found.scales[outliers].min()) > float(found.scales.median()) * 2  # outliers protected


def test_packing_matches_a_hand_packed_word():
    # one row of eight output columns holding 1..8: nibble i holds column AWQ_ORDER[i] = 0, 2, 4, 6, 1, 3, 5, 7
    vals = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    word = 0x86427531  # nibbles low to high: 1, 3, 5, 7, 2, 4, 6, 8
    assert AWQ_ORDER == (0, 2, 4, 6, 1, 3, 5, 7)
    assert pack_awq(vals).tolist() == [[word - 2**32]]  # the same bits in an int32
    assert unpack_awq(pack_awq(vals)).tolist() == vals.tolist()
    # AutoAWQ's own loop (WQLinear_GEMM.from_linear) and unpacking (dequantize_gemm), transcribed
    g = torch.Generator().manual_seed(1)
    iw = torch.randint(0, 16, (6, 24), generator=g, dtype=torch.int32)
    ref = torch.zeros(6, 3, dtype=torch.int32)
    for col in range(3):
        for i in range(8):
            ref[:, col] |= iw[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
    assert torch.equal(pack_awq(iw), ref)
    shifts = torch.arange(0, 32, 4)
    unpacked = (ref[:, :, None] >> shifts).to(torch.int8).reshape(6, -1)
    order = torch.arange(24).view(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].reshape(-1)
    assert torch.equal(unpacked[:, order] & 15, iw.to(torch.int8))


def test_load_awq_tensors_reads_an_autoawq_layout():
    w, _, _ = outlier_layer(3)
    q, s, z = quantize_int4(w, 32)  # W [out=48, in=128]
    qweight, qzeros = pack_awq(q.T), pack_awq(z.T)  # AutoAWQ: [in, out/8] and [in/G, out/8]
    scales = s.T.half()  # [in/G, out]
    assert qweight.shape == (128, 6) and qzeros.shape == (4, 6) and scales.shape == (4, 48)
    back = load_awq_tensors(qweight, qzeros, scales)
    assert back.group == 32 and torch.equal(back.q, q) and torch.equal(back.scales, s) and torch.equal(back.zeros, z)
    # AutoAWQ's dequantization: W.T = (iweight - izeros) * scales, groups repeated along the input
    ref = (q.T.float() - z.T.repeat_interleave(32, 0)) * scales.float().repeat_interleave(32, 0)
    assert torch.equal(back.dequantize(), ref.T)
    with pytest.raises(ValueError, match="group_size"):
        load_awq_tensors(qweight, qzeros, scales, group_size=64)


def test_the_canonical_form_feeds_int4linear():
    from lmserve.layers import quant
    w, x, _ = outlier_layer(4)
    q, s, z = quantize_int4(w, 32)
    layer = quant.Int4Linear.from_quantized(q, s, z, 32)
    assert torch.allclose(layer(x), x @ dequantize_int4(q, s, z).T, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- on tiny models

def calib_sequences(vocab: int, n: int = 4, length: int = 48, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def mha_model(path: Path) -> Path:
    """A tiny Qwen2 (q/k/v bias) with one KV head per query head, so the o_proj scale folds into v_proj's
    rows and bias."""
    import transformers as tf
    torch.manual_seed(7)
    cfg = tf.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, use_sliding_window=False,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    m = tf.AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.08) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    m.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def mha_dir(tmp_path_factory):  # type: ignore[no-untyped-def]
    return mha_model(tmp_path_factory.mktemp("mha") / "m")


@pytest.mark.parametrize("which", ["llama", "qwen2", "mha"])
def test_folding_scales_keeps_the_float_model(which, tiny_models, mha_dir):
    folder = mha_dir if which == "mha" else tiny_models[which][0]
    llm = LLM(str(folder), kv_cache_memory=KV)
    model = llm.engine.model
    groups = [g.prev for g in scale_groups(model)]
    assert any("qkv_proj[2]" in p for p in groups) == (which == "mha")  # o -> v only when heads align
    probe = calib_sequences(128, 1, 40, seed=9)[0]
    before = llm.score(probe)
    w0 = model.layers[0].mlp.down_proj.weight.clone()
    result = awq_calibrate(model, lambda s: llm.score(s, last_only=True), calib_sequences(128), group=32, n_grid=10)
    assert not torch.equal(model.layers[0].mlp.down_proj.weight, w0)  # scales were folded in
    assert any(s.alpha > 0 for s in result.searches.values())
    after = llm.score(probe)
    assert (after - before).abs().max() < 1e-4 * before.abs().max()


def test_capture_keeps_means_over_every_token(tiny_models):
    llm = LLM(str(tiny_models["llama"][0]), kv_cache_memory=KV)
    seqs = calib_sequences(128, 3, 20)
    caps = capture_inputs(llm.engine.model, lambda s: llm.score(s), seqs, max_rows=12)
    c = caps["layers.1.mlp.down_proj"]
    assert c.count == 60 and c.sample.shape == (12, 128) and c.mean_abs.shape == (128,)


def test_checkpoint_round_trip_is_bit_exact(tiny_models, mha_dir, tmp_path):
    llm = LLM(str(mha_dir), kv_cache_memory=KV)
    model, cfg = llm.engine.model, llm.engine.model_config
    awq_calibrate(model, lambda s: llm.score(s, last_only=True), calib_sequences(128), group=32, n_grid=10)
    out = tmp_path / "awq"
    saved = save_awq_checkpoint(model, cfg, out, 32, source=mha_dir)
    qc = read_quantization_config(out)
    assert qc is not None and {k: qc[k] for k in ("quant_method", "bits", "group_size", "zero_point", "version")} \
        == {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    assert check_awq_config(qc) == 32 and check_awq_config({"w_bit": 4, "q_group_size": 128, "zero_point": True,
                                                            "version": "GEMM"}) == 128  # AutoAWQ's older names
    with pytest.raises(ValueError, match="GEMM"):
        check_awq_config({**qc, "version": "gemv"})
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    p = "model.layers.0.self_attn.k_proj"
    assert tensors[p + ".qweight"].dtype == torch.int32 and tensors[p + ".qweight"].shape == (64, 8)
    assert tensors[p + ".qzeros"].shape == (2, 8) and tensors[p + ".scales"].dtype == torch.float16
    assert tensors[p + ".bias"].dtype == torch.float32 and p + ".weight" not in tensors
    loaded = {n.removesuffix(".weight"): t for n, t in group_awq_tensors(tensors.items(), 32)
              if not isinstance(t, torch.Tensor)}
    assert sorted(loaded) == sorted(saved) and len(saved) == 2 * 7  # q k v o gate up down, per layer
    for name, w in saved.items():
        back = loaded[name]
        assert back.group == w.group and back.q.dtype == torch.uint8
        assert torch.equal(back.q, w.q) and torch.equal(back.scales, w.scales) and torch.equal(back.zeros, w.zeros)

    # the checkpoint, dequantized into a float folder, computes what the fake-quantized model computes
    from safetensors.torch import save_file
    flat = tmp_path / "flat"
    flat.mkdir()
    save_file({n: t.contiguous() for n, t in dequantized_weights(tensors.items())}, str(flat / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config")
    (flat / "config.json").write_text(json.dumps(config))
    fake_quantize_model(model, 32)
    probe = calib_sequences(128, 1, 30, seed=5)[0]
    ref = llm.score(probe)
    got = LLM(str(flat), kv_cache_memory=KV).score(probe)
    assert (got - ref).abs().max() < 1e-4 * ref.abs().max()


def test_hf_config_for_a_gguf_source_reads_back(tiny_models):
    from lmserve.config import ModelConfig
    llm = LLM(str(tiny_models["qwen3"][0]), kv_cache_memory=KV)
    cfg = llm.engine.model_config
    assert ModelConfig.from_hf(hf_config_dict(cfg)) == cfg
    assert default_group_size(llm.engine.model) == 64  # 128 does not divide the 64-wide inputs


def test_quantize_command_writes_an_awq_folder(tiny_models, tmp_path, capsys):
    from lmserve.cli import main
    model = char_tokenizer_model(tiny_models["llama"][0], tmp_path / "model")
    text = Path(__file__).parent / "data" / "declaration_gettysburg.txt"
    out = tmp_path / "awq"
    rc = main(["quantize", "--method", "awq", "--model", str(model), "--calib", str(text), "--out", str(out),
               "--calib-seq-len", "128", "--calib-samples", "6", "--kv-cache-memory", KV])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "AWQ int4, group 64: 6 calibration sequences, 768 tokens" in printed
    assert {"config.json", "model.safetensors", "tokenizer.json", "awq_search.json"} <= {p.name for p in out.iterdir()}
    report = json.loads((out / "awq_search.json").read_text())
    assert len(report["layers"]) == 2 * 3 and all(r["mse"] <= r["rtn_mse"] for r in report["layers"])
    assert read_quantization_config(out)["group_size"] == 64  # type: ignore[index]
    assert main(["quantize", "--model", str(model), "--calib", str(text), "--out", str(out),
                 "--quantization", "int8"]) == 2  # calibration needs the float model


def test_float_layers_inside_an_awq_checkpoint_are_refused_by_name():  # type: ignore[no-untyped-def]
    """AutoAWQ's modules_to_not_convert: those layers are stored in float, and every decoder linear loaded
    as int4 re-rounded them (logits 5% off, silently); refused naming the key. null / [] load as before."""
    qc = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    for empty in (None, []):
        assert check_awq_config({**qc, "modules_to_not_convert": empty}) == 32
    with pytest.raises(ValueError, match="modules_to_not_convert"):
        check_awq_config({**qc, "modules_to_not_convert": ["model.layers.0.mlp.down_proj"]})


def test_an_awq_folder_from_a_llama3_gguf_is_the_same_model_to_hf(tmp_path):  # type: ignore[no-untyped-def]
    """A Llama-3.x GGUF's rope_freqs divisors go into config.json as the llama3 scaling that gives them
    (they went as rope_type 'freq_factors', which only lmserve reads: HF raised KeyError building the
    model); HF on that config and the original weights computes the original logits."""
    import transformers as tf

    from tests.test_loader import LLAMA3, LONG, _llama3_rope_freqs, _tiny_llama, hf_logits, write_gguf
    hf = _tiny_llama(LLAMA3)
    write_gguf(tmp_path / "l3.gguf", hf, {}, _llama3_rope_freqs(10000.0, 16, LLAMA3))
    llm = LLM(str(tmp_path / "l3.gguf"), quantization="none", kv_cache_memory=KV)
    save_awq_checkpoint(llm.engine.model, llm.engine.model_config, tmp_path / "awq", 32, tokenizer=llm.tokenizer)
    config = json.loads((tmp_path / "awq" / "config.json").read_text())
    rope = config["rope_scaling"]
    assert rope["rope_type"] == "llama3" and rope["original_max_position_embeddings"] == 64, rope
    assert rope["factor"] == pytest.approx(8.0) and rope["low_freq_factor"] == 1.0
    assert rope["high_freq_factor"] == pytest.approx(4.0, rel=1e-4)
    config.pop("quantization_config")
    again = tf.LlamaForCausalLM(tf.LlamaConfig(**config)).eval()
    again.load_state_dict(hf.state_dict())
    ref = hf_logits(hf, LONG)
    assert (hf_logits(again, LONG) - ref).abs().max() < 1e-4 * ref.abs().max()
    from lmserve.layers.rotary import hf_rope_scaling
    with pytest.raises(ValueError, match="no llama3 scaling"):  # (a linear factor on top: no llama3 gives it)
        hf_rope_scaling([2.0 * d for d in _llama3_rope_freqs(10000.0, 16, LLAMA3).tolist()], 10000.0)
    assert hf_rope_scaling([1.0] * 8, 1e4) is None and hf_rope_scaling([2.0] * 8, 1e4) == {"rope_type": "linear",
                                                                                          "factor": 2.0}


def test_a_gemma3_config_json_is_hfs_text_model():  # type: ignore[no-untyped-def]
    """model_type gemma3_text: HF read 'gemma3' as the multimodal wrapper with its default 4B text config
    (hidden 2304, 26 layers) and built Gemma3ForConditionalGeneration."""
    import transformers as tf

    from lmserve.config import ModelConfig
    cfg = ModelConfig.from_hf({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 96,
                               "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                               "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                               "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                               "rope_theta": 1e6, "rope_local_base_freq": 1e4, "query_pre_attn_scalar": 16})
    d = hf_config_dict(cfg)
    hc = tf.AutoConfig.for_model(**d)
    assert type(hc).__name__ == "Gemma3TextConfig", type(hc)
    assert (hc.hidden_size, hc.num_hidden_layers, hc.head_dim, hc.sliding_window, list(hc.layer_types)) == \
        (32, 2, 16, 8, ["sliding_attention", "full_attention"])
    assert tf.AutoModelForCausalLM.from_config(hc).__class__.__name__ == "Gemma3ForCausalLM"
    assert ModelConfig.from_hf(d) == cfg


def test_a_written_tokenizer_adds_its_bos_in_hf_too(tmp_path):  # type: ignore[no-untyped-def]
    """A GGUF tokenizer that adds a BOS (Gemma's, Llama's) written out gets a post-processor that adds it:
    HF's tokenizer ignored add_bos_token and encoded every text without the BOS."""
    import transformers as tf

    from lmserve.models.gguf_file import GGUFFile
    from lmserve.models.loader import resolve_model
    from lmserve.quant.checkpoint import write_tokenizer
    from lmserve.tokenizer import Tokenizer
    ours = Tokenizer.from_gguf(GGUFFile(resolve_model("gemma-3-270m").path))
    before = ours.raw.to_str()
    write_tokenizer(ours, tmp_path)
    theirs = tf.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ["Hello world", "  two  spaces", "数字123 😀", "<start_of_turn>user\nhi<end_of_turn>", ""]:
        assert theirs.encode(text) == ours.encode(text) and ours.encode(text)[0] == ours.bos_token_id, text
    assert ours.raw.to_str() == before  # (the live tokenizer is left as it was)


def test_an_awq_folder_with_another_quantization_is_refused_by_name(tiny_models, tmp_path):  # type: ignore[no-untyped-def]
    """It failed inside the weight stream ('Int8Linear has no qweight'), naming no option."""
    model = tiny_models["llama"][0]
    llm = LLM(str(model), kv_cache_memory=KV)
    save_awq_checkpoint(llm.engine.model, llm.engine.model_config, tmp_path / "awq", 32, source=model)
    for scheme in ("int8", "int4", "fp8"):
        with pytest.raises(ValueError, match=r"^quantization: the folder's weights are quantized already"):
            LLM(str(tmp_path / "awq"), quantization=scheme, kv_cache_memory=KV)
