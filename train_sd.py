"""JAGG-GRPO on a real DiT checkpoint: Stable Diffusion 3 / 3.5 through diffusers.

    python train_sd.py --model stabilityai/stable-diffusion-3.5-medium --method jagg --window 4
    torchrun --nproc_per_node=8 train_sd.py --model PATH --method jagg
    python train_sd.py --benchmark --window 4 --random-init [--json]   # exact vs JAGG timing

The algorithm is jagg.py's, unchanged; this file only knows the model. It follows Flow-GRPO's
practice: LoRA on the transformer (or full fine-tuning), classifier-free guidance when sampling
and training, KL to the reference model (the transformer with its adapter disabled), bf16
autocast on a GPU with the SDE math in fp32, gradient checkpointing, AdamW, gradient clipping,
optional EMA, and per-prompt advantages over groups gathered from every rank.

The model is wrapped once, in make_velocity_fn: the SD3 transformer becomes the
velocity_fn(z [S, B, C, H, W], t [S, B]) that jagg.py expects. The unconditional branch of
classifier-free guidance runs without a graph: the gradient flows through the conditional
branch only, so neither method pays a backward for it.

Weights cannot be downloaded on the machines this was written on: the tests build a tiny SD3
pipeline in code, save it with save_pretrained, and run this script on it end to end.
"""

import contextlib
import copy
import dataclasses
import io
import json
import os
import shutil
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from PIL import Image, ImageDraw
from tqdm import tqdm

import jagg
from common import all_gather_cat, arg, atomic_write, fail_on, init_distributed, jagg_flag_checks, parse_config
from common import report_benchmark
from common import param_checksums, save_png, step_metrics, write_json, write_jsonl

REWARDS = ["jpeg_compressibility", "jpeg_incompressibility", "pickscore"]
DEFAULT_PROMPTS = [
    "a photo of a cat sitting on a windowsill", "a red bicycle leaning against a brick wall",
    "a bowl of ramen with chopsticks", "a lighthouse on a cliff at sunset", "an astronaut riding a horse",
    "a watercolor painting of a fox in the snow", "a cozy cabin in a pine forest", "a bunch of sunflowers in a vase",
]


