"""GRPO on Stable Diffusion 3 / 3.5 with JAGG's gradient: Flow-GRPO's SD3 recipe in one file, top to bottom.

    python train_sd.py --model stabilityai/stable-diffusion-3.5-medium   # the paper's JAGG, W = 4
    python train_sd.py --model DIR --jagg-frac 0                         # exact GRPO, Flow-GRPO's gradient
    python train_sd.py --model tiny --epochs 2                           # a tiny random SD3.5, on a CPU
    torchrun --nproc_per_node 8 train_sd.py --model DIR                  # DDP: one all-reduce per step
    python train_sd.py --resume runs/sd --epochs 200                     # go on, bit for bit

The file reads in the order a run goes: 1. the flags; 2. the SD3 block, the only code that knows
SD3 (another family replaces it: examples/diffusers_models.py has the velocity_fns of Flux,
Qwen-Image, Wan and LTX-Video); 3. the rewards; 4. the run's files; 5. the loop, from rollout to
optimizer step, with jagg.backward_batch in it. An epoch is one rollout of --prompts-per-epoch x
--group-size samples per rank, then --steps-per-epoch optimizer steps. docs/flow_grpo.md lists
every difference from Flow-GRPO's train_sd3.py; long multi-node runs belong in a trainer built for
them, with JAGG plugged in (docs/your_trainer.md).
"""

import argparse
import contextlib
import copy
import importlib
import io
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.distributed as dist
from PIL import Image, ImageDraw, ImageFont

import jagg
from beyond_paper import options, ranks


