"""The field's cheap alternatives to JAGG, trained on the toy at a cost we choose: fewer steps with grad.

    python lab/toy_baselines.py --baseline random --trained-steps 8 --out runs/b    # DanceGRPO's
    python lab/toy_baselines.py --baseline first --trained-steps 8 --out runs/b     # Flow-GRPO's
    python lab/toy_baselines.py --baseline window --trained-steps 8 --out runs/b    # Flow-GRPO-Fast's
    python lab/toy_baselines.py --baseline jagg_random --trained-steps 8 --out runs/b  # eff_grpo's
    lab/toy_equal_cost.sh [OUT]                 # every baseline and JAGG, 20 seeds: lab/reports/equal_cost.md

GRPO trainers for flow models already back-propagate fewer steps than they sample; at the same
number of rows with grad, does JAGG beat them? Each baseline trains --trained-steps of the T steps
of each sample (the rest still sampled), on lab/toy_options.py's loop and train_toy.py's task
(--method jagg runs the baseline; --method compare runs exact GRPO first, then it):
- random: each sample's own random set of steps, every epoch anew, each back-propagated exactly
  (DanceGRPO: timestep_fraction of a per-sample shuffle). Its loss is the mean over each sample's
  trained steps, so its gradient is unbiased for exact GRPO's (the mean over all steps).
- first: the first steps of every trajectory, in order (Flow-GRPO's timestep_fraction): biased, it
  never trains the late steps.
- window: an SDE window (Flow-GRPO-Fast): the steps from a random start, drawn each epoch, are
  sampled by the SDE and trained; the rest run the ODE and are not. Exact, or JAGG with
  --window-jagg (W = --window).
- jagg_random: the paper's JAGG on each sample's own random set of windows, --trained-steps of its
  steps in whole windows of --window (the authors' early code, eff_grpo's run_jagg.sh: W = 4 on 60 %
  of the windows): 2 rows with grad per window trained.
Rows with grad per sample, as JAGG counts them: random, first and window K; jagg_random 2 per window.
"""

import os
import sys
from dataclasses import dataclass, replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jagg  # noqa: E402
import sd_runner  # noqa: E402
from train_toy import arg  # noqa: E402

import toy_options  # noqa: E402  (this file's folder, lab/, is on the path)

BASELINES = ("random", "first", "window", "jagg_random")


@dataclass
class Args(toy_options.Args):
    baseline: str = arg("random", "random, first, window or jagg_random (the docstring says each)")
    trained_steps: int = arg(8, "K, the steps of each sample back-propagated (whole windows for jagg_random)")
    window_jagg: bool = arg(False, "--baseline window: train the window's steps by JAGG at --window")


def parse_args(argv=None):
    """Args from the command line: train_toy.py's and lab/toy_options.py's flags, and the
    baseline's; a bad value stops here in one line naming it."""
    args = toy_options.parse_args(argv, Args, __doc__)
    T, K, W = args.num_steps, args.trained_steps, args.window
    rules = [("baseline", args.baseline in BASELINES, "one of " + ", ".join(BASELINES)),
             ("trained_steps", 1 <= K <= T, f"in [1, --num-steps {T}]"),
             ("trained_steps", args.baseline != "jagg_random" or (K % W == 0 and T % W == 0),
              f"a multiple of --window {W}, which must divide --num-steps {T}, with jagg_random"),
             ("window_jagg", not args.window_jagg or (args.baseline == "window" and W <= K),
              f"only with --baseline window and --window <= --trained-steps {K}")]
    for name, holds, must in rules:
        if not holds:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be {must}, got {getattr(args, name)!r}")
    return args


