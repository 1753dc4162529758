"""GRPO on a toy 2-D flow model, exact vs JAGG: the CPU demo and the evidence.

    python train_toy.py                       # compare exact GRPO and the paper's JAGG (about 2 min on 2 cores)
    python train_toy.py --anchors shared --interior rollout   # JAGG with no network call between anchors
    python train_toy.py --jagg-frac 0.5 --route probe --probe-every 5   # route by measured fidelity
    python train_toy.py --benchmark           # time a window's and a whole training step's gradient, every mode
    torchrun --nproc_per_node=2 train_toy.py --method jagg   # DistributedDataParallel (gloo)

What happens:
1. A toy DiT (toy_dit.py) is pretrained by flow matching on a conditional 2-D distribution:
   4 "prompts", each a mixture of Gaussians with several modes. The checkpoint is cached.
2. GRPO fine-tunes it with a prompt-dependent reward: closeness to ONE target mode per prompt,
   which the base model, spreading its samples over all modes, does not maximise.
3. With --method compare (the default) exact GRPO and JAGG train from the same checkpoint and seed;
   the run writes the rewards, the backward time, the gradient fidelity and pictures to --out.
"""

import contextlib
import copy
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from PIL import Image, ImageDraw
from tqdm import tqdm

import jagg
import jagg_options
from common import COLORS, all_gather_cat, arg, bench_modes, benchmark_trajectory, benchmark_window, chart, fail_on, font
from common import finish_distributed, init_distributed, jagg_flag_checks
from common import mean_over_ranks, mode_name, param_checksums, parse_config, report_benchmark
from common import report_trajectory, save_png, step_metrics, torch_save, trained_steps, training_step_bars
from common import writable_folder_check
from common import JaggConfig, compare_summary, probe_cosine_by_position, probe_counts_as_training
from common import probe_error_to_noise_by_position, probe_error_to_noise_stderr_by_position, probe_report
from common import write_json, write_jsonl
from toy_dit import ToyDiT, ToyDiTConfig, flow_matching_loss


