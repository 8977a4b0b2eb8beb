#!/usr/bin/env bash
# One pass over the GPU path: training beside nanoGPT, the race to a loss, decoding, the
# server, the CUDA tests, each step under its own time limit and the whole under BUDGET
# seconds, so that a few minutes on a GPU give the figures of docs/performance.md's
# "On a CUDA GPU" in one call.
#
# Usage:
#   TEXT=tinyshakespeare/input.txt bash benchmarks/gpu.sh                       # every step
#   TEXT=input.txt NANOGPT=~/nanoGPT BUDGET=540 bash benchmarks/gpu.sh           # beside nanoGPT
#   TEXT=input.txt NANOGPT=~/nanoGPT bash benchmarks/gpu.sh race gpt2_small      # these steps
#   PYTHON=python3 TEXT=input.txt bash benchmarks/gpu.sh                       # where python is python3
#
# The steps: nanogpt_baby (needs NANOGPT), baby_adamw, baby_profiles, race, gpt2_small,
# gpt2_profile, decode, serve, test_cuda, cpu_threads, cpu_tests. On a machine without internet, prepare
# beforehand where there is: BPE (a folder of Shakespeare in GPT-2 BPE tokens, python -m
# data.prepare FILE --tokenizer gpt2 --out FOLDER; default data/shakespeare_bpe), the asset
# cache ($GPTLAB_CACHE, which that fills), and for NANOGPT a checkout whose
# data/shakespeare_char and data/shakespeare hold train.bin and val.bin of the same texts.
# The log goes to $OUT/log.txt (default: gpu-log.txt).
set -u
cd "$(dirname "$0")/.."
: "${TEXT:?set TEXT to a text file for the character-level runs}"
BUDGET=${BUDGET:-540}
PYTHON=${PYTHON:-python}
BPE=${BPE:-data/shakespeare_bpe}
STEPS=${*:-nanogpt_baby baby_adamw baby_profiles race gpt2_small gpt2_profile decode serve test_cuda cpu_threads cpu_tests}
LOG=${OUT:+$OUT/log.txt}
LOG=${LOG:-gpu-log.txt}
START=$(date +%s)
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
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
    grep -vE "it/s\]|s/it\]|^  round" "$LOG.step" | tail -n 40
    rm -f "$LOG.step"
}

nanogpt() {  # the reference trainer, in its own folder
    (cd "$NANOGPT" && exec $PYTHON train.py "$@")
}
export -f nanogpt
export NANOGPT="${NANOGPT:-}" PYTHON
# nanoGPT's baby GPT has no biases (its bias = False), so ours is run without them too
bench="$PYTHON -m benchmarks.train"
baby_adamw="--config config/baby_gpt_adamw.toml --input $TEXT --set bias=false"
baby_muon="--config config/baby_gpt.toml --input $TEXT"
gpt2="--config config/gpt2_small.toml --set data_dir=\"$BPE\""

for name in $STEPS; do case $name in
nanogpt_baby)  # timed by when its log lines arrive (benchmarks/wallclock.py), as the race times it
    [ -n "$NANOGPT" ] && step nanogpt_baby 100 $PYTHON -m benchmarks.wallclock --tokens-per-iter 16384 -- bash -c \
        'nanogpt config/train_shakespeare_char.py --max_iters=300 --lr_decay_iters=300 \
        --eval_interval=300 --eval_iters=20 --log_interval=10 --out_dir=/tmp/ng_baby' ;;
baby_adamw)  # nanoGPT's recipe run by train.py
    step baby_adamw 100 $bench $baby_adamw --max-iters 200 --eval-interval 200 --eval-iters 5 ;;
baby_profiles)  # and the modern layout with AdamW, to tell Muon's cost from the layout's
    step baby_adamw_profile 80 $bench $baby_adamw --max-iters 40 --eval-interval 40 \
        --eval-iters 2 --profile
    step baby_muon_profile 100 $bench $baby_muon --max-iters 40 --eval-interval 40 \
        --eval-iters 2 --profile
    step baby_modern_adamw 80 $bench $baby_muon --set 'optimizer="adamw"' --max-iters 150 \
        --eval-interval 150 --eval-iters 5 ;;
race)  # each process timed from its start to its first evaluation at or below 1.48, which
    # nanoGPT's baby GPT reached on an H200 (its best was 1.4725 there, at iteration 1750)
    nano=${NANOGPT:+--nanogpt $NANOGPT}
    step race 330 $PYTHON -m benchmarks.train --time-to-loss 1.48 --input "$TEXT" $nano \
        --repeats 1 ;;
gpt2_small)
    step gpt2_small 130 $bench $gpt2 --max-iters 60 --eval-interval 60 --eval-iters 5
    [ -n "$NANOGPT" ] && step nanogpt_gpt2 110 $PYTHON -m benchmarks.wallclock \
        --tokens-per-iter 65536 -- bash -c 'nanogpt --dataset=shakespeare --batch_size=16 \
        --gradient_accumulation_steps=4 --max_iters=60 --lr_decay_iters=60 --eval_interval=60 \
        --eval_iters=5 --log_interval=5 --out_dir=/tmp/ng_gpt2' ;;
gpt2_profile)
    step gpt2_small_profile 120 $bench $gpt2 --max-iters 20 \
        --eval-interval 20 --eval-iters 2 --profile ;;
decode)
    step decode_batch1 150 $PYTHON sample.py --benchmark --preset gpt2 --device cuda \
        --decode compile --lengths 256 --repeats 3
    step decode_batch8 120 $PYTHON sample.py --benchmark --preset gpt2 --device cuda \
        --decode compile --lengths 256 --repeats 3 --batch 8 ;;
serve)
    step serve 100 $PYTHON -m benchmarks.serve --servers ours-fp32 --clients 1,16,64 \
        --slots 64 --device cuda --max-tokens 64 ;;
test_cuda)
    step test_cuda 200 $PYTHON -m pytest -q -n 6 -p no:cacheprovider tests/test_cuda.py ;;
cpu_threads)  # the CPU quickstart on this machine's many cores, the nearest thing here to a
    # laptop with many: each thread count fixed, then measured (threads=0), then nanoGPT's
    # README CPU recipe at torch's default count, timed by when its log lines arrive
    for t in 1 2 4 8 16 0; do
        step cpu_quickstart_threads_$t 60 $bench --input "$TEXT" --device cpu --max-iters 100 \
            --eval-interval 1000 --set threads=$t
    done
    [ -n "$NANOGPT" ] && step nanogpt_cpu 60 $PYTHON -m benchmarks.wallclock --tokens-per-iter 768 \
        -- bash -c 'nanogpt config/train_shakespeare_char.py --device=cpu --compile=False \
        --eval_iters=20 --eval_interval=1000 --log_interval=10 --block_size=64 --batch_size=12 \
        --n_layer=4 --n_head=4 --n_embd=128 --max_iters=200 --lr_decay_iters=2000 --dropout=0.0 \
        --out_dir=/tmp/ng_cpu' ;;
cpu_tests)  # the CPU suite's model, optimizer and training tests, under the GPU machine's torch
    step cpu_tests 300 $PYTHON -m pytest -q -n 8 -p no:cacheprovider tests/test_model.py \
        tests/test_optimizer.py tests/test_train.py tests/test_decode_step.py tests/test_processes.py ;;
*) echo "unknown step $name; the steps are in the usage above" >&2; exit 2 ;;
esac; done
echo "=== done in $(( $(date +%s) - START )) s" | tee -a "$LOG"