# === 1. Flags: every hyperparameter, printed at start and saved in OUT/config.json ===
def arg(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class Args:
    model: str = arg("stabilityai/stable-diffusion-3.5-medium",
                     "a StableDiffusion3Pipeline: hub id or folder; tiny: random weights, built here")
    reward: str = arg("jpeg_compressibility", "one of REWARDS, or module:function (section 3)")
    prompts: str = arg("", "a text file, one prompt a line; empty: a small built-in list")
    out: str = arg("runs/sd", "the run's folder: config.json, metrics.jsonl, samples_*.png, checkpoint.pt")
    resume: str = arg("", "a run's folder: go on from its checkpoint (only --epochs, --eval-every may change)")
    seed: int = arg(0, "the seed of the LoRA's start, the prompts and the noise (each rank adds its rank)")
    epochs: int = arg(100, "epochs, each one rollout and its optimizer steps")
    # --- GRPO: Flow-GRPO's geneval_sd3 settings
    num_steps: int = arg(10, "T, sampling steps of a rollout")
    timestep_fraction: float = arg(0.99, "train the first int(T x this) steps (Flow-GRPO's: 9 of 10)")
    guidance_scale: float = arg(4.5, "classifier-free guidance v_u + scale (v_c - v_u); 1: none")
    noise_level: float = arg(0.7, "the SDE's noise level a: std_t = a sqrt(sigma / (1 - sigma))")
    prompts_per_epoch: int = arg(2, "prompts an epoch, the same on every rank; a group spans the ranks")
    group_size: int = arg(8, "samples per prompt on each rank")
    train_batch: int = arg(4, "samples per micro-batch: one rollout chunk, one call of the gradient")
    steps_per_epoch: int = arg(2, "optimizer steps an epoch (zero-advantage samples dropped, as Flow-GRPO)")
    lr: float = arg(3e-4, "AdamW learning rate")
    clip_range: float = arg(1e-4, "GRPO's ratio clip range")
    beta: float = arg(0.04, "KL weight to the reference model (the LoRA off); 0: no reference forward")
    lora_rank: int = arg(32, "LoRA rank on the attention projections (alpha 2 x rank); 0: every weight")
    ema: bool = arg(True, "keep an EMA of the trained weights: evaluated and saved (Flow-GRPO's)")
    gradient_checkpointing: bool = arg(True, "recompute activations in the backward pass: less memory")
    resolution: int = arg(0, "image size in pixels, a multiple of 16; 0: 512, or the model's if smaller")
    eval_every: int = arg(10, "evaluate every N epochs and at the last, on fixed prompts and noise")
    eval_samples: int = arg(8, "samples per evaluation: the prompt list in order, cycled")
    # --- JAGG
    window: int = arg(4, "W, sampling steps per window")
    jagg_frac: float = arg(1.0, "the share of windows JAGG takes (jagg.py section 7); 0: exact GRPO")
    route: str = arg("early", "with --jagg-frac < 1, which windows: early (ours) or velocity (the cosine rule)")
    fast: bool = arg(False, "OURS, beyond the paper: windows share end steps, interiors from the rollout")


RESUMABLE = ("epochs", "eval_every", "resume", "out")  # what --resume may change
ADV_CLIP, WEIGHT_DECAY, MAX_GRAD_NORM, EMA_DECAY, EMA_EVERY = 5.0, 1e-4, 1.0, 0.9, 8  # Flow-GRPO's
PROMPTS = ["a photo of a cat on a windowsill", "a red bicycle against a brick wall",
           "a bowl of ramen with chopsticks", "a lighthouse on a cliff at sunset",
           "an astronaut riding a horse", "a watercolor painting of a fox in the snow"]


def fail(message):  # one line, no traceback, before any work
    raise SystemExit(f"error: {message}")


def parse_args(argv=None):
    """Args from the command line, one --flag per field; a bad value ends here (check_args)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in fields(Args):
        kind = {"action": argparse.BooleanOptionalAction} if f.type is bool else {"type": f.type}
        parser.add_argument("--" + f.name.replace("_", "-"), default=f.default,
                            help=f.metadata["help"], **kind)
    return check_args(Args(**vars(parser.parse_args(argv))))


def check_args(a):
    """a, or a stop in one line naming the first bad value and what it must be."""
    T = int(a.num_steps * a.timestep_fraction)  # the trained steps
    rules = [("num_steps", a.num_steps >= 2, ">= 2"), ("epochs", a.epochs >= 1, ">= 1"),
             ("timestep_fraction", 0 < a.timestep_fraction <= 1 and T >= 1, "in (0, 1], train >= 1 step"),
             ("guidance_scale", a.guidance_scale >= 1, ">= 1"),
             ("noise_level", 0 < a.noise_level <= 1, "in (0, 1]"), ("seed", a.seed >= 0, ">= 0"),
             ("prompts_per_epoch", a.prompts_per_epoch >= 1, ">= 1"),
             ("group_size", a.group_size >= 2, ">= 2 (advantages compare a group's samples)"),
             ("train_batch", a.train_batch >= 1, ">= 1"), ("steps_per_epoch", a.steps_per_epoch >= 1, ">= 1"),
             ("lr", a.lr > 0, "> 0"), ("clip_range", 0 < a.clip_range < 1, "in (0, 1)"),
             ("beta", a.beta >= 0, ">= 0"), ("lora_rank", a.lora_rank >= 0, ">= 0"),
             ("resolution", a.resolution >= 0 and a.resolution % 16 == 0, "0 or a multiple of 16"),
             ("eval_every", a.eval_every >= 1, ">= 1"), ("eval_samples", a.eval_samples >= 1, ">= 1"),
             ("window", 2 <= a.window <= max(T, 2), f"in [2, the {T} trained steps]"),
             ("jagg_frac", 0 <= a.jagg_frac <= 1, "in [0, 1]"),
             ("route", a.route in ("early", "velocity"), "early or velocity"),
             ("reward", a.reward in REWARDS or a.reward.count(":") == 1,
              f"one of {', '.join(REWARDS)} or module:function"),
             ("prompts", not a.prompts or os.path.isfile(a.prompts), "a text file, or empty")]
    floats = [f.name for f in fields(a) if f.type is float]
    rules += [(name, math.isfinite(getattr(a, name)), "a finite number") for name in floats]
    for name, holds, must in rules:
        if not holds:
            fail(f"--{name.replace('_', '-')} must be {must}, got {getattr(a, name)!r}")
    return a


# === 2. The SD3 block: every line that knows SD3 (another family replaces these functions) ===
def tiny_pipeline():
    """A StableDiffusion3Pipeline with SD3.5's parts (three text encoders, VAE, an MMDiT-X with dual
    attention) at a size that trains in seconds on a CPU, random weights: its images mean nothing."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from diffusers import StableDiffusion3Pipeline
    import transformers
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer
    from transformers import T5Config, T5EncoderModel, T5Tokenizer
    transformers.logging.set_verbosity_error()  # a prompt's letters overflow its 16 tokens: cut, silently
    letters = "abcdefghijklmnopqrstuvwxyz"  # a word is spelled letter by letter, 16 tokens at most
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1,
             **{c + e: 2 + 2 * i + j for i, c in enumerate(letters) for j, e in enumerate(("", "</w>"))}}
    clip_tok = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=16)
    t5_tok = T5Tokenizer(vocab=[("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
                         + [(c, -1.0) for c in letters], extra_ids=0, model_max_length=16)

    def clip():
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(clip_tok), hidden_size=16, intermediate_size=32, projection_dim=16,
            num_attention_heads=2, num_hidden_layers=1, max_position_embeddings=16, bos_token_id=0,
            eos_token_id=1, pad_token_id=1))
    t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tok), d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                 num_heads=4, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    vae = AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(8, 8), latent_channels=4,
                        layers_per_block=1, norm_num_groups=8, sample_size=16, mid_block_add_attention=False,
                        down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2,
                        use_quant_conv=False, use_post_quant_conv=False)
    transformer = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=32,
        pos_embed_max_size=8, dual_attention_layers=(0,), qk_norm="rms_norm")
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=clip(), tokenizer=clip_tok, text_encoder_2=clip(), tokenizer_2=clip_tok,
        text_encoder_3=t5, tokenizer_3=t5_tok)


