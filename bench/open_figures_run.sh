#!/usr/bin/env bash
# The GPU figures the open issues wait on, one device call per part, from the repo root with $OUT set (H200, one GPU).
# BASE: a checkout of the last tree before autotuning was turned off (`git archive df9e41e | tar -x -C .dev/base`
# here, carried). Logs go to $LOGDIR (default /tmp/logs: only 8 files come back); steps.md gets each log's tail.
#   part guard: issue 45's regression guard on the current tree (mid decode and NEXTN round against BASE, two pairs
#               of fresh processes); the HTTP server against in-process generation with the shipped pair (issue 50);
#               mid's census, XLA against Pallas kernels (issue 49).
#   part small: (fits an H100) the idle host's time per call against the argument arrays: N separate, donated, or
#               one stacked array (bench/dispatch_bench.py, issue 48); the HTTP server against in-process generation
#               (issue 50); mid's census, bf16 against fp8 (issue 49); the Pallas linear on layer-stacked weights
#               (bench/stacked_bench.py); mid at 1 and 4 rounds per call with the idle host's share (issue 48).
#   part flash: (needs an H200) full Flash fp8: decode and NEXTN round at 1 and 4 rounds per call (issue 48), the
#               decode's census, the DSpark round.
#   part flash2: (needs an H200) a 2048-token prefill chunk's census (issue 51), the NEXTN (S=3) and DSpark rounds
#               with the full and a 25% draft vocabulary (issue 52), the serving benchmark's plain decode (8192 in).
set -u
PART=${1:?part guard, small or flash}
BASE=${BASE:-.dev/base}
DEADLINE=${DEADLINE:-555}
LOGDIR=${LOGDIR:-/tmp/logs}
mkdir -p "$LOGDIR"
source "$(dirname "$0")/device_steps.sh"
heading "open-issue figures, part $PART"

if [[ $PART == guard ]]; then
    step step_ab 250 python bench/step_bench.py --model mid --kernels pallas --programs decode nextn --n 16 \
        --baseline "$BASE" --baseline-rounds 2 --out "$OUT/step_ab.md"
    step serve_http 150 python bench/serve_overhead.py --spec none nextn dspark --prompt-len 512 --output-len 256 \
        --requests 8 --log-dir "$LOGDIR" --out "$OUT/serve_overhead.md"
    step prof_kernels 130 python -m lingjax.cli profile compare --model mid --kernels xla pallas --n 10 --out "$LOGDIR/prof_kernels"
    cp "$LOGDIR/prof_kernels.log" "$OUT/"
elif [[ $PART == small ]]; then
    step dispatch 60 python bench/dispatch_bench.py --out "$OUT/dispatch.md"
    step serve_http 150 python bench/serve_overhead.py --spec none nextn dspark --prompt-len 512 --output-len 256 \
        --requests 8 --log-dir "$LOGDIR" --out "$OUT/serve_overhead.md"
    step prof_fp8 120 python -m lingjax.cli profile compare --model mid --weights dense fp8 \
        --n 10 --out "$LOGDIR/prof_fp8"
    cp "$LOGDIR/prof_fp8.log" "$OUT/"
    step stacked 60 python bench/stacked_bench.py --layers 35 --dim 2560 --out "$OUT/stacked.md"
    step step_mid_rpc 120 python bench/step_bench.py --model mid --kernels pallas --programs decode nextn \
        --rounds-per-call 1 4 --n 16 --out "$OUT/step_mid_rpc.md"
elif [[ $PART == flash ]]; then
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.97  # full Flash fp8 holds ~128 GB
    step step_flash 260 python bench/step_bench.py --model flash --kernels pallas --weights fp8 \
        --programs decode nextn --steps 3 --rounds-per-call 1 4 --n 16 --out "$OUT/step_flash.md"
    step prof_flash_decode 100 python -m lingjax.cli profile --model flash --kernels pallas --weights fp8 \
        --program decode --n 10
    step step_flash_dspark 200 python bench/step_bench.py --model flash --kernels pallas --weights fp8 \
        --programs dspark --dspark --markov-topk 64 --n 16 --out "$OUT/step_flash_dspark.md"
    cp "$LOGDIR/prof_flash_decode.log" "$OUT/" 2>/dev/null
elif [[ $PART == flash2 ]]; then
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.97
    step prof_flash_prefill 110 python -m lingjax.cli profile --model flash --kernels pallas --weights fp8 \
        --program prefill --prompt-len 2048 --n 3
    step vocab_flash 200 python bench/draft_vocab_sweep.py --model flash --weights fp8 --kernels pallas \
        --skip-accept --nextn-steps 3 --dspark-steps 15 --draft-vocab full,25% --out "$OUT/vocab_flash.md"
    step serve_flash 240 python bench/serve_bench.py --model flash --weights fp8 --prompt-len 8192 \
        --output-len 1024 --requests 3 --time-budget 60 --out "$OUT/serve_flash.md"
    cp "$LOGDIR/prof_flash_prefill.log" "$OUT/" 2>/dev/null
fi
grep -h "compiled in" "$LOGDIR"/*.log >>"$OUT/steps.md" 2>/dev/null
for f in "$LOGDIR"/*.log; do
    { echo; echo "## tail of $(basename "$f")"; tail -n 25 "$f"; } >>"$OUT/steps.md"
done
finish
