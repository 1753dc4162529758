"""GRPO on a toy 2-D flow model, exact vs JAGG: the CPU demo, one file that reads top to bottom.

    python train_toy.py                                  # exact GRPO, then the paper's JAGG (a few minutes on a CPU)
    python train_toy.py --method jagg --anchors shared --interior rollout   # JAGG's options beyond the paper
    python train_toy.py --method jagg --jagg-frac 0.5 --route probe --probe-every 5   # route by measured fidelity
    torchrun --nproc_per_node=2 train_toy.py --method jagg   # DistributedDataParallel (gloo); --resume: go on, bit for bit

A toy DiT (toy_dit.py; you need not read it), pretrained on 4 "prompts" (mixtures of Gaussians in 2-D), is tuned by
GRPO to put each prompt's samples on ONE of its modes. An epoch: one rollout of the batch, then --minibatches optimizer
steps. --out gets config.json, samples.png, reward.png; per method metrics.jsonl, summary.json, checkpoint.pt.
"""

import argparse
import contextlib
import copy
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields, replace

import torch
import torch.distributed as dist

import jagg
import jagg_options
import toy_dit
from toy_dit import PROMPTS

# === Flags: every hyperparameter with its --help and its range (declared once: a test, a text), checked before any work ===
AT_LEAST_0, AT_LEAST_1, AT_LEAST_2 = (lambda v: v >= 0, ">= 0"), (lambda v: v >= 1, ">= 1"), (lambda v: v >= 2, ">= 2")
POSITIVE, FRACTION = (lambda v: v > 0, "> 0"), (lambda v: 0 <= v <= 1, "in [0, 1]")
OPEN_UNIT, UNIT = (lambda v: 0 < v < 1, "in (0, 1)"), (lambda v: 0 < v <= 1, "in (0, 1]")
DECAY, COSINE = (lambda v: 0 <= v < 1, "in [0, 1)"), (lambda v: -1 <= v <= 1, "in [-1, 1]")
DRIFT = (lambda v: v >= 0 or v == -1, ">= 0 or -1")  # max_drift's -1: the guard off


def flag(default, help, valid=None, choices=None):
    return field(default=default, metadata={"help": help, "valid": valid, "choices": choices})


