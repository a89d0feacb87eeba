"""Checkpoint loading against HF transformers: which files of an HF folder are read, and GGUF RoPE scaling."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lmserve import LLM, SamplingParams
from tests.conftest import make_tiny
from tests.test_models_vs_hf import PROMPTS, hf_greedy

LONG = [(7 * i + 3) % 128 for i in range(120)]  # positions far enough for the scaled low frequencies to matter


def hf_logits(model, prompt: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """HF's logits at every position of one prompt."""
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()  # (T, V)


# ---------------------------------------------------------------- HF folders

def _stray_consolidated(path) -> None:  # type: ignore[no-untyped-def]
    """What Mistral repos ship beside the HF files: the same weights under Mistral's own names."""
    from safetensors.torch import save_file
    save_file({"tok_embeddings.weight": torch.zeros(128, 64), "layers.0.attention.wq.weight": torch.zeros(64, 64)},
              str(path / "consolidated.safetensors"))


@pytest.mark.parametrize("rows", [1, 100])
def test_an_embedding_of_the_wrong_shape_is_refused_by_name(tmp_path, rows):  # type: ignore[no-untyped-def]
    """(1, hidden) against a vocabulary of 128 loaded silently before (broadcast: every token the same
    embedding), (100, hidden) was a bare torch RuntimeError naming no tensor; both name it now, as every
    other tensor's mismatch does."""
    from safetensors.torch import load_file, save_file
    path = tmp_path / "m"
    make_tiny("llama", path, seed=0)
    sd = load_file(str(path / "model.safetensors"))
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"][:rows].contiguous()
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"embed_tokens.weight: checkpoint \(%d, 64\)" % rows):
        LLM(str(path), kv_cache_memory="16MiB")


@pytest.mark.parametrize("sharded", [True, False], ids=["index", "single"])
def test_hf_folder_reads_only_the_model_files(tmp_path, sharded):  # type: ignore[no-untyped-def]
    hf = make_tiny("mistral", tmp_path / "scratch", seed=3)
    path = tmp_path / "model"
    hf.save_pretrained(path, safe_serialization=True, max_shard_size="40KB" if sharded else "1GB")
    assert (path / "model.safetensors.index.json").is_file() == sharded
    _stray_consolidated(path)
    llm = LLM(str(path), kv_cache_memory="64MiB")
    for prompt in PROMPTS:
        diff = (llm.score(prompt) - hf_logits(hf, prompt)).abs().max().item()
        assert diff < 1e-4, diff
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(hf, PROMPTS[0], 8)


# ---------------------------------------------------------------- GGUF RoPE scaling