def load_pipeline(args, device, dtype):
    """The pipeline frozen on device; its transformer's LoRA (Flow-GRPO's: alpha 2 x rank on the
    attention projections of both streams) or every weight trainable, in fp32."""
    from diffusers import StableDiffusion3Pipeline
    if args.model == "tiny":
        with torch.random.fork_rng():  # the same tiny model whatever --seed, which then starts the LoRA
            torch.manual_seed(0)
            pipe = tiny_pipeline()
    else:
        try:
            pipe = StableDiffusion3Pipeline.from_pretrained(args.model, torch_dtype=dtype)
        except Exception as e:
            fail(f"cannot load --model {args.model!r} ({type(e).__name__}: {str(e)[:200]}): give a "
                 "StableDiffusion3Pipeline folder, or a hub id on a machine with network")
    pipe.set_progress_bar_config(disable=True)  # and diffusers' warning at every encoding of a long prompt:
    sd3 = "diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3"
    logging.getLogger(sd3).setLevel(logging.ERROR)
    pipe.to(device)
    for part in (pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3, pipe.transformer):
        if part is not None:  # frozen, and in eval mode: a T5 built in code would apply its dropout
            part.requires_grad_(False).eval()
    transformer = pipe.transformer
    if args.lora_rank:
        from peft import LoraConfig
        targets = ["to_k", "to_q", "to_v", "to_out.0", "add_k_proj", "add_q_proj", "add_v_proj", "to_add_out"]
        transformer.add_adapter(LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank,
                                           init_lora_weights="gaussian", target_modules=targets))
        from diffusers.training_utils import cast_training_params
        cast_training_params(transformer)  # the LoRA in fp32; the frozen base may stay in bf16
    else:
        transformer.to(torch.float32).requires_grad_(True)
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    return pipe


