"""scripts/gpu_check.py on the CPU: the margin-aware argmax gate on synthetic logits, the part runner
(each part in its own process, its results in its own file: a crashed, raising or killed part keeps
what it wrote and the next part still runs, within the budget), and the whole dry run within --budget.

Kept free of torch at import: the part functions below are unpickled in fresh worker processes,
which import this module.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))  # the workers import gpu_check by name too (they get this sys.path)

import gpu_check  # noqa: E402


def _logits(p: int, v: int, seed: int):  # type: ignore[no-untyped-def]
    """Reference logits (p, v) whose top-two gaps are exponential with median 0.08 (as a random-weight
    qwen3-0.6b's are)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(p, v, generator=g)  # (p, v)
    top = ref.argmax(-1)  # (p,)
    gaps = -torch.rand(p, generator=g).log() * (0.08 / 0.693)  # (p,): the top-two gap each position will have
    second = ref.scatter(1, top[:, None], float("-inf")).amax(-1)  # (p,)
    ref[torch.arange(p), top] = second + gaps
    return ref


def test_gate_passes_rounding_noise_that_raw_agreement_fails():
    """A correct fast path: the reference plus rounding-sized noise. Raw agreement falls well below
    99% (small gaps flip), the margin-aware gate passes."""
    import torch
    ref = _logits(400, 1000, 0)
    fast = ref + 0.01 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))  # (400, 1000)
    g = gpu_check.argmax_gate(fast, ref)
    assert g["raw_agreement"] < 0.99
    assert g["passed"], g["reasons"]
    assert g["confident"] > 0.5 * 400 and g["confident_agreement"] == 1.0 and g["worst_rank"] < 5


def test_gate_fails_a_path_wrong_at_a_few_positions():
    """The same noise, plus 3% of positions whose argmax moves to the reference's 3rd token (a
    kernel bug on some rows): every fast argmax is still in the top 5, yet the gate fails on the
    confident positions, and the wrong positions' large differences do not raise the noise."""
    import torch
    ref = _logits(400, 1000, 2)
    fast = ref + 0.01 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(3))  # (400, 1000)
    bad = torch.arange(0, 400, 33)  # (13,)
    third = ref[bad].topk(3, -1).indices[:, 2]  # (13,)
    fast[bad, third] = ref[bad].amax(-1) + 1.0
    g = gpu_check.argmax_gate(fast, ref)
    assert not g["passed"] and g["worst_rank"] == 2
    assert any("confident positions" in r for r in g["reasons"])
    assert g["noise"] < 0.2


def test_gate_fails_outside_the_top5_even_where_the_margin_is_small():
    import torch
    ref = _logits(200, 500, 4)
    fast = ref.clone()
    i = int((ref.topk(2, -1).values.diff(dim=-1).abs().squeeze(-1)).argmin())  # the smallest-gap position
    fast[i, ref[i].argsort()[0]] = ref[i].amax() + 0.01  # its least likely token wins
    g = gpu_check.argmax_gate(fast, ref)
    assert not g["passed"] and any("top 5" in r for r in g["reasons"])


def test_gate_fails_noise_that_leaves_nothing_confident():
    """A broken path (logits unrelated to the reference) is not passed for lack of evidence."""
    import torch
    ref = _logits(200, 500, 5)
    g = gpu_check.argmax_gate(torch.randn(ref.shape, generator=torch.Generator().manual_seed(6)), ref)
    assert not g["passed"]
    assert g["confident"] < 0.1 * 200


# parts for the runner test: module level, so that the worker processes can unpickle them

def _part_crash(p: gpu_check.Part, s: dict) -> None:
    p.row("written before the crash", "1")
    os.kill(os.getpid(), signal.SIGKILL)


def _part_ok(p: gpu_check.Part, s: dict) -> None:
    p.row("fine", str(s["value"]))


def _part_raise(p: gpu_check.Part, s: dict) -> None:
    p.row("written before raising", "2")
    raise subprocess.CalledProcessError(1, ["cc", "launcher.c"])


def _part_check_fails(p: gpu_check.Part, s: dict) -> None:
    p.fail("a check")


def _part_hang(p: gpu_check.Part, s: dict) -> None:
    p.row("written before hanging", "3")
    time.sleep(600)


def test_part_runner_keeps_each_parts_results(tmp_path):  # type: ignore[no-untyped-def]
    """A crashed (SIGKILL), raising, failing and hanging part each end with their own status and the
    rows they wrote; the parts after them still run; the hanging one is killed at the budget's end;
    the one that no longer fits is skipped; the whole run stays inside the budget; `after` can
    change what the next parts get."""
    parts = [("crash", 5, _part_crash), ("ok", 5, _part_ok), ("raise", 5, _part_raise),
             ("check", 5, _part_check_fails), ("hang", 5, _part_hang), ("late", 2, _part_ok)]
    seen = []

    def after(name: str, res: dict) -> None:
        seen.append((name, res["status"]))
        settings["value"] = 42

    settings = {"value": 1}
    budget = 8.0
    t0 = time.monotonic()
    report = gpu_check.run_parts(parts, settings, tmp_path, budget, preload=(), after=after)
    wall = time.monotonic() - t0
    assert wall < budget + 1.0
    on_disk = json.loads((tmp_path / "gpu_check.json").read_text())
    assert on_disk["parts"] == json.loads(json.dumps(report["parts"]))
    st = {n: r["status"] for n, r in on_disk["parts"].items()}
    assert st == {"crash": "crashed", "ok": "ok", "raise": "error", "check": "failed", "hang": "timeout",
                  "late": "skipped"}
    rows = {n: r["rows"] for n, r in on_disk["parts"].items()}
    assert rows["crash"] == [["written before the crash", "1"]]
    assert rows["ok"] == [["fine", "42"]]  # settings as `after` left them
    assert rows["raise"] == [["written before raising", "2"]] and rows["hang"] == [["written before hanging", "3"]]
    assert "CalledProcessError" in on_disk["parts"]["raise"]["error"]
    assert "exit code -9" in on_disk["parts"]["crash"]["error"]
    assert "left of --budget" in on_disk["parts"]["late"]["error"]
    assert on_disk["failed"] == ["crash", "raise", "check", "hang"]
    assert [n for n, _ in seen] == ["crash", "ok", "raise", "check", "hang"]
    assert (tmp_path / "parts" / "crash.json").exists()
    table = gpu_check.format_table(on_disk)
    assert "== crash: CRASHED" in table and "== late: SKIPPED" in table and "written before hanging" in table


