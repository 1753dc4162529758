#!/usr/bin/env bash
# JAGG's quality on the mini SD3 (lab/mini_sd3.py) on one GPU: lab/mini_quality.sh's table, with
# lab/presets.py mini (lr 3e-4, CFG 2.5, Flow-GRPO's T = 10, noise level 0.7 and KL beta
# 0.04) and, for geneval, the LoRA and global std that let exact GRPO raise it on the CPU
# (lab/reports/mini_sd3.md; full fine-tuning lowers it), with more samples and epochs than a CPU
# affords: 16 prompts x 8 samples per epoch in optimizer steps of 32, the seeds side by side (the
# mini transformer leaves a large GPU mostly idle), in bf16 autocast (lab/sd_runner.py's on a GPU; before the
# layout change this script ran fp32). Not yet run on a GPU.
#
#   lab/gpu_mini_quality.sh [OUT] [EPOCHS] [more lab/sd_runner.py flags]   # default runs/gpu_mini, 40
#   REWARD=darkness lab/gpu_mini_quality.sh ...                        # the reward (default geneval)
#   SEEDS="0 1 2 3 4" JOBS=10 lab/gpu_mini_quality.sh ...              # the seeds (default 0-19: the
#                                                                        # CPU tables' spread asks for 15-90; geneval's
#                                                                        # shared + rollout about 60), runs at a time
#   PHASE=exact lab/gpu_mini_quality.sh ...; PHASE=jagg lab/gpu_mini_quality.sh ...   # in two calls
#   DRAWS=64 lab/gpu_mini_quality.sh ...   # each seed's final models redrawn 64 times with fresh noise
#                                            # (lab/eval_noise.py; default 16, 0: none), then
#                                            # summarize.py paired: the intervals and the draws ±10 points need
#   CUDA_VISIBLE_DEVICES= lab/gpu_mini_quality.sh /tmp/q 1 --eval-samples 8 --prompts-per-epoch 2 --group-size 4 \
#     --train-batch 8                                                    # the same script, tested on a CPU
#
# Each seed: exact GRPO into OUT/paper_seedS/exact, then the paper's JAGG (OUT/paper_seedS) and
# shared anchors + rollout interiors (OUT/shared_seedS), each compared with that exact run
# (lab/compare_runs.py). The
# mini model is taken from runs/cache/ (carry it) or pretrained first. Needs diffusers and peft: as
# lab/gpu_benchmark.sh, from wheels in .whl/ where they are not installed.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/gpu_mini}
epochs=${2:-40}
phase=${PHASE:-all}  # exact, jagg (the exact runs must exist) or all
seeds=${SEEDS:-$(seq -s ' ' 0 19)}
jobs_max=${JOBS:-10}  # runs at a time on the GPU
draws=${DRAWS:-16}  # the redrawn evaluation of each seed's final models (0: none)
case "$draws" in ''|*[!0-9]*|1) echo "error: DRAWS must be 0 (none) or a whole number of draws of at least 2, got '$draws'"; exit 1 ;; esac
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
preset=mini  # geneval: mini-geneval, the setting exact GRPO raises it at (its LoRA and global std)
[ "${REWARD:-geneval}" = geneval ] && preset=mini-geneval
preset_flags=$(python3 lab/presets.py "$preset")  # pretrains the mini SD3 once, before the runs share it
every=$(( epochs >= 10 ? epochs / 10 : 1 ))
reward=${REWARD:-geneval}
[ "$reward" = geneval ] || preset_flags="$preset_flags --reward $reward"
run() {  # DIR FLAGS...: one lab/sd_runner.py compare or exact run
  local dir=$1; shift
  python3 lab/sd_runner.py $preset_flags --train-batch 32 --prompts-per-epoch 16 --group-size 8 --epochs "$epochs" \
    --eval-every "$every" --eval-samples 192 --probe-every "$every" --window 4 --out "$dir" "$@" > "$dir.log" 2>&1
  tail -n 2 "$dir.log"
}
slot() { while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n; done; }  # wait for a free slot
mkdir -p "$out"
if [ "$phase" != jagg ]; then
  for seed in $seeds; do
    mkdir -p "$out/paper_seed$seed"; slot
    run "$out/paper_seed$seed/exact" --method exact --seed "$seed" "$@" &
  done
  wait
fi
[ "$phase" = exact ] && exit 0
for seed in $seeds; do
  slot; run "$out/paper_seed$seed/jagg" --method jagg --seed "$seed" "$@" &
  mkdir -p "$out/shared_seed$seed"
  slot; run "$out/shared_seed$seed/jagg" --method jagg --seed "$seed" --anchors shared --interior rollout "$@" &
done
wait
for seed in $seeds; do  # OUT/<mode>_seed<S>/summary.json against the seed's exact run (what summarize.py compare reads)
  python3 lab/compare_runs.py "$out/paper_seed$seed/exact" "$out/paper_seed$seed/jagg" --out "$out/paper_seed$seed" \
    --final-evals 3 --no-samples | tail -n 1
  python3 lab/compare_runs.py "$out/paper_seed$seed/exact" "$out/shared_seed$seed/jagg" --out "$out/shared_seed$seed" \
    --final-evals 3 --no-samples | tail -n 1
done
python3 lab/summarize.py compare $(for s in $seeds; do echo "$out/paper_seed$s"; done) \
  $(for s in $seeds; do echo "$out/shared_seed$s"; done)
[ "$draws" -gt 0 ] || exit 0
first=${seeds%% *}
# the same fresh noise for a seed's three models, each seed its own (one noise for all seeds leaves a
# part of a draw's luck common to them, which more seeds do not average out: lab/reports/mini_sd3.md);
# the base model in the first seed's file
for seed in $seeds; do
  slot; python3 lab/eval_noise.py "$out/paper_seed$seed/exact" "$out/paper_seed$seed/jagg" "$out/shared_seed$seed/jagg" \
    --draws "$draws" $([ "$seed" = "$first" ] || echo --no-base) --noise-seed $((7000000 + 1000 * (seed + 1))) \
    --out "$out/noise_seed$seed.json" \
    >> "$out/noise_seed$seed.log" 2>&1 &
done
wait
python3 lab/summarize.py paired $(for s in $seeds; do echo "$out/noise_seed$s.json"; done)
