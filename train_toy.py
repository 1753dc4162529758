"""GRPO on a toy 2-D flow model, exact against the paper's JAGG: the demo, to read top to bottom.

    python train_toy.py                        # exact GRPO, then JAGG, from one base model and seed
    python train_toy.py --method jagg --window 8 --jagg-frac 0.5

A toy DiT (toy_dit.py; you need not read it) is pretrained on 4 "prompts", each a mixture of
Gaussians in 2-D. GRPO then tunes it to put each prompt's samples on ONE of its modes. An epoch is
one rollout of the batch (4 prompts x --group-size samples), then --minibatches optimizer steps,
each calling jagg.backward_batch: jagg_frac 0 is exact GRPO (Flow-GRPO's per-step backward),
jagg_frac 1 the paper's JAGG on every window. --out gets config.json, samples.png and reward.png;
each method's folder metrics.jsonl and summary.json (it overwrites what was there).
"""

import argparse
import copy
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields

import torch
from PIL import Image, ImageDraw, ImageFont

import jagg
import toy_dit
from toy_dit import PROMPTS


def arg(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class Args:
    method: str = arg("compare", "exact, jagg, or compare: both, from the same base model and seed")
    out: str = arg("runs/toy", "output folder")
    seed: int = arg(0, "random seed of the base model's pretraining and of the rollouts")
    # --- GRPO (Flow-GRPO's loss on the toy)
    epochs: int = arg(80, "epochs: each one rollout of the batch, then --minibatches steps")
    num_steps: int = arg(16, "T, sampling steps of a rollout")
    shift: float = arg(3.0, "the sigma schedule's shift (SD3's 3: more steps at high noise)")
    noise_level: float = arg(0.7, "a, the SDE's noise level: std_t = a sqrt(t / (1 - t))")
    group_size: int = arg(16, "G, samples per prompt; the batch is G x 4 prompts")
    minibatches: int = arg(4, "optimizer steps per epoch: the batch split into this many")
    lr: float = arg(1e-3, "AdamW learning rate, decayed to 0 along a cosine over the run")
    clip_range: float = arg(0.2, "GRPO's ratio clip range")
    beta: float = arg(0.0, "KL weight to the frozen base model (0: no reference forward)")
    adv_clip: float = arg(5.0, "advantages are clipped to [-adv_clip, adv_clip]")
    max_grad_norm: float = arg(1.0, "gradient clipping norm")
    eval_every: int = arg(10, "evaluate on fixed noise and print a line every N epochs")
    eval_samples: int = arg(512, "evaluation samples per prompt")
    # --- JAGG (the paper's two knobs)
    window: int = arg(4, "W, sampling steps per window")
    jagg_frac: float = arg(1.0, "--method jagg: the share of windows JAGG takes, the rest exact")
    route: str = arg("early", "with --jagg-frac < 1, which windows: early (ours) or velocity (the cosine rule)")
    # --- the base model
    base_ckpt: str = arg("", "a pretrained toy DiT to start from; empty: pretrain one (cached)")
    pretrain_steps: int = arg(2000, "flow-matching steps to pretrain the base model")


def parse_args(argv=None):
    """Args from the command line, one --flag per field; a bad value stops here (check_args)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in fields(Args):
        parser.add_argument("--" + f.name.replace("_", "-"), default=f.default,
                            help=f.metadata["help"], type=f.type)
    a = check_args(Args(**vars(parser.parse_args(argv))))
    if a.route not in ("early", "velocity"):  # jagg.py's two rules
        raise SystemExit(f"error: --route must be early or velocity, got {a.route!r}")
    return a


def check_args(a):
    """a itself, or a stop in one line naming the first bad value and what it must be, before any
    work."""
    finite = all(math.isfinite(getattr(a, f.name)) for f in fields(a) if f.type is float)
    rules = [  # (flag, holds, what it must be)
        ("method", a.method in ("exact", "jagg", "compare"), "exact, jagg or compare"),
        ("seed", a.seed >= 0, ">= 0"), ("epochs", a.epochs >= 1, ">= 1"),
        ("num_steps", a.num_steps >= 2, ">= 2"), ("shift", a.shift > 0, "> 0"),
        ("noise_level", 0 < a.noise_level <= 1, "in (0, 1]"),
        ("group_size", a.group_size >= 2, ">= 2 (advantages compare a group's samples)"),
        ("minibatches", 4 * a.group_size % max(a.minibatches, 1) == 0 and a.minibatches >= 1,
         f"a divisor of the batch of {4 * a.group_size} (4 x --group-size)"),
        ("lr", a.lr > 0, "> 0"), ("clip_range", 0 < a.clip_range < 1, "in (0, 1)"),
        ("beta", a.beta >= 0, ">= 0"), ("adv_clip", a.adv_clip > 0, "> 0"),
        ("max_grad_norm", a.max_grad_norm > 0, "> 0"), ("eval_every", a.eval_every >= 1, ">= 1"),
        ("eval_samples", a.eval_samples >= 1, ">= 1"),
        ("window", 2 <= a.window <= a.num_steps, f"in [2, --num-steps {a.num_steps}]"),
        ("jagg_frac", 0 <= a.jagg_frac <= 1, "in [0, 1]"),
        ("base_ckpt", not a.base_ckpt or os.path.isfile(a.base_ckpt), "an existing file, or empty"),
        ("pretrain_steps", a.pretrain_steps >= 1, ">= 1")]
    if not finite:
        raise SystemExit(f"error: every number must be finite, got {a}")
    for name, holds, must in rules:
        if not holds:
            value = getattr(a, name)
            raise SystemExit(f"error: --{name.replace('_', '-')} must be {must}, got {value!r}")
    return a


# === The task: the reward prefers ONE mode of each prompt; the base model spreads over all ===
TARGETS = torch.tensor([(1.414, 1.414), (2.0, -2.0), (-2.4, -2.4), (-2.0, 2.0)])  # one per prompt


def reward_fn(x, labels):
    """r(x, c) = exp(-|x - target_c|^2 / 2): in (0, 1], 1 at the prompt's target mode. x [B, 2]."""
    return torch.exp(-((x - TARGETS[labels]) ** 2).sum(-1) / 2)  # [B]


def make_velocity_fn(model, labels):
    """jagg.py's contract: velocity_fn(z [S, B, 2], t [S, B]) -> v [S, B, 2] for the samples whose
    prompts are labels [B]. Rows are step-major, so the labels repeat over S as a block."""
    def velocity_fn(z, t):
        S, B = t.shape
        v = model(z.reshape(S * B, 2), t.reshape(S * B), labels.repeat(S))  # [S*B, 2]
        return v.reshape(S, B, 2)
    return velocity_fn


def base_model(args):
    """The pretrained toy DiT: --base-ckpt, or pretrained once and cached under runs/cache/."""
    path = args.base_ckpt or f"runs/cache/toy_dit_h64_d3_s{args.pretrain_steps}_seed{args.seed}.pt"
    if not os.path.exists(path):
        print(f"pretraining the base toy DiT ({args.pretrain_steps} steps) into {path}")
        save_base_model(toy_dit.pretrain(args.pretrain_steps, args.seed, log_every=500), path)
    try:
        return toy_dit.load(path)
    except Exception as e:
        raise SystemExit(f"error: {path} is not a toy DiT checkpoint ({type(e).__name__}); "
                         "delete it or pass another --base-ckpt") from None


def save_base_model(model, path):
    save(path, lambda f: torch.save(toy_dit.checkpoint(model), f), "wb")


def save(path, write, mode="w"):
    """Write a file whole: write(f) fills a file beside path, which then replaces path, so a run
    killed midway leaves the old file or the new one, never half of one."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", mode) as f:
        write(f)
    os.replace(path + ".tmp", path)


def save_json(path, obj):
    save(path, lambda f: json.dump(obj, f, indent=2))


@torch.no_grad()
def evaluate(model, args):
    """Mean reward of --eval-samples per prompt from fixed noise; returns (reward, (x, labels))."""
    g = torch.Generator().manual_seed(12345)
    labels = torch.arange(len(PROMPTS)).repeat_interleave(args.eval_samples)  # [E]
    sigmas = jagg.sigma_schedule(args.num_steps, args.shift)  # [T+1]
    noise = torch.randn(len(labels), 2, generator=g)  # [E, 2]
    traj = jagg.rollout(make_velocity_fn(model, labels), noise, sigmas, args.noise_level, g)
    return reward_fn(traj.sample, labels).mean().item(), (traj.sample, labels)


# === GRPO: the whole loop ===
def train(args, base, method):
    """Fine-tune a copy of base by GRPO, exact (jagg_frac 0) or JAGG. Returns (rows, model)."""
    jagg_frac = args.jagg_frac if method == "jagg" else 0.0
    model = copy.deepcopy(base)
    ref = copy.deepcopy(base).requires_grad_(False)  # the KL's frozen reference (beta > 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sigmas = jagg.sigma_schedule(args.num_steps, args.shift)  # [T+1]
    loss_cfg = jagg.LossConfig(args.noise_level, args.clip_range, args.beta)
    labels = torch.arange(len(PROMPTS)).repeat_interleave(args.group_size)  # [B]: G per prompt
    B, g = len(labels), torch.Generator().manual_seed(args.seed * 1000)  # the rollouts' noise
    total_steps, rows = args.epochs * args.minibatches, []
    for epoch in range(1, args.epochs + 1):
        start = time.perf_counter()
        # 1. Rollout: B trajectories of T SDE steps, with velocities and log-probabilities
        noise = torch.randn(B, 2, generator=g)  # [B, 2]
        traj = jagg.rollout(make_velocity_fn(model, labels), noise, sigmas, args.noise_level, g)
        # 2. Rewards, and advantages relative to each prompt's group
        rewards = reward_fn(traj.sample, labels)  # [B]
        advantages = jagg.group_advantages(rewards, labels, clip=args.adv_clip)  # [B]
        # 3. Optimizer steps, one per minibatch: slice the trajectories and their labels alike
        stats, grad_seconds = [], 0.0
        for idx in torch.randperm(B, generator=g).chunk(args.minibatches):
            step = (epoch - 1) * args.minibatches + len(stats)  # optimizer steps so far
            for group in optimizer.param_groups:  # a cosine to 0: the end is learned, not a jitter
                group["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * step / total_steps))
            optimizer.zero_grad(set_to_none=True)
            grad_start = time.perf_counter()
            s, routed = jagg.backward_batch(make_velocity_fn(model, labels[idx]), traj.subset(idx),
                                             advantages[idx], loss_cfg, args.window, jagg_frac,
                                             make_velocity_fn(ref, labels[idx]), route=args.route)
            grad_seconds += time.perf_counter() - grad_start
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            stats.append({**s, "routed_frac": sum(routed) / len(routed)})  # the windows JAGG took
        # 4. Logging: the steps' means, their rows with grad and seconds summed
        row = {"epoch": epoch, "method": method, "rollout/reward_mean": rewards.mean().item()}
        for key in ("loss", "clipfrac", "approx_kl", "kl", "routed_frac"):
            row[f"train/{key}"] = sum(s[key] for s in stats) / len(stats)
        row["train/grad_rows"] = sum(s["grad_rows"] for s in stats)
        row["time/grad_seconds"] = grad_seconds  # the gradients: forwards with graph, backwards
        row["time/train_seconds"] = time.perf_counter() - start  # the rollout included
        if epoch % args.eval_every == 0 or epoch == args.epochs:
            row["eval/reward"] = evaluate(model, args)[0]
            print(f"[{method}] epoch {epoch:3d}/{args.epochs}"
                  f"  reward {row['rollout/reward_mean']:.3f}  eval {row['eval/reward']:.3f}"
                  f"  loss {row['train/loss']:+.4f}"
                  f"  clipfrac {row['train/clipfrac']:.3f}  approx_kl {row['train/approx_kl']:.5f}"
                  f"  routed {row['train/routed_frac']:.2f}  grad {grad_seconds:.2f}s", flush=True)
        rows.append(row)
    return rows, model


def compare(args, exact, jagg_run):
    """--method compare's summary: JAGG's share of exact's reward gain, exact's rows with grad and
    seconds over JAGG's, and both summaries."""
    c = {"method": "compare", "exact": exact, "jagg": jagg_run, "config": asdict(args),
         "reward_gain_ratio": jagg_run["reward_gain"] / exact["reward_gain"] if exact["reward_gain"]
         else None, "grad_rows_ratio": exact["grad_rows"] / jagg_run["grad_rows"],
         "grad_speedup": exact["grad_seconds"] / jagg_run["grad_seconds"],
         "train_speedup": exact["train_seconds"] / jagg_run["train_seconds"]}
    return c


def summarize(args, method, rows, initial_reward, final_reward):
    """A method's summary.json: its reward gain, its rows with grad and its seconds."""
    def total(key):
        return sum(r[key] for r in rows)
    return {"method": method, "jagg_frac": args.jagg_frac if method == "jagg" else 0.0,
            "initial_reward": initial_reward, "final_reward": final_reward,
            "reward_gain": final_reward - initial_reward, "grad_rows": total("train/grad_rows"),
            "grad_seconds": total("time/grad_seconds"),
            "train_seconds": total("time/train_seconds"),
            "config": asdict(args)}


# === Pictures: the samples (the base model's, then each method's), the reward over training ===
COLORS = {"base": (150, 150, 150), "exact": (40, 90, 200), "jagg": (230, 120, 20)}
FONT = ImageFont.load_default(size=16)


def samples_picture(rows, size=200, lim=3.5):
    """rows {name: (x [E, 2], labels [E])}: a row of panels each, one per prompt; grey circles: the
    prompt's modes, red: its target."""
    img = Image.new("RGB", (80 + size * len(PROMPTS), 30 + size * len(rows)), "white")
    d = ImageDraw.Draw(img)
    for i, (row, (x, labels)) in enumerate(rows.items()):
        d.text((6, 30 + i * size + size / 2), row, fill=COLORS[row], font=FONT, anchor="lm")
        for j, (name, modes) in enumerate(PROMPTS.items()):
            left, top = 80 + j * size, 30 + i * size  # the panel's corner

            def circle(p, r):  # the box of a circle of r pixels around the point p = (x1, x2)
                cx = left + (p[0] + lim) / (2 * lim) * size
                cy = top + (lim - p[1]) / (2 * lim) * size
                return [cx - r, cy - r, cx + r, cy + r]
            d.text((left + size / 2, 4), name, fill="black", font=FONT, anchor="mt")
            d.rectangle([left, top, left + size - 1, top + size - 1], outline="grey")
            for m in modes:
                d.ellipse(circle(m, 9), outline=(200, 200, 200), width=2)
            d.ellipse(circle(TARGETS[j].tolist(), 11), outline="red", width=2)
            for p in x[labels == j].tolist():
                d.ellipse(circle(p, 1), fill=COLORS[row])
    return img


def curve_picture(curves, size=(720, 400), box=(60, 40, 590, 350)):
    """curves {name: [(epoch, reward)]}: the evaluation reward over training, the legend beside."""
    img, (left, top, right, bottom) = Image.new("RGB", size, "white"), box
    d, last = ImageDraw.Draw(img), max(e for c in curves.values() for e, _ in c)

    def xy(epoch, reward):  # reward in [0, 1]
        return left + epoch / last * (right - left), bottom - reward * (bottom - top)
    d.rectangle(box, outline="black")
    d.text(((left + right) / 2, 10), "evaluation reward (mean, in (0, 1]) during GRPO",
           fill="black", font=FONT, anchor="mt")
    d.text(((left + right) / 2, size[1] - 8), "epoch", fill="black", font=FONT, anchor="md")
    for v in (0.0, 0.25, 0.5, 0.75, 1.0):
        d.text((left - 6, xy(0, v)[1]), f"{v:.2f}", fill="black", font=FONT, anchor="rm")
    for e in (0, last // 2, last):
        d.text((xy(e, 0)[0], bottom + 6), str(e), fill="black", font=FONT, anchor="mt")
    for i, (name, points) in enumerate(curves.items()):
        y = top + 20 + 24 * i  # the legend's line
        d.line([xy(e, r) for e, r in points], fill=COLORS[name], width=3)
        d.line([right + 12, y, right + 36, y], fill=COLORS[name], width=3)
        d.text((right + 42, y), name, fill="black", font=FONT, anchor="lm")
    return img


def main(argv=None):
    args = parse_args(argv)
    # One thread: the toy's tensors are tiny, and on a busy machine more threads wait on each other
    torch.set_num_threads(1)
    try:  # the run's folder first, so that an unwritable --out ends here in one line, before any work
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"error: --out {args.out!r} cannot be made ({e.strerror}): give a folder you can write")
    print("config: " + json.dumps(asdict(args)))
    save_json(os.path.join(args.out, "config.json"), asdict(args))
    base = base_model(args)
    initial_reward, base_samples = evaluate(base, args)
    samples, curves, summaries = {"base": base_samples}, {}, {}
    methods = ["exact", "jagg"] if args.method == "compare" else [args.method]
    for method in methods:
        folder = os.path.join(args.out, method) if args.method == "compare" else args.out
        rows, model = train(args, base, method)
        final_reward, samples[method] = evaluate(model, args)
        s = summarize(args, method, rows, initial_reward, final_reward)
        save_json(os.path.join(folder, "summary.json"), s)
        metrics = "".join(json.dumps(r) + "\n" for r in rows)
        save(os.path.join(folder, "metrics.jsonl"), lambda f: f.write(metrics))
        curves[method] = [(0, initial_reward)] + [(r["epoch"], r["eval/reward"])
                                                  for r in rows if "eval/reward" in r]
        summaries[method] = s
        print(f"[{method}] reward {initial_reward:.3f} -> {final_reward:.3f} "
              f"({s['reward_gain']:+.3f}), gradients {s['grad_seconds']:.1f} s, "
              f"training {s['train_seconds']:.1f} s")
    for name, picture in [("samples.png", samples_picture(samples)),
                          ("reward.png", curve_picture(curves))]:
        save(os.path.join(args.out, name), lambda f: picture.save(f, format="PNG"), "wb")
    if args.method == "compare":
        c = compare(args, summaries["exact"], summaries["jagg"])
        save_json(os.path.join(args.out, "summary.json"), c)
        print(f"JAGG kept {100 * (c['reward_gain_ratio'] or 0):.0f} % of exact GRPO's reward gain; "
              f"{c['grad_rows_ratio']:.2f}x fewer rows with grad, gradients "
              f"{c['grad_speedup']:.1f}x faster, training {c['train_speedup']:.1f}x "
              "(rollouts included)")


if __name__ == "__main__":
    main()