def test_part_killed_after_overrunning_its_estimate(tmp_path):  # type: ignore[no-untyped-def]
    """A hang is cut at OVERRUN x its estimate, not at the budget's end: the next part still runs."""
    report = gpu_check.run_parts([("hang", 1, _part_hang), ("ok", 2, _part_ok)], {"value": 7}, tmp_path, 30.0,
                                 preload=())
    assert report["parts"]["hang"]["status"] == "timeout" and "estimate" in report["parts"]["hang"]["error"]
    assert report["parts"]["hang"]["seconds"] < gpu_check.OVERRUN * 1 + 2
    assert report["parts"]["ok"]["rows"] == [["fine", "7"]]


def test_cpu_dry_run_within_budget(tmp_path):  # type: ignore[no-untyped-def]
    """`gpu_check.py --device cpu --small --budget B` ends within B and writes one JSON with every
    part's status (parts that would not fit are skipped, not cut off mid-way). All ten take ~60 s alone
    on a 2-core CI machine; the budget leaves room for the other test worker's load (at 45 s the
    correctness part, started late on a loaded machine, was cut at the budget's end)."""
    budget = 120
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(SCRIPTS / "gpu_check.py"), "--device", "cpu", "--small",
                           "--budget", str(budget), "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=budget + 30)
    wall = time.monotonic() - t0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert wall < budget + 3, proc.stdout[-2000:]
    assert report["order"] == [n for n, *_ in gpu_check.PARTS]
    st = {n: r["status"] for n, r in report["parts"].items()}
    assert set(st.values()) <= {"ok", "skipped"}, (st, proc.stdout[-3000:])  # a slow machine skips the last ones
    assert st["preflight"] == "ok" and st["correctness"] == "ok" and proc.returncode == 0
    assert all(n in proc.stdout for n in st)  # the table names every part


def _part_no_compiler(p: gpu_check.Part, s: dict) -> None:
    p.row("C compiler / Python.h (as Triton finds them)", "NONE / /usr/include/python3.12/Python.h MISSING")
    raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")


def _part_engine_sees_no_triton(p: gpu_check.Part, s: dict) -> None:
    import importlib.util

    from lmserve.attention import get_backend
    from lmserve.utils import triton_available
    try:
        import lmserve.layers.fused  # noqa: F401
        fused = "imports"
    except ImportError:
        fused = "hidden"
    p.row("triton", f"{importlib.util.find_spec('triton')} {triton_available()} {fused} "
                    f"{type(get_backend('auto', 'cuda')).__name__}")


def test_failed_preflight_runs_the_rest_on_torch_ops(tmp_path):  # type: ignore[no-untyped-def]
    """When the preflight cannot launch a Triton kernel (no C compiler), the parts that test Triton
    are skipped, the others run with Triton hidden (the engine picks the torch attention backend,
    the fused ops do not import, the sampler sees no Triton), and the table says so loudly."""
    settings = {"no_triton": False}
    banner: list[str] = []
    parts = [("preflight", 5, _part_no_compiler), ("kernels", 5, _part_ok),
             ("batch-1 decode", 20, _part_engine_sees_no_triton)]
    report = gpu_check.run_parts(parts, settings, tmp_path, 60.0, preload=(), before=gpu_check.skip_without_triton,
                                 after=lambda n, r: gpu_check.note_preflight(n, r, settings, banner))
    st = {n: r["status"] for n, r in report["parts"].items()}
    assert st == {"preflight": "error", "kernels": "skipped", "batch-1 decode": "ok"}
    assert report["parts"]["preflight"]["rows"][0][1].endswith("MISSING")
    assert report["parts"]["batch-1 decode"]["rows"] == [["triton", "None False hidden TorchAttention"]]
    assert banner and "NO TRITON" in banner[0] and "Failed to find C compiler" in banner[0]


def test_swap_comparison_allows_a_divergence_at_a_near_tie_only():
    """The swap part compares swapped greedy outputs with an unpreempted pool's: a first difference where
    the reference's top two were within the tie (other batch shapes round differently in bf16) passes;
    one at a clear choice, or a length difference, is a failure."""
    from types import SimpleNamespace as NS

    def lps(gaps: list[float]) -> list[NS]:
        return [NS(top={1: -0.1, 2: -0.1 - g}) for g in gaps]
    ref = [[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1]]
    got = [[1, 1, 1], [1, 2, 2], [2, 1, 1], [1, 1, 1]]
    ref_lps = [lps([1.0, 1.0, 1.0]), lps([1.0, 0.01, 1.0]), lps([0.5, 1.0, 1.0]), lps([1.0, 1.0])]
    same, ties, clear = gpu_check.near_tie_divergences(got, ref, ref_lps, tie=0.05)
    assert (same, ties) == (1, 1)
    assert [(k, i) for k, i, _ in clear] == [(2, 0), (3, 2)]
    assert clear[0][2] == pytest.approx(0.5)
