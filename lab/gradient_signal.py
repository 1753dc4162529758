"""How much of a batch's policy gradient is signal, and how much of that signal JAGG keeps.

    python lab/gradient_signal.py toy                       # the toy DiT of train_toy.py
    python lab/gradient_signal.py mini --batch 32 --group 8 # the mini SD3, lab/sd_runner.py's LoRA
    python lab/gradient_signal.py mini --anchors shared --interior rollout

The fidelity probe (probe.gradient_cosines) compares JAGG's gradient to the exact one on the
same rollouts. That says how close the two are, not whether the difference matters: GRPO's
gradient is a Monte-Carlo estimate, and on a batch of a few dozen samples it can be mostly
noise. This tool draws --batches independent batches from the base model (the same sampler,
advantages and loss as training, beta 0: at the base model the KL's gradient is zero) and
computes on each the whole trajectory's exact gradient g_k and JAGG's j_k (every window), then:

- probe: mean cos(j_k, g_k), JAGG against exact on the same batch;
- batch agreement: mean cos(g_a, g_b) over pairs a != b of independent batches. Near 0 means a
  batch's gradient is mostly noise; about |s|^2 / (|s|^2 + noise^2 / n) for a true gradient s;
- samples for agreement 0.5: n (1 - c) / c, the batch size at which two batches' gradients
  would agree to a cosine of 0.5 (the noise falls as 1 / n), and the smallest value that the
  agreement's spread allows (c two standard errors higher);
- error / noise: mean |j_k - g_k|^2 over mean |g_a - g_b|^2 / 2, JAGG's error against the
  batch's own sampling noise (the variance of g). 0.1: JAGG adds a tenth to the noise a batch
  already has; were its error unbiased, like training on a batch about 9 % smaller. Precise
  from a few batches;
- signal kept: sum <j_a, g_b> / sum <g_a, g_b> over pairs a != b. g_b is an unbiased estimate of
  the true gradient s, independent of batch a, so this estimates <E j, s> / |s|^2: the share of
  the true gradient's direction JAGG's expected gradient carries, 1 for exact. It is the
  gradient-level counterpart of "gain kept", with a spread from the pairs (a jackknife over
  batches).

Prints a table and writes JSON to --out.
"""

import argparse
import itertools
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jagg  # noqa: E402
from beyond_paper import options, probe  # noqa: E402
from run_folder import write_json  # noqa: E402
from base_batches import mini_batches, toy_batches  # noqa: E402


def batch_gradients(fn, params, traj, adv, loss_cfg, window, jagg_frac, **mode):
    """The flattened gradient [P] of the batch's whole-trajectory loss, exact (jagg_frac 0) or
    JAGG on every window (jagg_frac 1)."""
    for p in params:
        p.grad = None
    options.backward_batch(fn, traj, adv, loss_cfg, options.JaggOptions(window, jagg_frac, **mode))
    g = probe.flat_grad(params)
    for p in params:
        p.grad = None
    return g


