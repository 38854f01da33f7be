# Sourced by the one-call device scripts (fp8_device_run.sh, fresh_machine_run.sh): the environment, the run's
# heading in $OUT/steps.md, and step(): each step under a time cap inside one deadline (DEADLINE seconds from the
# sourcing), its stdout and stderr in ${LOGDIR:-$OUT}/NAME.log, its exit status and seconds in $OUT/steps.md. A step cut short
# keeps what its report printed (the benches rewrite --out line by line).
: "${OUT:?set OUT to the directory the reports go to}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
START=$(date +%s)
DEADLINE=${DEADLINE:-400}

heading() {  # heading TITLE: the run's first lines in $OUT/steps.md
    {
        echo "# $1, $(date -u +%FT%TZ)"
        nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,utilization.gpu \
            --format=csv 2>&1
        python -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tail -1
        echo
        echo "steps (rc 124: cut at its cap; the report holds what it printed):"
    } >"$OUT/steps.md"
}

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
    timeout -k 5 "$cap" "$@" >"${LOGDIR:-$OUT}/$name.log" 2>&1
    local rc=$?
    echo "- $name: rc $rc in $(($(date +%s) - t0)) s (cap $cap s): \`$*\`" | tee -a "$OUT/steps.md"
}

finish() {  # the clocks at the end and the run's seconds
    nvidia-smi --query-gpu=clocks.sm,temperature.gpu --format=csv,noheader >>"$OUT/steps.md" 2>&1
    echo "total $(($(date +%s) - START)) s" | tee -a "$OUT/steps.md"
}
