#!/usr/bin/env bash
# The toy's retention table (lab/reports/quality.md): exact GRPO, five JAGG modes and a control (exact at
# 0.9x the learning rate), seeds 0-19, every run from the seed-0 base model, two runs at a time with
# one thread each (about 40 s a run, 140 runs: about an hour on 2 idle cores). A run that has
# finished before is skipped, so an interrupted table resumes.
#
#   lab/toy_quality.sh [OUT]                                       # default OUT: runs/toy_quality
#   SEEDS="0 1 2" lab/toy_quality.sh runs/toy_quality_try           # fewer seeds
#   python lab/summarize.py retention runs/toy_quality              # the table: gain kept per mode, 95 % intervals,
#                                                                   # paired difference to the paper's mode, worst seed
#
# The setting is train_toy.py's defaults, run by lab/toy_options.py (W = 4, T = 16, 80 epochs of 4 optimizer steps; the probe off).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/toy_quality}
seeds=${SEEDS:-$(seq -s ' ' 0 19)}
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
base=runs/cache/toy_dit_h64_d3_s2000_seed0.pt
[ -f "$base" ] || python3 -c "import train_toy; train_toy.base_model(train_toy.Args())"
mkdir -p "$out"
# name and flags of each mode; the folders are OUT/<name>/seed<S>
modes=(
  "exact|--method exact"
  "paper|--method jagg"
  "shared_forward|--method jagg --anchors shared"
  "rollout|--method jagg --interior rollout"
  "shared_rollout|--method jagg --anchors shared --interior rollout"
  "shared_rollout_unguarded|--method jagg --anchors shared --interior rollout --max-drift -1"
  "exact_lr09|--method exact --lr 9e-4"  # a control: exact GRPO at 0.9x the learning rate (JAGG's projection)
)
jobs_file=$(mktemp)
trap 'rm -f "$jobs_file"' EXIT
for s in $seeds; do
  for m in "${modes[@]}"; do
    name=${m%%|*} flags=${m#*|}
    dir="$out/$name/seed$s"
    [ -f "$dir/summary.json" ] && continue
    echo "mkdir -p $out/$name && python3 lab/toy_options.py $flags --seed $s --base-ckpt $base --out $dir > $dir.log 2>&1 && tail -n 1 $dir.log" >> "$jobs_file"
  done
done
echo "$(wc -l < "$jobs_file") runs to do in $out"
xargs -P 2 -I{} bash -c {} < "$jobs_file"
python3 lab/summarize.py retention "$out"
