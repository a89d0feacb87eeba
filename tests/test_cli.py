"""The command line as a user runs it: generate (text and JSON), chat (streaming, interactive); and the
engine flags, one per EngineConfig field, parsed back into the same EngineConfig."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lmserve.cli import build_parser, main
from lmserve.cli.engine_args import add_engine_args, engine_kwargs
from lmserve.cli.sampling_args import sampling_params
from lmserve.config import EngineConfig


def run(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmserve.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_generate_json_and_text():
    r = run(["generate", "The capital of France is", "The sky is", "--max-tokens", "6", "--json"])
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert len(data["outputs"]) == 2 and all(len(o["token_ids"]) == 6 for o in data["outputs"])
    assert data["outputs"][0]["text"].strip().startswith("Paris")
    assert data["summary"]["output_tokens"] == 12 and data["summary"]["output_tokens_per_s"] > 0
    assert data["summary"]["cuda_graph_capture_s"] is None  # no CUDA here: nothing captured
    bad = run(["generate", "hi", "--top-p", "1.5"])
    assert bad.returncode == 2 and "top_p" in bad.stderr


@pytest.mark.slow
def test_chat_streams_and_keeps_history():
    r = run(["chat", "--max-tokens", "12", "--temperature", "0"], stdin="What is 2+2?\n/reset\nSay hi.\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "4" in r.stdout
    assert r.stdout.count("> ") >= 3  # a prompt per turn


def engine_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def config_from(argv: list[str]) -> EngineConfig:
    a = engine_parser().parse_args(argv)
    return EngineConfig(model=a.model, **engine_kwargs(a))


def test_every_engine_config_field_has_a_flag():
    flags = set(re.findall(r"--[a-z-]+", engine_parser().format_help()))
    for f in dataclasses.fields(EngineConfig):
        assert "--" + f.name.replace("_", "-") in flags, f.name
    assert {"--no-enable-prefix-caching", "--spec-min-acceptance"} <= flags


def test_engine_flags_round_trip_to_engine_config():
    assert config_from([]) == EngineConfig()
    assert config_from(["--spec-min-acceptance", "0.5", "--no-enable-prefix-caching",
                        "--cuda-graph-sizes", "1", "2", "4"]) == EngineConfig(
        spec_min_acceptance=0.5, enable_prefix_caching=False, cuda_graph_sizes=[1, 2, 4])
    assert config_from(["--model", "shape:qwen3-0.6b", "--kv-cache-memory", "512MiB", "--enforce-eager",
                        "--max-num-seqs", "8", "--gpu-memory-utilization", "0.5", "--attention-backend", "torch",
                        "--speculative-method", "ngram", "--num-speculative-tokens", "2"]) == EngineConfig(
        model="shape:qwen3-0.6b", kv_cache_memory=512 * 2**20, enforce_eager=True, max_num_seqs=8,
        gpu_memory_utilization=0.5, attention_backend="torch", speculative_method="ngram", num_speculative_tokens=2)
    with pytest.raises(SystemExit):
        engine_parser().parse_args(["--attention-backend", "cuda"])


@pytest.mark.parametrize("argv", [["generate", "hi"], ["chat"], ["serve"], ["bench", "throughput"],
                                  ["bench", "latency"], ["bench", "spec"], ["bench", "parallel"]])
def test_every_model_command_takes_the_engine_flags(argv):  # type: ignore[no-untyped-def]
    """(`bench serve` only talks HTTP to a server: it has no engine flags.)"""
    a = build_parser().parse_args([*argv, "--spec-min-acceptance", "0.5", "--block-size", "32"])
    assert a.spec_min_acceptance == 0.5 and a.block_size == 32 and a.model == EngineConfig().model


def test_chat_defaults_differ_from_generate():
    gen = sampling_params(build_parser().parse_args(["generate", "hi"]))
    chat = sampling_params(build_parser().parse_args(["chat"]))
    assert (gen.max_tokens, gen.temperature) == (64, 0.0) and (chat.max_tokens, chat.temperature) == (256, 0.7)
    given = sampling_params(build_parser().parse_args(["chat", "--temperature", "0"]), {"temperature": 0.3})
    assert (given.max_tokens, given.temperature) == (256, 0.0)  # a flag given is not the model's to change


def test_ctrl_c_in_chat_stops_a_reply_or_leaves_without_a_traceback(tiny_models, tmp_path, capsys, monkeypatch):  # type: ignore[no-untyped-def]
    """Ctrl-C at the chat prompt ended in a KeyboardInterrupt traceback, and during a reply it ended the
    whole chat. Now during a reply it stops that reply (the message that asked for it leaves the history)
    and at the prompt it leaves with status 130."""
    from lmserve.engine import Engine
    from tests.conftest import char_tokenizer_model
    model = char_tokenizer_model(tiny_models["llama"][0], tmp_path / "llama")
    lines = iter(["hi", "again"])

    def typed(prompt: str = "") -> str:
        try:
            return next(lines)
        except StopIteration:
            raise KeyboardInterrupt from None
    monkeypatch.setattr("builtins.input", typed)
    prompts, steps = [], []
    real_add, real_step = Engine.add_request, Engine.step

    def add(self, rid, ids, *a, **kw):  # type: ignore[no-untyped-def]
        prompts.append("".join(map(chr, ids)))
        return real_add(self, rid, ids, *a, **kw)

    def step(self):  # type: ignore[no-untyped-def]
        steps.append(1)
        if len(steps) == 2:  # Ctrl-C in the first reply
            raise KeyboardInterrupt
        return real_step(self)
    monkeypatch.setattr(Engine, "add_request", add)
    monkeypatch.setattr(Engine, "step", step)
    tpl = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<a>"
    assert main(["chat", "--model", str(model), "--kv-cache-memory", "64MiB", "--chat-template", tpl,
                 "--max-tokens", "3", "--ignore-eos"]) == 130
    err = capsys.readouterr().err
    assert "[stopped]" in err and "Traceback" not in err
    assert prompts == ["<user>hi<a>", "<user>again<a>"]  # the stopped turn left the history
    assert len(steps) >= 2 + 3  # the second reply ran to its 3 tokens


def test_generate_chat_without_a_template_is_an_error(tiny_models, capsys):  # type: ignore[no-untyped-def]
    """`generate --chat` on a model without a chat template (here: without a tokenizer) raised
    AttributeError: 'NoneType' object has no attribute 'encode'."""
    assert main(["generate", "hi", "--chat", "--model", str(tiny_models["llama"][0]),
                 "--kv-cache-memory", "64MiB"]) == 2
    assert "error: --chat: this model has no chat template" in capsys.readouterr().err


def test_readme_flag_table_names_every_engine_flag():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    table = readme.split("Engine flags (every command that loads a model)")[1].split("\n\n## ")[0]
    documented = set(re.findall(r"--[a-z-]+", table))
    for f in dataclasses.fields(EngineConfig):
        assert "--" + f.name.replace("_", "-") in documented, f.name


def test_chat_templates_are_bounded_in_output_and_time():
    """A chat template is code from the model's files: one that renders past 4 Mi characters or runs
    past 2 s (a loop that prints nothing included: the sandbox checks the clock at every call) is a
    ValueError naming messages, and a normal template still renders."""
    import time

    from tokenizers import Tokenizer as Raw
    from tokenizers.models import WordLevel

    from lmserve.tokenizer import Tokenizer
    raw = Raw(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    msgs = [{"role": "user", "content": "hi"}]
    for tpl, why in (("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "longer"),
                     ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "output")):
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=f"messages: the chat template.*{why}"):
            Tokenizer(raw, chat_template=tpl).apply_chat_template(msgs)
        assert time.monotonic() - t0 < 5
    assert Tokenizer(raw, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}").apply_chat_template(
        msgs) == "hi"


def test_a_template_with_transformers_generation_block_renders_as_transformers_does():
    """{% generation %} ... {% endgeneration %} (transformers' tag marking the assistant's text; TRL saves
    templates with it) did not compile: every chat request to such a model was a 400."""
    from tokenizers import Tokenizer as Raw
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from lmserve.tokenizer import Tokenizer
    tpl = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<A>{% generation %}{{ m['content'] }}</A>"
           "{% endgeneration %}\n{% else %}<{{ m['role'] }}>{{ m['content'] }}\n{% endif %}{% endfor %}"
           "{% if add_generation_prompt %}<A>{% endif %}")
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    raw = Raw(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")
    hf.chat_template = tpl
    want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert Tokenizer(raw, chat_template=tpl).apply_chat_template(msgs) == want
    assert want.startswith("<user>Hi\n<A>Hello</A>") and want.endswith("<A>")


def test_one_operation_cannot_build_a_huge_value_in_a_template():
    """`*` and `**` make a huge value with no call for the clock check to see ({{ 'x' * 10**9 }},
    {{ 9 ** (9 ** 9) }}, which jinja would even fold while compiling): their operands are bounded, so such a
    template fails at once (a request's own template, with the server's trust, too)."""
    import time

    import jinja2
    from tokenizers import Tokenizer as Raw
    from tokenizers.models import WordLevel

    from lmserve.tokenizer import Tokenizer
    raw = Raw(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    msgs = [{"role": "user", "content": "hi"}]
    tok = Tokenizer(raw, chat_template="{{ messages[0]['content'] }}")
    for tpl in ("{{ 'x' * 10**9 }}", "{{ 9 ** (9 ** 9) }}", "{{ 2 ** (10 ** 7) }}", "{{ [1, 2] * 10**8 }}",
                "{% set n = 10**1000 %}{% set m = n * n %}{{ m * m * m }}"):
        t0 = time.monotonic()
        with pytest.raises((jinja2.exceptions.SecurityError, ValueError)):
            tok.apply_chat_template(msgs, template=tpl)
        assert time.monotonic() - t0 < 2, tpl
    assert tok.apply_chat_template(msgs, template="{{ 'ab' * 3 }}{{ 2 ** 10 }}") == "ababab1024"


@pytest.mark.parametrize("argv,flag", [
    (["eval", "perplexity", "--stride", "0"], "--stride"), (["eval", "perplexity", "--window", "0"], "--window"),
    (["eval", "perplexity", "--max-tokens", "-50"], "--max-tokens"),
    (["bench", "throughput", "--num-requests", "0"], "--num-requests"),
    (["bench", "throughput", "--num-requests", "-3"], "--num-requests"),
    (["quantize", "--calib", "c", "--out", "o", "--group-size", "0"], "--group-size"),
    (["quantize", "--calib", "c", "--out", "o", "--n-grid", "0"], "--n-grid"),
    (["plan", "--mem-gb", "0"], "--mem-gb"), (["plan", "--mem-gb", "-4"], "--mem-gb"),
    (["plan", "--seq-len", "-5"], "--seq-len"), (["plan", "--batch", "0"], "--batch"),
    (["plan", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["bench", "latency", "--repeats", "0"], "--repeats"), (["bench", "latency", "--batch-size", "0"], "--batch-size"),
    (["bench", "serve", "--request-rate", "0"], "--request-rate"),
    (["serve", "--max-queue", "-5"], "--max-queue"), (["serve", "--request-timeout", "-1"], "--request-timeout"),
    (["router", "--replica", "http://x", "--health-interval", "0"], "--health-interval"),
    (["router", "--replica", "http://x", "--balance", "-1"], "--balance"),
    (["serve", "--port", "70000"], "--port"), (["router", "--replica", "http://x", "--port", "70000"], "--port"),
])
def test_a_flag_out_of_range_is_a_usage_error(argv, flag, capsys):  # type: ignore[no-untyped-def]
    """Each was taken (0 silently became the default: --stride 0 -> 16, --num-requests 0 -> the preset's;
    -50 tokens scored 53) or crashed with a traceback (KeyError, ZeroDivisionError, AssertionError)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and flag in capsys.readouterr().err


