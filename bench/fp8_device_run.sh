#!/usr/bin/env bash
# One device call on an H200 (from the repo root, $OUT set): the fp8 decode's kernels at their tunings against the
# previous reading of x and against bf16 (bench/fp8_bench.py, TP1), mid's decode step and NEXTN round with dense and
# fp8 weights (bench/step_bench.py), and the host's dispatch time per weight array and per kernel
# (bench/launch_bench.py: separate against stacked weights). Each step runs under a time cap inside one deadline
# (DEADLINE seconds, default 400: the whole run stays under 7 minutes); every report is rewritten line by line, so a
# step cut short keeps what it printed. $OUT/steps.md lists each step's exit status and seconds, $OUT/*.log its
# stdout and stderr.
set -u
: "${OUT:?set OUT to the directory the reports go to}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jc \
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
START=$(date +%s)
DEADLINE=${DEADLINE:-400}

step() {  # step NAME CAP_SECONDS COMMAND...: run COMMAND under min(CAP, the time left), logged to $OUT/NAME.log
    local name=$1 cap=$2
    shift 2
    local left=$((DEADLINE - ($(date +%s) - START) - 5))
    if ((left < 30)); then
        echo "- $name: skipped, ${left} s left: \`$*\`" | tee -a "$OUT/steps.md"
        return
    fi
    ((cap > left)) && cap=$left
    local t0=$(date +%s)
    timeout -k 5 "$cap" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "- $name: rc $rc in $(($(date +%s) - t0)) s (cap $cap s): \`$*\`" | tee -a "$OUT/steps.md"
}

{
    echo "# fp8 device run, $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,utilization.gpu \
        --format=csv 2>&1
    python -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tail -1
    echo
    echo "steps (rc 124: cut at its cap; the report holds what it printed):"
} >"$OUT/steps.md"

step fp8_moe 110 python bench/fp8_bench.py --sections moe --out "$OUT/fp8_moe.md"
step step_mid 200 python bench/step_bench.py --model mid --kernels pallas --weights dense fp8 --n 16 \
    --out "$OUT/step_mid.md"
step fp8_proj 100 python bench/fp8_bench.py --sections proj --copies 6 --out "$OUT/fp8_proj.md"
step launch 60 python bench/launch_bench.py --tp 1 --layers 64 512 --repeat 1 --n 20 --out "$OUT/launch.md"
# if time is left: the fp8 step with the previous reading of x (one unpipelined row per scale block) beside the default
step step_mid_prev 150 python bench/step_bench.py --model mid --kernels pallas --weights fp8 --n 16 \
    --kernel-option fp8_linear:x_row_min_bytes=256 --kernel-option moe_routed_experts:x_row_min_bytes=256 \
    --out "$OUT/step_mid_prev.md"
nvidia-smi --query-gpu=clocks.sm,temperature.gpu --format=csv,noheader >>"$OUT/steps.md" 2>&1
echo "total $(($(date +%s) - START)) s" | tee -a "$OUT/steps.md"
