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
#   part h200: (needs an H200) full Flash fp8: TTFT for 8192, 2048 and 512 tokens (issue 51), the decode step and
#               the NEXTN round (S=3), then the DSpark round alone (issue 48).
#   part e128: (fits an H100) flash_e128 (Flash's 42 layers and arrays, 128 experts) in fp8: decode and NEXTN round at
#               1 and 4 rounds per call with the idle host's share, then the DSpark round (issue 48).
#   part stacked: (fits an H100) the per-layer parameters stacked (lingjax.stacked.Stacking) against BASE (a checkout
#               with the flash_e128 preset: 602b479 plus this tree's lingjax/presets.py for the stacking itself,
#               ca7984f for the layer read from a kernel input): flash_e128's decode step and the idle host's share,
#               this tree then BASE, then this tree's decode at 4 rounds per call (issue 48).
#   part compile: (fits an H100) the compile seconds, cold and warm, of every program the three generation modes
#               need, on flash18 and mid in fp8, with each mode's programs also compiled at once (issue 51).
#   part compile_flash: (fits an H100) the same for full Flash's NEXTN and DSpark programs (abstract weights; XLA's
#               memory limit lifted to an H200's); flash18's TTFT for 512, 2048 and 8192 tokens.
#   part first_token: (fits an H100) `lingjax generate` on flash18 fp8 (--spec dspark, random drafter, 8192-token
#               prompt), a cold process (empty cache) then two warm ones (PASSES), for this tree and BASE, alternating
#               (each summary line and the process's seconds).
#               Then (unless SKIP_FLASH18=1) issue 52's round times on flash18 (full and 25% draft vocabulary; NEXTN
#               S = 1..7, DSpark 3, 5, 7).
#   part sweep: (fits an H100) issue 52's round times of the shipped pair (NEXTN S = 1..7, DSpark 3..15) and of
#               flash18's DSpark widths (full and 25% draft vocabulary; SKIP_FLASH18=1: not); issue 51's warm first
#               token on flash18 with the Triton dialect alias (lingjax/pallas/dialect_lookup.py) against without,
#               alternating processes.
set -u
PART=${1:?part guard, small, flash, flash2, h200, e128, stacked, compile, compile_flash, first_token or sweep}
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
elif [[ $PART == h200 ]]; then
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.97
    step ttft_flash 230 python bench/serve_bench.py --model flash --kernels pallas --weights fp8 \
        --prompt-len 8192 2048 512 --output-len 64 --requests 4 --time-budget 20 --out "$OUT/ttft_flash.md"
    step step_flash 190 python bench/step_bench.py --model flash --kernels pallas --weights fp8 \
        --programs decode nextn --steps 3 --n 16 --out "$OUT/step_flash.md"
    step step_flash_dspark 190 python bench/step_bench.py --model flash --kernels pallas --weights fp8 \
        --programs dspark --dspark --markov-topk 64 --n 16 --out "$OUT/step_flash_dspark.md"
elif [[ $PART == e128 ]]; then
    step step_e128 360 python bench/step_bench.py --model flash_e128 --kernels pallas --weights fp8 \
        --programs decode nextn --steps 3 --rounds-per-call 1 4 --n 16 --out "$OUT/step_e128.md"
    step step_e128_dspark 220 python bench/step_bench.py --model flash_e128 --kernels pallas --weights fp8 \
        --programs dspark --dspark --markov-topk 64 --n 16 --out "$OUT/step_e128_dspark.md"
elif [[ $PART == stacked ]]; then
    # each side in its own step, its report written as it goes (--baseline holds its children's output until they
    # end, so a side cut at its cap would leave nothing)
    step stacked_tree 240 python bench/step_bench.py --model flash_e128 --kernels pallas --weights fp8 \
        --programs decode --n 16 --out "$OUT/stacked_tree.md"
    base=$(realpath "$BASE")
    step stacked_base 240 env -C "$base" PYTHONPATH="$base" python bench/step_bench.py --model flash_e128 \
        --kernels pallas --weights fp8 --programs decode --n 16 --out "$OUT/stacked_base.md"
    step stacked_r4 150 python bench/step_bench.py --model flash_e128 --kernels pallas --weights fp8 \
        --programs decode --rounds-per-call 4 --n 16 --out "$OUT/stacked_r4.md"
