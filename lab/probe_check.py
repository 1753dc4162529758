"""Does the probe's error_to_noise read what independent batches measure? lab/reports/probe_check.md.

    python lab/probe_check.py toy --batches 8 --batch 16     # train_toy.py's base model and setting
    python lab/probe_check.py mini --batches 8 --batch 16    # the mini SD3 at lab/sd_runner.py --preset mini
    python lab/probe_check.py mini --preset mini-geneval      # ... at --preset mini-geneval (LoRA, GenEval-like)

On the base model, for --batches independent rollout batches of --batch samples, per segment of
the mode (the paper's windows by default): the probe's own figure, probe.probe_segments on
each batch alone (its two halves give the noise), and the same quantity from the independent
batches, |j - g|^2 over the noise of one batch's exact gradient, mean |g_a - g_b|^2 / 2 over pairs
of batches (lab/offpolicy_error.py's measure, per segment). One probe's figure scatters widely (its
noise is one pair of halves); the probes' errors summed over their noises summed should match the
independent batches' figure up to the sampling error of both.
"""

import argparse
import dataclasses
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from beyond_paper import options, probe  # noqa: E402
from offpolicy_error import MINI_PRESETS, MODES, MiniTask, ToyTask  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_kind", choices=["toy", "mini"], help="which model and setting")
    parser.add_argument("--batches", type=int, default=8, help="independent rollout batches (>= 2)")
    parser.add_argument("--batch", type=int, default=16, help="samples per batch (mini: a multiple of the group, 8)")
    parser.add_argument("--mode", choices=list(MODES), default="paper", help="the JAGG mode to check")
    parser.add_argument("--model", default="mini", help="mini: a saved mini pipeline folder, or mini (the cached one)")
    parser.add_argument("--resolution", type=int, default=0, help="mini: image size (0: the model's own)")
    parser.add_argument("--preset", choices=MINI_PRESETS, default="mini",
                        help="mini: lab/sd_runner.py's preset (mini: darkness; mini-geneval: the GenEval-like reward, LoRA)")
    parser.add_argument("--step-batch", type=int, default=0,
                        help="samples of an optimizer step: that many of each batch at random, as training draws its "
                             "steps; the independent figure is measured on them (0: the whole batch)")
    parser.add_argument("--probe-batch", type=int, default=0,
                        help="samples the probe measures on, that many of each batch at random, asked for the error "
                             "of a step of --step-batch samples (0: the step's own samples)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the rollouts")
    parser.add_argument("--sde-window", type=int, default=0,
                        help="an SDE window of this many steps from --sde-start, trained with JAGG at W = K (0: none)")
    parser.add_argument("--sde-start", type=int, default=0, help="the SDE window's first step")
    args = parser.parse_args(argv)
    if args.batches < 2:
        parser.error(f"--batches must be >= 2 (the noise compares independent batches), got {args.batches}")
    for flag, value in (("--step-batch", args.step_batch), ("--probe-batch", args.probe_batch)):
        if not 0 <= value <= args.batch or value == 1:
            parser.error(f"{flag} must be 0 or 2 to --batch ({args.batch}), got {value}")
    if args.sde_window == 1 or args.sde_window < 0:
        parser.error(f"--sde-window must be 0 (none) or >= 2 (JAGG needs two end steps), got {args.sde_window}")
    task = MiniTask(args) if args.model_kind == "mini" else ToyTask(args)
    window_start = None
    if args.sde_window:
        window_start, task.window = args.sde_start, args.sde_window
        if args.model_kind == "mini":
            task.cfg = dataclasses.replace(task.cfg, sde_window=args.sde_window)
        else:
            task.sde_window = args.sde_window
    opts = options.JaggOptions(task.window, 1.0, **MODES[args.mode])
    step = args.step_batch or args.batch
    rows = check(task, opts, args.batches, args.batch, torch.Generator().manual_seed(args.seed), window_start,
                 step, args.probe_batch or step)
    window = f", an SDE window of {args.sde_window} steps from step {args.sde_start}" if args.sde_window else ""
    probe = (f", steps of {step} of them" if step < args.batch else "") + (
        f", the probe on {args.probe_batch} of them" if args.probe_batch else "")
    print(f"{args.model_kind}, {task.setting}{window}, mode {args.mode} at W = {task.window}: {args.batches} batches of "
          f"{args.batch}{probe}, the base model")
    old = bool(rows) and rows[0]["old_way"] is not None  # the probe smaller than the step: its old reading too
    print("| segment (steps) | one probe: error / noise, median (range) | probes: their errors' sum / their noises' sum "
          "(± 95 %) |" + (" the same, read as before the probe's fix |" if old else "")
          + " independent batches: error / noise |")
    print("|---|---|---|" + ("---|" if old else "") + "---|")
    for r in rows:
        figures = r["probes"]
        print(f"| {r['segment']} ({r['steps'][0]}-{r['steps'][1] - 1}) | {figures[len(figures) // 2]:.4f} "
              f"({figures[0]:.4f}-{figures[-1]:.4f}) | {r['pooled']:.4f} ± {1.96 * r['pooled_stderr']:.4f} |"
              + (f" {r['old_way']:.4f} |" if old else "") + f" {r['independent']:.4f} |")
    return rows


