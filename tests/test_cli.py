"""The command line as a user runs it: generate (text and JSON), chat (streaming, interactive)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def run(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmserve.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=300)


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


def test_chat_streams_and_keeps_history():
    r = run(["chat", "--max-tokens", "12", "--temperature", "0"], stdin="What is 2+2?\n/reset\nSay hi.\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "4" in r.stdout
    assert r.stdout.count("> ") >= 3  # a prompt per turn
