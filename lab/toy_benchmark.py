"""The toy's benchmark: exact vs JAGG on train_toy.py's base model, one process, medians of
interleaved repeats.

    python lab/toy_benchmark.py                          # W = 4 and 8, B = 256: the toy tables of lab/reports/benchmarks.md
    python lab/summarize.py toybench runs/toy_bench/benchmark.json   # the training-step table, in ms
    python lab/summarize.py window runs/toy_bench/benchmark.json     # one window's gradient, in ms

Per W: one window's gradient, exact vs the paper's JAGG (bench.benchmark_window), then one whole
trajectory's in every training mode with a rollout (bench.benchmark_trajectory: what a GRPO
training step costs). --out gets benchmark.json ({"config", "results": {W: ...}}, the format
lab/summarize.py reads) and benchmark.png (where a training step's time goes).
"""

import argparse
import copy
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jagg  # noqa: E402
import train_toy  # noqa: E402
import run_folder  # noqa: E402
from bench import bench_modes, benchmark_trajectory, benchmark_window, report_benchmark, report_trajectory  # noqa: E402
from charts import save_png, training_step_bars  # noqa: E402


def benchmark(args):
    """Exact vs JAGG at each --windows W on the toy DiT: returns {W: {"window", "exact", "jagg", speedups,
    and report_trajectory's objects}} (seconds)."""
    cfg = train_toy.Args(seed=args.seed, base_ckpt=args.base_ckpt, beta=args.beta)  # the toy's own setting
    base = train_toy.base_model(cfg)
    torch.manual_seed(args.seed)
    sigmas = jagg.sigma_schedule(cfg.num_steps, cfg.shift)  # [T+1]
    labels = torch.arange(args.batch) % len(train_toy.TARGETS)  # [B]
    velocity_fn = train_toy.make_velocity_fn(base, labels)
    ref = copy.deepcopy(base).requires_grad_(False)
    noise = torch.randn(args.batch, 2)  # [B, 2]
    with torch.no_grad():
        traj = jagg.rollout(velocity_fn, noise, sigmas, cfg.noise_level)
    adv = torch.randn(args.batch)  # [B]: the timing does not depend on the advantages' values
    loss_cfg = jagg.LossConfig(noise_level=cfg.noise_level, clip_range=cfg.clip_range, beta=cfg.beta)
    print(f"toy DiT, {sum(p.numel() for p in base.parameters())} parameters, B = {args.batch}, T = {cfg.num_steps}, "
          f"beta {cfg.beta}, {torch.get_num_threads()} threads, medians of {args.repeats} interleaved repeats")
    results = {}
    for W in args.windows:
        step_loss = jagg.make_step_loss(traj, adv, 0, W, loss_cfg)
        t = benchmark_window(velocity_fn, base.parameters(), traj.z[:W], traj.t[:W], step_loss, repeats=args.repeats)
        print(f"\n-- one window's gradient (W = {W})")
        results[W] = {"window": W, "exact": t["exact"], "jagg": t["jagg"], **report_benchmark(t, W, 1000, "ms")}
        t = benchmark_trajectory(velocity_fn, base.parameters(), traj, adv, loss_cfg, W,
                                 train_toy.make_velocity_fn(ref, labels) if cfg.beta > 0 else None,
                                 rollout_fn=lambda: jagg.rollout(velocity_fn, noise, sigmas, cfg.noise_level),
                                 modes=bench_modes(args.max_graph_rows), repeats=args.repeats)
        print(f"\n-- one whole trajectory's gradient (T = {cfg.num_steps}, W = {W}), every mode")
        results[W].update(report_trajectory(t, W, 1000, "ms"))
    return results, cfg


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--windows", type=int, nargs="+", default=[4, 8], help="the W to time (each <= T = 16)")
    parser.add_argument("--batch", type=int, default=256, help="B, trajectories timed at once")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per mode (medians are reported)")
    parser.add_argument("--beta", type=float, default=0.0, help="KL weight: > 0 times the reference's forwards too")
    parser.add_argument("--max-graph-rows", type=int, default=0, help="also time each mode a bound of k rows changes")
    parser.add_argument("--seed", type=int, default=0, help="the base model's seed (train_toy.py's cache) and the noise's")
    parser.add_argument("--base-ckpt", default="", help="a pretrained toy DiT; empty: train_toy.py's cached one")
    parser.add_argument("--out", default="runs/toy_bench", help="where benchmark.json and benchmark.png go")
    args = parser.parse_args(argv)
    T = train_toy.Args().num_steps
    problems = [(all(2 <= W <= T for W in args.windows), f"--windows must each be in [2, {T}], got {args.windows}"),
                (args.batch >= len(train_toy.TARGETS), f"--batch must be >= {len(train_toy.TARGETS)}, got {args.batch}"),
                (args.repeats >= 1, f"--repeats must be >= 1, got {args.repeats}"),
                (args.beta >= 0, f"--beta must be >= 0, got {args.beta}"),
                (args.max_graph_rows >= 0, f"--max-graph-rows must be >= 0, got {args.max_graph_rows}"),
                (not args.base_ckpt or os.path.isfile(args.base_ckpt), f"--base-ckpt {args.base_ckpt!r} does not exist")]
    if any(not ok for ok, _ in problems):
        raise SystemExit("error: " + next(message for ok, message in problems if not ok))
    results, cfg = benchmark(args)
    run_folder.write_json(os.path.join(args.out, "benchmark.json"),
                            {"config": {**vars(args), "train_toy": dataclasses.asdict(cfg)}, "results": results})
    save_png(os.path.join(args.out, "benchmark.png"), training_step_bars(
        results, 1000, "ms", f"toy DiT: one GRPO training step (T = {cfg.num_steps}, B = {args.batch}), where the time goes"))
    print(f"\nwrote {args.out}/benchmark.json and benchmark.png")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
