"""`lmserve eval perplexity`: the sliding-window perplexity through the engine equals a hand computation
with HF transformers' forward (several stride cases), top-1 agreement is 100% for the same model, and
the command prints a line per configuration and writes its JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lmserve import LLM
from lmserve.quant.perplexity import evaluate_perplexity, sliding_windows
from tests.conftest import char_tokenizer_model

KV = "16MiB"
TEXT = Path(__file__).parent / "data" / "declaration_gettysburg.txt"


def token_ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_perplexity(hf_model, ids: list[int], window: int, stride: int) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """HF's recipe, by hand: window after window, labels of the tokens the last window already scored
    set to -100, the loss summed over the rest (label shift inside), then exp(total NLL / count)."""
    total, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        trg_len = end - prev_end
        x = torch.tensor([ids[begin:end]])
        labels = x.clone()
        labels[:, :-trg_len] = -100
        with torch.no_grad():
            logits = hf_model(x).logits.double()
        shift_logits, shift_labels = logits[0, :-1], labels[0, 1:]
        total += float(F.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="sum"))
        count += int((shift_labels != -100).sum())
        prev_end = end
        if end == len(ids):
            break
    return math.exp(total / count), count


def test_every_token_after_the_first_is_scored_once():
    """With overlapping windows every token but the first is scored once; disjoint windows (stride =
    window) cannot score their own first token, which has no context inside its window."""
    for n, window, stride in [(50, 16, 16), (50, 16, 8), (50, 16, 5), (50, 64, 32), (17, 16, 16), (2, 2, 1)]:
        scored = [t for _, end, first in sliding_windows(n, window, stride) for t in range(first, end)]
        skipped = set(range(window, n, window)) if stride == window else set()
        assert scored == [t for t in range(1, n) if t not in skipped], (n, window, stride)
    assert sliding_windows(40, 16, 8)[:2] == [(0, 16, 1), (8, 24, 16)]
    with pytest.raises(ValueError, match="stride"):
        sliding_windows(40, 16, 17)


@pytest.mark.parametrize("window,stride", [(16, 16), (16, 8), (16, 5), (24, 23), (64, 32)])
def test_perplexity_equals_a_hand_computation_with_hf(tiny_models, window, stride):
    folder, hf = tiny_models["llama"]
    llm = LLM(str(folder), kv_cache_memory=KV)
    ids = token_ids(50)
    res = evaluate_perplexity({"m": llm.score}, ids, window, stride)["m"]
    want, count = hf_perplexity(hf, ids, window, stride)
    assert res.tokens == count == 49 - (len(range(window, 50, window)) if stride == window else 0)
    assert res.perplexity == pytest.approx(want, rel=1e-5)
    assert res.top1_agreement is None  # no reference given


def test_agreement_is_total_for_the_same_model_and_not_for_another(tiny_models):
    a = LLM(str(tiny_models["llama"][0]), kv_cache_memory=KV)
    b = LLM(str(tiny_models["llama"][0]), kv_cache_memory=KV)
    other = LLM(str(tiny_models["qwen2"][0]), kv_cache_memory=KV)
    ids = token_ids(40, seed=1)
    res = evaluate_perplexity({"ref": a.score, "same": b.score, "other": other.score}, ids, 16, 8, reference="ref")
    assert res["ref"].top1_agreement == res["same"].top1_agreement == 1.0
    assert res["same"].perplexity == pytest.approx(res["ref"].perplexity, rel=1e-6)
    assert res["other"].top1_agreement < 0.5 and res["other"].tokens == 39


def test_eval_command_prints_a_line_per_configuration_and_writes_json(tiny_models, tmp_path, capsys):
    from lmserve.cli import main
    model = char_tokenizer_model(tiny_models["llama"][0], tmp_path / "a")
    other = char_tokenizer_model(tiny_models["mistral"][0], tmp_path / "b")
    out = tmp_path / "ppl.json"
    common = ["--text", str(TEXT), "--window", "64", "--stride", "32", "--max-tokens", "300",
              "--kv-cache-memory", KV, "--no-progress", "--output-json", str(out)]
    assert main(["eval", "perplexity", "--model", str(model), *common]) == 0
    printed = capsys.readouterr().out
    assert "300 tokens of declaration_gettysburg.txt, windows of 64 every 32 (9 windows, 299 scored tokens)" in printed
    data = json.loads(out.read_text())
    assert [r["top1_agreement"] for r in data["results"]] == [1.0] and data["text"]["tokens"] == 300
    # the same tokens, another model as the reference: two lines, the second with its agreement
    assert main(["eval", "perplexity", "--model", str(model), "--reference-model", str(other), *common]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "weights=none kv=auto" in ln]
    assert len(lines) == 2 and lines[0].startswith(str(other))
    data = json.loads(out.read_text())
    first, second = data["results"]
    assert first["reference"] and first["top1_agreement"] == 1.0 and 0 <= second["top1_agreement"] < 1
    llm = LLM(str(model), kv_cache_memory=KV)
    want = evaluate_perplexity({"m": llm.score}, llm.tokenizer.encode(TEXT.read_text())[:300], 64, 32)["m"].perplexity
    assert second["perplexity"] == pytest.approx(want, rel=1e-6)


def test_an_awq_checkpoint_is_labelled_awq_and_needs_a_float_reference(tiny_models, tmp_path, capsys):  # type: ignore[no-untyped-def]
    """An AutoAWQ folder loads as awq whatever --quantization says: it was labelled weights=none and, as
    its own 'unquantized' reference, agreed with itself 100%. Now it is labelled awq, and without a float
    --reference-model it is refused; with one, the float model is the reference. A bad --reference-dtype
    names that flag (it said dtype:)."""
    from lmserve.cli import main
    model = char_tokenizer_model(tiny_models["llama"][0], tmp_path / "model")
    awq = tmp_path / "awq"
    assert main(["quantize", "--method", "awq", "--model", str(model), "--calib", str(TEXT), "--out", str(awq),
                 "--calib-seq-len", "128", "--calib-samples", "4", "--kv-cache-memory", KV]) == 0
    capsys.readouterr()
    common = ["--text", str(TEXT), "--window", "64", "--stride", "32", "--max-tokens", "200", "--kv-cache-memory", KV,
              "--no-progress"]
    assert main(["eval", "perplexity", "--model", str(awq), *common]) == 2
    assert "reference-model" in capsys.readouterr().err
    assert main(["eval", "perplexity", "--model", str(awq), "--reference-model", str(model), *common]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if " kv=auto" in ln]
    assert len(lines) == 2 and "weights=none" in lines[0] and lines[0].startswith(str(model))
    assert "weights=awq" in lines[1] and lines[1].startswith(str(awq))
    assert main(["eval", "perplexity", "--model", str(model), "--reference-dtype", "float99", *common]) == 2
    assert "reference-dtype" in capsys.readouterr().err


def test_a_quantized_label_says_when_activations_are_int8(monkeypatch):  # type: ignore[no-untyped-def]
    """On the CPU tile kernel's paths (VNNI, avx2int8) a quantized model's inputs are rounded to int8 too:
    the label says acts=int8 (it read as weight-only; a review measured int8 16.61 against 16.37
    weight-only on SmolLM2); float x paths and float models say nothing of it."""
    from lmserve.cli.eval import _label
    from lmserve.layers import cpu_native
    for isa, acts in (("avx2int8", True), ("vnni", True), ("avx2", False)):
        monkeypatch.setattr(cpu_native, "isa", lambda isa=isa: isa)
        assert ("acts=int8" in _label("m", {"quantization": "int8", "device": "cpu"})) == acts
        assert "acts=int8" not in _label("m", {"quantization": None, "device": "cpu"})