@dataclass
class Config:
    # --- model and data
    model: str = arg("stabilityai/stable-diffusion-3.5-medium", "diffusers StableDiffusion3Pipeline: hub id or local directory")
    prompts: str = arg("", "text file with one prompt a line; empty: a small built-in list")
    reward: str = arg("jpeg_compressibility", "reward function", choices=REWARDS)
    reward_model: str = arg("", "for --reward pickscore: local directory of a CLIP model and processor (PickScore)")
    resolution: int = arg(512, "image size in pixels (also the benchmark's, for SD3.5-medium or --model)")
    out: str = arg("runs/sd", "output folder: metrics.jsonl, sample grids, weights, checkpoint")
    resume: str = arg("", "continue from the checkpoint in this output folder")
    seed: int = arg(0, "random seed; ranks add their rank to the sampling seed")
    # --- JAGG
    method: str = arg("jagg", "exact (Flow-GRPO) or jagg", choices=["exact", "jagg"])
    window: int = arg(4, "W, sampling steps per window")
    jagg_frac: float = arg(1.0, "fraction of windows (the most linear) trained by JAGG; the rest exact")
    probe_every: int = arg(0, "every N epochs, log the cosine of JAGG's gradient to the exact one per window (0: off)")
    # --- GRPO
    epochs: int = arg(100, "GRPO epochs (each: rollouts of --prompts-per-epoch prompts, then training)")
    num_steps: int = arg(10, "T, sampling steps of a rollout (Flow-GRPO trains with 10)")
    guidance_scale: float = arg(4.5, "classifier-free guidance scale (1: no guidance)")
    noise_level: float = arg(0.7, "SDE noise level")
    prompts_per_epoch: int = arg(2, "prompts sampled each epoch (the same on every rank)")
    group_size: int = arg(8, "samples per prompt on each rank; a group is all ranks' samples of a prompt")
    rollout_batch: int = arg(8, "samples per rollout forward pass")
    train_batch: int = arg(4, "samples per optimizer step")
    lr: float = arg(1e-4, "AdamW learning rate")
    weight_decay: float = arg(1e-4, "AdamW weight decay")
    clip_range: float = arg(1e-4, "GRPO ratio clip range (Flow-GRPO uses 1e-4)")
    beta: float = arg(0.04, "KL weight to the reference model (0: no reference forward)")
    adv_clip: float = arg(5.0, "advantages are clipped to [-adv_clip, adv_clip]")
    global_std: bool = arg(False, "standardise advantages by the std of all rewards instead of each group's")
    max_grad_norm: float = arg(1.0, "gradient clipping norm")
    lora_rank: int = arg(32, "LoRA rank on the transformer's attention projections")
    lora_alpha: int = arg(64, "LoRA alpha")
    full_finetune: bool = arg(False, "train all transformer weights instead of a LoRA")
    gradient_checkpointing: bool = arg(True, "recompute activations in the backward pass to save memory")
    mixed_precision: str = arg("auto", "bf16 autocast (SDE math stays fp32), fp32, or auto (bf16 on GPU)",
                               choices=["auto", "bf16", "fp32"])
    ema: bool = arg(False, "keep an EMA of the trained weights (used for evaluation and saved)")
    ema_decay: float = arg(0.95, "EMA decay per optimizer step")
    eval_every: int = arg(10, "every N epochs, sample fixed prompts with fixed noise (EMA weights if kept): eval/reward and a grid")
    save_every: int = arg(10, "write a checkpoint every N epochs")
    device: str = arg("auto", "cuda, cpu, or auto")
    # --- benchmark
    benchmark: bool = arg(False, "time one window's gradient exact vs JAGG on the SD3 transformer (conditional branch "
                                 "only: CFG's no-graph unconditional forward costs both methods the same), then exit")
    random_init: bool = arg(False, "benchmark: build the transformer from its config alone (no weights needed); the benchmark never uses gradient checkpointing")
    bench_size: str = arg("auto", "benchmark transformer with --random-init: sd35-medium, cpu (9M params), tiny; "
                                  "auto: sd35-medium on GPU, cpu on CPU", choices=["auto", "sd35-medium", "cpu", "tiny"])
    bench_batch: int = arg(0, "benchmark batch size B (0: 4 on GPU, 2 on CPU)")
    bench_repeats: int = arg(5, "timed repeats per method (medians are reported)")
    json: bool = arg(False, "benchmark: print one JSON object instead of a table")

    def validate(self):
        """Every bad value is reported before any model is loaded or any file is touched."""
        if self.benchmark:
            checks = [(self.window >= 2, f"--window must be >= 2, got {self.window}")]
            if not self.random_init:
                checks.append(_model_exists(self.model))
        else:
            checks = jagg_flag_checks(self.window, self.num_steps, self.jagg_frac) + [
                (self.group_size >= 2 or int(os.environ.get("WORLD_SIZE", 1)) > 1,
                 f"--group-size must be >= 2 on one process (advantages compare a group's samples), got {self.group_size}"),
                (self.reward != "pickscore" or os.path.isdir(self.reward_model),
                 f"--reward pickscore needs --reward-model, a local directory with a CLIP model and processor; got {self.reward_model!r}"),
                (not self.prompts or os.path.isfile(self.prompts), f"--prompts file {self.prompts!r} does not exist"),
                (not self.prompts or not os.path.isfile(self.prompts) or bool(read_prompts(self.prompts)),
                 f"--prompts file {self.prompts!r} has no prompts (one a line; blank lines are skipped)"),
                (not self.resume or os.path.isfile(os.path.join(self.resume, "checkpoint", "state.json")),
                 f"--resume {self.resume!r} holds no checkpoint (expected {self.resume}/checkpoint/state.json)"),
                _model_exists(self.model),
            ]
        fail_on(checks)