def _tiny_llama(rope: dict | None, seed: int = 0):  # type: ignore[no-untyped-def]
    """A tiny HF Llama (the conftest shape) with the given rope_parameters, weights drawn from seed."""
    import transformers as tf
    torch.manual_seed(seed)
    params = {"rope_type": "default", **(rope or {}), "rope_theta": 10000.0}
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         rope_parameters=params)
    model = tf.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    return model


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter (convert_hf_to_gguf.py LlamaModel.permute): rows of each head interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_freqs(theta: float, dim: int, rope: dict) -> np.ndarray:
    """The `rope_freqs` tensor llama.cpp's converter writes for rope_type llama3: per-frequency divisors."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # (d/2,)
    old, lo, hi, factor = (rope["original_max_position_embeddings"], rope["low_freq_factor"],
                           rope["high_freq_factor"], rope["factor"])
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)  # (d/2,)


def write_gguf(path, hf, keys: dict, rope_freqs: np.ndarray | None = None) -> None:  # type: ignore[no-untyped-def]
    """Write an HF Llama as llama.cpp's converter would (F32, Q/K rows permuted, a byte-level BPE vocabulary),
    plus the given extra `llama.*` metadata keys (name -> value) and an optional rope_freqs tensor."""
    import gguf
    c = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    for key, value in keys.items():
        if isinstance(value, str):
            w.add_string(f"llama.{key}", value)
        elif isinstance(value, int):
            w.add_uint32(f"llama.{key}", value)
        else:
            w.add_float32(f"llama.{key}", value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(0x100 + i) for i in range(c.vocab_size - 1)] + ["ĀĀ"])
    w.add_token_types([1] * c.vocab_size)
    w.add_token_merges(["Ā Ā"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for i in range(c.num_hidden_layers):
        for hf_name, gg in names.items():
            t = sd[f"model.layers.{i}.{hf_name}.weight"]
            if gg == "attn_q":
                t = _permute(t, c.num_attention_heads)
            elif gg == "attn_k":
                t = _permute(t, c.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{gg}.weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _check_gguf_matches_hf(path, rope: dict) -> None:  # type: ignore[no-untyped-def]
    """Our logits on the GGUF equal HF's with rope_parameters=rope on the same weights; HF without the
    scaling differs from them (so unscaled RoPE fails the check)."""
    ref = hf_logits(_tiny_llama(rope), LONG)  # (T, V)
    unscaled = (hf_logits(_tiny_llama(None), LONG) - ref).abs().max().item()
    assert unscaled > 1e-2, unscaled
    llm = LLM(str(path), kv_cache_memory="64MiB")
    diff = (llm.score(LONG) - ref).abs().max().item()
    assert diff < 1e-4, diff


LINEAR = {"rope_type": "linear", "factor": 4.0}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize("keys", [{"rope.scaling.type": "linear", "rope.scaling.factor": 4.0},
                                  {"rope.scaling.factor": 4.0},  # llama.cpp reads a missing type as linear
                                  {"rope.scale_linear": 4.0}],  # the key's old name
                         ids=["type", "no-type", "old-key"])
def test_gguf_linear_rope_scaling_matches_hf(tmp_path, keys):  # type: ignore[no-untyped-def]
    path = tmp_path / "linear.gguf"
    write_gguf(path, _tiny_llama(LINEAR), keys)
    _check_gguf_matches_hf(path, LINEAR)


def test_gguf_rope_freqs_match_hf_llama3(tmp_path):  # type: ignore[no-untyped-def]
    hf = _tiny_llama(LLAMA3)
    freqs = _llama3_rope_freqs(10000.0, 16, LLAMA3)  # (d/2,)
    default_inv = _tiny_llama(None).model.rotary_emb.inv_freq  # (d/2,)
    assert torch.allclose(default_inv / torch.from_numpy(freqs), hf.model.rotary_emb.inv_freq, rtol=1e-6)
    assert len(set(freqs.tolist())) > 2  # unscaled, interpolated and fully scaled frequencies all present
    path = tmp_path / "llama3.gguf"
    write_gguf(path, hf, {}, rope_freqs=freqs)
    _check_gguf_matches_hf(path, LLAMA3)


def test_gguf_unsupported_rope_scaling_raises(tmp_path):  # type: ignore[no-untyped-def]
    path = tmp_path / "yarn.gguf"
    write_gguf(path, _tiny_llama(None), {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                                         "rope.scaling.original_context_length": 64})
    with pytest.raises(ValueError, match="yarn"):
        LLM(str(path), kv_cache_memory="64MiB")


def test_a_byte_level_gguf_matches_its_user_defined_tokens_whole():
    """llama.cpp's converter writes every added token that is not special as USER_DEFINED (type 4): Qwen
    2.5's <tool_call>, Qwen 3's <think>. Only SentencePiece files added them; in a byte-level ('gpt2')
    file text holding them was split by BPE ('<', 'think', '>'), ids the model never saw there."""
    from lmserve.models.gguf_file import GGUFFile
    from lmserve.models.loader import resolve_model
    from lmserve.tokenizer import Tokenizer
    real = GGUFFile(resolve_model("smollm2-135m").path)
    extra = ["<think>", "</think>", "<tool_call>"]

    class WithUserTokens:  # the default model's metadata, three user-defined tokens appended
        path = None

        def field(self, key, default=None):  # type: ignore[no-untyped-def]
            v = real.field(key, default)
            if key == "tokenizer.ggml.tokens":
                return list(v) + extra
            if key == "tokenizer.ggml.token_type":
                return list(v) + [4] * len(extra)
            return v

    tok = Tokenizer.from_gguf(WithUserTokens())
    ids = [tok.raw.token_to_id(t) for t in extra]
    assert ids == [49152, 49153, 49154]
    text = "<think>\n\n</think>\n\n<tool_call>"
    got = tok.encode(text, add_special_tokens=False)
    nl = tok.encode("\n\n", add_special_tokens=False)
    assert got == [ids[0], *nl, ids[1], *nl, ids[2]]
    assert tok.decode(got) == text  # not special: kept by skip_special_tokens


def test_the_tokenizer_option_is_used_for_every_kind_of_model(tmp_path):  # type: ignore[no-untyped-def]
    """`tokenizer=` (--tokenizer) was read for HF folders only: a GGUF kept its own vocabulary and a
    shape model had none, the option silently ignored. Now the folder named is the tokenizer for any
    model; one that holds no tokenizer, or one with more tokens than the model, is refused by name."""
    from tokenizers import Tokenizer as Raw
    from tokenizers import models

    from tests.conftest import char_tokenizer_model
    (tmp_path / "empty").mkdir()
    chars = char_tokenizer_model(tmp_path / "empty", tmp_path / "chars")  # a tokenizer alone: ids = ASCII codes
    path = tmp_path / "tiny.gguf"
    write_gguf(path, _tiny_llama(None), {})
    assert LLM(str(path), kv_cache_memory="64MiB").tokenizer.encode("ab", add_special_tokens=False) != [97, 98]
    own = LLM(str(path), kv_cache_memory="64MiB", tokenizer=str(chars))
    assert own.tokenizer.encode("ab", add_special_tokens=False) == [97, 98]
    assert own.generate("ab", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0].prompt_token_ids == [97, 98]
    shape = LLM("shape:debug-tiny", kv_cache_memory="64MiB", tokenizer=str(chars))
    assert shape.tokenizer is not None and shape.tokenizer.encode("ab", add_special_tokens=False) == [97, 98]
    with pytest.raises(ValueError, match="tokenizer: .* is not a folder holding a tokenizer"):
        LLM("shape:debug-tiny", kv_cache_memory="64MiB", tokenizer=str(tmp_path))
    big = tmp_path / "big"
    big.mkdir()
    Raw(models.WordLevel({f"t{i}": i for i in range(600)}, unk_token="t0")).save(str(big / "tokenizer.json"))
    with pytest.raises(ValueError, match="tokenizer: .* has 600 tokens, more than the model's 512"):
        LLM("shape:debug-tiny", kv_cache_memory="64MiB", tokenizer=str(big))