@dataclass
class Config(JaggConfig):
    # --- what to run
    method: str = arg("compare", "exact, jagg, or compare (both, from the same seed and checkpoint)",
                      choices=["exact", "jagg", "compare"])
    benchmark: bool = arg(False, "time one window's gradient (exact vs JAGG) and one whole trajectory's in every mode, "
                                 "with a rollout, at W = 4 and 8; write benchmark.json and benchmark.png, then exit")
    out: str = arg("runs/toy", "output folder: summary.json, metrics.jsonl, pictures")
    seed: int = arg(0, "random seed (model init, data, rollouts); ranks add their rank", valid=">= 0")
    # --- JAGG: common.JaggConfig's flags, the probe on by default here
    probe_every: int = arg(10, "every N GRPO steps (and at step 1), measure the cosine of JAGG's gradient to the exact one "
                               "per window on --probe-batch samples, before training on the batch (0: off)", valid=">= 0")
    probe_batch: int = arg(8, "samples the probe measures on; its two halves give the batch's own noise, which "
                              "error_to_noise is measured in", valid=">= 2")
    # --- GRPO
    steps: int = arg(80, "GRPO steps (each: one batch of rollouts, --minibatches optimizer steps)", valid=">= 1")
    num_steps: int = arg(16, "T, sampling steps of a rollout", valid=">= 2")
    timestep_fraction: float = arg(1.0, "train the first int(T x this) steps of each rollout (Flow-GRPO's "
                                        "timestep_fraction; its SD3 configs use 0.99, train_sd.py's default)", valid="(0, 1]")
    shift: float = arg(3.0, "sigma schedule shift (SD3-style; >1 spends more steps at high noise)", valid="> 0")
    noise_level: float = arg(0.7, "SDE noise level a, std_t = a sqrt(sigma / (1 - sigma)) (Flow-GRPO's default 0.7; "
                                  "0 would be the ODE, which has no log-probability)", valid="(0, 1]")
    group_size: int = arg(16, "G, samples per prompt in a group", valid=">= 2")
    minibatches: int = arg(4, "optimizer steps per batch of rollouts (the batch split into this many parts)", valid=">= 1")
    lr: float = arg(1e-3, "AdamW learning rate for GRPO", valid="> 0")
    cosine_lr: bool = arg(True, "decay the learning rate to 0 along a cosine over the run")
    clip_range: float = arg(0.2, "GRPO ratio clip range", valid="(0, 1)")
    beta: float = arg(0.0, "KL weight to the frozen base model (0: no reference forward)", valid=">= 0")
    adv_clip: float = arg(5.0, "advantages are clipped to [-adv_clip, adv_clip]", valid="> 0")
    max_grad_norm: float = arg(1.0, "gradient clipping norm", valid="> 0")
    eval_every: int = arg(5, "evaluate the mean reward every N GRPO steps", valid=">= 1")
    eval_samples: int = arg(512, "samples per prompt for evaluation", valid=">= 1")
    # --- the base model
    base_ckpt: str = arg("", "pretrained toy DiT to start from; empty: pretrain one (cached in runs/cache)")
    pretrain_steps: int = arg(2000, "flow-matching steps when pretraining the base model", valid=">= 1")
    pretrain_batch: int = arg(512, "batch size for pretraining", valid=">= 1")
    hidden: int = arg(64, "toy DiT hidden size", valid=">= 4")
    depth: int = arg(3, "toy DiT blocks", valid=">= 1")
    # --- benchmark
    bench_batch: int = arg(256, "batch size B of the benchmark", valid=">= 1")
    bench_repeats: int = arg(7, "timed repeats per method in the benchmark (medians are reported)", valid=">= 1")

    def validate(self):
        """Every bad value is reported before any work starts; the output folder is checked last."""
        fail_on(jagg_flag_checks(self) + [
            (self.minibatches <= self.group_size * len(PROMPTS),
             f"--minibatches must be at most the batch size {self.group_size * len(PROMPTS)} (--group-size x "
             f"{len(PROMPTS)} prompts), got {self.minibatches}"),
            (self.hidden % 4 == 0, f"--hidden must be a multiple of the toy DiT's 4 attention heads, got {self.hidden}"),
            (self.base_ckpt == "" or os.path.isfile(self.base_ckpt),
             f"--base-ckpt {self.base_ckpt!r} does not exist; omit --base-ckpt to pretrain and cache a base model"),
        ])
        fail_on([writable_folder_check(self.out)])


# =====================================================================================
# The toy task: 4 prompts, each a mixture of Gaussians; the reward prefers one mode per prompt
# =====================================================================================

PROMPTS = {  # name: (modes, target mode the reward prefers)
    "ring": ([(2.0 * torch.cos(torch.tensor(i * 3.14159 / 4)).item(), 2.0 * torch.sin(torch.tensor(i * 3.14159 / 4)).item())
              for i in range(8)], (1.414, 1.414)),
    "grid": ([(x, y) for x in (-2.0, 0.0, 2.0) for y in (-2.0, 0.0, 2.0)], (2.0, -2.0)),
    "diagonal": ([(s, s) for s in (-2.4, -0.8, 0.8, 2.4)], (-2.4, -2.4)),
    "corners": ([(-2.0, -2.0), (-2.0, 2.0), (2.0, -2.0), (2.0, 2.0)], (-2.0, 2.0)),
}
MODE_STD = 0.2
REWARD_WIDTH = 1.0


def sample_data(labels, generator=None):
    """Points of the prompts' distributions: labels [B] -> x [B, 2]."""
    x = torch.empty(len(labels), 2)
    for c, (modes, _) in enumerate(PROMPTS.values()):
        m = labels == c
        modes = torch.tensor(modes)  # [M, 2]
        pick = torch.randint(len(modes), (int(m.sum()),), generator=generator)
        x[m] = modes[pick] + MODE_STD * torch.randn(int(m.sum()), 2, generator=generator)
    return x


