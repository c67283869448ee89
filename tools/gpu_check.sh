#!/usr/bin/env bash
# The GPU check: every `gpu` test, the CUDA benchmarks and a short CUDA demo, in one call, in about 6 minutes.
#
#   tools/gpu_check.sh [OUT_DIR]        (OUT_DIR defaults to $OUT, else ./gpu-check-out)
#
# For a machine with torch (CUDA build), pytest and a GPU, and no network. It needs only this repository and
# the wheels that tools/gpu_prepare.sh put in .gpu-wheels/ (or $PC_GPU_WHEELS): they are installed with
# `pip install --no-index --no-deps --target` into a temporary folder (or unzipped there without pip), which goes
# on PYTHONPATH with every packages/*/src; nothing is installed into the machine's Python. Every step runs
# even when an earlier one failed, each bounded by `timeout` and by the overall deadline.
#
# OUT_DIR receives: summary.txt (one line per step), env.txt, <step>.log, gpu-tests.xml (JUnit), bench/*.json
# (the CUDA benchmarks), gpu.md (the Benchmarks page's GPU section made from them), demo.json.
# Exit code: 0 when every step passed, 1 when a step failed, 3 when torch sees no CUDA device (the steps
# still run, and report "no CUDA").
set -u

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT_DIR=${1:-${OUT:-$ROOT/gpu-check-out}}
mkdir -p "$OUT_DIR" "$OUT_DIR/bench"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
WHEELS=${PC_GPU_WHEELS:-$ROOT/.gpu-wheels}
PY=${PYTHON:-$(command -v python3 || command -v python)}
BUDGET_S=${PC_GPU_CHECK_BUDGET_S:-350}
START=$(date +%s)
DEADLINE=$((START + BUDGET_S))
FAILED=0
SUMMARY=$OUT_DIR/summary.txt
: >"$SUMMARY"

