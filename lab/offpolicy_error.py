"""How far each JAGG mode's gradient is from exact's as training moves, in units of GRPO's own noise.

    python lab/offpolicy_error.py mini                      # the mini SD3 at lab/sd_runner.py --preset mini
    python lab/offpolicy_error.py toy --checkpoints 0 10 30 # the toy DiT of train_toy.py
    python lab/offpolicy_error.py report runs/offpolicy_mini.json   # the docs' markdown table of a run

Exact GRPO trains the model as the setting does (rollouts, then --inner-steps optimizer steps on
minibatches of each rollout). At each checkpoint epoch the tool draws --batches independent
rollout batches and, for each, follows exact GRPO's own optimizer steps on that one batch
(the whole batch per step, as an optimizer step after a rollout sees it: the 1st on-policy, the
2nd, 3rd, ... off-policy), and before every step computes the exact gradient g and every mode's
j on the same batch and parameters. It reports, per checkpoint, inner step and mode:

- rel_error |j - g| / |g| and cosine(j, g);
- error_to_noise |j - g|^2 over the batch's sampling noise, mean |g_a - g_b|^2 / 2 over pairs of
  the checkpoint's independent batches (gradient_signal.py's measure): 0.05 is as if the batch
  were about 5 % smaller, were the error unbiased;
- projection <j, g> / |g|^2 and norm_ratio |j| / |g|: whether JAGG's gradient is biased along
  exact's direction (shorter or longer), beside the cosine;
- for rollout interiors, vs_forward: |j - j_twin| / |j_twin| to the same anchors with forward
  interiors; on-policy (step 1) it is the KL reference's interpolated interiors alone (0 at beta 0);
- for rollout interiors, ratio_error: the mean over interior steps and samples of the error of
  the interior log-probability ratio, |log r(rollout rule) - log r(fresh forward)|, over the
  clip range (1: an error the size of the clip), and refreshed: the segments the drift guard
  sent to forward interiors; clipfrac is exact's.

Prints a table per checkpoint and writes all of it to --out (JSON). lab/reports/offpolicy.md reads it.
"""

import argparse
import copy
import dataclasses
import itertools
import os
import sys

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jagg  # noqa: E402
from beyond_paper import options, probe  # noqa: E402
import sd_runner  # noqa: E402
import grpo_step  # noqa: E402
from run_folder import write_json  # noqa: E402

# name -> JaggOptions fields; "guarded" is rollout interiors with the drift guard (the default),
# "unguarded" the rollout rule at any drift (max_drift None: the code before the guard).
MODES = {
    "paper": {},
    "rollout": {"interior": "rollout"},
    "rollout_unguarded": {"interior": "rollout", "max_drift": None},
    "shared": {"anchors": "shared"},
    "shared_rollout": {"anchors": "shared", "interior": "rollout"},
    "shared_rollout_unguarded": {"anchors": "shared", "interior": "rollout", "max_drift": None},
}

# each rollout mode's twin with forward interiors (listed before it in --modes' default order)
FORWARD_TWIN = {"rollout": "paper", "rollout_unguarded": "paper", "shared_rollout": "shared",
                "shared_rollout_unguarded": "shared"}


@dataclasses.dataclass
class Batch:
    traj: jagg.Trajectory
    adv: torch.Tensor  # [B]
    fns: object  # idx -> (velocity_fn, ref_velocity_fn) of the samples idx


MINI_PRESETS = ("mini", "mini-geneval")  # lab/presets.py's, which MiniTask can take


