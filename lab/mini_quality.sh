#!/usr/bin/env bash
# JAGG's quality on the mini SD3 (lab/mini_sd3.py), on a CPU: the table in lab/reports/mini_sd3.md.
# Seeds 0-4; per seed exact GRPO once, then the paper's JAGG and shared anchors + rollout
# interiors from the same model and seed, each compared with that exact run (lab/compare_runs.py);
# two runs at a time, one thread each.
# A run that has finished before is not run again, so an interrupted table resumes; one that
# finished at fewer epochs continues from its checkpoint, so a table can be trained longer.
#
#   lab/mini_quality.sh darkness [OUT]   # 15 epochs a run: about 20 minutes on 2 cores
#   lab/mini_quality.sh cover [OUT]      # 20 epochs a run: about 30 minutes on 2 cores
#   lab/mini_quality.sh geneval [OUT]    # 12 epochs, LoRA, global std, 8 prompts an epoch: about 15 minutes a seed
#   SEEDS="$(seq -s ' ' 0 19)" lab/mini_quality.sh darkness   # 20 seeds: summarize prints how many ±10 points need
#   SEEDS="$(seq -s ' ' 0 23)" EPOCHS=2 EVAL_SAMPLES=192 lab/mini_quality.sh geneval runs/geneval_2ep
#                      # the short-run table: 2 epochs from the base, both evaluations with the same noise
#   cp -r runs/mini_geneval runs/mini_geneval_24 && EPOCHS=24 lab/mini_quality.sh geneval runs/mini_geneval_24
#                      # the 12-epoch table trained on to 24 epochs (the same runs as 24 epochs from the start)
#   DRAWS=4 lab/mini_quality.sh geneval OUT   # then each seed's final models redrawn 4 times with fresh noise
#                      # (lab/eval_noise.py): summarize.py paired splits JAGG - exact's spread into the
#                      # evaluation's and the runs' own; DRAWS=16 later grows the same files to 16 draws
#   python lab/summarize.py compare OUT/paper_seed[0-9] OUT/shared_seed[0-9]     # the table
#   TABLE=window lab/mini_quality.sh darkness runs/mini_window_darkness
#                      # JAGG or an SDE window (lab/reports/sde_window.md): per seed exact and the paper's JAGG on
#                      # every step, and an SDE window of WINDOW (4) steps placed as Flow-GRPO-Fast does (a
#                      # random start in steps 0 to WINDOW_RANGE_END - 1 (6)), trained exact and by JAGG at
#                      # W = WINDOW, for WINDOW_EPOCHS (8/5 of the epochs: a window's epoch is cheaper); then
#                      # summarize.py wallclock: the reward each reaches at the same training time.
#                      # LR_CONTROL=7.5e-4 adds every step's exact run at that learning rate (10/K times the
#                      # default): does a larger update alone close the gap to the window?
#
# The setting is lab/presets.py mini, the one the sanity ladder in lab/reports/mini_sd3.md found to
# learn: full fine-tuning at lr 3e-4, CFG 2.5 (at Flow-GRPO's 4.5 the darkness rose +0.15 in 15
# epochs, short of the ladder's +0.2), Flow-GRPO's T = 10, noise level 0.7 and KL beta 0.04, all 10
# steps trained, 4 prompts x 8 samples per epoch in optimizer steps of 8 (docs/flow_grpo.md lists
# where that departs from Flow-GRPO's own setting). geneval runs mini-geneval, which adds
# what exact GRPO needed to raise it: Flow-GRPO's LoRA (rank 32, alpha 64) and global std, and 8
# prompts x 8 samples an epoch in optimizer steps of 16; with full fine-tuning it falls (lab/reports/mini_sd3.md).
set -euo pipefail
cd "$(dirname "$0")/.."
reward=${1:?usage: lab/mini_quality.sh darkness|cover|geneval [OUT]}
out=${2:-runs/mini_$reward}
preset=mini  # lab/presets.py's setting for the reward
case "$reward" in
  darkness) epochs=15 evals="--eval-samples 48 --eval-every 2" ;;
  cover) epochs=20 evals="--eval-samples 96 --eval-every 2 --reward lab.mini_sd3:cover_reward" ;;
  geneval) epochs=12 evals="--eval-samples 96 --eval-every 2" preset=mini-geneval ;;
  *) echo "error: the reward must be darkness, cover or geneval, got '$reward'"; exit 1 ;;
esac
epochs=${EPOCHS:-$epochs}  # EPOCHS=2: short runs, whose gain kept is not blurred by a whole run's divergence
[ -n "${EVAL_SAMPLES:-}" ] && evals="$evals --eval-samples $EVAL_SAMPLES"  # the later flag wins
case "$epochs" in ''|*[!0-9]*|0) echo "error: EPOCHS must be a whole number of epochs above 0, got '$epochs'"; exit 1 ;; esac
draws=${DRAWS:-0}  # DRAWS=4: the final models' evaluations redrawn with independent noise, paired across modes
case "$draws" in ''|*[!0-9]*|1) echo "error: DRAWS must be 0 (none) or a whole number of draws of at least 2, got '$draws'"; exit 1 ;; esac
table=${TABLE:-retention}
case "$table" in retention|window) ;; *) echo "error: TABLE must be retention or window, got '$table'"; exit 1 ;; esac
window=${WINDOW:-4} range_end=${WINDOW_RANGE_END:-6} window_epochs=${WINDOW_EPOCHS:-$((epochs * 8 / 5))}
for v in window range_end window_epochs; do
  case "${!v}" in ''|*[!0-9]*|0) echo "error: ${v^^} must be a whole number above 0, got '${!v}'"; exit 1 ;; esac