def _model_exists(model):
    """A local path must exist; anything else is taken as a hub id and checked when loading."""
    local = model.startswith((".", "/", "~")) or os.path.exists(model) or model.count("/") != 1
    return (not local or os.path.isdir(os.path.expanduser(model)),
            f"--model {model!r} is not a directory with a diffusers StableDiffusion3Pipeline (model_index.json)")


def read_prompts(path):
    with open(path) as f:
        return [line.strip() for line in f if line.strip()]


# =====================================================================================
# The model: loading, LoRA, and the velocity_fn that jagg.py sees
# =====================================================================================


def load_pipeline(cfg, device, dtype):
    from diffusers import StableDiffusion3Pipeline

    path = os.path.expanduser(cfg.model)
    # Components saved as [null, null] (T5 left out, no image encoder) must be passed as None.
    index = os.path.join(path, "model_index.json")
    absent = {}
    if os.path.isfile(index):
        with open(index) as f:
            absent = {k: None for k, v in json.load(f).items() if isinstance(v, list) and v[0] is None}
    try:
        pipe = StableDiffusion3Pipeline.from_pretrained(path, dtype=dtype, **absent)
    except Exception as e:
        raise SystemExit(f"error: could not load --model {cfg.model!r} ({type(e).__name__}: {str(e)[:300]}); "
                         f"pass a local directory saved with save_pretrained, or a hub id on a machine with network") from None
    pipe.set_progress_bar_config(disable=True)
    for module in (pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3):
        if module is not None:
            module.to(device).requires_grad_(False)
    transformer = pipe.transformer.to(device)
    transformer.requires_grad_(False)
    if cfg.full_finetune:
        # Full fine-tuning trains in fp32 master weights; a frozen copy is the KL reference.
        transformer.to(torch.float32).requires_grad_(True)
    else:
        from peft import LoraConfig

        transformer.add_adapter(LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, init_lora_weights="gaussian",
                                           target_modules=["to_k", "to_q", "to_v", "to_out.0", "add_k_proj",
                                                           "add_q_proj", "add_v_proj", "to_add_out"]))
        for p in transformer.parameters():
            if p.requires_grad:
                p.data = p.data.float()  # LoRA weights in fp32; the frozen base may stay in bf16
    if cfg.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    return pipe, transformer


def autocast(device, enabled):
    return torch.autocast(device.type, dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


def make_velocity_fn(transformer, cond, uncond, guidance_scale, use_bf16):
    """velocity_fn(z [S, B, C, H, W], t [S, B]) -> v [S, B, C, H, W] with classifier-free guidance.

    cond, uncond: (prompt_embeds [B, L, E], pooled [B, P]) of the B samples. The conditional
    branch carries the graph when grad is enabled; the unconditional one never does, so that
    v = v_u + s (v_c - v_u) back-propagates through s * v_c alone."""

    def velocity_fn(z, t):
        S, B = t.shape
        x = z.reshape(S * B, *z.shape[2:])  # [S*B, C, H, W]
        timestep = (t.reshape(S * B) * 1000).to(x.dtype)  # SD3's timesteps are sigma * 1000
        with autocast(x.device, use_bf16):
            v = transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=cond[0].repeat(S, 1, 1),
                            pooled_projections=cond[1].repeat(S, 1), return_dict=False)[0]  # [S*B, C, H, W]
            if guidance_scale > 1:
                with torch.no_grad():
                    v_u = transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=uncond[0].repeat(S, 1, 1),
                                      pooled_projections=uncond[1].repeat(S, 1), return_dict=False)[0]
                v = v_u + guidance_scale * (v - v_u)  # [S*B, C, H, W]
        return v.to(z.dtype).reshape(z.shape)  # [S, B, C, H, W], fp32 latents even under bf16 autocast

    return velocity_fn


@contextlib.contextmanager
def adapter_disabled(transformer):
    """The reference model for the KL term: the same transformer with its LoRA switched off."""
    transformer.disable_adapters()
    try:
        yield
    finally:
        transformer.enable_adapters()