@pytest.mark.parametrize("argv,field", [
    (["serve", "--policy", "round-robin"], "policy"), (["serve", "--health-interval", "5"], "health_interval"),
    (["serve", "--kv-peer", "http://127.0.0.1:1"], "kv_peer"),
    (["bench", "spec", "--spec-max-batch", "1"], "spec_max_batch"),
    (["bench", "spec", "--speculative-method", "ngram"], "speculative_method"),
    (["bench", "spec", "--speculative-config", '{"method": "ngram"}'], "speculative_config"),
    (["generate", "hi", "--num-speculative-tokens", "3"], "num_speculative_tokens"),
    (["chat", "--draft-model", "smollm2-135m"], "draft_model"), (["serve", "--spec-policy", "goodput"], "spec_policy"),
    (["serve", "--data-parallel", "2", "--ngram-max=4"], "ngram_max"),
    (["serve", "--chat-template-max-seconds", "0", "--model", "/nowhere"], "template_max_seconds"),
])
def test_a_flag_the_command_would_ignore_is_refused(argv, field, capsys):  # type: ignore[no-untyped-def]
    """Router flags without --data-parallel, --kv-peer without --role prefill, the two flags bench spec
    sets for each row, and speculation flags without a speculative method were accepted and ignored (no
    model is loaded before the refusal); serve's limits were checked only after the model loaded."""
    assert main(argv) == 2
    assert f"error: {field}" in capsys.readouterr().err