def latent_shape(pipe, resolution):
    """One sample's latents [C, h, w] at resolution pixels (0: 512, or the model's size if smaller)."""
    config, factor = pipe.transformer.config, pipe.vae_scale_factor
    size = resolution or min(512, config.sample_size * factor)
    limit = config.pos_embed_max_size * config.patch_size * factor  # the position embedding's reach
    if size > limit:
        fail(f"--resolution {size} is above this model's {limit} pixels: give at most {limit}")
    return (config.in_channels, size // factor, size // factor)


def pipeline_sigmas(pipe, num_steps):
    """The T + 1 sigmas the pipeline's own scheduler samples at, 1 down to 0 (Flow-GRPO's)."""
    scheduler = copy.deepcopy(pipe.scheduler)
    scheduler.set_timesteps(num_steps)
    return scheduler.sigmas.float()  # [T + 1]


@torch.no_grad()
def encode(pipe, prompts, device):
    """(cond, uncond): each (prompt_embeds [B, L, E], pooled [B, P]); uncond of the empty prompt."""
    t5_len = 256 if pipe.tokenizer_3 is None else min(256, pipe.tokenizer_3.model_max_length)
    pe, npe, pooled, npooled = pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None,
                                                  device=device, negative_prompt=[""] * len(prompts),
                                                  max_sequence_length=t5_len)
    return (pe.float(), pooled.float()), (npe.float(), npooled.float())


def make_velocity_fn(transformer, cond, uncond, guidance_scale, use_bf16):
    """jagg.py's velocity_fn(z [S, B, C, H, W], t [S, B]) -> v [S, B, C, H, W] with classifier-free
    guidance; cond, uncond: (prompt_embeds [B, L, E], pooled [B, P]), repeated as a block per step
    (step-major rows). The unconditional branch runs without graph, as in Flow-GRPO's trainer."""
    def velocity_fn(z, t):
        S, x = t.shape[0], z.flatten(0, 1)  # x: [S*B, C, H, W], row s * B + b
        timestep = (t.flatten() * 1000).to(x.dtype)  # SD3 takes sigma x 1000
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=use_bf16):
            v = transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=cond[0].repeat(S, 1, 1),
                            pooled_projections=cond[1].repeat(S, 1), return_dict=False)[0]
            if guidance_scale > 1:
                with torch.no_grad():
                    v_u = transformer(hidden_states=x, timestep=timestep,
                                      encoder_hidden_states=uncond[0].repeat(S, 1, 1),
                                      pooled_projections=uncond[1].repeat(S, 1), return_dict=False)[0]
                v = v_u + guidance_scale * (v - v_u)  # [S*B, C, H, W]
        return v.to(z.dtype).reshape(z.shape)  # fp32 latents, whatever the autocast
    return velocity_fn


def reference_velocity_fn(transformer, frozen, cond, uncond, guidance_scale, use_bf16):
    """The KL reference's velocity_fn: a frozen copy of the base weights (full fine-tuning), or the
    transformer with its LoRA switched off, as Flow-GRPO's disable_adapter()."""
    if frozen is not None:
        return make_velocity_fn(frozen, cond, uncond, guidance_scale, use_bf16)
    velocity_fn = make_velocity_fn(transformer, cond, uncond, guidance_scale, use_bf16)

    def lora_off(z, t):
        transformer.disable_adapters()
        try:
            return velocity_fn(z, t)
        finally:
            transformer.enable_adapters()
    return lora_off


@torch.no_grad()
def decode(pipe, latents):
    """Latents [B, C, h, w] -> B PIL images."""
    x = latents.to(pipe.vae.dtype) / pipe.vae.config.scaling_factor + (pipe.vae.config.shift_factor or 0.0)
    images = pipe.vae.decode(x, return_dict=False)[0].float()  # [B, 3, H, W] in [-1, 1]
    pixels = ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)  # [B, 3, H, W]
    return [Image.fromarray(im) for im in pixels.permute(0, 2, 3, 1).cpu().numpy()]  # [H, W, 3] each


# === 3. Rewards: reward_fn(images: a list of PIL images, prompts: a list of str) -> B numbers ===
def jpeg_kb(image):
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=95)
    return buffer.tell() / 1000


def darkness(image):  # 1 - the mean luminance, in [0, 1]: a reward any model can learn, to see the loop work
    return 1 - sum(image.convert("L").tobytes()) / (255 * image.width * image.height)