def make_ref_velocity_fn(transformer, ref_transformer, cond, uncond, cfg, use_bf16):
    if ref_transformer is not None:  # full fine-tuning: a frozen copy
        return make_velocity_fn(ref_transformer, cond, uncond, cfg.guidance_scale, use_bf16)
    fn = make_velocity_fn(transformer, cond, uncond, cfg.guidance_scale, use_bf16)

    def ref_velocity_fn(z, t):
        with adapter_disabled(transformer):
            return fn(z, t)

    return ref_velocity_fn


@torch.no_grad()
def encode(pipe, prompts, device):
    """(cond, uncond) text embeddings of the prompts, each (prompt_embeds, pooled)."""
    pe, npe, pooled, npooled = pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None, device=device,
                                                  do_classifier_free_guidance=True, negative_prompt=[""] * len(prompts))
    return (pe.float(), pooled.float()), (npe.float(), npooled.float())


@torch.no_grad()
def decode(pipe, latents):
    """Latents [B, C, h, w] -> list of PIL images."""
    vae = pipe.vae
    x = latents.to(vae.dtype) / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
    images = vae.decode(x, return_dict=False)[0]  # [B, 3, H, W] in [-1, 1]
    images = ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(im) for im in images]


@torch.no_grad()
def sample(pipe, transformer, prompts, cfg, sigmas, generator, use_bf16):
    """Roll out the SDE sampler for prompts in chunks of cfg.rollout_batch.

    Returns (traj, cond, uncond, images): trajectories over all B samples, their text embeddings
    and the decoded images."""
    device = sigmas.device
    C, h = pipe.transformer.config.in_channels, cfg.resolution // pipe.vae_scale_factor
    trajs, conds, unconds, images = [], [], [], []
    for s in tqdm(range(0, len(prompts), cfg.rollout_batch), desc="rollouts", leave=False, disable=not _is_main()):
        chunk = prompts[s : s + cfg.rollout_batch]
        cond, uncond = encode(pipe, chunk, device)
        noise = torch.randn(len(chunk), C, h, h, generator=generator, device=device)  # [b, C, h, w]
        traj = jagg.rollout(make_velocity_fn(transformer, cond, uncond, cfg.guidance_scale, use_bf16),
                            noise, sigmas, cfg.noise_level, generator=generator)
        trajs.append(traj), conds.append(cond), unconds.append(uncond)
        images += decode(pipe, traj.sample)
    traj = jagg.Trajectory(**{f: torch.cat([getattr(t, f) for t in trajs], dim=1)  # [T, B, C, h, w]
                              for f in jagg.Trajectory.__dataclass_fields__})
    cond = tuple(torch.cat([c[i] for c in conds]) for i in range(2))  # ([B, L, E], [B, P])
    uncond = tuple(torch.cat([c[i] for c in unconds]) for i in range(2))
    return traj, cond, uncond, images


def _is_main():
    return not dist.is_initialized() or dist.get_rank() == 0


@contextlib.contextmanager
def ema_weights(transformer, ema):
    """Temporarily load the EMA weights (if kept) into the trained parameters."""
    if ema is None:
        yield
        return
    params = {n: p for n, p in transformer.named_parameters() if p.requires_grad}
    saved = {n: p.detach().clone() for n, p in params.items()}
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(ema[n])
    try:
        yield
    finally:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(saved[n])


# =====================================================================================
# Rewards
# =====================================================================================


def jpeg_kb(image):
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=95)
    return buf.tell() / 1000


