#!/usr/bin/env bash
# The step programs on a fresh machine, every process with an empty compilation cache (issue 45): one device call
# per part, from the repo root with $OUT set. BASE: a checkout of the last good tree (the device has no git
# history: `git archive REV | tar -x -C .dev/base` here, carried), default .dev/base. PROMPTS: embedded_bench's
# prompts JSON (made here, carried), default .dev/prompts.json.
#   part 1: mid's decode step and NEXTN round against BASE in the same run (step_bench --baseline); the shipped
#           pair, NEXTN and DSpark greedy against plain greedy on the held-out prompts, in fresh processes
#           (embedded_bench); greedy speculation against plain greedy on tiny and mid (lossless_check).
#   part 2: the shipped pair once more if part 1 ran out of time; the dense projections one by one (linear_bench);
#           mid with XLA's GEMMs autotuned beside the default; mid's DSpark round and its fp8 step.
set -u
PART=${1:?part 1 or 2}
BASE=${BASE:-.dev/base}
PROMPTS=${PROMPTS:-.dev/prompts.json}
DEADLINE=${DEADLINE:-550}
source "$(dirname "$0")/device_steps.sh"
heading "fresh-machine run, part $PART"

embedded() {  # embedded N: the shipped pair's run N
    step "embedded_$1" 100 python bench/embedded_bench.py lingjax --prompts "$PROMPTS" --steps 3 --dspark-steps 15 \
        --markov-topk 64 --out "$OUT/embedded_$1.md"
}

if [[ $PART == 1 ]]; then
    step step_ab 240 python bench/step_bench.py --model mid --kernels pallas --programs decode nextn --n 16 \
        --baseline "$BASE" --out "$OUT/step_ab.md"
    embedded 1
    step lossless 130 python bench/lossless_check.py --model tiny mid --kernels pallas --out "$OUT/lossless.md"
    embedded 2
    embedded 3
else
    step linear 90 python bench/linear_bench.py --model mid --out "$OUT/linear_mid.md"
    step step_autotune 150 python bench/step_bench.py --model mid --kernels pallas --programs decode nextn --n 16 \
        --xla-ops linear --xla-option xla_gpu_autotune_level=4 --out "$OUT/step_autotune.md"
    step step_dspark 200 python bench/step_bench.py --model mid --kernels pallas --weights dense fp8 \
        --programs decode nextn dspark --dspark --n 16 --out "$OUT/step_mid_fp8_dspark.md"
fi
finish