def reward_fn(x, labels):
    """r(x, c) = exp(-||x - target_c||^2 / (2 width^2)): in (0, 1], 1 at the prompt's target mode."""
    targets = torch.tensor([target for _, target in PROMPTS.values()])[labels]  # [B, 2]
    return torch.exp(-((x - targets) ** 2).sum(-1) / (2 * REWARD_WIDTH**2))  # [B]


def make_velocity_fn(model, labels):
    """The contract with jagg.py: velocity_fn(z [S, B, 2], t [S, B]) -> v [S, B, 2]; the
    prompt labels [B] are repeated over the S steps here, as the caller's job."""

    def velocity_fn(z, t):
        S, B = t.shape
        v = model(z.reshape(S * B, 2), t.reshape(S * B), labels.repeat(S))  # [S*B, 2]
        return v.reshape(S, B, 2)

    return velocity_fn


# =====================================================================================
# The base model: pretrain once, cache, load safely
# =====================================================================================


def load_base(path, model_cfg):
    """Load a base checkpoint (weights only, no pickled code), with a clear error if corrupt."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        if ckpt.get("model_cfg") != model_cfg.to_dict():
            raise SystemExit(f"error: checkpoint {path} holds a toy DiT of another size ({ckpt.get('model_cfg')}); "
                             f"pass matching --hidden/--depth or delete it to retrain")
        model = ToyDiT(model_cfg)
        model.load_state_dict(ckpt["model"])
    except SystemExit:
        raise
    except Exception as e:
        raise SystemExit(f"error: checkpoint {path} is corrupt or not a toy DiT checkpoint ({type(e).__name__}: {e}); "
                         f"delete it to pretrain again") from None
    return model


def pretrain(cfg, model_cfg, path, rank):
    torch.manual_seed(cfg.seed)
    model = ToyDiT(model_cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, cfg.pretrain_steps)
    bar = tqdm(range(cfg.pretrain_steps), desc="pretrain base DiT", disable=rank != 0, dynamic_ncols=True)
    for _ in bar:
        labels = torch.randint(len(PROMPTS), (cfg.pretrain_batch,))
        loss = flow_matching_loss(model, sample_data(labels), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    torch_save(path, {"model_cfg": model_cfg.to_dict(), "model": model.state_dict()})
    return model


def base_model(cfg, rank):
    model_cfg = ToyDiTConfig(num_classes=len(PROMPTS), hidden=cfg.hidden, depth=cfg.depth)
    path = cfg.base_ckpt
    if not path:
        path = os.path.join("runs", "cache", f"toy_dit_h{cfg.hidden}_d{cfg.depth}_s{cfg.pretrain_steps}_seed{cfg.seed}.pt")
        if not os.path.exists(path):
            # One rank pretrains, the others wait and load the same file.
            if rank == 0:
                pretrain(cfg, model_cfg, path, rank)
            if dist.is_initialized():
                dist.barrier()
    return load_base(path, model_cfg), path


# =====================================================================================
# Evaluation and pictures
# =====================================================================================


@torch.no_grad()
def evaluate(model, cfg, sigmas, seed):
    """Mean reward of eval_samples per prompt, from a fixed noise seed; returns (reward, x, labels)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(len(PROMPTS)).repeat_interleave(cfg.eval_samples)  # [E]
    traj = jagg.rollout(make_velocity_fn(model, labels), torch.randn(len(labels), 2, generator=g),
                        sigmas, cfg.noise_level, generator=g)
    return reward_fn(traj.sample, labels).mean().item(), traj, labels


def _to_px(p, size, lim=3.5):
    return ((p[0] + lim) / (2 * lim) * size, (lim - p[1]) / (2 * lim) * size)


