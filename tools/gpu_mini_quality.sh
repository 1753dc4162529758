#!/usr/bin/env bash
# JAGG's quality on the mini SD3 (mini_sd3.py) with enough samples for exact GRPO to gain: the
# README's mini table, seeds 0, 1 and 2, exact GRPO and both JAGG modes, on one GPU.
#
# Why a GPU: on this task a batch's GRPO gradient is almost all noise (tools/gradient_signal.py:
# two batches of 32, or of 128, agree to a cosine indistinguishable from 0), so a step of a few
# dozen samples is nearly random; on a 2-core CPU exact GRPO gained +0.02-0.08 and did not hold
# more (README). This script takes 512 samples per optimizer step (32 prompts x 16, one step
# per epoch, full fine-tuning at lr 3e-4 decaying along a cosine), EPOCHS epochs (default 60,
# 30,720 samples a run). Sized from the CPU measurements, not yet run on a GPU: run PHASE=exact
# first and check that exact GRPO gains (the summary lines) before the JAGG phase.
#
#   tools/gpu_mini_quality.sh [OUT] [EPOCHS] [more train_sd.py flags]   # default runs/gpu_mini, 60
#   PHASE=exact tools/gpu_mini_quality.sh ...; PHASE=jagg tools/gpu_mini_quality.sh ...   # in two calls
#   tools/gpu_mini_quality.sh /tmp/q 1 --device cpu --eval-samples 8 --prompts-per-epoch 2 --group-size 4 \
#     --rollout-batch 8 --train-batch 8 --probe-batch 2                  # the same script, tested on a CPU
#
# Each seed: exact GRPO into OUT/paper_seedS/exact, then the paper's JAGG (OUT/paper_seedS) and
# shared anchors + rollout interiors (OUT/shared_seedS) with --exact-from that exact run. The
# three seeds run side by side (the mini transformer leaves a large GPU mostly idle). The mini
# model is taken from runs/cache/ (carry it) or pretrained first. Needs diffusers and peft: as
# tools/gpu_benchmark.sh, from wheels in .whl/ where they are not installed.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/gpu_mini}
epochs=${2:-60}
phase=${PHASE:-all}  # exact, jagg (the exact runs must exist) or all
case "$phase" in all|exact|jagg) ;; *) echo "error: PHASE must be all, exact or jagg, got '$phase'"; exit 1;; esac
shift 2 || shift $# || true
if ! python3 -c "import diffusers, peft" 2>/dev/null; then
  [ -d .whl ] || { echo "error: diffusers or peft is not installed and there is no .whl/ folder of wheels to install it from"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
python3 -c "import torch, diffusers; print('torch', torch.__version__, '| diffusers', diffusers.__version__, '| device',
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
python3 -c "import mini_sd3; mini_sd3.cached_pipeline()"  # pretrain once, before the runs share it
every=$(( epochs >= 10 ? epochs / 10 : 1 ))
run() {  # DIR FLAGS...: one train_sd.py compare or exact run
  local dir=$1; shift
  python3 train_sd.py --model mini --reward shapes --full-finetune --global-std --lr 3e-4 --lr-schedule cosine \
    --train-batch 512 --clip-range 0.2 --no-gradient-checkpointing --mixed-precision fp32 --prompts-per-epoch 32 \
    --group-size 16 --rollout-batch 256 --epochs "$epochs" --eval-every "$every" --eval-samples 192 --final-evals 3 \
    --probe-every "$every" --probe-batch 8 --save-every "$epochs" --window 4 --out "$dir" "$@" > "$dir.log" 2>&1
  tail -n 2 "$dir.log"
}
mkdir -p "$out"
if [ "$phase" != jagg ]; then
  for seed in 0 1 2; do
    mkdir -p "$out/paper_seed$seed"
    run "$out/paper_seed$seed/exact" --method exact --seed "$seed" "$@" &
  done
  wait
fi
[ "$phase" = exact ] && exit 0
for seed in 0 1 2; do
  run "$out/paper_seed$seed" --method compare --exact-from "$out/paper_seed$seed/exact" --seed "$seed" "$@" &
  run "$out/shared_seed$seed" --method compare --exact-from "$out/paper_seed$seed/exact" --seed "$seed" \
    --anchors shared --interior rollout "$@" &
done
wait
python3 tools/summarize.py compare "$out"/paper_seed[0-9] "$out"/shared_seed[0-9]
