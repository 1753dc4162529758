"""The toy's equal-cost modes timed as they train: short runs, interleaved in one process.

    python lab/toy_run_time.py --epochs 10 --repeats 3 --out runs/toy_run_time.json
    python lab/summarize.py frontier lab/results/equal_cost/toy_2.jsonl --timing runs/toy_run_time.json

lab/equal_cost_error.py --time times one training step of every mode on one batch (the rollout and
the gradient of 256 samples, on-policy). This times what the equal-cost runs did: lab/toy_options.py
and lab/toy_baselines.py at train_toy.py's defaults (a rollout, then 4 optimizer steps on its
minibatches, the later ones off-policy, where the fast modes' drift guard can fire), for a few epochs
from the base model, each mode once per repeat, in turn, so that a busy machine slows all alike. It
writes {"seconds": {mode: exact's median training seconds times the mode's median share of exact's,
repeat by repeat}} in --time's format, so that the frontier can be drawn on either axis, and prints
each mode's share of exact's training and gradient time.
"""

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import toy_baselines  # noqa: E402  (lab/, this file's folder, is on the path)
import toy_options  # noqa: E402
import train_toy  # noqa: E402
from run_folder import write_json  # noqa: E402

SHARED = ["--anchors", "shared", "--interior", "rollout"]
WINDOW = ["--baseline", "window", "--trained-steps"]
MODES = {  # lab/toy_equal_cost.sh's modes on the frontier's axis: (script, flags)
    "exact": (toy_options, ["--method", "exact"]),
    "jagg_w4": (toy_options, ["--method", "jagg"]),
    "jagg_w8": (toy_options, ["--method", "jagg", "--window", "8"]),
    "early0.5": (toy_options, ["--method", "jagg", "--jagg-frac", "0.5", "--route", "early"]),
    "early0.75": (toy_options, ["--method", "jagg", "--jagg-frac", "0.75", "--route", "early"]),
    "shared_rollout_w4": (toy_options, ["--method", "jagg", *SHARED]),
    "shared_rollout_w8": (toy_options, ["--method", "jagg", *SHARED, "--window", "8"]),
    "window8": (toy_baselines, ["--method", "jagg", *WINDOW, "8"]),
    "window4": (toy_baselines, ["--method", "jagg", *WINDOW, "4"]),
    "window8_jagg_w4": (toy_baselines, ["--method", "jagg", *WINDOW, "8", "--window-jagg"]),
    "window8_shared_rollout_w4": (toy_baselines, ["--method", "jagg", *WINDOW, "8", "--window-jagg", *SHARED]),
    "window4_shared_rollout_w4": (toy_baselines, ["--method", "jagg", *WINDOW, "4", "--window-jagg", *SHARED]),
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=10, help="epochs of each short run (the equal-cost runs: 80)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode, in turn; the median counts")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES), help="which modes (exact always)")
    parser.add_argument("--base-ckpt", default="", help="the base model (default: train_toy.py's, pretrained once)")
    parser.add_argument("--out", default="", help="write the medians here as JSON (lab/summarize.py frontier --timing)")
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.repeats < 1:
        parser.error(f"--epochs and --repeats must be >= 1, got {args.epochs} and {args.repeats}")
    torch.set_num_threads(1)
    base = args.base_ckpt or "runs/cache/toy_dit_h64_d3_s2000_seed0.pt"  # lab/toy_equal_cost.sh's
    if not args.base_ckpt:
        train_toy.base_model(train_toy.Args())  # pretrains it there once
    modes = ["exact"] + [m for m in args.modes if m != "exact"]
    times = {m: [] for m in modes}  # mode -> [(train seconds, gradient seconds)] per repeat
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for m in modes:
                script, flags = MODES[m]
                out = os.path.join(tmp, f"{m}_{repeat}")
                with contextlib.redirect_stdout(io.StringIO()):  # the runs' own epoch lines
                    script.main([*flags, "--seed", str(repeat), "--base-ckpt", base, "--epochs", str(args.epochs),
                                 "--eval-every", str(10 * args.epochs), "--out", out])
                with open(os.path.join(out, "summary.json")) as f:
                    s = json.load(f)
                times[m].append((s["train_seconds"], s["grad_seconds"]))
            print(f"repeat {repeat + 1}/{args.repeats} done", flush=True)
    print(f"\n{args.epochs} epochs at train_toy.py's defaults, medians of {args.repeats} interleaved runs, 1 thread\n")
    # each mode's median share of exact's (training, gradients), repeat by repeat
    shares = {m: [statistics.median(a[i] / b[i] for a, b in zip(times[m], times["exact"])) for i in (0, 1)]
              for m in modes}
    print("| mode | training, of exact's | gradients, of exact's |\n|---|---|---|")
    for m, (train, grad) in shares.items():
        print(f"| {m} | {100 * train:.0f} % | {100 * grad:.0f} % |")
    if args.out:  # seconds: exact's median times each mode's median share, so that shares read as printed
        exact = statistics.median(t for t, _ in times["exact"])
        seconds = {m: exact * train for m, (train, _) in shares.items()}
        write_json(args.out, {"setting": f"train_toy.py defaults, {args.epochs} epochs a run", "args": vars(args),
                              "seconds": seconds, "runs": times})


if __name__ == "__main__":
    main()