def subset_gradients(fns, traj, advantages, cfg, segments, count, generator, by_jagg=False):
    """Each sample's own random `count` of the equal-length segments [(start, stop), ...] of traj,
    drawn with generator and gathered, in step order, into one shorter trajectory whose step j holds
    each sample's j-th trained step; then exact GRPO on it (DanceGRPO's batching: one forward with
    graph and one backward of all B samples per trained step, the timesteps differing by sample), or
    the paper's JAGG on its windows with by_jagg (a segment each). The loss is the mean over each
    sample's trained steps and over the samples, which both DanceGRPO and eff_grpo use, so with
    exact steps its expectation over the draws is exact GRPO's loss. fns(idx) -> (velocity_fn,
    ref_velocity_fn) of samples idx. Adds to .grad; returns (stats, []) with stats as
    first_steps_gradients' or jagg.backward_batch' (grad_rows: per sample, rows with grad as JAGG
    counts them)."""
    B, length = traj.z.shape[1], segments[0][1] - segments[0][0]
    jagg._check(all(b - a == length for a, b in segments), "the segments must be of equal length")
    chosen = torch.stack([torch.randperm(len(segments), generator=generator)[:count] for _ in range(B)])
    starts = torch.tensor([a for a, _ in segments])[chosen.sort(dim=1).values]  # [B, count]
    steps = (starts[:, :, None] + torch.arange(length)).flatten(1).T  # [count * length, B]
    gathered = replace(traj, **{k: getattr(traj, k)[steps, torch.arange(B)] for k in traj.TENSORS})
    if not (by_jagg and length >= 3):  # every gathered step exactly, as first steps train theirs
        return first_steps_gradients(fns, gathered, advantages, cfg, len(steps))
    velocity_fn, ref_fn = fns(torch.arange(B))
    stats = jagg.backward_batch(velocity_fn, gathered, advantages, cfg, length, 1.0, ref_fn)[0]
    return {**stats, "routed_frac": 1.0}, []  # every gathered window by JAGG


def first_steps_gradients(fns, traj, advantages, cfg, count):
    """Flow-GRPO's: exact GRPO on the first count steps of every trajectory (an SDE window's: all of
    them), the loss their mean. Adds to .grad; returns (stats, [])."""
    velocity_fn, ref_fn = fns(torch.arange(traj.z.shape[1]))
    sub, log = traj.first_steps(count), []
    v_ref = None
    if cfg.beta > 0:
        with torch.no_grad():
            v_ref = ref_fn(sub.z, sub.t)  # [K, B, *D]
    loss = jagg.backward_exact(velocity_fn, sub.z, sub.t,
                               jagg.make_step_loss(sub, advantages, 0, count, cfg, v_ref, log))
    stats = {key: sum(s[key] for s in log) / len(log) for key in log[0]}
    return {**stats, "loss": loss, "grad_rows": count, "routed_frac": 0.0}, []


def window_rollout(args):
    """Flow-GRPO-Fast's SDE window of K steps, from a start drawn each epoch in [0, T - K]."""
    def rollout(velocity_fn, noise, sigmas, generator, epoch):
        start = sd_runner.window_start(epoch, args.trained_steps, 0, args.num_steps, seed=args.seed)
        return sd_runner.window_rollout(velocity_fn, noise, sigmas, args.noise_level, start,
                                       args.trained_steps, generator)
    return rollout


def hooks(args):
    """(gradient, rollout, mode) for lab/toy_options.run: the baseline's pieces."""
    T, K, W = args.num_steps, args.trained_steps, args.window
    cfg = jagg.LossConfig(args.noise_level, args.clip_range, args.beta)
    g = torch.Generator().manual_seed(args.seed * 1000 + 7)  # the draws of steps, apart from the rollouts'
    if args.baseline == "random":
        def gradient(fns, traj, advantages):
            return subset_gradients(fns, traj, advantages, cfg, [(k, k + 1) for k in range(T)], K, g)
        return gradient, None, f"random{K}"
    if args.baseline == "jagg_random":
        def gradient(fns, traj, advantages):
            windows = [(a, a + W) for a in range(0, T, W)]
            return subset_gradients(fns, traj, advantages, cfg, windows, K // W, g, by_jagg=True)
        return gradient, None, f"jagg_random{K}_w{W}"
    if args.baseline == "first":
        def gradient(fns, traj, advantages):
            return first_steps_gradients(fns, traj, advantages, cfg, K)
        return gradient, None, f"first{K}"
    if args.window_jagg:  # the window trained by backward_batch with the flags' JAGG options
        return None, window_rollout(args), f"window{K}_jagg_w{W}"

    def gradient(fns, traj, advantages):  # the window's K steps, exactly
        return first_steps_gradients(fns, traj, advantages, cfg, K)
    return gradient, window_rollout(args), f"window{K}"


def main(argv=None):
    args = parse_args(argv)
    gradient, rollout, mode = hooks(args)
    return toy_options.run(args, gradient, rollout, mode)


if __name__ == "__main__":
    main(sys.argv[1:])