def make_reward_fn(cfg, device):
    """reward_fn(images, prompts) -> tensor [B]."""
    if cfg.reward == "jpeg_compressibility":  # DDPO's: smaller files, simpler images
        return lambda images, prompts: torch.tensor([-jpeg_kb(im) for im in images])
    if cfg.reward == "jpeg_incompressibility":
        return lambda images, prompts: torch.tensor([jpeg_kb(im) for im in images])
    from transformers import AutoModel, AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(cfg.reward_model)
        model = AutoModel.from_pretrained(cfg.reward_model).eval().to(device)
    except Exception as e:
        raise SystemExit(f"error: could not load --reward-model {cfg.reward_model!r} as a CLIP model ({e})") from None

    def projected(out):
        # transformers 4 returns the projected embeddings; 5 returns an output whose pooler_output they are.
        return out if torch.is_tensor(out) else out.pooler_output

    @torch.no_grad()
    def pickscore(images, prompts):
        # PickScore = logit_scale * cos(image embedding, text embedding).
        img = processor(images=images, return_tensors="pt").to(device)
        txt = processor(text=prompts, padding=True, truncation=True, max_length=77, return_tensors="pt").to(device)
        ie = torch.nn.functional.normalize(projected(model.get_image_features(**img)), dim=-1)
        te = torch.nn.functional.normalize(projected(model.get_text_features(**txt)), dim=-1)
        return (model.logit_scale.exp() * (ie * te).sum(-1)).float().cpu()

    return pickscore


# =====================================================================================
# Checkpoints: safetensors weights, optimizer state loaded with weights_only=True
# =====================================================================================


def trainable_state(transformer):
    return {n: p.detach().float().cpu().contiguous() for n, p in transformer.named_parameters() if p.requires_grad}


def save_weights(path, state):
    from safetensors.torch import save

    atomic_write(path, lambda f: f.write(save(state)), mode="wb")


def save_checkpoint(out, transformer, optimizer, ema, epoch, rows):
    """Write out/checkpoint/ as a whole: into a temporary folder, then renamed into place."""
    final, tmp = os.path.join(out, "checkpoint"), os.path.join(out, ".checkpoint.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_weights(os.path.join(tmp, "weights.safetensors"), trainable_state(transformer))
    if ema is not None:
        save_weights(os.path.join(tmp, "ema.safetensors"), ema)
    torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
    write_jsonl(os.path.join(tmp, "metrics.jsonl"), rows)
    write_json(os.path.join(tmp, "state.json"), {"epoch": epoch})
    old = os.path.join(out, ".checkpoint.old")
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(folder, transformer, optimizer):
    from safetensors.torch import load_file

    ckpt = os.path.join(folder, "checkpoint")
    try:
        weights = load_file(os.path.join(ckpt, "weights.safetensors"))
        params = dict(transformer.named_parameters())
        missing = [n for n, p in params.items() if p.requires_grad and n not in weights]
        if missing or any(n not in params for n in weights):
            raise ValueError(f"the checkpoint's weights do not match this model ({len(missing)} missing); "
                             f"same --lora-rank / --full-finetune as the run being resumed?")
        with torch.no_grad():
            for n, w in weights.items():
                params[n].copy_(w)
        optimizer.load_state_dict(torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=True))
        ema = load_file(os.path.join(ckpt, "ema.safetensors")) if os.path.exists(os.path.join(ckpt, "ema.safetensors")) else None
        epoch = json.load(open(os.path.join(ckpt, "state.json")))["epoch"]
        rows = [json.loads(line) for line in open(os.path.join(ckpt, "metrics.jsonl"))]
    except Exception as e:
        raise SystemExit(f"error: cannot resume from {ckpt}: {e}") from None
    return epoch, ema, rows


# =====================================================================================
# Pictures
# =====================================================================================


