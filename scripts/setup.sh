#!/usr/bin/env bash
# Idempotent set-up on a fresh Debian machine: Fashion-MNIST (Debian package, when root with apt),
# a virtual environment in .venv, PyTorch 2.13.0 (CPU wheel, pinned in constraints.txt) and
# fedmosaic with its dev tools, Flower and Flower's Ray simulation runtime.
set -euo pipefail
cd "$(dirname "$0")/.."

FMNIST=/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
if [ ! -f "$FMNIST" ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "setup: installing Debian's dataset-fashion-mnist"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 || {
    apt-get update -q >/dev/null 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q dataset-fashion-mnist >/dev/null ||
      echo "setup: warning: could not install dataset-fashion-mnist (the main job needs it)"
  }
fi

# Headless Chromium: the test that opens the HTML report in a real browser (skipped without it).
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "setup: installing Debian's chromium (headless report test)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 || {
    apt-get update -q >/dev/null 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 ||
      echo "setup: warning: could not install chromium (the report screenshot test will be skipped)"
  }
fi

# g++ and ninja: fedmosaic's native kernels (fedmosaic/kernels) are compiled with them below;
# without them the torch path is used.
if { ! command -v g++ >/dev/null 2>&1 || ! command -v ninja >/dev/null 2>&1; } &&
  command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "setup: installing Debian's g++ and ninja-build (native kernels)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends g++ ninja-build >/dev/null 2>&1 || {
    apt-get update -q >/dev/null 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends g++ ninja-build >/dev/null 2>&1 ||
      echo "setup: warning: could not install g++/ninja-build (the torch path will be used)"
  }
fi

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $PY"
  "$PY" -m venv .venv
fi

# Re-install only when the project's dependencies or pins change (a stamp of pyproject.toml and
# constraints.txt).
STAMP=.venv/.fedmosaic-installed
WANT=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "setup: installing torch (constraints.txt: torch==2.13.0) and fedmosaic[dev,flower,flower-simulation,docs,privacy] into .venv"
  # torch first, pinned exactly (constraints.txt), and its CPU build: PyPI's default Linux wheel
  # is a CUDA build of several GB. A wheel in pip's find-links folders is taken as it is;
  # otherwise PyTorch's CPU index gives it; where that is unreachable, the configured index does
  # (with a warning: on Linux that is PyPI's CUDA build).
  if ! .venv/bin/pip install -q --disable-pip-version-check --no-index --no-deps \
      -c constraints.txt torch 2>/dev/null; then
    echo "setup: no torch wheel in pip's find-links; taking the CPU build from download.pytorch.org"
    .venv/bin/pip install -q --disable-pip-version-check --no-deps --retries 1 --timeout 30 \
      -c constraints.txt --index-url https://download.pytorch.org/whl/cpu torch ||
      echo "setup: warning: download.pytorch.org unreachable: torch from pip's configured index" \
        "(on Linux PyPI's default wheel is a CUDA build of several GB)"
  fi
  # torch's dependencies (and torch itself, where neither source above gave it)
  .venv/bin/pip install -q --disable-pip-version-check -c constraints.txt torch
  # flower-simulation: ray, for the test of Flower's simulation runtime on a two-node Ray cluster
  .venv/bin/pip install -q --disable-pip-version-check -c constraints.txt -e ".[dev,flower,flower-simulation,docs,privacy]"
  echo "$WANT" > "$STAMP"
fi

# The native AVX2/FMA kernels, built once into the user's cache (~/.cache/fedmosaic/kernels):
# about 10 s on two idle cores, under a minute on a busy 2-core machine; the command prints its
# own estimate and its time, and is a no-op when up to date. Never fatal: without a compiler or
# AVX2 (or with FEDMOSAIC_KERNELS=0, which skips it) the torch path is used.
.venv/bin/python -m fedmosaic.kernels build || echo "setup: warning: native kernels not built (torch path)"