REWARDS = {"jpeg_compressibility": lambda images, prompts: [-jpeg_kb(im) for im in images],  # DDPO's
           "jpeg_incompressibility": lambda images, prompts: [jpeg_kb(im) for im in images],
           "darkness": lambda images, prompts: [darkness(im) for im in images]}


def load_reward(name):
    """The reward_fn --reward names: a built-in, or module:function imported from here."""
    if name in REWARDS:
        return REWARDS[name]
    try:
        module, function = name.split(":")
        return getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as e:
        fail(f"--reward {name!r}: cannot import it ({type(e).__name__}: {e})")


def rewards_of(reward_fn, images, prompts, name):
    """[B] rewards, checked: one finite number per image, or the run ends in one line."""
    values = torch.as_tensor(reward_fn(images, prompts), dtype=torch.float32).reshape(-1)
    if values.shape != (len(images),) or not torch.isfinite(values).all():
        broken = int((~values.isfinite()).sum())
        fail(f"--reward {name} returned {values.numel()} numbers, {broken} not finite, for {len(images)} "
             "images: it must return one finite number per image")
    return values


# === 4. The run's files: each written whole (beside its place, then renamed): a kill leaves old or new ===
def save(path, write, mode="w"):
    with open(path + ".tmp", mode) as f:
        write(f)
    os.replace(path + ".tmp", path)


def trainable(transformer):  # the LoRA's weights, or all of them: what the optimizer trains
    return {n: p for n, p in transformer.named_parameters() if p.requires_grad}


def save_checkpoint(args, world, epoch, transformer, optimizer, ema, rows):
    state = {"config": asdict(args), "world": world, "epoch": epoch, "rows": rows, "ema": ema,
             "weights": {n: p.detach() for n, p in trainable(transformer).items()},
             "optimizer": optimizer.state_dict()}
    save(os.path.join(args.out, "checkpoint.pt"), lambda f: torch.save(state, f), "wb")


def resume_checkpoint(args, world):
    """--resume's checkpoint, or one line saying why this command would train another run."""
    path = os.path.join(args.resume, "checkpoint.pt")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError) as e:
        fail(f"--resume {args.resume!r}: cannot read {path} ({type(e).__name__}): give a run's folder")
    saved = {**state["config"], "world size": state["world"]}
    now = {**asdict(args), "world size": world}
    differ = [f"{k} {saved[k]!r} -> {now[k]!r}" for k in now if k not in RESUMABLE and saved.get(k) != now[k]]
    if differ or args.epochs < state["epoch"]:
        fail(f"--resume {args.resume!r} would train another run: {', '.join(differ) or 'fewer epochs'}"
             " (only --epochs, more, and --eval-every may change)")
    return state


# === 5. The loop ===
def sample(pipe, transformer, prompts, args, shape, sigmas, generator, use_bf16):
    """Roll out the prompts by Flow-GRPO's SDE in chunks of --train-batch from noise of shape [C, h, w]:
    (trajectories [T, B, ...], cond, uncond, images); the transformer in eval mode (no dropout)."""
    trajs, conds, unconds, images = [], [], [], []
    for i in range(0, len(prompts), args.train_batch):
        cond, uncond = encode(pipe, prompts[i : i + args.train_batch], sigmas.device)
        noise = torch.randn(len(cond[0]), *shape, generator=generator, device=sigmas.device)  # [b, C, h, w]
        fn = make_velocity_fn(transformer.eval(), cond, uncond, args.guidance_scale, use_bf16)
        trajs.append(jagg.rollout(fn, noise, sigmas, args.noise_level, generator))
        conds.append(cond)
        unconds.append(uncond)
        images += decode(pipe, trajs[-1].sample)
    tensors = {k: torch.cat([getattr(t, k) for t in trajs], dim=1) for k in jagg.Trajectory.TENSORS}
    traj = jagg.Trajectory(**tensors, noise_level=args.noise_level)  # [T, B, ...]
    cond = tuple(torch.cat(parts) for parts in zip(*conds))  # (prompt_embeds [B, L, E], pooled [B, P])
    uncond = tuple(torch.cat(parts) for parts in zip(*unconds))  # the empty prompt's, alike
    return traj, cond, uncond, images


