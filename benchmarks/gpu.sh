#!/usr/bin/env bash
# One pass over the GPU path: training beside nanoGPT, decoding, the server, the CUDA tests,
# each step under its own time limit and the whole under BUDGET seconds, so that a GPU lent
# for a few minutes gives every figure of docs/performance.md's "On a CUDA GPU" in one call.
#
# Usage:
#   TEXT=tinyshakespeare/input.txt bash benchmarks/gpu.sh                 # ours alone
#   TEXT=input.txt NANOGPT=~/nanoGPT BUDGET=540 bash benchmarks/gpu.sh     # beside nanoGPT
#   PYTHON=python3 TEXT=input.txt bash benchmarks/gpu.sh                 # where python is python3
#
# On a machine without internet, prepare beforehand where there is: data/shakespeare_bpe
# (python -m data.prepare --tokenizer gpt2), the asset cache ($GPTLAB_CACHE, which that
# fills), and for NANOGPT a checkout whose data/shakespeare_char and data/shakespeare hold
# train.bin and val.bin of TEXT. The log goes to $OUT/log.txt (default: gpu-log.txt here).
set -u
cd "$(dirname "$0")/.."
: "${TEXT:?set TEXT to a text file for the character-level runs}"
BUDGET=${BUDGET:-540}
PYTHON=${PYTHON:-python}
LOG=${OUT:+$OUT/log.txt}
LOG=${LOG:-gpu-log.txt}
START=$(date +%s)
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PYTHON -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"
  date -u; } 2>&1 | tee -a "$LOG"

# step NAME SECONDS COMMAND...: run it if the budget allows, log it, print its end
step() {
    local name=$1 limit=$2; shift 2
    local left=$((BUDGET - ($(date +%s) - START)))
    if [ "$left" -lt 30 ]; then echo "=== skipped $name: out of time" | tee -a "$LOG"; return; fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "=== $(date +%T) $name (at most $limit s): $*" | tee -a "$LOG"
    local t0 rc
    t0=$(date +%s)
    timeout -k 5 "$limit" "$@" >"$LOG.step" 2>&1
    rc=$?
    cat "$LOG.step" >>"$LOG"
    echo "=== exit $rc after $(( $(date +%s) - t0 )) s: $name" | tee -a "$LOG"
    grep -vE "it/s\]|s/it\]" "$LOG.step" | tail -n 40
    rm -f "$LOG.step"
}

nanogpt() {  # the reference trainer, in its own folder
    (cd "$NANOGPT" && exec $PYTHON train.py "$@")
}

# nanoGPT is timed by when its log lines arrive (benchmarks/wallclock.py says why), as ours
# are; its baby GPT has no biases (nanoGPT's bias = False), so ours is run without them too
short="--max-iters 300 --eval-interval 300 --eval-iters 20"
if [ -n "${NANOGPT:-}" ]; then
    export -f nanogpt; export NANOGPT PYTHON
    step nanogpt_baby 120 $PYTHON -m benchmarks.wallclock --tokens-per-iter 16384 -- bash -c \
        'nanogpt config/train_shakespeare_char.py --max_iters=300 --lr_decay_iters=300 \
        --eval_interval=300 --eval_iters=20 --log_interval=10 --out_dir=/tmp/ng_baby'
fi
step baby_adamw 120 $PYTHON -m benchmarks.train --config config/baby_gpt_adamw.toml --input "$TEXT" \
    --set bias=false $short
step baby_adamw_profile 100 $PYTHON -m benchmarks.train --config config/baby_gpt_adamw.toml \
    --input "$TEXT" --set bias=false --max-iters 100 --eval-interval 100 --eval-iters 2 --profile
step baby_muon 120 $PYTHON -m benchmarks.train --config config/baby_gpt.toml --input "$TEXT" $short
step gpt2_small 150 $PYTHON -m benchmarks.train --config config/gpt2_small.toml --max-iters 80 \
    --eval-interval 80 --eval-iters 10
step gpt2_small_profile 120 $PYTHON -m benchmarks.train --config config/gpt2_small.toml \
    --max-iters 20 --eval-interval 20 --eval-iters 2 --profile
if [ -n "${NANOGPT:-}" ]; then
    step nanogpt_gpt2 120 $PYTHON -m benchmarks.wallclock --tokens-per-iter 65536 -- bash -c \
        'nanogpt --dataset=shakespeare --batch_size=16 --gradient_accumulation_steps=4 \
        --max_iters=80 --lr_decay_iters=80 --eval_interval=80 --eval_iters=10 --log_interval=5 \
        --out_dir=/tmp/ng_gpt2'
fi
step decode_batch1 150 $PYTHON sample.py --benchmark --preset gpt2 --device cuda --decode compile \
    --lengths 256 --repeats 3
step serve 100 $PYTHON -m benchmarks.serve --servers ours-fp32 --clients 1,16,64 --slots 64 \
    --device cuda --max-tokens 64
step test_cuda 200 $PYTHON -m pytest -q -n 6 -p no:cacheprovider tests/test_cuda.py
step decode_batch8 120 $PYTHON sample.py --benchmark --preset gpt2 --device cuda --decode compile \
    --lengths 256 --repeats 3 --batch 8
echo "=== done in $(( $(date +%s) - START )) s" | tee -a "$LOG"