def check(task, opts, batches, batch_size, generator, window_start=None, step_batch=None, probe_batch=None):
    """Per segment of more than one step: {"segment", "steps", "probes" (each batch's probe figure,
    sorted), "pooled" (their errors' sum over their noises' sum), "independent" (mean |j - g|^2
    over the noise of one step's exact gradient, from pairs of batches)}. step_batch: a step is
    that many of a batch's samples at random, as training draws its steps (None: the whole batch);
    probe_batch: the probe measures on that many at random, asked for the error of such a step
    (None: on the step's own samples)."""
    step_batch = step_batch or batch_size
    probe_batch = probe_batch or step_batch

    def some(n):  # n of the batch's samples at random, or all of them in order
        return torch.arange(batch_size) if n == batch_size else torch.randperm(batch_size, generator=generator)[:n]

    probes, old_way, pairs = [], [], []  # per batch: the probe's figures; the (exact, JAGG) gradients per segment
    for _ in range(batches):
        batch = task.draw(batch_size, generator, window_start)
        ref = task.loss_cfg.beta > 0
        fns = lambda idx, batch=batch: (batch.fns(idx)[0], batch.fns(idx)[1] if ref else None)  # noqa: E731
        step = some(step_batch)
        probed = step if probe_batch == step_batch else some(probe_batch)

        def read(size, probed=probed, fns=fns):  # the probe on the samples probed, for a step of size samples
            return probe.probe_segments(lambda i: fns(probed[i]), task.params, batch.traj.subset(probed),
                                               batch.adv[probed], task.loss_cfg, opts, train_batch=size)

        probes.append(read(step_batch))
        if probe_batch < step_batch:  # |j - g|^2 on the probe's own samples: how the probe read before its fix
            old_way.append(read(probe_batch))
        fn, ref_fn = fns(step)
        pairs.append(list(probe.segment_gradients(fn, task.params, batch.traj.subset(step), batch.adv[step],
                                                          task.loss_cfg, opts, ref_fn)))
    pooled_probes = probe.pool_probes(probes)
    pooled, pooled_stderr = pooled_probes["error_to_noise"], pooled_probes["stderr"]
    rows = []
    for s, (start, stop) in enumerate(options.segment_bounds(batch.traj.z.shape[0], opts.window, opts.anchors)):
        if pairs[0][s] is None:
            continue
        exact = [p[s][0] for p in pairs]
        noise = sum((a - b).square().sum().item() for a, b in itertools.combinations(exact, 2)) / 2 / (
            len(exact) * (len(exact) - 1) / 2)
        error = sum((p[s][1] - p[s][0]).square().sum().item() for p in pairs) / len(pairs)
        rows.append({"segment": s, "steps": (start, stop), "probes": sorted(p["error_to_noise"][s] for p in probes),
                     "pooled": pooled[s], "pooled_stderr": pooled_stderr[s],
                     # before the fix: |j - g|^2 on the probe's own samples over the step's noise
                     "old_way": (sum(p["error"][s] for p in old_way) / sum(p["noise"][s] for p in probes)
                                 if old_way else None),
                     "independent": error / noise})
    return rows


if __name__ == "__main__":
    main()