def signal_stats(exact, approx):
    """exact, approx: lists of K flattened gradients (the same K batches). Returns the dict of
    the four numbers above (K >= 2)."""
    K = len(exact)
    cos = torch.nn.functional.cosine_similarity
    pairs = [(a, b) for a, b in itertools.permutations(range(K), 2)]
    dot_jg = {(a, b): torch.dot(approx[a], exact[b]).item() for a, b in pairs}
    dot_gg = {(a, b): torch.dot(exact[a], exact[b]).item() for a, b in pairs}

    def kept(skip=None):
        use = [p for p in pairs if skip not in p]
        return sum(dot_jg[p] for p in use) / sum(dot_gg[p] for p in use)

    noise = sum((exact[a] - exact[b]).pow(2).sum().item() for a, b in pairs) / len(pairs) / 2
    error = sum((j - g).pow(2).sum().item() for j, g in zip(approx, exact)) / K
    cosines = {p: cos(exact[p[0]], exact[p[1]], dim=0).item() for p in pairs}

    def agree(skip=None):
        use = [p for p in pairs if skip not in p]
        return sum(cosines[p] for p in use) / len(use)

    def jackknife(estimate):  # the spread of an estimate over pairs of batches, leaving one batch out at a time
        leave_one = [estimate(skip=k) for k in range(K)]
        mean = sum(leave_one) / K
        return math.sqrt((K - 1) / K * sum((x - mean) ** 2 for x in leave_one))

    agreement = agree()
    out = {
        "probe_cosine": sum(cos(j, g, dim=0).item() for j, g in zip(approx, exact)) / K,
        "batch_agreement": agreement,
        "error_to_noise": error / noise,
        "signal_kept": kept(),
    }
    if K >= 3:
        out["batch_agreement_stderr"] = jackknife(agree)
        out["signal_kept_stderr"] = jackknife(kept)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_kind", choices=["toy", "mini"], help="which model")
    parser.add_argument("--model", default="mini", help="for mini: a saved mini pipeline folder, or mini (the cached one)")
    parser.add_argument("--window", type=int, default=4, help="W")
    parser.add_argument("--anchors", choices=["window", "shared"], default="window", help="JAGG's anchors")
    parser.add_argument("--interior", choices=list(options.INTERIOR_MODES), default="forward", help="JAGG's interiors")
    parser.add_argument("--batches", type=int, default=6, help="independent batches (>= 3 for a spread)")
    parser.add_argument("--batch", type=int, default=32, help="samples per batch")
    parser.add_argument("--group", type=int, default=8, help="mini: samples per prompt in a batch (a divisor of --batch)")
    parser.add_argument("--reward", default="shapes", help="mini: lab/sd_runner.py's --reward (shapes, cover, ...)")
    parser.add_argument("--full-finetune", action="store_true", help="mini: every transformer weight instead of the LoRA")
    parser.add_argument("--cfg-grad", choices=["cond", "both"], default="cond", help="mini: the CFG gradient through the conditional branch (lab/sd_runner.py's) or both")
    parser.add_argument("--global-std", action="store_true", help="mini: advantages by the std of all rewards")
    parser.add_argument("--seed", type=int, default=0, help="seed of the rollouts")
    parser.add_argument("--out", default="", help="JSON file (default runs/gradient_signal_<model>.json)")
    args = parser.parse_args(argv)
    if args.batches < 2:
        parser.error(f"--batches must be >= 2 (agreement compares independent batches), got {args.batches}")
    if args.batch < 2 or args.batch % args.group:
        parser.error(f"--batch must be a multiple of --group ({args.group}), got {args.batch}")
    if args.model_kind == "toy":
        batches = toy_batches(args)
    else:
        batches = mini_batches(args, full_finetune=args.full_finetune, reward=args.reward, group=args.group,
                               cfg_grad=args.cfg_grad, global_std=args.global_std)
    loss_cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2)
    mode = {"anchors": args.anchors, "interior": args.interior}
    exact, approx = [], []
    for k, (fn, params, traj, adv, T) in enumerate(batches):
        exact.append(batch_gradients(fn, params, traj, adv, loss_cfg, args.window, 0.0))
        approx.append(batch_gradients(fn, params, traj, adv, loss_cfg, args.window, 1.0, **mode))
        print(f"batch {k + 1}/{args.batches}: probe cosine {torch.nn.functional.cosine_similarity(approx[-1], exact[-1], dim=0).item():.3f}",
              flush=True)
    stats = signal_stats(exact, approx)
    c, spread = stats["batch_agreement"], stats.get("batch_agreement_stderr")
    stats["samples_for_agreement_0.5"] = args.batch * (1 - c) / c if c > 0 else None
    if spread:  # a bound that the spread allows: the agreement at most two standard errors above
        high = min(c + 2 * spread, 0.999)
        stats["samples_for_agreement_0.5_at_least"] = args.batch * (1 - high) / high if high > 0 else None
    name = "paper" if mode == {"anchors": "window", "interior": "forward"} else f"{args.anchors}+{args.interior}"
    print(f"\n{args.model_kind}, JAGG {name} (W = {args.window}), {args.batches} batches of {args.batch} samples:")
    print(f"  probe cosine (JAGG vs exact, same batch)    {stats['probe_cosine']:.3f}")
    print(f"  batch agreement (exact vs exact, two batches) {c:.3f}" + (f" +- {spread:.3f}" if spread else ""))
    n05, bound = stats["samples_for_agreement_0.5"], stats.get("samples_for_agreement_0.5_at_least")
    print(f"  samples per batch for agreement 0.5          {f'{n05:.0f}' if n05 else 'n/a (agreement <= 0)'}"
          + (f" (at least {bound:.0f} within two standard errors)" if bound else ""))
    print(f"  JAGG's error / the batch's sampling noise    {stats['error_to_noise']:.3f}")
    err = stats.get("signal_kept_stderr")
    print(f"  signal kept by JAGG                          {stats['signal_kept']:.2f}" + (f" +- {err:.2f}" if err else ""))
    write_json(args.out or os.path.join("runs", f"gradient_signal_{args.model_kind}.json"), {"args": vars(args), **stats})
    return stats


if __name__ == "__main__":
    main()