@dataclass
class Config:
    method: str = flag("compare", "exact, jagg, or compare (both, same base and seed)", None, ("exact", "jagg", "compare"))
    out: str = flag("runs/toy", "output folder")
    seed: int = flag(0, "random seed (base model, rollouts; each rank adds its rank to the rollouts')", AT_LEAST_0)
    resume: bool = flag(False, "continue the run in --out from its checkpoints (with its flags), bit for bit")
    overwrite: bool = flag(False, "start afresh in an --out that holds a run, deleting that run's files")
    # --- GRPO
    epochs: int = flag(80, "epochs: each one rollout of the batch, then --minibatches optimizer steps", AT_LEAST_1)
    num_steps: int = flag(16, "T, sampling steps of a rollout", AT_LEAST_2)
    shift: float = flag(3.0, "sigma schedule shift (SD3's: > 1 spends more steps at high noise)", POSITIVE)
    noise_level: float = flag(0.7, "a, the SDE's noise level: std_t = a sqrt(t / (1 - t)) (Flow-GRPO's)", UNIT)
    group_size: int = flag(16, "G, samples per prompt (the batch: G x 4 prompts)", AT_LEAST_2)
    minibatches: int = flag(4, "optimizer steps per epoch (the batch split into this many)", AT_LEAST_1)
    lr: float = flag(1e-3, "AdamW learning rate, decayed to 0 along a cosine over the run", POSITIVE)
    clip_range: float = flag(0.2, "GRPO's ratio clip range", OPEN_UNIT)
    beta: float = flag(0.0, "KL weight to the frozen base model (0: no reference forward)", AT_LEAST_0)
    adv_clip: float = flag(5.0, "advantages are clipped to [-adv_clip, adv_clip]", POSITIVE)
    max_grad_norm: float = flag(1.0, "gradient clipping norm", POSITIVE)
    eval_every: int = flag(10, "evaluate (fixed noise) and print a line every N epochs and at the last", AT_LEAST_1)
    eval_samples: int = flag(512, "evaluation samples per prompt", AT_LEAST_1)
    # --- JAGG: jagg_options.JaggOptions' fields; the defaults are the paper's
    window: int = flag(4, "W, sampling steps per window (or per segment between shared anchors)", AT_LEAST_2)
    jagg_frac: float = flag(1.0, "share of windows JAGG takes (the best by --route); the rest exact", FRACTION)
    anchors: str = flag("window", "the paper's disjoint windows, or shared end steps", None, jagg_options.ANCHOR_MODES)
    interior: str = flag("forward", "between anchors: no-graph forwards (the paper's) or the rollout's velocities", None,
                         jagg_options.INTERIOR_MODES)
    weights: str = flag("time", "interpolation by t (the paper's alpha_k) or by step index", None, jagg_options.WEIGHTS)
    max_graph_rows: int = flag(0, "at most this many anchor rows in a graph at once (same gradient); 0: no bound", AT_LEAST_0)
    max_drift: float = flag(0.5, "--interior rollout: forward interiors past this drift (share of the clip); -1: never", DRIFT)
    route: str = flag("velocity", "which windows JAGG takes: by linearity (free) or by the probe", None, jagg_options.ROUTES)
    min_cosine: float = flag(0.0, "--route probe: a window whose averaged cosine is below this stays exact", COSINE)
    probe_every: int = flag(0, "every N epochs (and the first), measure JAGG's gradient against exact (0: off)", AT_LEAST_0)
    probe_batch: int = flag(8, "samples the probe measures on (per rank)", AT_LEAST_2)
    probe_decay: float = flag(0.5, "--route probe ranks windows by an average of probes: the old one's weight", DECAY)
    base_ckpt: str = flag("", "pretrained toy DiT to start from; empty: pretrain one (cached in runs/cache)")
    pretrain_steps: int = flag(2000, "flow-matching steps to pretrain the base model", AT_LEAST_1)