class MiniTask:
    """The mini SD3 at lab/presets.py mini (darkness: full fine-tuning, lr 3e-4, CFG 2.5, clip
    0.2, beta 0.04), or with args.preset "mini-geneval" (the GenEval-like reward, LoRA, global std)."""

    def __init__(self, args):
        import presets
        import sd_runner
        from base_batches import draw_groups

        self.sd_runner, self.draw_groups = sd_runner, draw_groups
        preset = getattr(args, "preset", "mini")
        cfg = presets.config(preset, "--seed", args.seed, "--resolution", args.resolution, model=args.model)
        self.pipe, self.model, self.cfg = presets.load(cfg, seed=args.seed)
        self.ref = copy.deepcopy(self.model).requires_grad_(False)
        self.prompts = sd_runner.read_prompts(self.cfg)
        self.reward_fn = lambda images, prompts: sd_runner.rewards_of(sd_runner.load_reward(cfg.reward), images, prompts)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.loss_cfg = jagg.LossConfig(noise_level=cfg.noise_level, clip_range=cfg.clip_range, beta=cfg.beta)
        self.lr, self.window, self.minibatch, self.group = cfg.lr, cfg.window, cfg.train_batch, cfg.group_size
        self.setting = f"lab/presets.py {preset} ({cfg.reward})"

    @property
    def sde_window(self):  # as ToyTask's: the SDE window's steps that draw's window_start places
        return self.cfg.sde_window

    @sde_window.setter
    def sde_window(self, steps):
        self.cfg.sde_window = steps

    def draw(self, n, generator, window_start=None):
        """n samples' rollouts (with window_start, an SDE window of self.cfg.sde_window steps there)."""
        ids, prompts, traj, cond, uncond, images = self.draw_groups(self.pipe, self.model, self.cfg, self.prompts,
                                                                    n // self.group, self.group, generator, window_start)
        adv = jagg.group_advantages(self.reward_fn(images, prompts), ids, global_std=self.cfg.global_std,
                                    clip=self.sd_runner.FIXED["adv_clip"])
        sd, cfg = self.sd_runner, self.cfg

        def fns(idx):
            c, u = tuple(x[idx] for x in cond), tuple(x[idx] for x in uncond)
            return (sd.make_velocity_fn(self.model, c, u, cfg.guidance_scale, False),
                    sd.make_velocity_fn(self.ref, c, u, cfg.guidance_scale, False))

        return Batch(traj, adv, fns)


class ToyTask:
    """train_toy.py's toy DiT and task at its defaults (lr 1e-3, clip 0.2, beta 0, T = 16)."""

    def __init__(self, args):
        import train_toy

        self.train_toy = train_toy
        cfg = train_toy.Args(seed=args.seed)
        self.model = train_toy.base_model(cfg)
        self.params = list(self.model.parameters())
        self.sigmas = jagg.sigma_schedule(cfg.num_steps, cfg.shift)
        self.loss_cfg = jagg.LossConfig(noise_level=cfg.noise_level, clip_range=cfg.clip_range, beta=cfg.beta)
        self.lr, self.window, self.minibatch = cfg.lr, cfg.window, None
        self.noise_level, self.setting, self.sde_window = cfg.noise_level, "train_toy.py defaults", 0

    def draw(self, n, generator, window_start=None):
        """n samples' rollouts (with window_start, an SDE window of self.sde_window steps there)."""
        tt = self.train_toy
        labels = torch.arange(len(tt.PROMPTS)).repeat_interleave(n // len(tt.PROMPTS))  # [B]
        fn, noise = tt.make_velocity_fn(self.model, labels), torch.randn(len(labels), 2, generator=generator)
        if window_start is None:
            traj = jagg.rollout(fn, noise, self.sigmas, self.noise_level, generator=generator)
            sample = traj.sample
        else:
            traj, sample = sd_runner.window_rollout(fn, noise, self.sigmas, self.noise_level, window_start,
                                                       self.sde_window, generator=generator)
        adv = jagg.group_advantages(tt.reward_fn(sample, labels), labels)
        return Batch(traj, adv, lambda idx: (tt.make_velocity_fn(self.model, labels[idx]), None))


def gradient(task, batch, opts):
    """The flat gradient [P] of the whole batch's loss in mode opts, and the step's stats (with
    rollout interiors, the drift guard's rollout_refreshed and anchor_drift)."""
    for p in task.params:
        p.grad = None
    idx = torch.arange(len(batch.adv))
    fn, ref_fn = batch.fns(idx)
    stats, _ = options.backward_batch(fn, batch.traj, batch.adv, task.loss_cfg, opts,
                                     ref_fn if task.loss_cfg.beta > 0 else None)
    g = probe.flat_grad(task.params)
    for p in task.params:
        p.grad = None
    return g, stats


@torch.no_grad()
def ratio_error(task, batch, opts):
    """Rollout interiors: mean |log r(rule) - log r(fresh)| / clip over interior steps and samples."""
    fn, _ = batch.fns(torch.arange(len(batch.adv)))
    traj, cfg, errors = batch.traj, task.loss_cfg, []
    for a, b in options.segment_bounds(traj.z.shape[0], opts.window, opts.anchors):
        if b - a < 3:
            continue
        z, t = traj.z[a:b], traj.t[a:b]
        fresh = fn(z, t)  # [S, B, *D]
        anchors = [0, b - a - 1]
        H = options.hat_weights(t.to(torch.promote_types(t.dtype, torch.float32)), anchors)
        rule = options.interpolate_from_anchors(fresh[anchors], traj.v[a:b], H, anchors)
        for k in range(1, b - a - 1):
            i = a + k
            lp = [jagg.sde_step(v[k], traj.z[i], traj.t[i], traj.t_next[i], cfg.noise_level,
                                prev_sample=traj.z_next[i])[1] for v in (rule, fresh)]
            errors.append(((lp[0] - lp[1]).abs() / cfg.clip_range).mean().item())
    return sum(errors) / len(errors) if errors else 0.0


def train_exact(task, optimizer, epochs, batch_size, inner_steps, generator):
    """Exact GRPO as the setting trains: a rollout batch, then inner_steps optimizer steps on its minibatches."""
    for _ in tqdm(range(epochs), desc="exact GRPO between checkpoints", leave=False):
        batch = task.draw(batch_size, generator)
        perm = torch.randperm(len(batch.adv), generator=generator)
        for idx in perm.chunk(inner_steps):
            fn, ref_fn = batch.fns(idx)
            grpo_step.train_step(fn, optimizer, batch.traj.subset(idx), batch.adv[idx], task.loss_cfg,
                            options.JaggOptions(task.window, 0.0), ref_velocity_fn=ref_fn if task.loss_cfg.beta > 0 else None,
                            params=task.params)


def measure(task, args, generator, optimizer):
    """One checkpoint: --batches batches, each followed through --inner-steps exact steps of its own."""
    saved = [p.detach().clone() for p in task.params]
    records, on_policy = [], []  # per (batch, inner step, mode); the exact gradients at the checkpoint
    for b in range(args.batches):
        batch = task.draw(args.batch, generator)
        opt = torch.optim.AdamW(task.params, lr=task.lr)
        opt.load_state_dict(optimizer.state_dict())  # the training's moments: its next steps, on this batch
        for i in range(args.inner_steps):
            g, st = gradient(task, batch, options.JaggOptions(task.window, 0.0))
            if i == 0:
                on_policy.append(g)
            js = {}  # this step's gradient per mode, for the rollout modes' difference to their forward twins
            for name in args.modes:
                fields = MODES[name]
                opts = options.JaggOptions(task.window, 1.0, **fields)
                j, stats = gradient(task, batch, opts)
                js[name] = j
                rec = {"batch": b, "step": i + 1, "mode": name, "clipfrac": st["clipfrac"],
                       "rel_error": ((j - g).norm() / g.norm()).item(), "err2": (j - g).pow(2).sum().item(),
                       "cosine": torch.nn.functional.cosine_similarity(j, g, dim=0).item(),
                       "projection": (torch.dot(j, g) / g.pow(2).sum()).item(), "norm_ratio": (j.norm() / g.norm()).item()}
                if opts.interior == "rollout":
                    rec["refreshed"] = stats["rollout_refreshed"]
                    rec["anchor_drift"] = stats["anchor_drift"]
                    if fields.get("max_drift", "default") is None:  # the rule itself, without the guard
                        rec["ratio_error"] = ratio_error(task, batch, opts)
                twin = FORWARD_TWIN.get(name)
                if twin in js:  # on-policy, with beta > 0, the reference's interpolated interiors alone
                    rec["vs_forward"] = ((j - js[twin]).norm() / js[twin].norm()).item()
                records.append(rec)
            # exact GRPO's own step on this batch: the policy moves off the rollout's
            for p, gp in zip(task.params, g.split([p.numel() for p in task.params])):
                p.grad = gp.view_as(p).to(p.dtype)
            torch.nn.utils.clip_grad_norm_(task.params, 1.0)
            opt.step()
        with torch.no_grad():
            for p, s in zip(task.params, saved):
                p.copy_(s)
    pairs = list(itertools.combinations(range(len(on_policy)), 2))
    noise = sum((on_policy[a] - on_policy[b]).pow(2).sum().item() for a, b in pairs) / len(pairs) / 2
    agreement = sum(torch.nn.functional.cosine_similarity(on_policy[a], on_policy[b], dim=0).item()
                    for a, b in pairs) / len(pairs)
    for rec in records:
        rec["error_to_noise"] = rec.pop("err2") / noise
    return {"noise": noise, "batch_agreement": agreement, "records": records}


def summary(result):
    """{(step, mode): means over batches} of one checkpoint's records."""
    out = {}
    for (step, mode), recs in itertools.groupby(sorted(result["records"], key=lambda r: (r["step"], r["mode"])),
                                                key=lambda r: (r["step"], r["mode"])):
        recs = list(recs)
        keys = [k for k in recs[0] if k not in ("batch", "step", "mode")]
        out[step, mode] = {k: sum(r[k] for r in recs if k in r) / len(recs) for k in keys}
    return out


REPORT_MODES = ("paper", "shared", "rollout_unguarded", "rollout", "shared_rollout_unguarded", "shared_rollout")


def report(path):
    """The markdown table lab/reports/offpolicy.md shows: per checkpoint and optimizer step after the
    rollout, each mode's error to noise, relative error, projection and norm ratio (means over
    batches), the rule's interior ratio error and the guard's refreshed segments."""
    import json

    data = json.load(open(path))
    modes = [m for m in REPORT_MODES if m in data["args"]["modes"]]
    lines = [f"{data['setting']}, {data['args']['batches']} batches of {data['args']['batch']} per checkpoint; "
             "each cell: error / noise, relative error, projection, |j| / |g| (means over batches)", "",
             "| epoch | step | clipfrac | " + " | ".join(modes) + " | interior ratio error / clip | segments refreshed (guarded) |",
             "|---" * (5 + len(modes)) + "|"]
    for c, result in data["checkpoints"].items():
        table = summary(result)
        for step in sorted({s for s, _ in table}):
            cells = [f"{table[step, m]['error_to_noise']:.3f}, {table[step, m]['rel_error']:.2f}, "
                     f"{table[step, m]['projection']:.2f}, {table[step, m]['norm_ratio']:.2f}" for m in modes]
            ratio = next((table[step, m]["ratio_error"] for m in modes if "ratio_error" in table[step, m]), float("nan"))
            refreshed = table.get((step, "shared_rollout"), {}).get("refreshed", float("nan"))
            lines.append(f"| {c} | {step} | {table[step, modes[0]]['clipfrac']:.3f} | " + " | ".join(cells) +
                         f" | {ratio:.3f} | {refreshed:.1f} |")
        lines.append(f"| {c} | | batch agreement {result['batch_agreement']:.3f} |" + " |" * (len(modes) + 2))
    print("\n".join(lines))
    return lines


def main(argv=None):
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "report":
        return report(argv[1])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_kind", choices=["toy", "mini"], help="which model and setting (or: report JSON)")
    parser.add_argument("--checkpoints", type=int, nargs="+", default=[0, 5, 10],
                        help="epochs of exact GRPO training at which to measure (increasing; 0: the base model)")
    parser.add_argument("--batches", type=int, default=3, help="independent rollout batches per checkpoint (>= 2)")
    parser.add_argument("--batch", type=int, default=32, help="samples per batch (mini: a multiple of the group, 8)")
    parser.add_argument("--inner-steps", type=int, default=4,
                        help="optimizer steps per rollout (the mini setting: 4; Flow-GRPO: 2)")
    parser.add_argument("--model", default="mini", help="mini: a saved mini pipeline folder, or mini (the cached one)")
    parser.add_argument("--resolution", type=int, default=0, help="mini: image size (0: the model's own)")
    parser.add_argument("--preset", choices=MINI_PRESETS, default="mini",
                        help="mini: lab/sd_runner.py's preset (mini: darkness; mini-geneval: the GenEval-like reward, LoRA)")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                        help="the JAGG modes to measure against exact (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model's training and the rollouts")
    parser.add_argument("--out", default="", help="JSON file (default runs/offpolicy_<model>.json)")
    args = parser.parse_args(argv)
    if args.batches < 2:
        parser.error(f"--batches must be >= 2 (the noise compares independent batches), got {args.batches}")
    if sorted(set(args.checkpoints)) != args.checkpoints or args.checkpoints[0] < 0:
        parser.error(f"--checkpoints must be increasing epochs >= 0, got {args.checkpoints}")
    if args.inner_steps < 1:
        parser.error(f"--inner-steps must be >= 1, got {args.inner_steps}")
    task = MiniTask(args) if args.model_kind == "mini" else ToyTask(args)
    if args.model_kind == "mini" and args.batch % task.group:
        parser.error(f"--batch must be a multiple of the group size {task.group}, got {args.batch}")
    g = torch.Generator().manual_seed(args.seed)
    optimizer = torch.optim.AdamW(task.params, lr=task.lr)
    results, done = {}, 0
    for c in args.checkpoints:
        train_exact(task, optimizer, c - done, args.batch, args.inner_steps, g)
        done = c
        results[c] = measure(task, args, torch.Generator().manual_seed(args.seed * 7919 + c), optimizer)
        table = summary(results[c])
        print(f"\n{args.model_kind}, {task.setting}: epoch {c}, {args.batches} batches of {args.batch}; batch "
              f"agreement {results[c]['batch_agreement']:.3f}; per optimizer step after the rollout, means over batches")
        print(f"{'step':>4} {'mode':>25} {'clipfrac':>8} {'rel err':>8} {'cosine':>7} {'err/noise':>9} "
              f"{'proj':>6} {'|j|/|g|':>7} {'ratio err':>9} {'refreshed':>9} {'vs forward':>10}")
        for (step, mode), m in sorted(table.items()):
            print(f"{step:>4} {mode:>25} {m['clipfrac']:8.3f} {m['rel_error']:8.3f} {m['cosine']:7.3f} "
                  f"{m['error_to_noise']:9.4f} {m['projection']:6.3f} {m['norm_ratio']:7.3f} "
                  f"{m.get('ratio_error', float('nan')):9.3f} {m.get('refreshed', float('nan')):9.2f} "
                  f"{m.get('vs_forward', float('nan')):10.2e}")
    write_json(args.out or os.path.join("runs", f"offpolicy_{args.model_kind}.json"),
               {"args": vars(args), "setting": task.setting, "checkpoints": {str(c): r for c, r in results.items()}})
    return results


if __name__ == "__main__":
    main()
