#!/usr/bin/env bash
# The equal-cost question on a GPU, in one command (lab/reports/equal_cost.md): one training step of
# SD3.5-medium's transformer (built from its config, random weights: time and memory do not depend on
# them), 512 px, bf16, in Flow-GRPO's configuration (T = 10 with the first 9 trained, CFG 4.5, KL beta
# 0.04, LoRA rank 32 on a batch of 9, gradient checkpointing as train_sd.py), timed by interleaved
# medians in one process, for
#   exact GRPO; the paper's JAGG (jagg) at W = 4; the fast modes (jagg_shared_rollout, train_sd.py
#   --fast; jagg_shared, jagg_rollout), each also with at most 2 anchor rows in a graph (_rows2);
#   and SDE windows of 8 and 4 steps (Flow-GRPO-Fast's), exact, with the paper's JAGG and with the
#   fast mode inside at W = 4,
# printing each one's rows with grad, seconds, speedup over exact and peak memory. W = 8 follows.
#
#   lab/gpu_equal_cost.sh [OUT] [more lab/sd_benchmark.py flags]   # writes OUT/w4, OUT/w8 (default runs/gpu_equal_cost)
#   lab/gpu_equal_cost.sh /tmp/e --size tiny --device cpu --batch 2 --repeats 1   # the same script on a CPU, in seconds
#
# A machine without diffusers or peft (a lent GPU has no network): put their wheels in .whl/ first,
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl diffusers==0.42.1 importlib_metadata peft
# and this script installs them into /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/gpu_equal_cost}
shift || true
if ! python3 -c "import diffusers, peft" 2>/dev/null; then
  [ -d .whl ] || { echo "error: diffusers or peft is not installed and there is no .whl/ folder of wheels to install it from"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
python3 -c "import torch, diffusers; print('torch', torch.__version__, '| diffusers', diffusers.__version__, '| device',
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
for W in 4 8; do
  echo "=== W = $W"
  python3 lab/sd_benchmark.py --size sd35-medium --resolution 512 --num-steps 10 --timestep-fraction 0.99 \
    --guidance-scale 4.5 --beta 0.04 --train lora --lora-rank 32 --batch 9 --checkpointing \
    --window "$W" --max-graph-rows 2 --sde-windows 8,4 --repeats 3 --out "$out/w$W" "$@"
done
