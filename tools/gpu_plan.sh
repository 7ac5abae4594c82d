#!/usr/bin/env bash
# The GPU plan in one command (docs/performance.md, "On a GPU: the one command"):
# the machine and its library versions, every `-m gpu` test, and the attention
# kernel benchmark in bfloat16 and float16 at block sizes 16 and 128; everything
# it prints is also saved under OUT, and kernel-table.md there holds the
# benchmark rows for docs/backends.md "GPU timings".
#
#   tools/gpu_plan.sh [--dry-run] [--only env|tests|bench] [OUT]    (OUT: ./gpu-plan-out)
#
# --dry-run  print each command (one a line, after "+ ", shell-quoted) and run none
# --only     one stage: env (nvidia-smi, versions), tests, or bench
# $PYTHON    the interpreter (default: python); the repository goes on PYTHONPATH
#
# A failing stage does not stop the later ones. Exit status: pytest's when the
# tests failed, else 1 when a benchmark failed, else 0.
set -euo pipefail

usage() {
    sed -n '8,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

DRY_RUN=0
ONLY=all
OUT=
while (($#)); do
    case $1 in
        --dry-run) DRY_RUN=1 ;;
        --only)
            if (($# < 2)); then
                echo "gpu_plan.sh: --only needs a stage: env, tests or bench" >&2
                exit 2
            fi
            ONLY=$2
            shift
            ;;
        --only=*) ONLY=${1#--only=} ;;
        -h | --help) usage; exit 0 ;;
        -*) echo "gpu_plan.sh: unknown option '$1'" >&2; usage >&2; exit 2 ;;
        *)
            if [[ -n $OUT ]]; then
                echo "gpu_plan.sh: one output directory, got '$OUT' and '$1'" >&2
                exit 2
            fi
            OUT=$1
            ;;
    esac
    shift
done
case $ONLY in
    all | env | tests | bench) ;;
    *) echo "gpu_plan.sh: --only '$ONLY': must be env, tests or bench" >&2; exit 2 ;;
esac

PYTHON=${PYTHON:-python}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-./gpu-plan-out}
if ((DRY_RUN)); then
    [[ $OUT == /* ]] || OUT=$PWD/$OUT
else
    mkdir -p "$OUT"
    OUT=$(cd "$OUT" && pwd)
fi
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

TEST_PATHS=(tests/gpu tests/backends tests/entrypoints/test_gpu.py)
BENCH=benchmarks/attention_kernels.py
BENCH_DTYPES=(bfloat16 float16)
BENCH_BLOCK_SIZES=(16 128)
# Library versions from the installed distributions: importing xformers or
# flash_attn here could fail (issue 24, X1) before anything is recorded.
VERSIONS='import importlib.metadata as md, platform, torch; have = {(d.metadata["Name"] or "").lower().replace("_", "-"): d.version for d in md.distributions()}; print("python", platform.python_version()); print("torch", torch.__version__, "cuda", torch.version.cuda); [print(n, have.get(n, "not installed")) for n in ("triton", "xformers", "flash-attn", "flash-attn-4", "transformers")]; print("gpu", torch.cuda.get_device_name(0), "capability %d.%d" % torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else print("gpu none: torch.cuda.is_available() is False")'

# run LOG CMD...: show the command; unless this is a dry run, run it with its
# output shown and saved to LOG, and leave its exit status in $RC.
RC=0
run() {
    local log=$1
    shift
    local line
    line=$(printf '%q ' "$@")
    echo "+ ${line% }"
    RC=0
    if ((DRY_RUN)); then
        return 0
    fi
    set +e
    "$@" 2>&1 | tee "$log"
    RC=${PIPESTATUS[0]}
    set -e
}

stage() { [[ $ONLY == all || $ONLY == "$1" ]]; }

if stage env; then
    if ((DRY_RUN)) || command -v nvidia-smi >/dev/null; then
        run "$OUT/nvidia-smi.txt" nvidia-smi
    else
        echo "nvidia-smi: not found on PATH" | tee "$OUT/nvidia-smi.txt"
    fi
    run "$OUT/versions.txt" "$PYTHON" -c "$VERSIONS"
fi

TESTS_RC=0
if stage tests; then
    run "$OUT/pytest.log" "$PYTHON" -m pytest -m gpu -q -rfEs --junitxml="$OUT/pytest.xml" "${TEST_PATHS[@]}"
    TESTS_RC=$RC
fi

BENCH_RC=0
if stage bench; then
    for dtype in "${BENCH_DTYPES[@]}"; do
        for bs in "${BENCH_BLOCK_SIZES[@]}"; do
            run "$OUT/bench-$dtype-bs$bs.md" "$PYTHON" "$BENCH" --dtype "$dtype" --block-size "$bs"
            if ((RC != 0)); then
                BENCH_RC=1
            fi
        done
    done
fi

if ((DRY_RUN)); then
    exit 0
fi

# The benchmark's rows, one table over every dtype and block size, in the
# columns of docs/backends.md "GPU timings" (plus dtype).
if stage bench; then
    {
        echo "| backend | dtype | block | decode us | floor / decode | prefill ms | encoder ms |"
        echo "|---|---|---|---|---|---|---|"
        for dtype in "${BENCH_DTYPES[@]}"; do
            for bs in "${BENCH_BLOCK_SIZES[@]}"; do
                f=$OUT/bench-$dtype-bs$bs.md
                [[ -f $f ]] || continue
                # Columns: | backend | block | decode us | floor / decode | prefill ms
                # | prefill TFLOP/s | encoder ms | encoder TFLOP/s |
                awk -F'|' -v dtype="$dtype" '
                    /^\| backend \|/ || /^\|---/ || !/^\| / { next }
                    $4 ~ /skipped/ { gsub(/^ +| +$/, "", $2); gsub(/^ +| +$/, "", $4)
                                     printf "| %s | %s | - | %s | | | |\n", $2, dtype, $4; next }
                    { for (i = 2; i <= 9; i++) gsub(/^ +| +$/, "", $i)
                      printf "| %s | %s | %s | %s | %s | %s | %s |\n", $2, dtype, $3, $4, $5, $6, $8 }' "$f"
            done
        done
    } >"$OUT/kernel-table.md"
fi

{
    echo "out: $OUT"
    stage tests && echo "tests: exit $TESTS_RC (log: pytest.log, junit: pytest.xml)"
    stage bench && echo "bench: $([[ $BENCH_RC == 0 ]] && echo ok || echo 'a run failed, see bench-*.md') (table: kernel-table.md)"
    true
} | tee "$OUT/summary.txt"

if ((TESTS_RC != 0)); then
    exit "$TESTS_RC"
fi
exit "$BENCH_RC"
