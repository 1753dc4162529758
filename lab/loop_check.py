"""Check the GRPO loop of lab/sd_runner.py on a model, part by part, before trusting any reward curve.

    python lab/loop_check.py                         # the mini SD3 (cached), the darkness reward
    python lab/loop_check.py --reward shapes --prompts-per-batch 8

A loop that cannot raise an easy reward fails in one of a few places. This tool measures each
on fresh rollouts from the model, with lab/sd_runner.py's own functions:

- on-policy: the log-probability of each sampled transition recomputed in training mode (dropout
  and the like switched as training switches them) against the sampler's; the first ratio of a
  batch must be 1 (max |log ratio| ~ 1e-6 in fp32).
- exploration: how much a group's rewards differ (the mean within-group standard deviation) for
  guidance scales and SDE noise levels; GRPO learns only from these differences.
- the step: one optimizer step of lab/sd_runner.py's training (exact GRPO, the flags below) and how
  far it moves the policy: the relative change of the velocity on the batch, the log-ratio of the
  sampled transitions after the step, and how much it moved toward the samples with positive
  advantage (the advantage-weighted change of their log-probabilities).
- the VAE's reach: task images darkened by a factor, through the VAE's encoder and decoder: how
  much of a change in the image survives the latent round trip.
- direction (darkness only): cosines between independent batches' darkness gradients, pathwise
  (differentiated through the sampler and the VAE) and GRPO's score-function estimate.
Prints one table per part; --json writes them too.
"""

import argparse
import copy
import dataclasses
import os
import random
import sys

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jagg  # noqa: E402
from beyond_paper import options  # noqa: E402
import sd_runner  # noqa: E402
import grpo_step  # noqa: E402
from base_batches import draw_groups  # noqa: E402
from run_folder import write_json  # noqa: E402


def rollouts(pipe, transformer, cfg, prompts_all, args, g):
    return draw_groups(pipe, transformer, cfg, prompts_all, args.prompts_per_batch, args.group, g)


def exploration(pipe, transformer, cfg, prompts_all, reward_fn, args):
    rows = []
    for scale in args.guidance_scales:
        for noise in args.noise_levels:
            c = dataclasses.replace(cfg, guidance_scale=scale, noise_level=noise)
            g = torch.Generator().manual_seed(args.seed)
            ids, prompts, traj, _, _, images = rollouts(pipe, transformer, c, prompts_all, args, g)
            r = reward_fn(images, prompts)
            within = torch.stack([r[ids == i].std() for i in ids.unique()]).mean().item()
            pix = torch.stack([torch.tensor(np.stack([np.asarray(images[j], dtype=np.float32) / 255
                                                      for j in (ids == i).nonzero().flatten().tolist()])).std(0).mean()
                               for i in ids.unique()]).mean().item()
            rows.append({"guidance_scale": scale, "noise_level": noise, "reward_mean": r.mean().item(),
                         "reward_std_within_group": within, "reward_std_all": r.std().item(),
                         "pixel_std_within_group": pix})
    return rows


