#!/usr/bin/env bash
# One device call on an H200 (from the repo root, $OUT set): the fp8 decode's kernels at their tunings against the
# previous reading of x and against bf16 (bench/fp8_bench.py, TP1), mid's decode step and NEXTN round with dense and
# fp8 weights (bench/step_bench.py), and the host's dispatch time per weight array and per kernel
# (bench/launch_bench.py: separate against stacked weights). Each step runs under a time cap inside one deadline
# (DEADLINE seconds, default 400: the whole run stays under 7 minutes); every report is rewritten line by line, so a
# step cut short keeps what it printed. $OUT/steps.md lists each step's exit status and seconds, $OUT/*.log its
# stdout and stderr.
set -u
source "$(dirname "$0")/device_steps.sh"
heading "fp8 device run"

step fp8_moe 110 python bench/fp8_bench.py --sections moe --out "$OUT/fp8_moe.md"
step step_mid 200 python bench/step_bench.py --model mid --kernels pallas --weights dense fp8 --n 16 \
    --out "$OUT/step_mid.md"
step fp8_proj 100 python bench/fp8_bench.py --sections proj --copies 6 --out "$OUT/fp8_proj.md"
step launch 60 python bench/launch_bench.py --tp 1 --layers 64 512 --repeat 1 --n 20 --out "$OUT/launch.md"
# if time is left: the fp8 step with the previous reading of x (one unpipelined row per scale block) beside the default
step step_mid_prev 150 python bench/step_bench.py --model mid --kernels pallas --weights fp8 --n 16 \
    --kernel-option fp8_linear:x_row_min_bytes=256 --kernel-option moe_routed_experts:x_row_min_bytes=256 \
    --out "$OUT/step_mid_prev.md"
finish
