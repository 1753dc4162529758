"""lab/sd_runner.py with DanceGRPO's random steps in place of its gradient: a baseline for the mini SD3.

    python lab/sd_baselines.py --random-steps 6 -- $(python lab/presets.py mini) --method exact --out DIR
    lab/mini_equal_cost.sh [OUT]          # every baseline and JAGG on the mini SD3: lab/reports/equal_cost.md

lab/sd_runner.py already trains Flow-GRPO's first steps (--timestep-fraction) and Flow-GRPO-Fast's SDE
window (--sde-window); DanceGRPO's shuffle is not a JAGG option and stays here, in the lab. Each
micro-batch back-propagates its own random --random-steps of the trained steps, exactly, the loss
their mean: unbiased for exact GRPO's. DanceGRPO draws per sample; lab/sd_runner.py's velocity_fn serves
a whole micro-batch, so here its samples share one draw (the same expectation, a larger variance;
lab/toy_baselines.py draws per sample on the toy). Run with --method exact: the options' JAGG is
not used. The draws are seeded by --seed; a resumed run draws anew.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jagg  # noqa: E402
import sd_runner  # noqa: E402

PAPER_GRADIENTS = jagg.backward_batch  # the original, which the baseline calls on its steps


def random_steps(count, generator):
    """A jagg.backward_batch (lab/sd_runner.py's call at --method exact) that trains a random count of
    traj's steps, exactly, their mean as the loss."""
    def backward_batch(velocity_fn, traj, advantages, cfg, window=4, jagg_frac=1.0, ref_fn=None):
        T = traj.z.shape[0]
        steps = sorted(torch.randperm(T, generator=generator)[:count].tolist())
        sub = jagg.Trajectory(**{name: getattr(traj, name)[steps] for name in jagg.Trajectory.TENSORS},
                              noise_level=traj.noise_level)  # their order kept; exact needs no neighbours
        # every step exact (jagg_frac 0): the window only groups them
        return PAPER_GRADIENTS(velocity_fn, sub, advantages, cfg, window=2, jagg_frac=0.0, ref_fn=ref_fn)
    return backward_batch


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ours, theirs = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--random-steps", type=int, required=True, help="K, the steps each micro-batch trains")
    args = parser.parse_args(ours)
    cfg = sd_runner.validate(sd_runner.parse(theirs))  # lab/sd_runner.py's own checks, before any work
    if not 2 <= args.random_steps <= cfg.trained_steps():
        parser.error(f"--random-steps must be in [2, {cfg.trained_steps()}] (the trained steps), "
                     f"got {args.random_steps}")
    if cfg.method != "exact":
        parser.error("give lab/sd_runner.py --method exact: the baseline replaces its gradient")
    generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + 17)
    if not cfg.papers_jagg(int(os.environ.get("WORLD_SIZE", 1))):
        parser.error("give lab/sd_runner.py no JAGG option: the baseline replaces jagg.backward_batch")
    jagg.backward_batch = random_steps(args.random_steps, generator)
    try:
        return sd_runner.main(theirs)
    finally:
        jagg.backward_batch = PAPER_GRADIENTS


if __name__ == "__main__":
    main()