def policy_step(pipe, transformer, ref, cfg, prompts_all, reward_fn, args):
    """One batch: the first ratio (must be 1), then one optimizer step and how far it moved."""
    g = torch.Generator().manual_seed(args.seed + 1)
    transformer.eval()
    ids, prompts, traj, cond, uncond, images = rollouts(pipe, transformer, cfg, prompts_all, args, g)
    adv = jagg.group_advantages(reward_fn(images, prompts), ids)
    fn = sd_runner.make_velocity_fn(transformer, cond, uncond, cfg.guidance_scale, False)
    ref_fn = sd_runner.make_ref_velocity_fn(transformer, ref, cond, uncond, cfg.guidance_scale, False) if cfg.beta else None
    loss_cfg = jagg.LossConfig(noise_level=cfg.noise_level, clip_range=cfg.clip_range, beta=cfg.beta)
    transformer.train()

    @torch.no_grad()
    def log_ratio_and_v():
        v = fn(traj.z, traj.t)  # [T, B, C, h, w]
        lp = torch.stack([jagg.sde_step(v[k], traj.z[k], traj.t[k], traj.t_next[k], cfg.noise_level,
                                        prev_sample=traj.z_next[k])[1] for k in range(len(v))])  # [T, B]
        return lp - traj.log_prob, v

    before, v0 = log_ratio_and_v()
    params = [p for p in transformer.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=sd_runner.FIXED["weight_decay"])
    stats, _ = grpo_step.train_step(fn, opt, traj, adv, loss_cfg, cfg.jagg_options("exact"), ref_velocity_fn=ref_fn, params=params,
                               max_grad_norm=sd_runner.FIXED["max_grad_norm"])
    after, v1 = log_ratio_and_v()
    # the direction GRPO wants: samples with positive advantage more likely, negative less
    want = (after * adv).mean().item() - (before * adv).mean().item()
    transformer.eval()
    return {"first_ratio_max_abs_log": before.abs().max().item(),
            "velocity_relative_change": ((v1 - v0).norm() / v0.norm()).item(),
            "log_ratio_after_step_mean_abs": after.abs().mean().item(),
            "log_ratio_after_step_max_abs": after.abs().max().item(),
            "clipfrac_after_step": (after.sum(0).exp() - 1).abs().gt(cfg.clip_range).float().mean().item(),
            "advantage_weighted_log_ratio": want, "grad_norm": stats["grad_norm"], "trained_params": sum(p.numel() for p in params)}


def both_branches_velocity_fn(transformer, cond, uncond, scale):
    """sd_runner.make_velocity_fn (fp32) with graph through both guidance branches, as Flow-GRPO's
    first release: the exact derivative s J_c - (s - 1) J_u of the guided velocity."""
    def velocity_fn(z, t):
        S, x = t.shape[0], z.flatten(0, 1)  # [S*B, C, H, W]

        def branch(c):
            return transformer(hidden_states=x, timestep=(t.flatten() * 1000).to(x.dtype),
                               encoder_hidden_states=c[0].repeat(S, 1, 1), pooled_projections=c[1].repeat(S, 1),
                               return_dict=False)[0]
        v_u = branch(uncond)
        return (v_u + scale * (branch(cond) - v_u)).reshape(z.shape)
    return velocity_fn


def pathwise_darkness_gradient(pipe, transformer, params, cfg, prompts, g):
    """The gradient of the batch's mean darkness by differentiating through the sampler and the VAE
    decoder (the reparameterised SDE: fixed noise, the states a function of the parameters). An
    estimate of the same gradient GRPO's score-function estimate targets, with far less noise."""
    cond, uncond = sd_runner.encode(pipe, prompts, "cpu")
    fn = both_branches_velocity_fn(transformer, cond, uncond, cfg.guidance_scale)
    sigmas = sd_runner.sampling_sigmas(cfg, pipe.scheduler)
    C, h = pipe.transformer.config.in_channels, cfg.resolution // pipe.vae_scale_factor
    z = torch.randn(len(prompts), C, h, h, generator=g)  # [B, C, h, w]
    for k in range(cfg.num_steps):
        t, t_next = sigmas[k].expand(len(prompts)), sigmas[k + 1].expand(len(prompts))
        z = jagg.sde_step(fn(z[None], t[None])[0], z, t, t_next, cfg.noise_level, generator=g)[0]
    vae = pipe.vae
    x = vae.decode(z / vae.config.scaling_factor + (vae.config.shift_factor or 0.0), return_dict=False)[0]
    rgb = (x.clamp(-1, 1) + 1) / 2  # [B, 3, H, W] in [0, 1]
    darkness = 1 - (0.299 * rgb[:, 0] + 0.587 * rgb[:, 1] + 0.114 * rgb[:, 2]).mean()  # sd_runner.darkness, smooth
    return torch.cat([gr.flatten() for gr in torch.autograd.grad(darkness, params)])


