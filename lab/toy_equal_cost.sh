#!/usr/bin/env bash
# JAGG against the field's cheap alternatives at equal cost, and routing against a fixed schedule,
# on the toy (lab/reports/equal_cost.md): seeds 0-19, every run from the seed-0 base model, P runs at
# a time with one thread each (default 1: about 30 s a run, 19 runs a seed).
# A run that has finished before is skipped, so an interrupted table resumes.
#
#   lab/toy_equal_cost.sh [OUT]                              # default OUT: runs/toy_equal_cost
#   SEEDS="0 1 2" P=2 lab/toy_equal_cost.sh runs/try          # fewer seeds, two runs at a time
#   MODES="exact jagg_w4" lab/toy_equal_cost.sh runs/try      # some modes only
#   python lab/summarize.py equal_cost runs/toy_equal_cost    # the tables and equal_cost.png
#
# The setting is train_toy.py's defaults: T = 16, all 16 steps trained by exact GRPO, 80 epochs of
# 4 optimizer steps. Rows with grad per sample: exact 16; the paper's JAGG at W = 4 and the
# alternatives at K = 8 steps, 8; JAGG at W = 8 and the alternatives at K = 4, 4; routing at
# jagg_frac 0.5 and 0.75, 12 and 10. Beyond the paper (shared anchors, rollout interiors: train_sd.py
# --fast): 6 at W = 4 (anchors 0, 3, ..., 15), 4 at W = 8; inside an SDE window of 8 and 4 steps, 4
# and 2; --max-graph-rows 2 trains the same gradient in less memory; shared_w4 (forward interiors)
# and shared_rollout_w4_noguard (no drift guard) tell the rollout interiors and the guard apart.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/toy_equal_cost}
seeds=${SEEDS:-$(seq -s ' ' 0 19)}
parallel=${P:-1}
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
base=runs/cache/toy_dit_h64_d3_s2000_seed0.pt
[ -f "$base" ] || python3 -c "import train_toy; train_toy.base_model(train_toy.Args())"
mkdir -p "$out"
toy="lab/toy_options.py --method jagg"
baseline="lab/toy_baselines.py --method jagg --baseline"
modes=(  # name|script and flags; the folders are OUT/<name>/seed<S>
  "exact|lab/toy_options.py --method exact"
  "jagg_w4|$toy"
  "random8|$baseline random --trained-steps 8"
  "first8|$baseline first --trained-steps 8"
  "window8|$baseline window --trained-steps 8"
  "window8_jagg_w4|$baseline window --trained-steps 8 --window-jagg"
  "jagg_random8_w4|$baseline jagg_random --trained-steps 8"
  "jagg_w8|$toy --window 8"
  "random4|$baseline random --trained-steps 4"
  "first4|$baseline first --trained-steps 4"
  "window4|$baseline window --trained-steps 4"
  "velocity0.5|$toy --jagg-frac 0.5"
  "late0.5|$toy --jagg-frac 0.5 --route late"
  "early0.5|$toy --jagg-frac 0.5 --route early"
  "probe0.5|$toy --jagg-frac 0.5 --route probe --probe-every 5"
  "velocity0.75|$toy --jagg-frac 0.75"
  "late0.75|$toy --jagg-frac 0.75 --route late"
  "early0.75|$toy --jagg-frac 0.75 --route early"
  "probe0.75|$toy --jagg-frac 0.75 --route probe --probe-every 5"
  "step_error0.5|$toy --jagg-frac 0.5 --route step_error"
  "step_error0.75|$toy --jagg-frac 0.75 --route step_error"
  "shared_rollout_w4|$toy --anchors shared --interior rollout"
  "shared_rollout_w8|$toy --anchors shared --interior rollout --window 8"
  "window8_shared_rollout_w4|$baseline window --trained-steps 8 --window-jagg --anchors shared --interior rollout"
  "window4_shared_rollout_w4|$baseline window --trained-steps 4 --window-jagg --anchors shared --interior rollout"
  "shared_rollout_w4_rows2|$toy --anchors shared --interior rollout --max-graph-rows 2"
  "shared_rollout_w8_rows2|$toy --anchors shared --interior rollout --window 8 --max-graph-rows 2"
  "window8_shared_rollout_w4_rows2|$baseline window --trained-steps 8 --window-jagg --anchors shared --interior rollout --max-graph-rows 2"
  "window4_shared_rollout_w4_rows2|$baseline window --trained-steps 4 --window-jagg --anchors shared --interior rollout --max-graph-rows 2"
  "shared_w4|$toy --anchors shared"
  "shared_rollout_w4_noguard|$toy --anchors shared --interior rollout --max-drift -1"
)
jobs_file=$(mktemp)
trap 'rm -f "$jobs_file"' EXIT
for s in $seeds; do
  for m in "${modes[@]}"; do
    name=${m%%|*}
    flags=${m#*|}
    [ -n "${MODES:-}" ] && [[ " $MODES " != *" $name "* ]] && continue  # MODES="a b": those modes only
    dir="$out/$name/seed$s"
    [ -f "$dir/summary.json" ] && continue
    echo "mkdir -p $out/$name && python3 $flags --seed $s --base-ckpt $base --out $dir > $dir.log 2>&1 && tail -n 1 $dir.log" >> "$jobs_file"
  done
done
echo "$(wc -l < "$jobs_file") runs to do in $out"
xargs -P "$parallel" -I{} bash -c {} < "$jobs_file"
python3 lab/summarize.py equal_cost "$out"