def samples_picture(rows, size=180):
    """rows: {row name: (x [E, 2], labels [E])}; one panel per prompt, target as a red cross."""
    img = Image.new("RGB", (90 + size * len(PROMPTS), 24 + size * len(rows)), "white")
    d = ImageDraw.Draw(img)
    for j, name in enumerate(PROMPTS):
        d.text((90 + j * size + 6, 6), name, fill="black")
    for i, (row, (x, labels)) in enumerate(rows.items()):
        d.text((6, 24 + i * size + size // 2), row, fill="black")
        for j, (_, (modes, target)) in enumerate(PROMPTS.items()):
            ox, oy = 90 + j * size, 24 + i * size
            d.rectangle([ox, oy, ox + size - 1, oy + size - 1], outline=(200, 200, 200))
            for m in modes:
                mx, my = _to_px(m, size)
                d.ellipse([ox + mx - 8, oy + my - 8, ox + mx + 8, oy + my + 8], outline=(210, 210, 210))
            for p in x[labels == j].tolist():
                px, py = _to_px(p, size)
                d.ellipse([ox + px - 1, oy + py - 1, ox + px + 1, oy + py + 1], fill=COLORS.get(row, (0, 0, 0)))
            tx, ty = _to_px(target, size)
            d.line([ox + tx - 6, oy + ty - 6, ox + tx + 6, oy + ty + 6], fill="red", width=2)
            d.line([ox + tx - 6, oy + ty + 6, ox + tx + 6, oy + ty - 6], fill="red", width=2)
    return img


def trajectories_picture(traj, routed, bounds, scores, score_name, n=24, width=640, panel=220):
    """Each coordinate of n trajectories against the sampling step, from noise (left) to data
    (right), on bands that show how each segment trained: orange JAGG, blue exact."""
    T = traj.z.shape[0]
    img = Image.new("RGB", (width, 2 * panel + 76), "white")
    d = ImageDraw.Draw(img)
    z = torch.cat([traj.z, traj.z_next[-1:]])  # [T+1, B, 2]
    idx = torch.linspace(0, z.shape[1] - 1, n).long()  # spread over the prompts
    left, right = 40, width - 10
    small = font(12)

    def x_px(k):
        return left + k / T * (right - left)

    ends = [a for a, _ in bounds[1:]] + [T]  # a band runs to the next segment's first step
    for c in range(2):
        top = 10 + c * panel
        for (a, _), end, use_jagg, score in zip(bounds, ends, routed, scores):
            band = (253, 225, 195) if use_jagg else (205, 218, 245)
            d.rectangle([x_px(a), top, x_px(end), top + panel - 20], fill=band, outline="white")
            d.text((x_px(a) + 4, top + 2), f"{'JAGG' if use_jagg else 'exact'}\n{score:.3f}", fill="black", font=small)
        d.text((4, top + panel // 2 - 20), f"x{c + 1}", fill="black", font=small)
        for i in idx.tolist():
            pts = [(x_px(k), top + (panel - 20) / 2 - z[k, i, c].item() / 8 * (panel - 20)) for k in range(T + 1)]
            d.line(pts, fill=(60, 60, 60), width=1)
    d.text((left, 2 * panel), "sampling step: noise (left) -> data (right); bands: segments, labelled with", fill="black",
           font=small)
    d.text((left, 2 * panel + 16), f"how they trained and their {score_name}. orange: JAGG (interpolated between "
           "its end steps);", fill="black", font=small)
    d.text((left, 2 * panel + 32), "blue: exact (one backward per step)", fill="black", font=small)
    return img


def probe_pictures(rows):
    """From the probe rows of a run: the measured cosine per segment position over training, a
    filled circle where that position was routed to JAGG in that step; and the velocity score
    against the measured cosine, one dot per segment and probe."""
    probes = [r for r in rows if "probe/grad_cosine" in r]
    positions = range(len(probes[0]["probe/grad_cosine"]))
    over_time = chart(
        {f"segment {j}": [(r["step"], r["probe/grad_cosine"][j]) for r in probes] for j in positions},
        "probe: gradient cosine, JAGG vs exact, per segment (filled: routed to JAGG)", "GRPO step",
        "cosine", marks={f"segment {j}": [(r["step"], r["probe/grad_cosine"][j], r["routing/routed"][j]) for r in probes]
                         for j in positions})
    scatter = chart(
        {f"segment {j}": [(r["probe/velocity_score"][j], r["probe/grad_cosine"][j]) for r in probes] for j in positions},
        "does the free velocity score predict the measured cosine?", "velocity linearity score (free, from the rollout)",
        "measured gradient cosine", lines=False)
    return over_time, scatter


# =====================================================================================
# GRPO training: the whole loop in one place
# =====================================================================================


def train(cfg, method, base, rank, world):
    """Fine-tune a copy of base with GRPO by method ('exact' or 'jagg'); returns (summary, rows, extras)."""
    torch.manual_seed(cfg.seed)
    model = copy.deepcopy(base)
    ref = copy.deepcopy(base).requires_grad_(False) if cfg.beta > 0 else None
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    no_sync = net.no_sync if world > 1 else contextlib.nullcontext
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    # Cosine decay to zero: the policy settles at the end instead of jittering around the plateau,
    # so the final reward measures what a method learned, not where the last update happened to land.
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: 0.5 * (1 + math.cos(math.pi * i / (cfg.steps * cfg.minibatches))) if cfg.cosine_lr else 1.0)
    sigmas = jagg.sigma_schedule(cfg.num_steps, cfg.shift)  # [T+1]
    # The contract, checked once on every prompt (its own noise: the run's random streams are untouched).
    jagg_options.check_velocity_fn(make_velocity_fn(model, torch.arange(len(PROMPTS))),
                                   torch.randn(len(PROMPTS), 2, generator=torch.Generator().manual_seed(0)), sigmas)
    loss_cfg = jagg.LossConfig(noise_level=cfg.noise_level, clip_range=cfg.clip_range, beta=cfg.beta)
    opts = cfg.jagg_options(method)  # exact: every window exact (jagg_frac 0)
    n_train = trained_steps(cfg)  # the first steps of each rollout, in order
    jagg_frac = opts.jagg_frac
    # The probe routes (counted as training) only where it decides something; else it is a diagnostic.
    probe_routes = probe_counts_as_training(method, cfg.route)
    # Each rank draws its own rollouts (groups stay on one rank, so advantages are local).
    g = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    labels = torch.arange(len(PROMPTS)).repeat_interleave(cfg.group_size)  # [B]
    B = len(labels)

    def ref_fn(idx):
        return make_velocity_fn(ref, labels[idx]) if ref is not None else None

    initial_reward, initial_traj, initial_labels = evaluate(model, cfg, sigmas, seed=12345)
    rows, curve = [], [(0, initial_reward)]
    probe_avg, routed_count, opt_steps = None, None, 0
    t_start = time.perf_counter()
    eval_seconds = probe_seconds = 0.0
    bar = tqdm(range(1, cfg.steps + 1), desc=f"GRPO {method}", disable=rank != 0, dynamic_ncols=True)
    for it in bar:
        row = {"step": it, "method": method}
        # --- rollouts, rewards, advantages
        with torch.no_grad():
            traj = jagg.rollout(make_velocity_fn(model, labels), torch.randn(B, 2, generator=g), sigmas,
                                cfg.noise_level, generator=g)
        rewards = reward_fn(traj.sample, labels)  # [B]
        adv = jagg.group_advantages(rewards, labels, clip=cfg.adv_clip)  # [B]
        perm = torch.randperm(B, generator=g)
        # --- the fidelity probe, on a few samples of this batch before training on it: the cosine
        # of the mode's gradient to the exact one per segment (averaged over ranks, so all route alike)
        if cfg.probe_every and (it % cfg.probe_every == 0 or it == 1):
            t0 = time.perf_counter()
            idx = perm[: cfg.probe_batch]
            sub = traj.subset(idx).first_steps(n_train)
            probe = jagg_options.probe_segments(lambda i: (make_velocity_fn(model, labels[idx[i]]), ref_fn(idx[i])),
                                                model.parameters(), sub, adv[idx], loss_cfg, cfg.jagg_options(),
                                                train_batch=B // cfg.minibatches * world)
            row["probe/grad_cosine"] = mean_over_ranks(probe["cosine"])
            for key in ("error_to_noise", "error", "noise"):  # the ratio, and its two parts for averages over probes
                row[f"probe/{key}"] = mean_over_ranks(probe[key])
            row["probe/velocity_score"] = [jagg.linearity_score(sub.v[a:b], sub.t[a:b])
                                           for a, b in jagg_options.segment_bounds(n_train, cfg.window, cfg.anchors)]
            probe_avg = jagg_options.probe_average(probe_avg, row["probe/grad_cosine"], cfg.probe_decay)
            row["time/probe_seconds"] = time.perf_counter() - t0
            probe_seconds += row["time/probe_seconds"]
            if not probe_routes:
                eval_seconds += row["time/probe_seconds"]
        # --- optimizer steps on minibatches of the rollouts
        step_stats = []
        for idx in perm.chunk(cfg.minibatches):
            stats, routed = jagg_options.train_step(
                make_velocity_fn(net, labels[idx]), opt, traj.subset(idx).first_steps(n_train), adv[idx], loss_cfg,
                opts, ref_velocity_fn=ref_fn(idx), max_grad_norm=cfg.max_grad_norm, no_sync=no_sync,
                probe_cosines=probe_avg, step=opt_steps + 1)
            step_stats.append(stats)
            routed_count = [c + r for c, r in zip(routed_count or [0] * len(routed), routed)]
            opt_steps += 1
            sched.step()
        row.update(step_metrics(step_stats))
        row["rollout/reward_mean"] = all_gather_cat(rewards).mean().item()
        row["routing/window_scores"] = step_stats[0]["window_scores"]
        row["routing/routed"] = routed  # the batch's last optimizer step
        # --- evaluation (not timed as training)
        t0 = time.perf_counter()
        if it % cfg.eval_every == 0 or it == cfg.steps:  # always after the last step: the final reward
            row["eval/reward"], final_traj, final_labels = evaluate(model, cfg, sigmas, seed=12345)
            curve.append((it, row["eval/reward"]))
        eval_seconds += time.perf_counter() - t0
        rows.append(row)
        bar.set_postfix(reward=f"{row['rollout/reward_mean']:.3f}", clipfrac=f"{row['train/clipfrac']:.3f}",
                        routed=f"{row['train/routed_frac']:.2f}", bwd=f"{row['time/backward_seconds']:.2f}s",
                        **({"skipped": row["train/skipped_steps"]} if row["train/skipped_steps"] else {}))
    train_seconds = time.perf_counter() - t_start - eval_seconds

    final_reward = rows[-1]["eval/reward"]
    # Every (probe, segment) pair, by how that step routed the segment: does JAGG take the faithful ones?
    pairs = [(c, r["routing/routed"][j]) for r in rows if "probe/grad_cosine" in r for j, c in enumerate(r["probe/grad_cosine"])]

    def mean_cosine(routed):
        cs = [c for c, r in pairs if r == routed]
        return sum(cs) / len(cs) if cs else None

    summary = {
        "method": method,
        "mode": mode_name(method, cfg.anchors, cfg.interior),
        "anchors": cfg.anchors,
        "interior": cfg.interior,
        "route": cfg.route,
        "weights": cfg.weights,
        "initial_reward": initial_reward,
        "final_reward": final_reward,
        "reward_gain": final_reward - initial_reward,
        "backward_seconds": sum(r["time/backward_seconds"] for r in rows),
        "grad_seconds": sum(r["time/grad_seconds"] for r in rows),
        # rollouts and optimizer steps (and the probe where it routes); not evaluation
        "train_seconds": train_seconds,
        "probe_seconds": probe_seconds,
        "grad_steps": sum(r["train/grad_rows"] for r in rows),  # network rows with grad (the name summary.json had)
        "skipped_steps": sum(r["train/skipped_steps"] for r in rows),
        "window": cfg.window,
        "jagg_frac": jagg_frac,
        # per segment position: the mean measured cosine, and how often JAGG took it
        "probe_cosine_by_position": probe_cosine_by_position(rows),
        "probe_error_to_noise_by_position": probe_error_to_noise_by_position(rows),
        "probe_error_to_noise_stderr_by_position": probe_error_to_noise_stderr_by_position(rows),
        "routed_frac_by_position": [c / opt_steps for c in routed_count],
        "cosine_routed": mean_cosine(True),  # mean probe cosine of the segments JAGG took in that step
        "cosine_kept_exact": mean_cosine(False),
        "world_size": world,
        # Each rank trained on its own rollouts: equal checksums show DDP kept the weights in sync.
        "param_checksums": param_checksums(model.parameters()),
    }
    extras = {"curve": curve, "initial": (initial_traj, initial_labels), "final": (final_traj, final_labels),
              "routed": routed, "route_scores": probe_avg if probe_routes and probe_avg else step_stats[-1]["window_scores"]}
    return summary, rows, extras


def benchmark(cfg, base):
    """Exact vs JAGG at W = 4 and 8: one window's gradient (the backward JAGG shrinks), then one
    whole trajectory's in every training mode, with a rollout (what a GRPO step costs); interleaved."""
    torch.manual_seed(cfg.seed)
    results = {}
    sigmas = jagg.sigma_schedule(cfg.num_steps, cfg.shift)
    labels = torch.arange(cfg.bench_batch) % len(PROMPTS)  # [B]
    velocity_fn = make_velocity_fn(base, labels)
    ref = copy.deepcopy(base).requires_grad_(False)
    noise = torch.randn(cfg.bench_batch, 2)  # [B, 2]
    with torch.no_grad():
        traj = jagg.rollout(velocity_fn, noise, sigmas, cfg.noise_level)
    adv = torch.randn(cfg.bench_batch)  # [B]
    loss_cfg = jagg.LossConfig(noise_level=cfg.noise_level, clip_range=cfg.clip_range, beta=cfg.beta)
    print(f"toy DiT, {sum(p.numel() for p in base.parameters())} parameters, B = {cfg.bench_batch}, T = {cfg.num_steps}, "
          f"beta {cfg.beta}, {torch.get_num_threads()} threads, medians of {cfg.bench_repeats} interleaved repeats")
    for W in (4, 8):
        step_loss = jagg.make_step_loss(traj, adv, 0, W, loss_cfg)
        t = benchmark_window(velocity_fn, base.parameters(), traj.z[:W], traj.t[:W], step_loss,
                                  repeats=cfg.bench_repeats)
        print(f"\n-- one window's gradient (W = {W})")
        results[W] = {"window": W, "exact": t["exact"], "jagg": t["jagg"], **report_benchmark(t, W, 1000, "ms")}
        t = benchmark_trajectory(velocity_fn, base.parameters(), traj.first_steps(trained_steps(cfg)), adv, loss_cfg, W,
                                      make_velocity_fn(ref, labels) if cfg.beta > 0 else None,
                                      rollout_fn=lambda: jagg.rollout(velocity_fn, noise, sigmas, cfg.noise_level),
                                      modes=bench_modes(cfg.max_graph_rows), repeats=cfg.bench_repeats)
        print(f"\n-- one whole trajectory's gradient (T = {cfg.num_steps}, W = {W}), every mode")
        results[W].update(report_trajectory(t, W, 1000, "ms"))
    return results


def main(argv=None):
    cfg = parse_config(Config, argv, description=__doc__.split("\n")[0])
    cfg.validate()
    rank, world = init_distributed()
    if rank == 0:
        print("config: " + json.dumps(dataclasses.asdict(cfg)))
    base, base_path = base_model(cfg, rank)

    if cfg.benchmark:
        results = benchmark(cfg, base)
        if rank == 0:
            write_json(os.path.join(cfg.out, "benchmark.json"), {"config": dataclasses.asdict(cfg), "results": results})
            save_png(os.path.join(cfg.out, "benchmark.png"), training_step_bars(
                results, 1000, "ms", f"toy DiT: one GRPO training step (T = {cfg.num_steps}, B = {cfg.bench_batch}), "
                                     "where the time goes"))
        return results

    methods = ["exact", "jagg"] if cfg.method == "compare" else [cfg.method]
    summaries, curves, finals, all_rows = {}, {}, {}, {}
    for method in methods:
        summary, rows, extras = train(cfg, method, base, rank, world)
        summaries[method], curves[method], finals[method], all_rows[method] = summary, extras["curve"], extras, rows
        if rank == 0:
            folder = cfg.out if len(methods) == 1 else os.path.join(cfg.out, method)
            write_jsonl(os.path.join(folder, "metrics.jsonl"), rows)
            write_json(os.path.join(folder, "summary.json"), {**summary, "config": dataclasses.asdict(cfg), "base_ckpt": base_path})
            print(f"[{summary['mode']}] reward {summary['initial_reward']:.3f} -> {summary['final_reward']:.3f}, "
                  f"backward {summary['backward_seconds']:.2f}s, window gradients {summary['grad_seconds']:.2f}s, "
                  f"train {summary['train_seconds']:.1f}s, network rows with grad {summary['grad_steps']}"
                  + (f", {summary['skipped_steps']} steps skipped (non-finite)" if summary["skipped_steps"] else ""))
    if rank != 0:
        return summaries

    # --- pictures
    base_traj, base_labels = extras["initial"]  # the base model's evaluation, as every run starts
    picture_rows = {"base": (base_traj.sample, base_labels)}
    picture_rows.update({m: (finals[m]["final"][0].sample, finals[m]["final"][1]) for m in methods})
    save_png(os.path.join(cfg.out, "samples.png"), samples_picture(picture_rows))
    save_png(os.path.join(cfg.out, "reward_curves.png"),
             chart(curves, "evaluation reward during GRPO", "GRPO step", "mean reward (in (0, 1])"))
    last = finals[methods[-1]]
    score_name = "averaged probe cosine" if methods[-1] == "jagg" and cfg.route == "probe" else "velocity score"
    save_png(os.path.join(cfg.out, "trajectories.png"), trajectories_picture(
        last["final"][0], last["routed"], jagg_options.segment_bounds(trained_steps(cfg), cfg.window, cfg.anchors),
        last["route_scores"], score_name))
    written = ["summary.json", "metrics.jsonl", "samples.png", "reward_curves.png", "trajectories.png"]
    if cfg.probe_every:
        over_time, scatter = probe_pictures(all_rows[methods[-1]])
        save_png(os.path.join(cfg.out, "probe.png"), over_time)
        save_png(os.path.join(cfg.out, "score_vs_cosine.png"), scatter)
        written += ["probe.png", "score_vs_cosine.png"]

    if cfg.method == "compare":
        ex, jg = summaries["exact"], summaries["jagg"]
        comparison = compare_summary(ex, jg, dataclasses.asdict(cfg))
        write_json(os.path.join(cfg.out, "summary.json"), comparison)
        print(f"JAGG ({jg['mode']}) kept {100 * comparison['reward_gain_ratio']:.1f}% of exact GRPO's reward gain; "
              f"backward {comparison['backward_speedup']:.2f}x faster, window gradients {comparison['grad_speedup']:.2f}x, "
              f"training (rollouts included) {comparison['train_speedup']:.2f}x, "
              f"{comparison['grad_steps_ratio']:.2f}x fewer network rows with grad")
        if jg["probe_cosine_by_position"]:
            print(probe_report(jg) + "\nrouted to JAGG per segment: " + " ".join(f"{f:.2f}" for f in jg["routed_frac_by_position"]))
    print(f"wrote {cfg.out}/: " + ", ".join(written))
    return summaries


if __name__ == "__main__":
    main(sys.argv[1:])
    finish_distributed()
