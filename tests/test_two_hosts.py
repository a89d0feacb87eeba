"""Two network hosts: two network namespaces joined by a veth pair. Tensor parallelism with one rank in
each, started by torchrun (its static rendezvous at rank 0's address), every collective over the veth
(--distributed-interface); and disaggregation with the prefill instance (and the router) on one host,
the decode instance on the other, the KV blocks crossing the veth. Needs root and iproute2 (`ip
netns`); skipped, with the reason, where the namespaces cannot be made."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lmserve import LLM
from lmserve.sequence import SamplingParams
from tests.conftest import char_tokenizer_model

PORT = 29533
HOSTS = [("a", "10.77.0.1"), ("b", "10.77.0.2")]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


@pytest.fixture
def two_hosts():  # type: ignore[no-untyped-def]
    """Namespaces lmtp<pid>a / b with veth ends va / vb holding 10.77.0.1 / .2."""
    tag = f"lmtp{os.getpid()}"
    names = [f"{tag}{h}" for h, _ in HOSTS]
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2): cannot make network namespaces")
    try:
        for n in names:
            _ip("netns", "add", n)
        _ip("link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb")
        for n, (h, addr) in zip(names, HOSTS):
            _ip("link", "set", f"{tag}v{h}", "netns", n)
            _ip("-n", n, "addr", "add", f"{addr}/24", "dev", f"{tag}v{h}")
            _ip("-n", n, "link", "set", f"{tag}v{h}", "up")
            _ip("-n", n, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError) as e:
        for n in names:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
        reason = getattr(e, "stderr", "") or str(e)
        print(f"\nskipped: cannot make network namespaces here (root needed): {reason.strip()}")
        pytest.skip(f"cannot make network namespaces here (root needed): {reason.strip()}")
    yield [(n, f"{tag}v{h}", addr) for n, (h, addr) in zip(names, HOSTS)]
    for n in names:  # deleting a namespace deletes its veth end, and the pair with it
        subprocess.run(["ip", "netns", "del", n], capture_output=True)


def test_two_hosts_over_a_veth_pair_give_the_one_process_tokens(two_hosts, tiny_models, tmp_path):
    folder = char_tokenizer_model(tiny_models["llama"][0], tmp_path / "chars")
    prompt = "hello world"
    with LLM(str(folder), kv_cache_memory="16MiB") as one:
        want = one.generate([prompt], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)[0].outputs[0]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    procs = []
    for node, (ns, dev, _) in enumerate(two_hosts):
        cmd = ["ip", "netns", "exec", ns, torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
               "--master-addr", two_hosts[0][2], "--master-port", str(PORT), "-m", "lmserve.cli", "generate", prompt,
               "--model", str(folder), "--tensor-parallel-size", "2", "--distributed-interface", dev,
               "--kv-cache-memory", "16MiB", "--max-tokens", "16", "--temperature", "0", "--json"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      cwd=Path(__file__).resolve().parents[1]))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=180))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert outs[1][0].strip() == ""  # rank 1 prints nothing: it only follows rank 0
    got = json.loads(outs[0][0])["outputs"][0]
    assert got["token_ids"] == want.token_ids and got["text"] == want.text


CLIENT = """
import json, sys, time, httpx
router, decode = sys.argv[1], sys.argv[2]
for _ in range(600):
    try:
        if httpx.get(router + "/health", timeout=1).status_code == 200 and len(
                [1 for u in (decode,) if httpx.get(u + "/health", timeout=1).status_code == 200]) == 1:
            break
    except httpx.HTTPError:
        pass
    time.sleep(0.1)
time.sleep(1.0)  # the router's next health check sees the prefill instance too
r = httpx.post(router + "/v1/completions", timeout=60, json={"prompt": json.loads(sys.argv[3]), "max_tokens": 16,
               "temperature": 0, "ignore_eos": True})
print(json.dumps({"status": r.status_code, "body": r.json(), "router": httpx.get(router + "/metrics").text,
                  "decode": httpx.get(decode + "/metrics").text}))
"""


def test_disaggregation_across_two_hosts_moves_the_kv_over_the_veth(two_hosts, tiny_models, tmp_path):
    folder = str(char_tokenizer_model(tiny_models["llama"][0], tmp_path / "chars"))
    prompt = [5, 9, 13, 7, 21, 3, 44, 8, 17, 4, 99, 100, 3, 61, 62, 70, 71, 72, 30, 31, 40, 41, 50, 51, 52, 53,
              54, 55, 56, 57, 58, 59, 60, 61, 2, 3]  # 36 tokens: two full blocks move
    with LLM(folder, kv_cache_memory="16MiB") as one:
        want = one.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    (ns_a, _, addr_a), (ns_b, _, addr_b) = two_hosts
    decode, prefill, router = f"http://{addr_b}:8101", f"http://{addr_a}:8102", "http://127.0.0.1:8100"
    serve = [sys.executable, "-m", "lmserve.cli"]
    common = ["--model", folder, "--kv-cache-memory", "16MiB"]
    root = Path(__file__).resolve().parents[1]
    procs = [subprocess.Popen(["ip", "netns", "exec", ns, *serve, *args], cwd=root, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for ns, args in (
        (ns_b, ["serve", "--role", "decode", "--host", addr_b, "--port", "8101", "--kv-secret", "s", *common]),
        (ns_a, ["serve", "--role", "prefill", "--kv-peer", decode, "--host", addr_a, "--port", "8102",
                "--kv-secret", "s", *common]),
        (ns_a, ["router", "--replica", decode, "--prefill", prefill, "--port", "8100", "--health-interval", "0.5"]))]
    try:
        out = subprocess.run(["ip", "netns", "exec", ns_a, sys.executable, "-c", CLIENT, router, decode, json.dumps(prompt)],
                             capture_output=True, text=True, timeout=120, cwd=root)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert got["status"] == 200 and got["body"]["choices"][0]["text"] == want
    assert 'lmserve_router_prefills_total{outcome="pushed"} 1.0' in got["router"]
    hits = sum(float(x.split()[-1]) for x in got["decode"].splitlines() if x.startswith("lmserve_prefix_cache_hit_tokens"))
    assert hits == 32  # the two blocks that crossed the veth