def sample_grid(images, prompts, rewards, cell=256):
    cols = min(4, len(images))
    rows = (len(images) + cols - 1) // cols
    grid = Image.new("RGB", (cols * cell, rows * (cell + 30)), "white")
    d = ImageDraw.Draw(grid)
    for i, (im, p, r) in enumerate(zip(images, prompts, rewards)):
        x, y = (i % cols) * cell, (i // cols) * (cell + 30)
        grid.paste(im.resize((cell, cell)), (x, y))
        d.text((x + 4, y + cell + 2), p[:40], fill="black")
        d.text((x + 4, y + cell + 15), f"reward {r:.3f}", fill="black")
    return grid


# =====================================================================================
# Training: the whole loop in one place
# =====================================================================================


def train(cfg):
    rank, world = init_distributed()
    torch.manual_seed(cfg.seed)  # the same LoRA initialisation on every rank and every run
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    use_bf16 = cfg.mixed_precision == "bf16" or (cfg.mixed_precision == "auto" and device.type == "cuda")
    prompts_all = read_prompts(cfg.prompts) if cfg.prompts else DEFAULT_PROMPTS
    reward_fn = make_reward_fn(cfg, device)
    pipe, transformer = load_pipeline(cfg, device, torch.bfloat16 if use_bf16 else torch.float32)
    ref_transformer = None
    if cfg.full_finetune and cfg.beta > 0:  # a frozen copy, in the pipeline's precision (bf16 on GPU)
        ref_transformer = copy.deepcopy(transformer).requires_grad_(False).to(pipe.vae.dtype)
    params = [p for p in transformer.parameters() if p.requires_grad]
    net = torch.nn.parallel.DistributedDataParallel(transformer, device_ids=[device.index] if device.type == "cuda" else None) \
        if world > 1 else transformer
    no_sync = net.no_sync if world > 1 else contextlib.nullcontext
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    ema = {n: p.detach().clone() for n, p in transformer.named_parameters() if p.requires_grad} if cfg.ema else None

    start_epoch, rows = 0, []
    if cfg.resume:
        start_epoch, saved_ema, rows = load_checkpoint(cfg.resume, transformer, optimizer)
        ema = saved_ema if cfg.ema and saved_ema is not None else ema
    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
        write_json(os.path.join(cfg.out, "config.json"), dataclasses.asdict(cfg))
        print("config: " + json.dumps(dataclasses.asdict(cfg)))
        print(f"trainable parameters: {sum(p.numel() for p in params):,}; device {device}; bf16 {use_bf16}; world {world}")

    sigmas = jagg.sigma_schedule(cfg.num_steps, pipe.scheduler.config.get("shift", 3.0)).to(device)  # [T+1]
    loss_cfg = jagg.LossConfig(noise_level=cfg.noise_level, clip_range=cfg.clip_range, beta=cfg.beta)
    jagg_frac = cfg.jagg_frac if cfg.method == "jagg" else 0.0
    eval_prompts = prompts_all[:8]

    def evaluate(epoch):
        """Fixed prompts and noise, the EMA weights if kept: a reward curve and a grid of samples."""
        transformer.eval()
        with ema_weights(transformer, ema):
            g = torch.Generator(device=device).manual_seed(cfg.seed + 12345)
            _, _, _, images = sample(pipe, transformer, eval_prompts, cfg, sigmas, g, use_bf16)
        rewards = reward_fn(images, eval_prompts)
        save_png(os.path.join(cfg.out, f"samples_{epoch:04d}.png"), sample_grid(images, eval_prompts, rewards.tolist()))
        return rewards.mean().item()

    if rank == 0 and start_epoch == 0:
        rows.append({"epoch": 0, "eval/reward": evaluate(0)})
    # The prompts of an epoch are the same on every rank (shared seed); the noise differs per rank,
    # so a prompt's group is spread over the ranks and advantages use the gathered rewards.
    # Generators are seeded per epoch, so a resumed run draws what an uninterrupted one would.
    bar = tqdm(range(start_epoch + 1, cfg.epochs + 1), desc=f"GRPO {cfg.method}", disable=rank != 0, dynamic_ncols=True)
    for epoch in bar:
        # --- rollouts: sample, decode, reward
        prompt_gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
        noise_gen = torch.Generator(device=device).manual_seed((cfg.seed * 1_000_003 + epoch) * 1009 + rank + 1)
        pick = torch.randint(len(prompts_all), (cfg.prompts_per_epoch,), generator=prompt_gen)  # [P]
        prompt_ids = pick.repeat_interleave(cfg.group_size)  # [B]
        prompts = [prompts_all[i] for i in prompt_ids.tolist()]
        transformer.eval()
        traj, cond, uncond, images = sample(pipe, transformer, prompts, cfg, sigmas, noise_gen, use_bf16)
        rewards = reward_fn(images, prompts).to(device)  # [B]
        # --- advantages over groups gathered from all ranks, then this rank's slice
        all_rewards, all_ids = all_gather_cat(rewards), all_gather_cat(prompt_ids.to(device))
        adv = jagg.group_advantages(all_rewards, all_ids, global_std=cfg.global_std, clip=cfg.adv_clip)
        adv = adv.reshape(world, -1)[rank]  # [B]

        # --- training: minibatches of train_batch samples, one optimizer step each
        transformer.train()
        perm = torch.randperm(len(prompts), generator=prompt_gen)
        step_stats = []
        for idx in perm.split(cfg.train_batch):
            idx_d = idx.to(device)
            c = tuple(x[idx_d] for x in cond)
            u = tuple(x[idx_d] for x in uncond)
            ref_fn = make_ref_velocity_fn(transformer, ref_transformer, c, u, cfg, use_bf16) if cfg.beta > 0 else None
            stats, _ = jagg.train_step(make_velocity_fn(net, c, u, cfg.guidance_scale, use_bf16), params, optimizer,
                                       traj.subset(idx_d), adv[idx_d], loss_cfg, cfg.window, jagg_frac,
                                       cfg.max_grad_norm, ref_velocity_fn=ref_fn, no_sync=no_sync)
            step_stats.append(stats)
            if ema is not None:
                with torch.no_grad():
                    for n, p in transformer.named_parameters():
                        if p.requires_grad:
                            ema[n].mul_(cfg.ema_decay).add_(p.detach().to(ema[n].device), alpha=1 - cfg.ema_decay)

        row = {"epoch": epoch, "method": cfg.method, "rollout/reward_mean": all_rewards.mean().item(),
               "rollout/reward_std": all_rewards.std().item(), **step_metrics(step_stats)}
        if cfg.probe_every and epoch % cfg.probe_every == 0:
            idx_d = perm[: cfg.train_batch].to(device)
            c, u = tuple(x[idx_d] for x in cond), tuple(x[idx_d] for x in uncond)
            row["probe/grad_cosine"] = jagg.gradient_cosines(
                make_velocity_fn(transformer, c, u, cfg.guidance_scale, use_bf16), params, traj.subset(idx_d),
                adv[idx_d], loss_cfg, cfg.window,
                make_ref_velocity_fn(transformer, ref_transformer, c, u, cfg, use_bf16) if cfg.beta > 0 else None)
        row["train/param_checksums"] = param_checksums(params)  # equal on every rank: DDP kept them in sync
        rows.append(row)
        bar.set_postfix(reward=f"{row['rollout/reward_mean']:.3f}", kl=f"{row['train/kl']:.4f}",
                        clipfrac=f"{row['train/clipfrac']:.3f}", bwd=f"{row['time/backward_seconds']:.1f}s")
        if rank == 0:
            if epoch % cfg.eval_every == 0 or epoch == cfg.epochs:
                row["eval/reward"] = evaluate(epoch)
            write_jsonl(os.path.join(cfg.out, "metrics.jsonl"), rows)
            if epoch % cfg.save_every == 0 or epoch == cfg.epochs:
                save_checkpoint(cfg.out, transformer, optimizer, ema, epoch, rows)
                save_weights(os.path.join(cfg.out, "lora.safetensors" if not cfg.full_finetune else "transformer.safetensors"),
                             ema if ema is not None else trainable_state(transformer))
    if dist.is_initialized():
        dist.barrier()
    return rows


# =====================================================================================
# Benchmark: one window's gradient, exact vs JAGG, on the SD3 transformer
# =====================================================================================

SD3_CONFIGS = {
    # SD3.5-medium's transformer (MMDiT-X; 2.24B parameters by our count): 24 blocks, dual attention in blocks 0-12.
    "sd35-medium": dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                        num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                        pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                        dual_attention_layers=tuple(range(13)), qk_norm="rms_norm"),
    # A reduced SD3 transformer (about 9M parameters) whose window gradient a 2-core CPU times in minutes.
    "cpu": dict(sample_size=32, patch_size=2, in_channels=16, num_layers=6, attention_head_dim=32,
                num_attention_heads=6, joint_attention_dim=192, caption_projection_dim=192,
                pooled_projection_dim=192, out_channels=16, pos_embed_max_size=32),
    # For tests only.
    "tiny": dict(sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
                 num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                 pooled_projection_dim=16, out_channels=4, pos_embed_max_size=8),
}


