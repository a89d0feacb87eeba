"""Every Triton kernel of lmserve compiles for a GPU (sm_90, the device gpu_check.py runs on) with the
installed Triton's real compiler and ptxas, though no GPU is here: scripts/triton_compile_check.py
--quick (every kernel, bf16, a third of the attention cases). The interpreter the other kernel tests
use shares Triton's front end but not the compiler's rules: a `break` in a kernel loop, for one, runs
there and fails to compile (checked by hand on the invariant combine kernel)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton has no CUDA backend (ptxas)")
def test_every_kernel_compiles_for_sm90(tmp_path):  # type: ignore[no-untyped-def]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    script = Path(__file__).resolve().parents[1] / "scripts" / "triton_compile_check.py"
    proc = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = next(line for line in proc.stdout.splitlines() if line.startswith("sm_90:"))
    for kernel in ("triton_invariant._split_kernel", "triton_invariant._combine_kernel", "triton_attn._prefill_kernel",
                   "triton_mla._decode_kernel", "triton_quant._tiled_kernel", "gumbel._gumbel_argmax_kernel",
                   "fused._add_rmsnorm_kernel"):
        assert kernel in summary, summary