def parse(argv):
    """Config from the command line; a bad value ends the run with one line that names it, before any work."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in fields(Config):
        help, valid, choices = f.metadata.values()
        kind = {"action": argparse.BooleanOptionalAction} if f.type is bool else {"type": f.type, "choices": choices}
        parser.add_argument("--" + f.name.replace("_", "-"), default=f.default, **kind,
                            help=help + (f" [{valid[1]}]" if valid else ""))
    cfg = Config(**vars(parser.parse_args(argv)))
    B, rows = 4 * cfg.group_size, jagg_options.min_graph_rows(cfg.interior)
    ranges = [("--" + f.name.replace("_", "-"), getattr(cfg, f.name), *f.metadata["valid"])
              for f in fields(cfg) if f.metadata["valid"]]
    checks = [(math.isfinite(v) and ok(v), f"{name} must be {text}, got {v}") for name, v, ok, text in ranges]
    checks += [  # (ok, the line that says what is wrong and what to do)
        (cfg.window <= cfg.num_steps, f"--window {cfg.window} is longer than --num-steps {cfg.num_steps}; shorten it"),
        (cfg.route != "probe" or cfg.probe_every >= 1, "--route probe routes by the probe: give it --probe-every N >= 1"),
        (cfg.max_graph_rows == 0 or cfg.max_graph_rows >= rows,
         f"--max-graph-rows {cfg.max_graph_rows} is below the {rows} --interior {cfg.interior} needs; use 0 or >= {rows}"),
        (B % cfg.minibatches == 0, f"--minibatches {cfg.minibatches} must divide the batch of {B} (4 x --group-size)"),
        (not cfg.base_ckpt or os.path.isfile(cfg.base_ckpt), f"--base-ckpt {cfg.base_ckpt!r} does not exist; omit it"),
        (not (cfg.resume and cfg.overwrite), "--resume continues a run, --overwrite deletes it: give one")]
    try:  # --resume goes on as the run started: every flag as it was (--epochs sets the learning rate's cosine)
        saved = json.load(open(os.path.join(cfg.out, "config.json"))) if cfg.resume else {}
    except (OSError, ValueError) as e:
        saved, checks = {}, checks + [
            (False, f"--resume: {cfg.out} holds no run ({type(e).__name__} reading its config.json); drop --resume")]
    checks += [(False, f"--resume: {d}; give the run's") for d in jagg_options.changed_flags(saved, asdict(cfg),
                                                                                            ("resume", "overwrite"))]
    if any(not ok for ok, _ in checks):
        raise SystemExit("error: " + next(message for ok, message in checks if not ok))
    return cfg


# === Files and ranks ===
def save(path, obj):  # whole or not at all (a kill leaves the old file or the new): text, a picture, or tensors and lists
    jagg_options.atomic_write(path, (lambda f: f.write(obj.encode())) if isinstance(obj, str) else (lambda f: obj.save(
        f, format="PNG")) if path.endswith(".png") else (lambda f: torch.save(obj, f)), "wb")  # torch.load(weights_only)


def all_ranks(obj):  # [rank 0's obj, rank 1's, ...] on every rank; [obj] on one process
    out = [obj] * (dist.get_world_size() if dist.is_initialized() else 1)
    dist.all_gather_object(out, obj) if dist.is_initialized() else None
    return out


# === The task: the reward prefers ONE mode of each prompt, which the base model, spread over all, misses ===
TARGETS = torch.tensor([(1.414, 1.414), (2.0, -2.0), (-2.4, -2.4), (-2.0, 2.0)])  # per prompt: ring, grid, diagonal, corners


def reward_fn(x, labels):
    """r(x, c) = exp(-|x - target_c|^2 / 2): in (0, 1], 1 at the prompt's target mode. x [B, 2] -> [B]."""
    return torch.exp(-((x - TARGETS[labels]) ** 2).sum(-1) / 2)  # [B]


def make_velocity_fn(model, labels):
    """jagg.py's contract: velocity_fn(z [S, B, 2], t [S, B]) -> v [S, B, 2]; the labels [B] repeat over S."""
    def velocity_fn(z, t):
        S, B = t.shape
        return model(z.reshape(S * B, 2), t.reshape(S * B), labels.repeat(S)).reshape(S, B, 2)
    return velocity_fn


def base_model(cfg, rank):
    """The pretrained toy DiT: --base-ckpt, or pretrained once (by rank 0) and cached. Returns (model, path)."""
    path = cfg.base_ckpt or f"runs/cache/toy_dit_h64_d3_s{cfg.pretrain_steps}_seed{cfg.seed}.pt"
    if rank == 0 and not os.path.exists(path):
        print(f"pretraining the base toy DiT ({cfg.pretrain_steps} flow-matching steps) into {path}", flush=True)
        toy_dit.pretrain(path, cfg.pretrain_steps, cfg.seed)
    if dist.is_initialized():
        dist.barrier()  # the other ranks load what rank 0 wrote
    try:
        return toy_dit.load(path), path
    except Exception as e:
        raise SystemExit(f"error: {path} is not a toy DiT checkpoint ({type(e).__name__}); delete it or pass another") from None


@torch.no_grad()
def evaluate(model, cfg):
    """Mean reward of --eval-samples per prompt from fixed noise; returns (reward, (samples [E, 2], labels [E]))."""
    g = torch.Generator().manual_seed(12345)
    labels = torch.arange(len(PROMPTS)).repeat_interleave(cfg.eval_samples)  # [E]
    x = jagg.rollout(make_velocity_fn(model, labels), torch.randn(len(labels), 2, generator=g),
                     jagg.sigma_schedule(cfg.num_steps, cfg.shift), cfg.noise_level, generator=g).sample  # [E, 2]
    return reward_fn(x, labels).mean().item(), (x, labels)


