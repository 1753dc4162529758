"""At equal cost, whose gradient is closer to exact GRPO's: JAGG's, or the cheap alternatives'?

    python lab/equal_cost_error.py toy --checkpoints 0 40 --batches 4    # lab/reports/equal_cost.md
    python lab/equal_cost_error.py mini --checkpoints 0 7 --batches 3 --batch-sizes 16 64
    python lab/equal_cost_error.py report runs/equal_cost_error_toy.json
    python lab/equal_cost_error.py routing TOY.json MINI.json           # lab/reports/routing.md's table
    python lab/equal_cost_error.py fast TOY.json MINI.json              # the fast modes' (equal_cost.md)
    python lab/equal_cost_error.py toy --time 256 --batches 7           # each method's training step, timed
    python lab/equal_cost_error.py mini --time 32 --batches 3

For each checkpoint (epochs of exact GRPO from the base model, trained as lab/offpolicy_error.py
does) and batch size, --batches independent rollout batches; on each, exact GRPO's gradient g on
all its steps, and every method's estimate j on the same batch and parameters: JAGG (W = 4 and 8),
DanceGRPO's random steps and Flow-GRPO's first steps at the same rows with grad, JAGG on random
windows (eff_grpo). Reported per method: the relative error |j - g| / |g| and cos(j, g), means over
the batches with a 95 % interval. A random subset's error is variance and falls with the batch;
JAGG's is mostly a bias and falls far less; where the two cross, the cheap alternative wins.
Routing at jagg_frac 0.5 and 0.75 (W = 4) too: the free velocity score, a fixed late-first
schedule (route="late"), its opposite (route="early"), the estimated error JAGG adds to the step
(route="step_error"), and two oracles that route by the batch's own per-window cosines (cosine)
and errors |j - g| (error_oracle). And the fast modes beyond the paper: shared anchors with
rollout interiors at W = 4 and 8 (train_sd.py --fast).
The SDE window is left out: it samples other trajectories, so it has no estimate of the same g.
"""

import argparse
import json
import os
import sys

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jagg  # noqa: E402
from beyond_paper import options, probe  # noqa: E402
import bench  # noqa: E402
from offpolicy_error import MiniTask, ToyTask, train_exact  # noqa: E402
from run_folder import write_json  # noqa: E402
from stats import mean_interval  # noqa: E402
from toy_baselines import first_steps_gradients, subset_gradients  # noqa: E402