def benchmark(cfg):
    from diffusers import SD3Transformer2DModel

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
    use_bf16 = cfg.mixed_precision == "bf16" or (cfg.mixed_precision == "auto" and device.type == "cuda")
    torch.manual_seed(cfg.seed)
    if cfg.random_init:
        size = cfg.bench_size if cfg.bench_size != "auto" else ("sd35-medium" if device.type == "cuda" else "cpu")
        transformer = SD3Transformer2DModel(**SD3_CONFIGS[size])
    else:
        size = cfg.model
        transformer = SD3Transformer2DModel.from_pretrained(os.path.expanduser(cfg.model), subfolder="transformer")
    transformer.to(device, torch.bfloat16 if use_bf16 else torch.float32)
    # No gradient checkpointing here: the benchmark times the plain forward and backward passes.
    tc = transformer.config
    B = cfg.bench_batch or (4 if device.type == "cuda" else 2)
    W, L = cfg.window, 77
    # The reduced configurations at their own size; SD3.5-medium or a real model at --resolution.
    h = tc.sample_size if size in ("cpu", "tiny") else cfg.resolution // 8  # latent side
    cond = (torch.randn(B, L, tc.joint_attention_dim, device=device), torch.randn(B, tc.pooled_projection_dim, device=device))
    velocity_fn = make_velocity_fn(transformer, cond, None, 1.0, use_bf16)
    sigmas = jagg.sigma_schedule(max(W, 10), 3.0).to(device)[: W + 1]  # the first W steps of a 10-step schedule
    traj = jagg.rollout(velocity_fn, torch.randn(B, tc.in_channels, h, h, device=device), sigmas, cfg.noise_level)
    step_loss = jagg.make_step_loss(traj, torch.randn(B, device=device), 0, W,
                                    jagg.LossConfig(noise_level=cfg.noise_level, clip_range=cfg.clip_range))
    t = jagg.benchmark_window(velocity_fn, transformer.parameters(), traj.z, traj.t, step_loss, repeats=cfg.bench_repeats)
    result = {
        "window": W, "params": sum(p.numel() for p in transformer.parameters()), "device": str(
            torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
        "config": size, "batch": B, "tokens": (h // tc.patch_size) ** 2 + L, "bf16": use_bf16, "repeats": cfg.bench_repeats,
        "exact_backward_s": t["exact"]["backward"], "jagg_backward_s": t["jagg"]["backward"],
        "exact_fwd_graph_s": t["exact"]["fwd_graph"], "jagg_fwd_graph_s": t["jagg"]["fwd_graph"],
        "jagg_fwd_nograd_s": t["jagg"]["fwd_nograd"],
        "exact_step_s": t["exact"]["total"], "jagg_step_s": t["jagg"]["total"],
    }
    with contextlib.redirect_stdout(io.StringIO()) if cfg.json else contextlib.nullcontext():
        print(f"SD3 transformer '{size}', {result['params'] / 1e6:.1f}M parameters, {result['device']}, B = {B}, "
              f"{result['tokens']} tokens, bf16 {use_bf16}, medians of {cfg.bench_repeats} interleaved repeats")
        result.update(report_benchmark(t, W))
    if cfg.json:
        print(json.dumps(result))
    return result


def main(argv=None):
    cfg = parse_config(Config, argv, description=__doc__.split("\n")[0])
    cfg.validate()
    if cfg.benchmark:
        return benchmark(cfg)
    return train(cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