done
lr_control=${LR_CONTROL:-}
[ -z "$lr_control" ] || python3 -c 'import sys; assert float(sys.argv[1]) > 0' "$lr_control" 2>/dev/null \
  || { echo "error: LR_CONTROL must be a learning rate above 0, e.g. 7.5e-4, got '$lr_control'"; exit 1; }
[ "$range_end" -ge "$window" ] || { echo "error: WINDOW_RANGE_END ($range_end) must be at least WINDOW ($window)"; exit 1; }
seeds=${SEEDS:-0 1 2 3 4}  # SEEDS="0 1 ... 19" lab/mini_quality.sh ...: more seeds, a narrower interval
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
preset_flags=$(python3 lab/presets.py "$preset")  # pretrains the mini SD3 once, before the runs share it
run() {  # DIR FLAGS...: one lab/sd_runner.py run, skipped where it has finished before, continued where it stopped short
  local dir=$1; shift
  local done resume=()
  done=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["config"]["epochs"])' "$dir/summary.json" \
         2>/dev/null || echo 0)
  [ "$done" -ge "$epochs" ] && { [ "$done" -gt "$epochs" ] && echo "note: $dir has $done epochs, kept"; return 0; }
  [ -f "$dir/checkpoint.pt" ] && resume=(--resume "$dir")  # a shorter finished run continues
  mkdir -p "$(dirname "$dir")"
  python3 lab/sd_runner.py $preset_flags --epochs "$epochs" $evals --out "$dir" "${resume[@]}" "$@" >> "$dir.log" 2>&1
  tail -n 1 "$dir.log"
}
compared() {  # EXACT JAGG OUT: OUT/summary.json (what summarize.py compare reads) and pictures
  python3 lab/compare_runs.py "$1" "$2" --out "$3" --final-evals 3 >> "$3.log" 2>&1 && tail -n 1 "$3.log"
}
job() {  # KIND SEED: exact, or a JAGG mode compared with the seed's exact run
  local kind=$1 s=$2
  local base="$out/paper_seed$s" sde=()
  if [ "$kind" = wexact ] || [ "$kind" = wpaper ]; then  # an SDE window, longer in epochs; JAGG's W = its length
    local epochs=$window_epochs
    base="$out/window_seed$s" sde=(--sde-window "$window" --sde-range-end "$range_end" --window "$window")
  fi
  local jagg_flags=(--method jagg --seed "$s" --probe-every 5 "${sde[@]}")
  case "$kind" in
    exact|wexact) run "$base/exact" --method exact --seed "$s" "${sde[@]}" ;;
    paper|wpaper) run "$base/jagg" "${jagg_flags[@]}" && compared "$base/exact" "$base/jagg" "$base" ;;
    lexact) run "$out/lr_seed$s" --method exact --seed "$s" --lr "$lr_control" ;;
    shared) run "$out/shared_seed$s/jagg" "${jagg_flags[@]}" --anchors shared --interior rollout \
              && compared "$out/paper_seed$s/exact" "$out/shared_seed$s/jagg" "$out/shared_seed$s" ;;
  esac
}
noise() {  # SEED: its exact and JAGG final models, each drawn $draws times with the same fresh noise (the base model: the first seed's file)
  local s=$1 file="$out/noise_seed$1.json" have
  # a file with fewer draws grows: eval_noise.py keeps the draws it holds and draws only the rest
  have=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["draws"])' "$file" 2>/dev/null || echo 0)
  [ "$have" -ge "$draws" ] && return 0
  python3 lab/eval_noise.py "$out/paper_seed$s/exact" "$out/paper_seed$s/jagg" "$out/shared_seed$s/jagg" \
    --draws "$draws" $([ "$s" = "$first" ] || echo --no-base) --out "$file" >> "$out/noise_seed$s.log" 2>&1
  tail -n 1 "$out/noise_seed$s.log"
}
export -f run compared job noise
first=${seeds%% *}
export reward out epochs evals preset preset_flags draws first window range_end window_epochs lr_control
mkdir -p "$out"
# two runs at a time: every seed's exact runs first, then the JAGG runs that start from them
if [ "$table" = window ]; then
  for s in $seeds; do echo "exact $s"; echo "wexact $s"; done | xargs -P 2 -L 1 bash -c 'job "$0" "$1"'
  for s in $seeds; do echo "paper $s"; echo "wpaper $s"; [ -z "$lr_control" ] || echo "lexact $s"; done \
    | xargs -P 2 -L 1 bash -c 'job "$0" "$1"'
  python3 lab/summarize.py wallclock $(for s in $seeds; do echo "$out/paper_seed$s $out/window_seed$s"
    [ -z "$lr_control" ] || echo "$out/lr_seed$s"; done) --png "$out/wallclock.png"
  exit 0
fi
for s in $seeds; do echo "exact $s"; done | xargs -P 2 -L 1 bash -c 'job "$0" "$1"'
for s in $seeds; do echo "paper $s"; echo "shared $s"; done | xargs -P 2 -L 1 bash -c 'job "$0" "$1"'
python3 lab/summarize.py compare $(for s in $seeds; do echo "$out/paper_seed$s"; done) \
  $(for s in $seeds; do echo "$out/shared_seed$s"; done)
if [ "$draws" -gt 0 ]; then
  for s in $seeds; do echo "$s"; done | xargs -P 2 -L 1 bash -c 'noise "$0"'
  python3 lab/summarize.py paired $(for s in $seeds; do echo "$out/noise_seed$s.json"; done)
fi