def sample_grid(images, prompts, rewards, cell=96):
    """Images in rows of 4, each with its prompt and reward beneath."""
    grid = Image.new("RGB", (4 * cell, -(-len(images) // 4) * (cell + 32)), "white")
    font = ImageFont.load_default(size=12)
    for i, (im, p, r) in enumerate(zip(images, prompts, rewards)):
        x, y = (i % 4) * cell, (i // 4) * (cell + 32)
        grid.paste(im.resize((cell, cell), Image.NEAREST), (x, y))
        ImageDraw.Draw(grid).text((x + 3, y + cell + 2), f"{p[:16]}\n{r:.3f}", fill="black", font=font)
    return grid


def train(args):
    # Many GPUs (torchrun): DDP as nanoGPT runs it, with JAGG's rule (jagg.py section 10,
    # docs/many_gpus.md): every backward inside no_sync, one all-reduce per optimizer step.
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if on_gpu else torch.device("cpu")
    use_bf16 = on_gpu  # bf16 autocast on a GPU; fp32 on a CPU
    # Every check that needs no model, before any work: the run to go on, the reward, the prompts
    if args.resume:
        args.out = args.resume
        state = resume_checkpoint(args, world)
    elif os.path.isfile(os.path.join(args.out, "checkpoint.pt")):
        fail(f"--out {args.out!r} holds a run: go on with --resume {args.out}, or give another --out")
    reward_fn = load_reward(args.reward)
    prompts_all = PROMPTS
    if args.prompts:
        with open(args.prompts, encoding="utf-8", errors="replace") as f:
            prompts_all = [line.strip() for line in f if line.strip()]
        if not prompts_all:
            fail(f"--prompts {args.prompts!r} holds no prompt: give one a line")
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        fail(f"--out {args.out!r} cannot be made ({e.strerror}): give a folder you can write")
    if world > 1:
        dist.init_process_group("nccl" if on_gpu else "gloo")
    torch.manual_seed(args.seed)  # the LoRA starts alike on every rank and in a resumed run
    pipe = load_pipeline(args, device, torch.bfloat16 if use_bf16 else torch.float32)
    transformer, shape = pipe.transformer, latent_shape(pipe, args.resolution)  # shape: [C, h, w]
    sigmas = pipeline_sigmas(pipe, args.num_steps).to(device)  # [T + 1]
    net = transformer  # what the training forwards run through: DDP's wrapper on many GPUs
    no_sync = contextlib.nullcontext
    if world > 1:
        device_ids = [device.index] if on_gpu else None
        net = torch.nn.parallel.DistributedDataParallel(transformer, device_ids=device_ids)
        no_sync = net.no_sync
    params = list(trainable(transformer).values())
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=WEIGHT_DECAY)
    ema = {n: p.detach().clone() for n, p in trainable(transformer).items()} if args.ema else None
    frozen = None  # the KL's reference under full fine-tuning: a copy of the base weights
    if args.beta > 0 and not args.lora_rank:
        frozen = copy.deepcopy(transformer).requires_grad_(False)
    start, rows = 0, []
    if args.resume:  # where the run stopped: weights, Adam's moments, the EMA, the metrics
        with torch.no_grad():
            for n, p in trainable(transformer).items():
                p.copy_(state["weights"][n])
        optimizer.load_state_dict(state["optimizer"])
        start, rows, ema = state["epoch"], state["rows"], state["ema"]
    if rank == 0:
        print(f"config: {json.dumps(asdict(args))}\ntrainable parameters: "
              f"{sum(p.numel() for p in params):,}, latents {shape}, device {device}, world {world}")
        config = {**asdict(args), "world": world}
        save(os.path.join(args.out, "config.json"), lambda f: json.dump(config, f, indent=2))
    loss_cfg = jagg.LossConfig(args.noise_level, args.clip_range, args.beta)
    n_train = int(args.num_steps * args.timestep_fraction)  # Flow-GRPO trains the first 9 of 10 steps
    eval_prompts = [prompts_all[i % len(prompts_all)] for i in range(args.eval_samples)]

    def velocity_fns(cond, uncond, idx):  # the policy's velocity_fn and the KL reference's, for samples idx
        c, u = tuple(x[idx] for x in cond), tuple(x[idx] for x in uncond)
        ref_fn = None
        if args.beta > 0:
            ref_fn = reference_velocity_fn(transformer, frozen, c, u, args.guidance_scale, use_bf16)
        return make_velocity_fn(net, c, u, args.guidance_scale, use_bf16), ref_fn

    def evaluate(epoch):
        """The mean reward on fixed prompts and noise, the EMA's weights in; rank 0 saves their grid."""
        trained = {n: p.detach().clone() for n, p in trainable(transformer).items()}
        if ema is not None:
            with torch.no_grad():
                for n, p in trainable(transformer).items():
                    p.copy_(ema[n])
        g = torch.Generator(device).manual_seed(args.seed + 12345)  # the same noise at every evaluation
        images = sample(pipe, transformer, eval_prompts, args, shape, sigmas, g, use_bf16)[3]
        rewards = rewards_of(reward_fn, images, eval_prompts, args.reward)
        with torch.no_grad():
            for n, p in trainable(transformer).items():
                p.copy_(trained[n])
        if rank == 0:
            grid = sample_grid(images[:16], eval_prompts[:16], rewards.tolist()[:16])
            path = os.path.join(args.out, f"samples_{epoch:04d}.png")
            save(path, lambda f: grid.save(f, format="PNG"), "wb")
        return rewards.mean().item()

    if start == 0:
        rows.append({"epoch": 0, "eval/reward": evaluate(0)})
    for epoch in range(start + 1, args.epochs + 1):
        epoch_start = time.perf_counter()
        # 1. Rollout: the epoch's prompts, alike on every rank, and each rank's own noise, seeded by
        # the epoch, so that a resumed run draws what an uninterrupted one would
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + epoch)
        noise_g = torch.Generator(device).manual_seed((args.seed * 1_000_003 + epoch) * 1009 + rank)
        prompt_ids = torch.randint(len(prompts_all), (args.prompts_per_epoch,), generator=g)
        prompt_ids = prompt_ids.repeat_interleave(args.group_size).to(device)  # [B]
        prompts = [prompts_all[i] for i in prompt_ids.tolist()]
        traj, cond, uncond, images = sample(pipe, transformer, prompts, args, shape, sigmas, noise_g,
                                            use_bf16)
        # 2. Rewards and advantages. A group is a prompt's samples on every rank; Flow-GRPO divides by
        # the std of all the epoch's rewards (global std), clips to 5, and drops the samples whose
        # advantage is 0, putting random ones back so that the optimizer steps split evenly
        rewards = rewards_of(reward_fn, images, prompts, args.reward).to(device)  # [B]
        all_rewards = ranks.all_gather_cat(rewards)  # [world * B]
        adv = jagg.group_advantages(all_rewards, ranks.all_gather_cat(prompt_ids), global_std=True,
                                    clip=ADV_CLIP).reshape(world, -1)[rank]  # [B]: this rank's
        keep, dropped = (adv != 0).nonzero().flatten().cpu(), (adv == 0).nonzero().flatten().cpu()
        back = dropped[torch.randperm(len(dropped), generator=g)][: -len(keep) % args.steps_per_epoch]
        order = torch.cat([keep, back])[torch.randperm(len(keep) + len(back), generator=g)]
        # 3. The optimizer steps: each the mean of its micro-batches' gradients over the ranks
        transformer.train()
        stats, grad_seconds = [], 0.0
        for i, samples in enumerate(order.tensor_split(args.steps_per_epoch)):
            micro = samples.split(args.train_batch)
            for idx in micro:
                idx = idx.to(device)
                policy, ref_fn = velocity_fns(cond, uncond, idx)
                minibatch = traj.subset(idx).first_steps(n_train)
                grad_start = time.perf_counter()
                with no_sync():  # no all-reduce in the backward passes: one in the step below
                    if not args.fast:  # THE JAGG CALL: the micro-batch's gradient added to .grad
                        s = jagg.backward_batch(policy, minibatch, adv[idx], loss_cfg, args.window,
                                                 args.jagg_frac, ref_fn, args.route)[0]
                    else:  # OURS: windows share end steps, interiors from the rollout (beyond_paper/)
                        opts = options.JaggOptions(args.window, args.jagg_frac, anchors="shared",
                                                   interior="rollout", route=args.route)
                        s = options.backward_batch(policy, minibatch, adv[idx], loss_cfg, opts, ref_fn)[0]
                grad_seconds += time.perf_counter() - grad_start
                stats.append(s)
            # The step: the mean over the micro-batches and the ranks in ONE all-reduce, Flow-GRPO's
            # clip, optimizer.step(), skipped on every rank alike where a loss or the gradient is not
            # finite (a NaN would poison Adam's moments for good), then .grad cleared
            step = (epoch - 1) * args.steps_per_epoch + i + 1
            losses = [s["loss"] for s in stats[len(stats) - len(micro):]]
            ranks.optimizer_step(params, optimizer, losses, micro_batches=max(len(micro), 1),
                                 max_grad_norm=MAX_GRAD_NORM, step=step)
            if ema is not None and step % EMA_EVERY == 0:  # Flow-GRPO's EMA of the trained weights
                decay = min(step / (9 + step), EMA_DECAY)
                for n, p in trainable(transformer).items():
                    ema[n].mul_(decay).add_(p.detach(), alpha=1 - decay)
        # 4. One line an epoch, with the gradient's seconds: beside a --jagg-frac 0 run, JAGG's speedup
        row = {"epoch": epoch, "rollout/reward_mean": all_rewards.mean().item(),
               "time/grad_seconds": grad_seconds, "train/grad_rows": sum(s["grad_rows"] for s in stats)}
        for key in ("loss", "kl", "clipfrac", "approx_kl"):
            row[f"train/{key}"] = sum(s[key] for s in stats) / max(len(stats), 1)
        row["time/epoch_seconds"] = time.perf_counter() - epoch_start
        if epoch % args.eval_every == 0 or epoch == args.epochs:
            row["eval/reward"] = evaluate(epoch)
        rows.append(row)
        if rank == 0:
            evaluation = f" eval {row['eval/reward']:.3f}" if "eval/reward" in row else ""
            print(f"epoch {epoch}/{args.epochs} reward {row['rollout/reward_mean']:.3f}{evaluation} loss "
                  f"{row['train/loss']:+.5f} kl {row['train/kl']:.5f} clipfrac {row['train/clipfrac']:.3f} "
                  f"gradients {grad_seconds:.1f} s ({row['train/grad_rows']} rows with grad)", flush=True)
            save_checkpoint(args, world, epoch, transformer, optimizer, ema, rows)
            lines = "".join(json.dumps(r) + "\n" for r in rows)
            save(os.path.join(args.out, "metrics.jsonl"), lambda f: f.write(lines))
    if rank == 0:  # the trained weights for users, the EMA if kept
        from safetensors.torch import save_file
        weights = ema if ema is not None else {n: p.detach() for n, p in trainable(transformer).items()}
        path = os.path.join(args.out, "weights.safetensors")
        save_file({n: w.contiguous() for n, w in weights.items()}, path)
        print(f"eval reward {rows[0]['eval/reward']:.3f} -> {rows[-1]['eval/reward']:.3f}, gradients "
              f"{sum(r.get('time/grad_seconds', 0.0) for r in rows):.0f} s; weights in {path}")
    if world > 1:
        dist.barrier()  # no rank tears the group down while another still uses it
        dist.destroy_process_group()
    return rows

if __name__ == "__main__":
    train(parse_args())