cd "$ROOT" || exit 1
DEPS=${PC_GPU_DEPS:-$(mktemp -d -t pc-gpu-deps.XXXXXX)}  # outside OUT_DIR: not sent back with the results
PYTHONPATH=$(ls -d "$ROOT"/packages/*/src | paste -sd:):$DEPS${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1

# step NAME LIMIT_S COMMAND...: run COMMAND with its output in NAME.log, bounded by LIMIT_S and the deadline.
step() {
    local name=$1 limit=$2 left rc began
    shift 2
    left=$((DEADLINE - $(date +%s)))
    if [ "$left" -lt "$limit" ]; then limit=$left; fi
    if [ "$limit" -lt 5 ]; then
        echo "$name: not run (the check's ${BUDGET_S} s budget is spent)" | tee -a "$SUMMARY"
        FAILED=1
        return
    fi
    began=$(date +%s)
    echo ">>> $name (at most ${limit} s): $*"
    timeout -k 10 "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
    rc=$?
    local verdict=passed
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then verdict="TIMED OUT after ${limit} s"; fi
    if [ "$rc" -ne 0 ] && [ "$verdict" = passed ]; then verdict="FAILED (exit code $rc)"; fi
    if [ "$rc" -ne 0 ]; then FAILED=1; fi
    echo "$name: $verdict in $(($(date +%s) - began)) s" | tee -a "$SUMMARY"
    tail -n 3 "$OUT_DIR/$name.log"
}

# -- the environment and the wheels --------------------------------------------------------------------------
step env 60 "$PY" - <<'PYEOF'
import os, platform, subprocess, sys
import torch
print("python", sys.version.split()[0], platform.platform())
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for i in range(torch.cuda.device_count()):
    print(f"cuda:{i}", torch.cuda.get_device_name(i))
print("cpus", os.cpu_count())
print("PYTHONPATH", os.environ.get("PYTHONPATH"))
try:
    print(subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout)
except (OSError, subprocess.TimeoutExpired) as exc:
    print("nvidia-smi:", exc)
PYEOF
cp "$OUT_DIR/env.log" "$OUT_DIR/env.txt" 2>/dev/null

HAS_CUDA=$(timeout 60 "$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
if [ "$HAS_CUDA" != 1 ]; then
    echo "no CUDA: torch sees no CUDA device; the steps below run but check nothing on a GPU" | tee -a "$SUMMARY"
fi

# Installs what the tests need and this Python lacks (dill, psutil, pytest-timeout), from the wheels only.
install_wheels() {
    local missing=() mod pkg
    for pair in dill:dill psutil:psutil pytest_timeout:pytest-timeout; do
        mod=${pair%%:*}
        pkg=${pair##*:}
        "$PY" -c "import $mod" 2>/dev/null || missing+=("$pkg")
    done
    if [ ${#missing[@]} -eq 0 ]; then
        echo "dill, psutil and pytest-timeout are already importable"
        return 0
    fi
    echo "missing: ${missing[*]}; installing from $WHEELS"
    if [ ! -d "$WHEELS" ]; then
        echo "no wheel folder $WHEELS (run tools/gpu_prepare.sh on a machine with network)"
        return 1
    fi
    mkdir -p "$DEPS"
    local rc=0
    for pkg in "${missing[@]}"; do
        if "$PY" -m pip --version >/dev/null 2>&1; then
            "$PY" -m pip install --no-index --no-deps --no-compile --disable-pip-version-check \
                --find-links "$WHEELS" --target "$DEPS" "$pkg" || rc=1
        else  # no pip: a wheel is a zip of what goes into site-packages
            "$PY" - "$WHEELS" "$DEPS" "$pkg" <<'PYEOF' || rc=1
import glob, sys, zipfile
wheels, deps, pkg = sys.argv[1:]
found = sorted(glob.glob(f"{wheels}/{pkg.replace('-', '_')}-*.whl"))
if not found:
    sys.exit(f"no wheel of {pkg} in {wheels}")
zipfile.ZipFile(found[-1]).extractall(deps)
print("unzipped", found[-1])
PYEOF
        fi
    done
    return $rc
}
export PY WHEELS DEPS
export -f install_wheels
step wheels 90 bash -c install_wheels

# pytest.ini asks for pytest-timeout's ini keys under --strict-config: without the plugin, drop the strict
# config check (the keys only warn then) and rely on this step's own timeout.
PYTEST_OPTS=(-m gpu --continue-on-collection-errors)
if ! "$PY" -c "import pytest_timeout" 2>/dev/null; then
    PYTEST_OPTS+=(-o "addopts=-ra --strict-markers -p no:cacheprovider")
    echo "pytest-timeout missing: per-test timeouts off, the step's timeout bounds the tests" | tee -a "$SUMMARY"
fi
if [ "$HAS_CUDA" = 1 ]; then export PC_REQUIRE_GPU=1; fi

# -- every gpu test --------------------------------------------------------------------------------------------
# shellcheck disable=SC2046
step gpu-tests 200 "$PY" -m pytest "${PYTEST_OPTS[@]}" --junitxml "$OUT_DIR/gpu-tests.xml" -q -rs $(ls -d packages/*/tests) tests-integration
# the RPC layer's gpu tests again on the c10d backend (the run above takes the default, TensorPipe)
step gpu-tests-c10d 90 env PC_RPC_BACKEND=c10d "$PY" -m pytest "${PYTEST_OPTS[@]}" --junitxml "$OUT_DIR/gpu-tests-c10d.xml" -q -rs \
    packages/pc-distributed/tests packages/pc-server/tests

# -- the CUDA benchmarks, then the Benchmarks page's GPU section from their JSON -------------------------------
# run_cuda.py -> bench-<package>, <package>-cuda.json; run_<what>_cuda.py -> bench-<package>-<what>,
# <package>-<what>-cuda.json (gpu_report.py merges a package's files). Each script gets its own 75 s.
for script in packages/*/benchmarks/run*_cuda.py; do
    package=$(basename "$(dirname "$(dirname "$script")")")
    what=$(basename "$script" _cuda.py)
    what=${what#run}
    name=$package${what:+-${what#_}}
    step "bench-$name" 75 "$PY" "$script" --out "$OUT_DIR/bench/$name-cuda.json"
done
step gpu-report 30 "$PY" benchmarks/gpu_report.py --from "$OUT_DIR/bench" --md "$OUT_DIR/gpu.md" --no-store

# -- a short demo on CUDA ----------------------------------------------------------------------------------------
step demo 60 "$PY" examples/gpu_smoke.py --out "$OUT_DIR/demo.json"

echo "total: $(($(date +%s) - START)) s" | tee -a "$SUMMARY"
if [ "$FAILED" -ne 0 ]; then exit 1; fi
if [ "$HAS_CUDA" != 1 ]; then exit 3; fi
exit 0
