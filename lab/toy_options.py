"""JAGG's options beyond the paper (beyond_paper/options.py) on train_toy.py's task, one flag each.

    python lab/toy_options.py --anchors shared --interior rollout      # exact, then that mode
    python lab/toy_options.py --jagg-frac 0.5 --route early            # half the windows: the noisiest
    python lab/toy_options.py --jagg-frac 0.5 --route probe --probe-every 1
    python lab/toy_options.py --method jagg --weights index --probe-every 5

train_toy.py's model, reward, evaluation and flags, and its loop with two changes: the gradient is
options.backward_batch with a JaggOptions built from the flags (its defaults are the
paper's, so `--method jagg` alone trains what train_toy.py does, bit for bit), and the probe
(probe.probe_segments), every --probe-every epochs, measures each window's JAGG gradient
against the exact one before the epoch trains. lab/ runs its toy tables with this file, and its
baselines (lab/toy_baselines.py) replace the gradient or the rollout through train()'s arguments.
--out gets what train_toy.py writes, and in each run's metrics.jsonl the probe's figures and the
routing per window (lab/toy_pictures.py draws them).
"""

import argparse
import copy
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, fields

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jagg  # noqa: E402
from beyond_paper import options, probe  # noqa: E402
import run_folder  # noqa: E402
import toy_dit  # noqa: E402
import train_toy  # noqa: E402
from train_toy import arg  # noqa: E402


@dataclass
class Args(train_toy.Args):
    # --- options.JaggOptions' fields beyond the paper; the defaults are the paper's
    anchors: str = arg("window", "window: the paper's disjoint windows; shared: windows share ends")
    interior: str = arg("forward", "forward: the paper's no-graph forwards; rollout: traj.v moved")
    weights: str = arg("time", "time: the paper's alpha_k by t; index: alpha_k = k / (W - 1)")
    max_graph_rows: int = arg(0, "at most this many anchor rows in a graph at once; 0: no bound")
    max_drift: float = arg(0.5, "--interior rollout: a forward past this drift; -1: never")
    route: str = arg("velocity", "which windows JAGG takes: velocity (the free score: lowest "
                                 "noise first, as late), early (highest noise first, fixed: "
                                 "more reward kept at equal cost), late, or probe (measured)")
    min_cosine: float = arg(0.0, "--route probe: a window whose cosine is below this stays exact")
    # --- the probe (beyond_paper/probe.py)
    probe_every: int = arg(0, "every N epochs and the first, JAGG's gradient against exact; 0: off")
    probe_batch: int = arg(8, "samples the probe measures on")
    probe_decay: float = arg(0.5, "--route probe ranks windows by an average of probes: its decay")


def jagg_opts(args, method):
    """The JaggOptions of the flags; method "exact" trains every window exactly (jagg_frac 0)."""
    return options.JaggOptions(
        window=args.window, jagg_frac=args.jagg_frac if method != "exact" else 0.0,
        anchors=args.anchors, interior=args.interior, weights=args.weights,
        max_graph_rows=args.max_graph_rows or None,
        max_drift=None if args.max_drift == -1 else args.max_drift,
        route=args.route, min_cosine=args.min_cosine)


