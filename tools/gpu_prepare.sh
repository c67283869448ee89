#!/usr/bin/env bash
# Fill .gpu-wheels/ (gitignored) with the wheels tools/gpu_check.sh installs on a GPU machine without network.
#
# Run on a machine with network, from anywhere in the repository:  tools/gpu_prepare.sh
# The GPU machine has torch, CUDA and pytest; the tests also need dill (pc-pickle, pc-pool), psutil (pc-pool's
# test fixtures) and pytest-timeout (pytest.ini's per-test timeout). dill and pytest-timeout are pure Python;
# psutil's wheel is abi3 (one wheel for every CPython 3 on x86-64 Linux). No other test dependency is needed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:-$root/.gpu-wheels}
python=${PYTHON:-python3}
mkdir -p "$dest"
"$python" -m pip download --no-deps --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux2010_x86_64 \
    --implementation cp --python-version 3.10 \
    dill pytest-timeout psutil -d "$dest"
ls -l "$dest"