def test_plan_under_torchrun_runs_on_rank_0_and_is_refused_elsewhere(monkeypatch, capsys):  # type: ignore[no-untyped-def]
    """plan has --tensor-parallel-size but loads no model: rank 1 of a torchrun got an AttributeError."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert main(["plan", "--model", "llama-3.1-8b"]) == 2 and "loads no model" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")
    assert main(["plan", "--model", "llama-3.1-8b"]) == 0


def test_cli_hunt_findings(tmp_path, capsys, tiny_models):  # type: ignore[no-untyped-def]
    """Found by the CLI hunt (each failed before): the byte-size flags take a plain number of bytes, 0
    included, as README says (they were "cannot parse '0'"); timeouts take fractions of a second; a
    config.json without a field the shapes need, or not an object, is one error line (a KeyError /
    AttributeError traceback); --device cuda without CUDA says so (torch's AssertionError); eval's float
    reference does not take the model's --quantization-group-size (it was refused, always)."""
    args = build_parser().parse_args(["generate", "hi", "--swap-space", "0", "--kv-offloading-size", "0",
                                      "--kv-cache-memory", "268435456"])
    cfg = EngineConfig(**engine_kwargs(args))
    assert (cfg.swap_space, cfg.kv_offloading_size, cfg.kv_cache_memory) == (0, 0, 268435456)
    assert EngineConfig(**engine_kwargs(build_parser().parse_args(["generate", "hi", "--kv-cache-memory", "2GiB"]))
                        ).kv_cache_memory == 2 << 30
    assert build_parser().parse_args(["serve", "--shutdown-timeout", "2.5"]).shutdown_timeout == 2.5
    assert build_parser().parse_args(["router", "--replica", "http://x", "--upstream-timeout", "0.5"]
                                     ).upstream_timeout == 0.5
    for name, text in (("empty", "{}"), ("list", "[1, 2]")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(text)
        assert main(["plan", "--model", str(folder / "config.json")]) == 2
        assert main(["generate", "hi", "--model", str(folder)]) == 2
        err = capsys.readouterr().err
        why = "has no 'num_attention_heads'" if name == "empty" else "must be a JSON object"
        assert err.count(why) == 2 and err.count("error: ") == 2 and "Traceback" not in err, err
    import torch
    if not torch.cuda.is_available():
        assert main(["generate", "hi", "--model", str(tiny_models["llama"][0]), "--device", "cuda"]) == 2
        assert "error: device: 'cuda'" in capsys.readouterr().err
    from tests.conftest import char_tokenizer_model
    model = char_tokenizer_model(tiny_models["llama"][0], tmp_path / "chars")
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 4)
    assert main(["eval", "perplexity", "--model", str(model), "--text", str(text), "--quantization", "int8",
                 "--quantization-group-size", "32", "--window", "32", "--stride", "16",
                 "--kv-cache-memory", "16MiB"]) == 0, capsys.readouterr().err
