#!/usr/bin/env bash
# The GPU benchmark in one command: SD3.5-medium's transformer built from its config (random
# weights, 2.24B parameters), 512 px, bf16, T = 10 steps, CFG 4.5, KL beta 0.04; a window's
# gradient and a whole training step in every mode, each JAGG mode also with at most 2 anchor
# rows in a graph (--max-graph-rows 2), in three configurations:
#   full   every weight trained, no gradient checkpointing, B = 4, at W = 4 and W = 8 (the README's earlier table)
#   lora   Flow-GRPO's setting: LoRA rank 32 (alpha 64) on the attention, no checkpointing, its train batch of 9, W = 4
#   lora_ckpt  the same with gradient checkpointing (lab/sd_runner.py's training default), W = 4
# and on a machine with more than one GPU, FSDP over all of them (lab/fsdp_memory.py).
#
#   lab/gpu_benchmark.sh [OUT] [more lab/sd_benchmark.py flags]    # writes OUT/<config>_w<W> (default runs/gpu_bench)
#   lab/gpu_benchmark.sh /tmp/b --size tiny --device cpu   # the same script, tested on a CPU
#
# A machine without diffusers (e.g. a lent GPU with no network): put its wheels in .whl/ first,
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl diffusers==0.42.1 importlib_metadata peft
# and this script installs them into /tmp/site. In the full configuration gradient checkpointing
# is used only if the largest joint anchor batch does not fit; the output says so.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/gpu_bench}
shift || true
if ! python3 -c "import diffusers, peft" 2>/dev/null; then
  [ -d .whl ] || { echo "error: diffusers or peft is not installed and there is no .whl/ folder of wheels to install it from"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
python3 -c "import torch, diffusers; print('torch', torch.__version__, '| diffusers', diffusers.__version__, '| device',
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
bench() {  # NAME W FLAGS...: one benchmark into $out/NAME_wW
  local name=$1 W=$2; shift 2
  echo "=== $name, W = $W"
  python3 lab/sd_benchmark.py --size sd35-medium --resolution 512 --num-steps 10 --guidance-scale 4.5 --beta 0.04 \
    --window "$W" --repeats 3 --max-graph-rows 2 --out "$out/${name}_w$W" "$@"
}
bench full 4 "$@"
bench full 8 "$@"
bench lora 4 --train lora --lora-rank 32 --batch 9 "$@"
bench lora_ckpt 4 --train lora --lora-rank 32 --batch 9 --checkpointing "$@"
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -gt 1 ]; then  # FSDP: per-GPU state and each mode's activations, on every GPU of the machine
  echo "=== FSDP, $gpus GPUs"
  torchrun --standalone --nproc_per_node="$gpus" lab/fsdp_memory.py --size sd35-medium --out "$out/fsdp"
  python3 lab/fsdp_memory.py --report "$out/fsdp"
fi
echo "=== JSON"
for f in "$out"/*/benchmark.json; do python3 -c "import json, sys; print(json.dumps(json.load(open(sys.argv[1]))['result']))" "$f"; done