# === GRPO: the whole loop in one place ===
def train(cfg, method, base, initial_reward, folder, rank, world, stop=()):
    """Fine-tune a copy of base by GRPO, exact or JAGG, checkpointed each epoch; a signal in stop ends it after the
    epoch. Returns (summary, samples, curve)."""
    model = copy.deepcopy(base)
    ref = copy.deepcopy(base).requires_grad_(False) if cfg.beta > 0 else None  # the KL's frozen reference
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    no_sync = net.no_sync if world > 1 else contextlib.nullcontext  # train_step averages the gradients itself
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    sigmas = jagg.sigma_schedule(cfg.num_steps, cfg.shift)  # [T+1]
    loss_cfg = jagg.LossConfig(noise_level=cfg.noise_level, clip_range=cfg.clip_range, beta=cfg.beta)
    opts = jagg_options.JaggOptions(  # what the probe measures; exact GRPO trains every window exactly (jagg_frac 0)
        **{k: getattr(cfg, k) for k in ("window", "jagg_frac", "anchors", "interior", "weights", "route", "min_cosine")},
        max_graph_rows=cfg.max_graph_rows or None, max_drift=None if cfg.max_drift < 0 else cfg.max_drift)
    train_opts = opts if method == "jagg" else replace(opts, jagg_frac=0.0)
    labels = torch.arange(len(PROMPTS)).repeat_interleave(cfg.group_size)  # [B]: a group of G per prompt
    B, g = len(labels), torch.Generator().manual_seed(cfg.seed * 1000 + rank)  # each rank draws its own rollouts
    ref_fn = lambda idx: make_velocity_fn(ref, labels[idx]) if ref is not None else None  # noqa: E731
    rows, probe_avg, path = [], None, os.path.join(folder, "checkpoint.pt")
    if cfg.resume and os.path.exists(path):  # go on where it stopped: weights, optimizer, this rank's rollouts, rows
        try:  # a cut or foreign file: one line
            ckpt = jagg_options.read_checkpoint(path, ("model", "optimizer", "rng", "rows", "probe_average"), "train_toy.py")
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        model.load_state_dict(ckpt["model"]), opt.load_state_dict(ckpt["optimizer"]), g.set_state(ckpt["rng"][rank])
        rows, probe_avg = ckpt["rows"], ckpt["probe_average"]
    for epoch in range(len(rows) + 1, cfg.epochs + 1):
        row, start = {"epoch": epoch, "method": method}, time.perf_counter()
        # 1. Rollout: B trajectories of T SDE steps, with their velocities and log-probabilities, no graph
        noise = torch.randn(B, 2, generator=g)  # [B, 2]
        traj = jagg.rollout(make_velocity_fn(model, labels), noise, sigmas, cfg.noise_level, generator=g)  # T steps of B
        # 2. Rewards, and advantages relative to each prompt's group
        rewards = reward_fn(traj.sample, labels)  # [B]
        adv = jagg.group_advantages(rewards, labels, clip=cfg.adv_clip)  # [B]
        perm = torch.randperm(B, generator=g)  # the minibatches, and the probe's samples
        # 3. The probe (optional): JAGG's gradient against exact per window, on a few samples, before training
        if cfg.probe_every and (epoch % cfg.probe_every == 0 or epoch == 1):
            t0, idx = time.perf_counter(), perm[: cfg.probe_batch]
            probe = jagg_options.probe_segments(lambda i: (make_velocity_fn(model, labels[idx[i]]), ref_fn(idx[i])),
                                                model.parameters(), traj.subset(idx), adv[idx], loss_cfg, opts,
                                                train_batch=B // cfg.minibatches * world)
            row.update({f"probe/{k}": [sum(c) / world for c in zip(*all_ranks(v))] for k, v in probe.items()})
            probe_avg = jagg_options.probe_average(probe_avg, row["probe/cosine"], cfg.probe_decay)  # all ranks alike
            row["time/probe_seconds"] = time.perf_counter() - t0
            start += 0.0 if method == "jagg" and cfg.route == "probe" else row["time/probe_seconds"]  # training only if it routes
        # 4. Optimizer steps on minibatches: the JAGG call (exact GRPO's too, every window exact)
        stats, routed = [], []
        for idx in perm.chunk(cfg.minibatches):
            step = (epoch - 1) * cfg.minibatches + len(stats)  # optimizer steps so far
            for group in opt.param_groups:  # a cosine to 0: the final reward is what was learned, not a last jitter
                group["lr"] = cfg.lr * (0.5 * (1 + math.cos(math.pi * step / (cfg.epochs * cfg.minibatches))))
            s, r = jagg_options.train_step(make_velocity_fn(net, labels[idx]), opt, traj.subset(idx), adv[idx], loss_cfg,
                                           train_opts, ref_velocity_fn=ref_fn(idx), max_grad_norm=cfg.max_grad_norm,
                                           no_sync=no_sync, probe_cosines=probe_avg, step=step + 1)
            stats.append(s), routed.append(r)
        # 5. Logging: the means of the steps' diagnostics, the sums of their counts and times
        row["time/train_seconds"] = time.perf_counter() - start  # the rollout and the optimizer steps
        row["rollout/reward_mean"] = sum(all_ranks(rewards.mean().item())) / world
        row.update({**jagg_options.epoch_stats(stats), "routing/window_scores": stats[0]["window_scores"],
                    "routing/routed": [sum(r) / len(routed) for r in zip(*routed)]})  # per window: share of the steps
        if epoch % cfg.eval_every == 0 or epoch == cfg.epochs:
            row["eval/reward"], _ = evaluate(model, cfg)
            if rank == 0:
                print(f"[{method}] epoch {epoch:3d}/{cfg.epochs}  reward {row['rollout/reward_mean']:.3f}  "
                      f"eval {row['eval/reward']:.3f}  loss {row['train/loss']:+.4f}  clipfrac {row['train/clipfrac']:.3f}  "
                      f"approx_kl {row['train/approx_kl']:.5f}  routed {row['train/routed_frac']:.2f}  "
                      f"backward {row['time/backward_seconds']:.2f}s", flush=True)
        rows.append(row)
        rng, stops = zip(*all_ranks((g.get_state(), list(stop))))  # every rank's generator and signals received
        if rank == 0:  # the checkpoint holds the rows too: a kill between the two files loses nothing
            save(path, {"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": rng, "rows": rows,
                        "probe_average": probe_avg})
            save(os.path.join(folder, "metrics.jsonl"), "".join(jagg_options.json_text(r) + "\n" for r in rows))
        if any(stops):  # Ctrl-C or SIGTERM on any rank: every rank stops here, after the checkpoint
            raise SystemExit(f"error: stopped by {sum(stops, [])[0]} after epoch {epoch} of {method}, checkpointed: go on "
                             "with the same command and --resume")

    (final_reward, samples), total = evaluate(model, cfg), lambda key: sum(r.get(key, 0) for r in rows)  # noqa: E731
    probe = jagg_options.pool_probes([{k: r[f"probe/{k}"] for k in ("cosine", "error", "noise")} for r in rows
                                      if "probe/cosine" in r])  # per window: mean cosine, error / noise, its stderr
    s = {"method": method, "mode": opts.mode_name(method), "initial_reward": initial_reward, "final_reward": final_reward,
         "reward_gain": final_reward - initial_reward, "probe": probe, "world_size": world,  # checksums: each rank's
         **{k: total(f"time/{k}") for k in ("train_seconds", "backward_seconds", "probe_seconds")},  # weights, summed:
         **{k: total(f"train/{k}") for k in ("grad_rows", "skipped_steps")},  # equal when DDP kept the ranks in sync
         "routed_frac_by_position": [sum(f) / len(rows) for f in zip(*(r["routing/routed"] for r in rows))],
         "param_checksums": all_ranks(sum(p.detach().double().sum().item() for p in model.parameters()))}
    if rank == 0:
        jagg_options.write_json(os.path.join(folder, "summary.json"), {**s, "config": asdict(cfg)})
        print(f"[{method}] reward {initial_reward:.3f} -> {final_reward:.3f} ({s['reward_gain']:+.3f}), backward "
              f"{s['backward_seconds']:.1f} s, training {s['train_seconds']:.1f} s"
              + (f", {s['skipped_steps']} optimizer steps skipped (non-finite)" if s["skipped_steps"] else ""))
        for i, (c, e, se) in enumerate(zip(*[probe[k] for k in ("cosine", "error_to_noise", "stderr")]) if probe else []):
            print(f"[{method}] probe, window {i}: cosine {c:.2f}, error/noise {e:.2f}" + (f" ±{1.96 * se:.2f}" if se else ""))
    return s, samples, [(0, initial_reward)] + [(r["epoch"], r["eval/reward"]) for r in rows if "eval/reward" in r]


def main(argv=None):
    cfg = parse(argv)
    try:  # --out is this run's alone: rank 0 locks it until main returns, and refuses a folder holding another run
        lock = int(os.environ.get("RANK", 0)) == 0 and jagg_options.claim_folder(
            cfg.out, ("*.json*", "*.png", "*.pt", "*/*.json*", "*/*.pt"), cfg.resume, cfg.overwrite)  # a run's files
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    rank, world = jagg_options.init_distributed(backend="gloo")  # under torchrun: a rank per process; CPU tensors
    if rank == 0:  # the flags saved beside the results, before any work
        jagg_options.write_json(os.path.join(cfg.out, "config.json"), asdict(cfg))
        print("config: " + json.dumps(asdict(cfg)))
    base, _ = base_model(cfg, rank)
    initial_reward, base_samples = evaluate(base, cfg)
    summaries, samples, curves = {}, {"base": base_samples}, {}
    with jagg_options.stop_on_signals() as stop:  # Ctrl-C and SIGTERM end the run after an epoch, checkpointed
        for method in ["exact", "jagg"] if cfg.method == "compare" else [cfg.method]:
            folder = os.path.join(cfg.out, method) if cfg.method == "compare" else cfg.out
            summaries[method], samples[method], curves[method] = train(cfg, method, base, initial_reward, folder, rank,
                                                                       world, stop)
    if rank == 0:  # the pictures: each method's samples beside the base model's, and the reward curves
        save(os.path.join(cfg.out, "samples.png"), toy_dit.samples_picture(samples, TARGETS.tolist()))
        save(os.path.join(cfg.out, "reward.png"), toy_dit.curve_picture(curves))
    if rank == 0 and cfg.method == "compare":
        ex, jg = summaries["exact"], summaries["jagg"]
        ratios = {"reward_gain_ratio": jg["reward_gain"] / ex["reward_gain"] if ex["reward_gain"] else None, **{
            f"{k}_speedup": ex[f"{k}_seconds"] / jg[f"{k}_seconds"] for k in ("backward", "train")}}
        jagg_options.write_json(os.path.join(cfg.out, "summary.json"), {"method": "compare", "mode": jg["mode"], **ratios,
                                                                       "exact": ex, "jagg": jg, "config": asdict(cfg)})
        print(f"JAGG ({jg['mode']}) kept {100 * (ratios['reward_gain_ratio'] or 0):.0f} % of exact GRPO's reward gain; "
              f"{ex['grad_rows'] / jg['grad_rows']:.2f}x fewer rows with grad, backward {ratios['backward_speedup']:.1f}x "
              f"faster, training {ratios['train_speedup']:.1f}x (rollouts included)")
    lock and lock.close()  # the folder is free for the next run


if __name__ == "__main__":
    main()
    jagg_options.exit_distributed()  # a rank under torchrun leaves here, skipping a shutdown that can abort