elif [[ $PART == compile ]]; then
    step compile_flash18 360 python bench/compile_bench.py --model flash18 --weights fp8 --kernels pallas \
        --spec plain nextn dspark --concurrent --out "$OUT/compile_flash18.md"
    step compile_mid 180 python bench/compile_bench.py --model mid --weights fp8 --kernels pallas \
        --spec plain nextn dspark --concurrent --out "$OUT/compile_mid.md"
elif [[ $PART == compile_flash ]]; then
    step compile_flash 330 python bench/compile_bench.py --model flash --weights fp8 --kernels pallas \
        --spec nextn dspark --concurrent --xla-option xla_gpu_memory_limit_slop_factor=300 --out "$OUT/compile_flash.md"
    for n in 512 2048 8192; do
        step "ttft_$n" 100 python bench/serve_bench.py --model flash18 --weights fp8 --kernels pallas \
            --prompt-len "$n" --output-len 16 --requests 5 --time-budget 30 --out "$OUT/ttft_$n.md"
    done
elif [[ $PART == first_token ]]; then
    head -c 6144 /dev/urandom | base64 -w0 >/tmp/prompt_8192.txt  # 8192 bytes: 8192 tokens of the byte tokenizer
    n=0
    for pass in ${PASSES:-cold warm warm}; do  # each tree's cold process, then warm ones, the trees alternating
        for tree in . "$BASE"; do
            name="first_token_$([[ $tree == . ]] && echo new || echo base)_$pass$((++n))"
            t0=$(date +%s%N)
            (cd "$tree" && LINGJAX_CACHE_DIR="/tmp/cache_$(basename "$tree")" PYTHONPATH="$PWD" step "$name" 150 \
                python -m lingjax.cli generate --model flash18 --weights fp8 --kernels pallas --spec dspark \
                --draft random --prompt-file /tmp/prompt_8192.txt --max-new-tokens 32 --ignore-eos)
            echo "  $name: process $((($(date +%s%N) - t0) / 1000000)) ms; $(grep -ah "tokens (" "$LOGDIR/$name.log")" \
                | tee -a "$OUT/steps.md"
        done
    done
    [[ ${SKIP_FLASH18:-} ]] || step vocab_flash18 400 python bench/draft_vocab_sweep.py --model flash18 --weights fp8 \
        --kernels pallas --skip-accept --draft-vocab full,25% --dspark-steps 3,5,7 --out "$OUT/vocab_flash18.md"
elif [[ $PART == sweep ]]; then
    step sweep_shipped 260 python bench/draft_vocab_sweep.py --model checkpoints/ling-code-tiny --kernels pallas \
        --skip-accept --draft-vocab full --rounds 200 --out "$OUT/sweep_shipped.md"
    [[ ${SKIP_FLASH18:-} ]] || step sweep_flash18_dspark 220 python bench/draft_vocab_sweep.py --model flash18 \
        --weights fp8 --kernels pallas --skip-accept --nextn-steps "" --dspark-steps 3,5,7 --draft-vocab full,25% \
        --out "$OUT/sweep_flash18_dspark.md"
    head -c 6144 /dev/urandom | base64 -w0 >/tmp/prompt_8192.txt
    export LINGJAX_CACHE_DIR=/tmp/cache_alias
    n=0
    for pass in cold with without with without; do  # the alias popped by hand in the "without" processes
        t0=$(date +%s%N)
        step "alias_$pass$((++n))" 100 python -c "import runpy, sys, lingjax.pallas
if sys.argv[1] == 'without': sys.modules.pop('jaxlib.mlir.dialects.tt')
sys.argv[:2] = ['lingjax']; runpy.run_module('lingjax.cli', run_name='__main__')" "$pass" generate --model flash18 \
            --weights fp8 --kernels pallas --spec dspark --draft random --prompt-file /tmp/prompt_8192.txt \
            --max-new-tokens 32 --ignore-eos
        echo "  alias_$pass$n: process $((($(date +%s%N) - t0) / 1000000)) ms; $(grep -ah "tokens (\|compiled" \
            "$LOGDIR/alias_$pass$n.log" | tr '\n' ' ')" | tee -a "$OUT/steps.md"
    done
fi
grep -ah "compiled in" "$LOGDIR"/*.log >>"$OUT/steps.md" 2>/dev/null
for f in "$LOGDIR"/*.log; do
    { echo; echo "## tail of $(basename "$f")"; tail -n 25 "$f"; } >>"$OUT/steps.md"
done
finish