def direction(pipe, transformer, cfg, prompts_all, reward_fn, args):
    """Cosines between independent batches' gradients of the darkness: pathwise (through the
    sampler) and GRPO's (exact, beta 0, the negated loss gradient), full fine-tuning's parameters."""
    params = [p for p in transformer.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(args.seed + 2)
    loss_cfg = jagg.LossConfig(noise_level=cfg.noise_level, clip_range=cfg.clip_range, beta=0.0)
    path, grpo = [], []
    for _ in range(args.direction_batches):
        ids = torch.randint(len(prompts_all), (args.prompts_per_batch,), generator=g).repeat_interleave(args.group)
        path.append(pathwise_darkness_gradient(pipe, transformer, params, cfg, [prompts_all[i] for i in ids.tolist()], g))
        ids, prompts, traj, cond, uncond, images = rollouts(pipe, transformer, cfg, prompts_all, args, g)
        adv = jagg.group_advantages(reward_fn(images, prompts), ids)
        fn = both_branches_velocity_fn(transformer, cond, uncond, cfg.guidance_scale)
        for p in params:
            p.grad = None
        options.backward_batch(fn, traj, adv, loss_cfg, cfg.jagg_options("exact"))
        grpo.append(-torch.cat([p.grad.flatten() for p in params]))
        for p in params:
            p.grad = None

    def mean_cos(a, b, same):
        cs = [torch.nn.functional.cosine_similarity(x, y, dim=0).item()
              for i, x in enumerate(a) for j, y in enumerate(b) if not (same and i >= j)]
        return sum(cs) / len(cs)

    return {"pathwise_vs_pathwise": mean_cos(path, path, True), "grpo_vs_pathwise": mean_cos(grpo, path, False),
            "grpo_vs_grpo": mean_cos(grpo, grpo, True), "batches": args.direction_batches}


@torch.no_grad()
def vae_reach(pipe, factors=(1.0, 0.75, 0.5, 0.25)):
    import mini_sd3

    rng = random.Random(0)
    images = [mini_sd3.render(mini_sd3.sample_prompt(rng), rng) for _ in range(16)]
    vae, rows = pipe.vae, []
    for f in factors:
        arr = np.stack([np.asarray(im, dtype=np.float32) * f for im in images]).round()  # [N, H, W, 3]
        x = torch.tensor(arr).permute(0, 3, 1, 2) / 127.5 - 1
        lat = (vae.encode(x).latent_dist.mean - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor
        dark_in = np.mean([sd_runner.darkness(Image.fromarray(a.astype(np.uint8))) for a in arr])
        dark_out = np.mean([sd_runner.darkness(im) for im in sd_runner.decode(pipe, lat)])
        rows.append({"brightness": f, "darkness_in": float(dark_in), "darkness_after_vae": float(dark_out)})
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mini", help="a saved SD3 pipeline folder, or mini (the cached mini SD3)")
    parser.add_argument("--reward", default="darkness", help="lab/sd_runner.py's --reward, or the mini task's shapes, "
                                                               "geneval, cover, shapes_cover")
    parser.add_argument("--prompts-per-batch", type=int, default=4, help="prompts per rollout batch")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--guidance-scales", type=float, nargs="+", default=[4.5, 1.0], help="CFG scales to explore with")
    parser.add_argument("--noise-levels", type=float, nargs="+", default=[0.7, 1.0], help="SDE noise levels to explore with")
    parser.add_argument("--train", nargs="+", default=["lora:1e-3", "full:3e-4"],
                        help="what one optimizer step trains, as KIND:LR with KIND lora (lab/sd_runner.py's) or full")
    parser.add_argument("--direction-batches", type=int, default=3,
                        help="independent batches for the direction check (darkness only; 0: skip it)")
    parser.add_argument("--beta", type=float, default=0.04, help="KL weight of the step")
    parser.add_argument("--guidance-scale", type=float, default=4.5, help="CFG scale of the step and direction checks")
    parser.add_argument("--seed", type=int, default=0, help="seed of the rollouts and the LoRA's initialisation")
    parser.add_argument("--json", default="", help="also write the tables to this JSON file")
    args = parser.parse_args(argv)
    for spec in args.train:
        kind, _, lr = spec.partition(":")
        if kind not in ("lora", "full") or not lr:
            parser.error(f"--train {spec!r}: expected lora:LR or full:LR, e.g. lora:1e-3")
    import presets

    folder = presets.mini_pipeline() if args.model == "mini" else args.model
    base = sd_runner.parse(["--model", folder, "--prompts", presets.prompts_file(folder), "--reward",
                           presets.REWARDS.get(args.reward, args.reward), "--no-gradient-checkpointing", "--seed",
                           str(args.seed), "--train-batch", str(args.prompts_per_batch * args.group), "--beta",
                           str(args.beta), "--clip-range", "0.2", "--guidance-scale", str(args.guidance_scale)])
    reward = sd_runner.load_reward(base.reward)
    reward_fn = lambda images, prompts: sd_runner.rewards_of(reward, images, prompts)  # noqa: E731
    result = {}

    for spec in args.train:
        kind, _, lr = spec.partition(":")
        cfg = dataclasses.replace(base, lora_rank=0 if kind == "full" else base.lora_rank, lr=float(lr))
        pipe, transformer, cfg = presets.load(cfg, seed=args.seed)
        prompts_all = sd_runner.read_prompts(cfg)
        if "exploration" not in result:
            result["exploration"] = exploration(pipe, transformer, cfg, prompts_all, reward_fn, args)
            result["vae_reach"] = vae_reach(pipe) if args.model == "mini" else []
        ref = copy.deepcopy(transformer).requires_grad_(False) if cfg.lora_rank == 0 and cfg.beta > 0 else None
        result[f"step {spec}"] = policy_step(pipe, transformer, ref, cfg, prompts_all, reward_fn, args)
        if kind == "full" and args.reward == "darkness" and args.direction_batches > 1 and "direction" not in result:
            pipe, transformer, cfg = presets.load(cfg, seed=args.seed)
            result["direction"] = direction(pipe, transformer, cfg, prompts_all, reward_fn, args)

    print("exploration (rewards of one prompt's group):")
    for r in result["exploration"]:
        print(f"  CFG {r['guidance_scale']:<4} noise {r['noise_level']:<4} reward {r['reward_mean']:.3f}  std within group "
              f"{r['reward_std_within_group']:.4f}  (all {r['reward_std_all']:.4f}); pixel std within group {r['pixel_std_within_group']:.3f}")
    for r in result["vae_reach"]:
        print(f"  VAE: image brightness x{r['brightness']}: darkness {r['darkness_in']:.3f} -> {r['darkness_after_vae']:.3f} after encode/decode")
    for key, r in result.items():
        if key.startswith("step"):
            print(f"{key} ({r['trained_params']:,} trained): first ratio |log| max {r['first_ratio_max_abs_log']:.1e}; after one step: "
                  f"velocity moved {r['velocity_relative_change']:.2e} (relative), |log ratio| per transition mean "
                  f"{r['log_ratio_after_step_mean_abs']:.2e} max {r['log_ratio_after_step_max_abs']:.2e}, trajectory ratios outside "
                  f"the clip range {r['clipfrac_after_step']:.2f}, advantage-weighted log ratio {r['advantage_weighted_log_ratio']:+.2e}, "
                  f"grad norm {r['grad_norm']:.3f}")
    if "direction" in result:
        r = result["direction"]
        print(f"direction of the darkness gradient, cosines between {r['batches']} independent batches: pathwise vs pathwise "
              f"{r['pathwise_vs_pathwise']:+.3f}, GRPO vs pathwise {r['grpo_vs_pathwise']:+.3f}, GRPO vs GRPO {r['grpo_vs_grpo']:+.3f}")
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
