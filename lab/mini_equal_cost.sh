#!/usr/bin/env bash
# JAGG against the field's cheap alternatives at equal cost on the mini SD3 (lab/reports/equal_cost.md):
# lab/presets.py mini (darkness, T = 10 all trained, 15 epochs), seeds 0-4, P runs at a time with
# one thread each (default 1: about 4 minutes a run, 11 runs a seed). A finished run is skipped.
#
#   lab/mini_equal_cost.sh [OUT]                              # default OUT: runs/mini_equal_cost
#   SEEDS="0 1 2 3 4 5 6 7" P=2 lab/mini_equal_cost.sh OUT      # more seeds, two runs at a time
#   MODES="exact jagg_w4" lab/mini_equal_cost.sh OUT            # some modes only
#   python lab/summarize.py equal_cost OUT                    # the table (--png F: the picture)
#
# Rows with grad per sample and step of the 10: exact 10; the paper's JAGG at W = 4 (windows 0-3,
# 4-7, 8-9: 2 + 2 + 2) and the alternatives at K = 6, 6; JAGG at W = 8 (0-7, 8-9) and K = 4, 4;
# routing at jagg_frac 0.5 by the free score (velocity) and by the early-first schedule (early).
# random: lab/sd_baselines.py (DanceGRPO's steps, one draw per micro-batch); first: Flow-GRPO's
# --timestep-fraction; window: Flow-GRPO-Fast's --sde-window, anywhere in the 10 steps. Routing by the
# estimated error (step_error). Beyond the paper (shared anchors, rollout interiors: train_sd.py --fast):
# 4 rows at W = 4 (anchors 0, 3, 6, 9), 3 at W = 8 (0, 7, 9); inside an SDE window of 8 (0, 3, 6, 7: 4)
# and 4 (0, 3: 2); --max-graph-rows 2 trains the same gradient in less memory.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/mini_equal_cost}
seeds=${SEEDS:-0 1 2 3 4}
parallel=${P:-1}
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
preset=$(python3 lab/presets.py mini)  # pretrains the mini SD3 once (about 10 minutes)
mkdir -p "$out"
sd="lab/sd_runner.py $preset"
random="lab/sd_baselines.py"
modes=(  # name|command before its flags; the folders are OUT/<name>/seed<S>
  "exact|$sd --method exact"
  "jagg_w4|$sd --method jagg --window 4"
  "random6|$random --random-steps 6 -- $preset --method exact"
  "first6|$sd --method exact --timestep-fraction 0.6"
  "window6|$sd --method exact --sde-window 6 --sde-range-end 10"
  "jagg_w8|$sd --method jagg --window 8"
  "random4|$random --random-steps 4 -- $preset --method exact"
  "first4|$sd --method exact --timestep-fraction 0.4"
  "window4|$sd --method exact --sde-window 4 --sde-range-end 10"
  "velocity0.5|$sd --method jagg --window 4 --jagg-frac 0.5 --route velocity"
  "early0.5|$sd --method jagg --window 4 --jagg-frac 0.5 --route early"
  "step_error0.5|$sd --method jagg --window 4 --jagg-frac 0.5 --route step_error"
  "window8|$sd --method exact --sde-window 8 --sde-range-end 10"
  "window8_jagg_w4|$sd --method jagg --window 4 --sde-window 8 --sde-range-end 10"
  "shared_rollout_w4|$sd --method jagg --window 4 --anchors shared --interior rollout"
  "shared_rollout_w8|$sd --method jagg --window 8 --anchors shared --interior rollout"
  "window8_shared_rollout_w4|$sd --method jagg --window 4 --anchors shared --interior rollout --sde-window 8 --sde-range-end 10"
  "window4_shared_rollout_w4|$sd --method jagg --window 4 --anchors shared --interior rollout --sde-window 4 --sde-range-end 10"
  "shared_rollout_w4_rows2|$sd --method jagg --window 4 --anchors shared --interior rollout --max-graph-rows 2"
  "shared_rollout_w8_rows2|$sd --method jagg --window 8 --anchors shared --interior rollout --max-graph-rows 2"
  "window8_shared_rollout_w4_rows2|$sd --method jagg --window 4 --anchors shared --interior rollout --sde-window 8 --sde-range-end 10 --max-graph-rows 2"
  "window4_shared_rollout_w4_rows2|$sd --method jagg --window 4 --anchors shared --interior rollout --sde-window 4 --sde-range-end 10 --max-graph-rows 2"
)
jobs_file=$(mktemp)
trap 'rm -f "$jobs_file"' EXIT
for s in $seeds; do
  for m in "${modes[@]}"; do
    name=${m%%|*}
    cmd=${m#*|}
    [ -n "${MODES:-}" ] && [[ " $MODES " != *" $name "* ]] && continue  # MODES="a b": those modes only
    dir="$out/$name/seed$s"
    [ -f "$dir/summary.json" ] && continue
    echo "mkdir -p $out/$name && python3 $cmd --seed $s --overwrite --out $dir > $dir.log 2>&1 && tail -n 1 $dir.log" >> "$jobs_file"
  done
done
echo "$(wc -l < "$jobs_file") runs to do in $out"
xargs -P "$parallel" -I{} bash -c {} < "$jobs_file"
python3 lab/summarize.py equal_cost "$out"
