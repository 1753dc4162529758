"""Rollout batches from each base model, drawn exactly as training draws them: what the tools that
measure gradients (compare_weights.py, gradient_signal.py, loop_check.py) compute on. The
*_batches generators yield (velocity_fn, params, traj, advantages, T) per batch."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jagg  # noqa: E402


def toy_batches(args):
    """(velocity_fn, params, traj, adv) per batch, from train_toy.py's base model and task."""
    import train_toy

    cfg = train_toy.Args()
    model = train_toy.base_model(cfg)
    sigmas = jagg.sigma_schedule(cfg.num_steps, cfg.shift)
    g = torch.Generator().manual_seed(args.seed)
    labels = torch.arange(len(train_toy.TARGETS)).repeat_interleave(args.batch // len(train_toy.TARGETS))  # [B]
    fn = train_toy.make_velocity_fn(model, labels)
    for _ in range(args.batches):
        with torch.no_grad():
            traj = jagg.rollout(fn, torch.randn(len(labels), 2, generator=g), sigmas, cfg.noise_level, generator=g)
        adv = jagg.group_advantages(train_toy.reward_fn(traj.sample, labels), labels)
        yield fn, list(model.parameters()), traj, adv, cfg.num_steps


def draw_groups(pipe, transformer, cfg, prompts_all, n_prompts, group, generator, window_start=None):
    """lab/sd_runner.py's rollouts for n_prompts prompts drawn from prompts_all, group samples each, at
    cfg's T, CFG and noise level (with window_start, an SDE window of cfg.sde_window steps there).
    Returns (prompt ids [B], prompts, traj, cond, uncond, images)."""
    import sd_runner

    ids = torch.randint(len(prompts_all), (n_prompts,), generator=generator).repeat_interleave(group)  # [B]
    prompts = [prompts_all[i] for i in ids.tolist()]
    sigmas = sd_runner.sampling_sigmas(cfg, pipe.scheduler)
    traj, cond, uncond, images = sd_runner.sample(pipe, transformer, prompts, cfg, sigmas, generator, use_bf16=False,
                                                 window_start=window_start)
    return ids, prompts, traj, cond, uncond, images


def mini_batches(args, full_finetune=True, reward="shapes", group=4, cfg_grad="cond", global_std=False):
    """The same from the mini SD3 (CFG 4.5, T = 10, the shapes reward unless `reward` says
    otherwise): groups of `group` samples per prompt, the parameters full fine-tuning trains or,
    with full_finetune=False, lab/sd_runner.py's LoRA (zero-initialised, so the same base model)."""
    import presets
    import sd_runner

    folder = presets.mini_pipeline() if args.model == "mini" else args.model
    cfg = sd_runner.parse(["--model", folder, "--prompts", presets.prompts_file(folder), "--reward",
                          presets.REWARDS.get(reward, reward), "--lora-rank", "0" if full_finetune else "32",
                          "--no-gradient-checkpointing", "--train-batch", str(args.batch), "--seed", str(args.seed)])
    pipe, transformer, cfg = presets.load(cfg, seed=args.seed)  # the seed: the LoRA's initialisation
    prompts_all, reward_fn = sd_runner.read_prompts(cfg), sd_runner.load_reward(cfg.reward)
    g = torch.Generator().manual_seed(args.seed)
    params = [p for p in transformer.parameters() if p.requires_grad]
    for _ in range(args.batches):
        ids, prompts, traj, cond, uncond, images = draw_groups(pipe, transformer, cfg, prompts_all, args.batch // group,
                                                               group, g)
        adv = jagg.group_advantages(sd_runner.rewards_of(reward_fn, images, prompts), ids, global_std=global_std)
        fn = sd_runner.make_velocity_fn(transformer, cond, uncond, cfg.guidance_scale, False, cfg_grad == "both")
        yield fn, params, traj, adv, cfg.num_steps
