"""Which interpolation weighting is closer to the exact gradient: by t (the paper's abstract, our
default) or by step index (the authors' early code)? The fidelity probe on the same rollouts.

    python lab/compare_weights.py toy            # the toy DiT of train_toy.py (its cached base model)
    python lab/compare_weights.py mini           # the mini SD3 of lab/mini_sd3_pipeline.py (cached)

For each model: rollouts from the base model (T and the schedule its script trains with, W = 4),
then probe.gradient_cosines, the cosine of JAGG's gradient to the exact one per window, with
weights="time" and weights="index" on identical batches, averaged over --batches batches.
Prints a markdown table and writes it as JSON to --out.
"""

import argparse
import os
import sys


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jagg  # noqa: E402
from beyond_paper import options, probe  # noqa: E402
from base_batches import mini_batches, toy_batches  # noqa: E402
from run_folder import write_json  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_kind", choices=["toy", "mini"], help="which model to probe")
    parser.add_argument("--model", default="mini", help="for mini: a saved mini pipeline folder, or mini (the cached one)")
    parser.add_argument("--window", type=int, default=4, help="W")
    parser.add_argument("--batches", type=int, default=8, help="rollout batches to average over")
    parser.add_argument("--batch", type=int, default=16, help="samples per batch (a multiple of 4)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the rollouts")
    parser.add_argument("--out", default="", help="JSON file for the results (default runs/weights_<model>.json)")
    args = parser.parse_args(argv)
    if args.batch % 4 or args.batch < 4:
        parser.error(f"--batch must be a positive multiple of 4 (groups of 4 samples), got {args.batch}")
    loss_cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2)
    sums = {(a, w): None for a in ("window", "shared") for w in options.WEIGHTS}
    batches = toy_batches(args) if args.model_kind == "toy" else mini_batches(args)
    for fn, params, traj, adv, T in batches:
        for anchors, weights in sums:
            cos = probe.gradient_cosines(fn, params, traj, adv, loss_cfg,
                                        options.JaggOptions(args.window, anchors=anchors, weights=weights))
            sums[anchors, weights] = cos if sums[anchors, weights] is None else [s + c for s, c in zip(sums[anchors, weights], cos)]
    result = {f"{a}/{w}": [s / args.batches for s in v] for (a, w), v in sums.items()}
    print(f"{args.model_kind}: probe cosine to the exact gradient per segment (T = {T}, W = {args.window}, "
          f"{args.batches} batches of {args.batch} samples, the base model)\n")
    print("| model | anchors | weights | cosine per segment | mean |")
    print("|---|---|---|---|---|")
    for key, v in result.items():
        a, w = key.split("/")
        print(f"| {args.model_kind} | {a} | {w} | {', '.join(f'{c:.3f}' for c in v)} | {sum(v) / len(v):.3f} |")
    write_json(args.out or os.path.join("runs", f"weights_{args.model_kind}.json"),
               {"args": vars(args), "cosine_by_segment": result})
    return result


if __name__ == "__main__":
    main()