def methods(T, params=None, W=4):
    """name -> gradient(batch, cfg, generator): each adds its estimate to .grad. The alternatives
    train as many rows with grad per sample as JAGG at W = 4 (K: T / 2 for T = 16, 6 for T = 10)
    and at W = 8 (T / 4; 4 for T = 10).
    With params, routing too at W = 4, jagg_frac 0.5 and 0.75: by the free velocity score
    (velocity), by a fixed late-first schedule (late) or early-first (early), and by this batch's
    own cosines (cosine, an oracle: the best the probe's routing could do)."""
    k4, k8 = (sum(min(2, b - a) for a, b in jagg.window_bounds(T, w)) for w in (4, 8))  # JAGG's rows

    def jagg_w(window):
        def gradient(batch, cfg, g):
            fn, ref_fn = batch.fns(torch.arange(len(batch.adv)))
            opts = options.JaggOptions(window, 1.0)
            return options.backward_batch(fn, batch.traj, batch.adv, cfg, opts, ref_fn)
        return gradient

    def random(k):
        def gradient(batch, cfg, g):
            return subset_gradients(batch.fns, batch.traj, batch.adv, cfg, [(s, s + 1) for s in range(T)], k, g)
        return gradient

    def first(k):
        def gradient(batch, cfg, g):
            return first_steps_gradients(batch.fns, batch.traj, batch.adv, cfg, k)
        return gradient

    def jagg_random(k):
        def gradient(batch, cfg, g):
            windows = [(a, a + W) for a in range(0, T - T % W, W)]
            return subset_gradients(batch.fns, batch.traj, batch.adv, cfg, windows, k // W, g, by_jagg=True)
        return gradient

    def routed(frac, how):  # jagg_frac < 1 at W: which windows JAGG takes, by how
        oracle = how in ("cosine", "error_oracle")
        opts = options.JaggOptions(W, frac, route="probe" if oracle else how)

        def gradient(batch, cfg, g):
            fn, ref_fn = batch.fns(torch.arange(len(batch.adv)))
            ranks = None  # velocity, step_error: scores of the rollout, free; early / late: fixed schedules
            if how == "cosine":  # an oracle: this batch's own per-window cosines to exact
                exact_opts = options.JaggOptions(W)
                ranks = probe.gradient_cosines(fn, params, batch.traj, batch.adv, cfg, exact_opts, ref_fn)
            if how == "error_oracle":  # an oracle: this batch's own per-window |JAGG - exact|, smallest first
                pairs = probe.segment_gradients(fn, params, batch.traj, batch.adv, cfg, options.JaggOptions(W), ref_fn)
                ranks = [0.0 if pair is None else -(pair[1] - pair[0]).norm().item() for pair in pairs]
            return options.backward_batch(fn, batch.traj, batch.adv, cfg, opts, ref_fn, ranks)
        return gradient

    def fast(window, max_graph_rows=None):  # OURS: shared anchors, rollout interiors (train_sd.py --fast)
        def gradient(batch, cfg, g):
            fn, ref_fn = batch.fns(torch.arange(len(batch.adv)))
            opts = options.JaggOptions(window, 1.0, anchors="shared", interior="rollout",
                                       max_graph_rows=max_graph_rows)
            return options.backward_batch(fn, batch.traj, batch.adv, cfg, opts, ref_fn)
        return gradient

    out = {"jagg_w4": jagg_w(4), f"random{k4}": random(k4), f"first{k4}": first(k4)}
    for frac in (0.5, 0.75) if params is not None else ():
        out.update({f"{how}{frac:g}": routed(frac, how) for how in ("velocity", "late", "early", "cosine")})
    if T % W == 0 and k4 % W == 0:
        out[f"jagg_random{k4}_w4"] = jagg_random(k4)
    if T >= 8:
        out.update({"jagg_w8": jagg_w(8), f"random{k8}": random(k8), f"first{k8}": first(k8)})
    # Added after the methods above, and drawing nothing from the generator, so that those repeat
    # their kept figures: the fast modes (the same gradient with a bound on the rows in a graph, so
    # timed only), routing by the estimated error and by the error itself (an oracle)
    out.update({"shared_rollout_w4": fast(4), "shared_rollout_w8": fast(8)})
    if params is None:  # timing: the bound costs time, not accuracy
        out.update({"shared_rollout_w4_rows2": fast(4, 2), "shared_rollout_w8_rows2": fast(8, 2)})
    for frac in (0.5, 0.75) if params is not None else ():
        out.update({f"{how}{frac:g}": routed(frac, how) for how in ("step_error", "error_oracle")})
    return out


def flat_gradient(task, gradient, batch, g):
    for p in task.params:
        p.grad = None
    gradient(batch, task.loss_cfg, g)
    out = probe.flat_grad(task.params)
    for p in task.params:
        p.grad = None
    return out


def exact_gradient(batch, cfg, g):
    fn, ref_fn = batch.fns(torch.arange(len(batch.adv)))
    return options.backward_batch(fn, batch.traj, batch.adv, cfg, options.JaggOptions(2, 0.0), ref_fn)


def measure(task, sizes, batches, generator):
    """{size: {method: [(rel_error, cosine) per batch]}} at the task's current parameters."""
    T = None
    out = {}
    for size in sizes:
        out[size] = {}
        for _ in tqdm(range(batches), desc=f"batches of {size}", leave=False):
            batch = task.draw(size, generator)
            T = batch.traj.z.shape[0]
            exact = flat_gradient(task, exact_gradient, batch, generator)
            for name, gradient in methods(T, task.params).items():
                j = flat_gradient(task, gradient, batch, generator)
                rel = ((j - exact).norm() / exact.norm()).item()
                cos = torch.nn.functional.cosine_similarity(j, exact, dim=0).item()
                out[size].setdefault(name, []).append((rel, cos))
    return out


def timing(task, size, repeats, generator):
    """{method: seconds}: one training step's work on size samples, its rollout and its gradient,
    medians of interleaved repeats in this one process: exact GRPO, every method of methods but the
    oracles, the fast modes with a bound of 2 rows in a graph, and SDE windows placed where
    Flow-GRPO-Fast places them, anywhere in the trajectory: of as many steps as JAGG's rows at W = 4
    and 8, and of 8 and 4 steps, exact, with the paper's JAGG at W = 4, and with the fast modes."""
    T = task.draw(getattr(task, "group", 4), generator).traj.z.shape[0]  # one group
    steps = {"exact": exact_gradient, **methods(T, task.params), **methods(T)}
    steps = {name: gradient for name, gradient in steps.items()
             if not name.startswith(("cosine", "error_oracle"))}  # the oracles: not a training step

    def timed(gradient, window=0, opts=None):
        def run():
            start = bench.clock(torch.device("cpu"))
            task.sde_window = window
            where = int(torch.randint(0, T - window + 1, (), generator=generator)) if window else None
            batch = task.draw(size, generator, where)
            if opts is not None:  # the window's steps by JAGG, or exactly (opts None)
                fn, ref_fn = batch.fns(torch.arange(len(batch.adv)))
                options.backward_batch(fn, batch.traj, batch.adv, task.loss_cfg, opts, ref_fn)
            else:
                flat_gradient(task, gradient, batch, generator)
            return {"seconds": bench.clock(torch.device("cpu")) - start}
        return run
    fns = {name: timed(gradient) for name, gradient in steps.items()}
    rows = {int(name[5:]) for name in steps if name.startswith("first")}  # JAGG's rows at W = 8, 4
    for k in sorted(rows | {k for k in (8, 4) if k <= T}):
        fns[f"window{k}"] = timed(exact_gradient, k)
        if k % 4 == 0 and k > 4:
            fns[f"window{k}_jagg_w4"] = timed(None, k, options.JaggOptions(4))
        if k in (8, 4):
            for bound, suffix in ((None, ""), (2, "_rows2")):
                fast = options.JaggOptions(4, anchors="shared", interior="rollout", max_graph_rows=bound)
                fns[f"window{k}_shared_rollout_w4{suffix}"] = timed(None, k, fast)
    medians = bench.interleaved_medians(fns, repeats)
    return {name: m["seconds"] for name, m in medians.items()}


def report(path):
    """The markdown table of a run: per checkpoint and method, the relative error at each batch size
    (mean ± 95 % interval over the batches), and the cosine at the largest."""
    with open(path) as f:
        data = json.load(f)
    lines = []
    for c, result in data["checkpoints"].items():
        sizes = list(result)
        lines += [f"{data['setting']}, epoch {c} of exact GRPO, {data['args']['batches']} batches per size: "
                  "|j - g| / |g| (mean ± 95 % interval); cosine at the largest batch", "",
                  "| method | " + " | ".join(f"B = {s}" for s in sizes) + f" | cosine, B = {sizes[-1]} |",
                  "|---" * (len(sizes) + 2) + "|"]
        for name in result[sizes[0]]:
            cells = []
            for s in sizes:
                mean, half = mean_interval([r for r, _ in result[s][name]])
                cells.append(f"{mean:.3f} ± {half:.3f}")
            cos, chalf = mean_interval([c_ for _, c_ in result[sizes[-1]][name]])
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {cos:.3f} ± {chalf:.3f} |")
        lines.append("")
    print("\n".join(lines))
    return lines


ROUTING_ROWS = [(f"{key}{frac}", f"{label}, {frac}") for frac in ("0.5", "0.75") for key, label in
                [("early", "early (jagg.py)"), ("error_oracle", "error oracle"), ("step_error", "step_error"),
                 ("velocity", "velocity (free score)"), ("late", "late"), ("cosine", "cosine oracle")]]
ROUTING_ROWS.append(("jagg_w4", "every window (jagg_frac 1)"))
FAST_ROWS = [("jagg_w4", "JAGG, W = 4 (the paper's)"), ("shared_rollout_w4", "shared + rollout, W = 4"),
             ("jagg_w8", "JAGG, W = 8"), ("shared_rollout_w8", "shared + rollout, W = 8"),
             ("random8", "random 8 steps (toy)"), ("random6", "random 6 steps (mini)")]


def side_by_side(paths, rows):
    """One table of the relative error (mean ± 95 % interval) of the methods rows [(key, label)],
    at every checkpoint and batch size of each run file (the toy's, the mini's), side by side;
    "-" where a file has no such method. routing: lab/reports/routing.md's; fast: equal_cost.md's."""
    columns, header = [], []  # columns: the result of one checkpoint at one batch size
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for c, result in data["checkpoints"].items():
            for i, size in enumerate(result):
                columns.append(result[size])
                where = f"{data['args']['model_kind']}, epoch {c}: " if i == 0 else ""
                header.append(f"{where}B = {size}")

    def cell(column, key):  # "mean ± half-width" of the relative error over the batches
        if key not in column:
            return "-"
        return "{:.3f} ± {:.3f}".format(*mean_interval([r for r, _ in column[key]]))

    lines = ["| method | " + " | ".join(header) + " |", "|---" * (len(header) + 1) + "|"]
    for key, label in rows:
        lines.append(f"| {label} | " + " | ".join(cell(column, key) for column in columns) + " |")
    print("\n".join(lines))
    return lines


def main(argv=None):
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "report":
        return report(argv[1])
    if argv and argv[0] in ("routing", "fast"):  # the routing rules' or the fast modes' rows, side by side
        return side_by_side(argv[1:], ROUTING_ROWS if argv[0] == "routing" else FAST_ROWS)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_kind", choices=["toy", "mini"], help="which model and setting (or: report JSON)")
    parser.add_argument("--checkpoints", type=int, nargs="+", default=[0, 40],
                        help="epochs of exact GRPO from the base model at which to measure (increasing)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64, 256],
                        help="samples per batch (a multiple of 4 for the toy, of the group 8 for mini)")
    parser.add_argument("--batches", type=int, default=4, help="independent batches per size (>= 2)")
    parser.add_argument("--train-batch", type=int, default=64, help="samples per epoch of the exact training")
    parser.add_argument("--inner-steps", type=int, default=4, help="optimizer steps per epoch of the training")
    parser.add_argument("--model", default="mini", help="mini: a saved mini pipeline folder, or mini (the cached one)")
    parser.add_argument("--resolution", type=int, default=0, help="mini: image size (0: the model's own)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the training and the rollouts")
    parser.add_argument("--out", default="", help="JSON file (default runs/equal_cost_error_<model>.json)")
    parser.add_argument("--time", type=int, default=0, metavar="B",
                        help="instead: time one training step per method (rollout and gradient) on B samples "
                             "at the base model, medians of --batches interleaved repeats")
    args = parser.parse_args(argv)
    if args.batches < 2:
        parser.error(f"--batches must be >= 2 (an interval needs two), got {args.batches}")
    if sorted(set(args.checkpoints)) != args.checkpoints or args.checkpoints[0] < 0:
        parser.error(f"--checkpoints must be increasing epochs >= 0, got {args.checkpoints}")
    group = 8 if args.model_kind == "mini" else 4
    if any(b % group or b < group for b in args.batch_sizes + [args.train_batch]):
        parser.error(f"--batch-sizes and --train-batch must be multiples of {group}, got {args.batch_sizes}, "
                     f"{args.train_batch}")
    task = MiniTask(args) if args.model_kind == "mini" else ToyTask(args)
    g = torch.Generator().manual_seed(args.seed)
    if args.time:
        seconds = timing(task, args.time, args.batches, g)
        print(f"{task.setting}: one training step on {args.time} samples, rollout included, medians of "
              f"{args.batches} interleaved repeats, {torch.get_num_threads()} thread(s)\n\n"
              "| method | seconds | of exact's |\n|---|---|---|")
        for name, sec in sorted(seconds.items(), key=lambda kv: -kv[1]):
            print(f"| {name} | {sec:.3f} | {sec / seconds['exact']:.0%} |")
        path = args.out or os.path.join("runs", f"equal_cost_timing_{args.model_kind}.json")
        write_json(path, {"args": vars(args), "setting": task.setting, "seconds": seconds})
        return seconds
    optimizer = torch.optim.AdamW(task.params, lr=task.lr)
    results, done = {}, 0
    for c in args.checkpoints:
        train_exact(task, optimizer, c - done, args.train_batch, args.inner_steps, g)
        done = c
        results[str(c)] = measure(task, args.batch_sizes, args.batches,
                                  torch.Generator().manual_seed(args.seed * 7919 + c))
    path = args.out or os.path.join("runs", f"equal_cost_error_{args.model_kind}.json")
    write_json(path, {"args": vars(args), "setting": task.setting, "checkpoints": results})
    return report(path)


if __name__ == "__main__":
    main()