def parse_args(argv=None, cls=Args, description=__doc__):
    """cls (Args, or a dataclass that extends it) from the command line, one --flag per field, as
    train_toy.parse_args; a bad value stops here in one line naming its flag."""
    parser = argparse.ArgumentParser(description=description.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in fields(cls):
        kind = {"action": argparse.BooleanOptionalAction} if f.type is bool else {"type": f.type}
        parser.add_argument("--" + f.name.replace("_", "-"), default=f.default,
                            help=f.metadata["help"], **kind)
    args = train_toy.check_args(cls(**vars(parser.parse_args(argv))))
    rules = [("max_graph_rows", args.max_graph_rows >= 0, ">= 0 (0: no bound)"),
             ("max_drift", args.max_drift >= 0 or args.max_drift == -1, ">= 0, or -1 (never)"),
             ("probe_every", args.probe_every >= 0, ">= 0"),
             ("probe_every", args.route != "probe" or args.probe_every >= 1,
              ">= 1 with --route probe (it routes by the probe)"),
             ("probe_batch", args.probe_batch >= 2, ">= 2 (the probe halves it)"),
             ("probe_decay", 0 <= args.probe_decay < 1, "in [0, 1)")]
    for name, holds, must in rules:
        if not holds:
            value = getattr(args, name)
            raise SystemExit(f"error: --{name.replace('_', '-')} must be {must}, got {value!r}")
    opts = jagg_opts(args, "jagg")
    try:  # the options' own checks; each message starts with the field's name
        options.check_options(opts, num_steps=args.num_steps)
    except ValueError as e:
        field, rest = str(e).split(" ", 1)
        raise SystemExit(f"error: --{field.replace('_', '-')} {rest}") from None
    return args


def train(args, base, method, gradient=None, rollout=None):
    """train_toy.train with the flags' options and the probe. Returns (rows, model).
    gradient(fns, minibatch, advantages) -> (stats, routed), fns(idx) -> (velocity_fn,
    ref_velocity_fn) of the minibatch's samples idx; rollout(velocity_fn, noise, sigmas, generator,
    epoch) -> (traj, samples): what the lab's baselines compute instead of backward_batch and
    jagg.rollout (None: these)."""
    opts = jagg_opts(args, method)
    model = copy.deepcopy(base)
    ref = copy.deepcopy(base).requires_grad_(False)  # the KL's frozen reference (beta > 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sigmas = jagg.sigma_schedule(args.num_steps, args.shift)  # [T+1]
    loss_cfg = jagg.LossConfig(args.noise_level, args.clip_range, args.beta)
    labels = torch.arange(len(toy_dit.PROMPTS)).repeat_interleave(args.group_size)  # [B]
    B, g = len(labels), torch.Generator().manual_seed(args.seed * 1000)  # the rollouts' noise
    total_steps, rows, probe_avg = args.epochs * args.minibatches, [], None

    def velocity_fns(model, idx):  # the policy's and the reference's velocity_fn of samples idx
        return (train_toy.make_velocity_fn(model, labels[idx]),
                train_toy.make_velocity_fn(ref, labels[idx]))

    for epoch in range(1, args.epochs + 1):
        start, row = time.perf_counter(), {"epoch": epoch, "method": method}
        # 1. Rollout, 2. rewards and group advantages: as train_toy.py
        noise = torch.randn(B, 2, generator=g)  # [B, 2]
        policy = train_toy.make_velocity_fn(model, labels)
        if rollout is None:
            traj = jagg.rollout(policy, noise, sigmas, args.noise_level, g)
            samples = traj.sample  # [B, 2]
        else:
            traj, samples = rollout(policy, noise, sigmas, g, epoch)
        rewards = train_toy.reward_fn(samples, labels)  # [B]
        advantages = jagg.group_advantages(rewards, labels, clip=args.adv_clip)  # [B]
        perm = torch.randperm(B, generator=g)  # the minibatches, and the probe's samples
        # The probe (--probe-every): JAGG's gradient against exact per window, before training
        if args.probe_every and (epoch % args.probe_every == 0 or epoch == 1):
            probe_start, idx = time.perf_counter(), perm[: args.probe_batch]
            measured = probe.probe_segments(
                lambda i: velocity_fns(model, idx[i]), model.parameters(), traj.subset(idx),
                advantages[idx], loss_cfg, jagg_opts(args, "jagg"),
                train_batch=B // args.minibatches)
            row.update({f"probe/{key}": value for key, value in measured.items()})
            probe_avg = probe.probe_average(probe_avg, measured["cosine"], args.probe_decay)
            row["time/probe_seconds"] = time.perf_counter() - probe_start
            if not (method == "jagg" and args.route == "probe"):  # training time only if it routes
                start += row["time/probe_seconds"]
        # 3. Optimizer steps, one per minibatch
        stats, routed, grad_seconds = [], [], 0.0
        for idx in perm.chunk(args.minibatches):
            step = (epoch - 1) * args.minibatches + len(stats)  # optimizer steps so far
            for group in optimizer.param_groups:  # a cosine to 0, as train_toy.py
                group["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * step / total_steps))
            optimizer.zero_grad(set_to_none=True)
            grad_start = time.perf_counter()
            if gradient is None:
                fn, ref_fn = velocity_fns(model, idx)
                s, r = options.backward_batch(fn, traj.subset(idx), advantages[idx],
                                                     loss_cfg, opts, ref_fn, probe_avg)
            else:
                s, r = gradient(lambda i, idx=idx: velocity_fns(model, idx[i]), traj.subset(idx),
                                advantages[idx])
            grad_seconds += time.perf_counter() - grad_start
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            stats.append(s)
            routed.append(r)
        # 4. Logging, as train_toy.py, and the routing per window
        row["rollout/reward_mean"] = rewards.mean().item()
        for key in ("loss", "clipfrac", "approx_kl", "kl", "routed_frac"):
            row[f"train/{key}"] = sum(s[key] for s in stats) / len(stats)
        row["train/grad_rows"] = sum(s["grad_rows"] for s in stats)
        row["routing/window_scores"] = stats[0].get("window_scores")  # the first step's
        row["routing/routed"] = [sum(r) / len(routed) for r in zip(*routed)]  # share of the steps
        row["time/grad_seconds"] = grad_seconds
        row["time/train_seconds"] = time.perf_counter() - start  # the rollout included
        if epoch % args.eval_every == 0 or epoch == args.epochs:
            row["eval/reward"] = train_toy.evaluate(model, args)[0]
            print(f"[{method}] epoch {epoch:3d}/{args.epochs}"
                  f"  reward {row['rollout/reward_mean']:.3f}  eval {row['eval/reward']:.3f}"
                  f"  loss {row['train/loss']:+.4f}"
                  f"  clipfrac {row['train/clipfrac']:.3f}  routed {row['train/routed_frac']:.2f}"
                  f"  grad {grad_seconds:.2f}s", flush=True)
        rows.append(row)
    return rows, model


def summarize(args, method, rows, initial_reward, final_reward):
    """train_toy.summarize's summary, with the mode, the routing and the probe's pooled figures."""
    s = train_toy.summarize(args, method, rows, initial_reward, final_reward)
    probes = [{k: r[f"probe/{k}"] for k in ("cosine", "error", "noise")}
              for r in rows if "probe/cosine" in r]
    routed = [r["routing/routed"] for r in rows]
    s.update(mode=jagg_opts(args, method).mode_name(method), probe=probe.pool_probes(probes),
             probe_seconds=sum(r.get("time/probe_seconds", 0.0) for r in rows),
             routed_frac_by_position=[sum(f) / len(rows) for f in zip(*routed)])
    return s


def run(args, gradient=None, rollout=None, mode=None):
    """train_toy.main's runs, with the options. gradient and rollout: train()'s, for the JAGG side;
    mode: its name in the summary (None: the options' mode)."""
    print("config: " + run_folder.json_text(asdict(args)))
    run_folder.write_json(os.path.join(args.out, "config.json"), asdict(args))
    base = train_toy.base_model(args)
    initial_reward = train_toy.evaluate(base, args)[0]
    summaries = {}
    for method in ["exact", "jagg"] if args.method == "compare" else [args.method]:
        folder = os.path.join(args.out, method) if args.method == "compare" else args.out
        jagg_side = method == "jagg"
        rows, model = train(args, base, method, gradient if jagg_side else None,
                            rollout if jagg_side else None)
        final_reward = train_toy.evaluate(model, args)[0]
        s = summaries[method] = summarize(args, method, rows, initial_reward, final_reward)
        if mode is not None and jagg_side:
            s["mode"] = mode
        run_folder.write_json(os.path.join(folder, "summary.json"), s)
        metrics = "".join(run_folder.json_text(r) + "\n" for r in rows)
        run_folder.atomic_write(os.path.join(folder, "metrics.jsonl"), metrics)
        print(f"[{s['mode']}] reward {initial_reward:.3f} -> {final_reward:.3f} "
              f"({s['reward_gain']:+.3f}), {s['grad_rows']} rows with grad, "
              f"training {s['train_seconds']:.1f} s")
        pooled = s["probe"] or {"cosine": [], "error_to_noise": []}
        for i, (c, e) in enumerate(zip(pooled["cosine"], pooled["error_to_noise"])):
            print(f"[{s['mode']}] probe, window {i}: cosine {c:.2f}, error/noise {e:.2f}")
    if args.method == "compare":
        c = train_toy.compare(args, summaries["exact"], summaries["jagg"])
        c["mode"] = summaries["jagg"]["mode"]
        run_folder.write_json(os.path.join(args.out, "summary.json"), c)
        print(f"{summaries['jagg']['mode']} kept {100 * (c['reward_gain_ratio'] or 0):.0f} % of "
              f"exact GRPO's reward gain with {c['grad_rows_ratio']:.2f}x fewer rows with grad")
    return summaries


def main(argv=None):
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
