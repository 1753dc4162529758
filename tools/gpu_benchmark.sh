#!/usr/bin/env bash
# The GPU benchmark in one command: SD3.5-medium's transformer built from its config (random
# weights, 2.24B parameters, all trained), 512 px, bf16, B = 4, T = 10 steps, CFG 4.5, KL beta
# 0.04, at W = 4 and W = 8: a window's gradient and a whole training step in every mode.
#
#   tools/gpu_benchmark.sh [OUT] [more train_sd.py flags]    # writes OUT/w4, OUT/w8 (default runs/gpu_bench)
#   tools/gpu_benchmark.sh /tmp/b --bench-size tiny --device cpu   # the same script, tested on a CPU
#
# A machine without diffusers (e.g. a lent GPU with no network): put its wheels in .whl/ first,
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl diffusers==0.42.1 importlib_metadata
# and this script installs them into /tmp/site. Gradient checkpointing is used only if the
# largest joint anchor batch does not fit; the output says so.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/gpu_bench}
shift || true
if ! python3 -c "import diffusers" 2>/dev/null; then
  [ -d .whl ] || { echo "error: diffusers is not installed and there is no .whl/ folder of wheels to install it from"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
python3 -c "import torch, diffusers; print('torch', torch.__version__, '| diffusers', diffusers.__version__, '| device',
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
for W in 4 8; do
  echo "=== W = $W"
  python3 train_sd.py --benchmark --random-init --bench-size sd35-medium --resolution 512 --mixed-precision auto \
    --num-steps 10 --guidance-scale 4.5 --beta 0.04 --window "$W" --bench-repeats 3 --out "$out/w$W" "$@"
done
echo "=== JSON"
for W in 4 8; do python3 -c "import json, sys; print(json.dumps(json.load(open(sys.argv[1]))['result']))" "$out/w$W/benchmark.json"; done
