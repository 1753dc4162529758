"""The lab's SD3 runner: the full trainer that made the kept mini SD3 runs, frozen with its long-run machinery.

    python lab/sd_runner.py $(python lab/presets.py mini) --method jagg --window 4
    torchrun --nproc_per_node=2 lab/sd_runner.py --model DIR [--fsdp]
    python lab/sd_runner.py --method exact --out E; python lab/sd_runner.py --method jagg --out J
    python lab/compare_runs.py E J --out DIR           # JAGG against exact: reward kept, speedups

This is provenance, not the reference: train_sd.py at the top level is the trainer to read and
use. This runner is the trainer as it was when the lab's SD3 tables were made, with what the lab's
experiments need beyond it (FSDP2, the SDE window, the probe, routing schedules, every option,
resume identity, a folder lock, signal stops); its tests are lab/tests/test_sd_runner.py.

The file reads in the order a run goes: 1. the flags; 2. THE MODEL, the only SD3 code (another
family replaces that block, keeping its functions' signatures: the rest passes a conditioning
around as encode returns it, a tuple of tensors batched on dim 0); 3. the rewards; 4. rollouts;
5. the run's files; 6. the training loop, train(), from rollout to optimizer step; 7. the command
line. An epoch is one rollout of --prompts-per-epoch x --group-size samples and its optimizer
steps; a sampling step is one of its --num-steps. docs/flow_grpo.md lists what differs from
Flow-GRPO's trainer.
"""

import argparse
import contextlib
import copy
import dataclasses
import functools
import importlib
import io
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from PIL import Image, ImageDraw, ImageFont
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jagg  # noqa: E402
from beyond_paper import checks, options, probe, ranks  # noqa: E402
import checkpoint  # noqa: E402  (this file's folder, lab/, is on the path)
import grpo_step  # noqa: E402
import run_folder  # noqa: E402
from checkpoint import load_weights, trainable  # noqa: E402
from run_folder import atomic_write, write_json  # noqa: E402

# === 1. Flags: every hyperparameter in one place, printed at start and saved in config.json ===
RANGES = {">= 0": lambda v: v >= 0, ">= 1": lambda v: v >= 1, ">= 2": lambda v: v >= 2,
          "> 0": lambda v: v > 0, "in (0, 1]": lambda v: 0 < v <= 1,
          "in (0, 1)": lambda v: 0 < v < 1}  # a flag's range, as its error says it


def flag(default, help, must=None, choices=None):
    return dataclasses.field(default=default,
                             metadata={"help": help, "must": must, "choices": choices})


@dataclasses.dataclass
class Config:
    model: str = flag("stabilityai/stable-diffusion-3.5-medium",
                      "diffusers StableDiffusion3Pipeline: hub id or folder")
    prompts: str = flag("", "text file, one prompt a line; empty: a small built-in list")
    reward: str = flag("jpeg_compressibility",
                       "a name in REWARDS; module:function, imported at start (its module's "
                       "code runs, even when the run is then refused) and importable from "
                       "here; or a CLIP folder (PickScore)")
    resolution: int = flag(0, "image size in pixels, a multiple of 16; 0: 512 (Flow-GRPO's), or "
                              "the model's if smaller")
    out: str = flag("runs/sd", "output folder, one run's: config.json, metrics.jsonl, "
                               "samples_*.png, weights, checkpoint.pt")
    resume: str = flag("", "continue the run in this folder with its flags; only --epochs (more), "
                           "--eval-every, --checkpoint-every and --out may change")
    overwrite: bool = flag(False, "start afresh in an --out that holds a run, deleting its files")
    seed: int = flag(0, "random seed; each rank adds its rank to the sampling seed", ">= 0")
    method: str = flag("jagg", "exact (Flow-GRPO's backward through every step) or jagg",
                       choices=["exact", "jagg"])
    epochs: int = flag(100, "GRPO epochs, each a rollout and then its optimizer steps", ">= 1")
    num_steps: int = flag(10, "T, sampling steps of a rollout (Flow-GRPO's 10)", ">= 2")
    timestep_fraction: float = flag(0.99, "train the first int(T x this) steps (Flow-GRPO's 0.99: "
                                          "9 of 10)", "in (0, 1]")
    sigma_schedule: str = flag("scheduler", "the pipeline's sigmas, or jagg.sigma_schedule's",
                               choices=["scheduler", "linear"])
    sde_window: int = flag(0, "K > 0: only K steps in a row, from a random one, are SDE and "
                              "trained (Flow-GRPO-Fast)", ">= 0")
    sde_range_end: int = flag(0, "the SDE window lies in steps 0 .. this - 1; 0: T - 1 (the last "
                                 "step stays ODE)")
    guidance_scale: float = flag(4.5, "classifier-free guidance v_u + scale (v_c - v_u); 1: none",
                                 ">= 1")
    noise_level: float = flag(0.7, "a, Flow-GRPO's SDE noise level: std_t = a sqrt(sigma / "
                                   "(1 - sigma))", "in (0, 1]")
    prompts_per_epoch: int = flag(2, "prompts sampled each epoch, the same on every rank", ">= 1")
    group_size: int = flag(8, "samples per prompt on each rank; a group is all ranks' samples of "
                              "a prompt", ">= 1")
    train_batch: int = flag(4, "samples per micro-batch (one forward and backward); rollouts "
                               "run in these too", ">= 1")
    steps_per_epoch: int = flag(2, "optimizer steps an epoch, zero advantages dropped; 0: one a "
                                   "micro-batch", ">= 0")
    lr: float = flag(3e-4, "AdamW learning rate (Flow-GRPO's geneval_sd3)", "> 0")
    clip_range: float = flag(1e-4, "GRPO's ratio clip range (Flow-GRPO's)", "in (0, 1)")
    beta: float = flag(0.04, "KL weight to the reference model (0: no reference forward)", ">= 0")
    global_std: bool = flag(True, "advantages over the std of all the epoch's rewards "
                                  "(Flow-GRPO's), else each group's")
    lora_rank: int = flag(32, "LoRA rank on the attention projections (alpha 2 x rank); 0: full "
                              "fine-tuning", ">= 0")
    gradient_checkpointing: bool = flag(True, "recompute activations in the backward pass to "
                                              "save memory")
    ema: bool = flag(True, "keep an EMA of the trained weights: evaluated and saved (Flow-GRPO's)")
    eval_every: int = flag(10, "every N epochs and at the last: evaluate on fixed prompts and "
                               "noise", ">= 1")
    checkpoint_every: int = flag(1, "every N epochs and at the last: checkpoint (a stop or a kill "
                                    "loses the epochs since)", ">= 1")
    eval_samples: int = flag(8, "samples per evaluation: the prompt list in order, cycled", ">= 1")
    fsdp: bool = flag(False, "under torchrun, shard the transformer with FSDP2 (else DDP)")
    window: int = flag(4, "W, sampling steps per window (the paper's) or per segment between "
                          "shared anchors")
    jagg_frac: float = flag(1.0, "the share of windows (the most linear by --route) JAGG takes; "
                                 "the rest exact")
    anchors: str = flag("window", "window: the paper's; shared: windows share end steps",
                        choices=options.ANCHOR_MODES)
    interior: str = flag("forward", "interiors from a no-graph forward (the paper's), or the "
                                    "rollout's", choices=options.INTERIOR_MODES)
    weights: str = flag("time", "interpolation weights by t (the paper's) or by step index",
                        choices=options.WEIGHTS)
    max_graph_rows: int = flag(None, "at most this many anchor rows in a graph at once: same "
                                     "gradient, less memory")
    route: str = flag("velocity", "which windows --jagg-frac gives JAGG: velocity (jagg.py's free "
                                  "score; it picks the lowest-noise windows, as late does), early "
                                  "(the highest-noise first: smaller error and more reward kept "
                                  "on the toy and the mini SD3), late, or probe (measured)",
                      choices=options.ROUTES)
    probe_every: int = flag(0, "every N epochs, measure JAGG's gradient against exact on one "
                               "micro-batch; 0: off", ">= 0")

    def jagg_options(self, method=None):
        """The JaggOptions of these flags; method "exact" trains every window exactly."""
        exact = (method or self.method) == "exact"
        return options.JaggOptions(
            window=self.window, jagg_frac=0.0 if exact else self.jagg_frac, anchors=self.anchors,
            interior=self.interior, weights=self.weights, max_graph_rows=self.max_graph_rows,
            route=self.route)

    def loss_config(self):
        """The per-step loss's knobs (jagg.LossConfig) of these flags."""
        return jagg.LossConfig(self.noise_level, self.clip_range, self.beta)

    def papers_jagg(self, world=1):
        """Whether jagg.backward_batch computes the gradient: every JAGG flag at the paper's value
        (--method exact is its jagg_frac 0), the route jagg.py's earliest-first schedule or moot
        (--jagg-frac 0 or 1: every window or none); a fixed schedule needs no agreement between
        ranks. Else options.backward_batch, the same where both apply (this runner's default route,
        velocity, is the one jagg.py took when the kept runs were made)."""
        opts = self.jagg_options()
        if opts.jagg_frac in (0.0, 1.0):
            opts = dataclasses.replace(opts, route="early")
        return opts == options.JaggOptions(window=opts.window, jagg_frac=opts.jagg_frac)

    def trained_steps(self):  # the SDE window's steps, or Flow-GRPO's first int(T * fraction)
        return self.sde_window or int(self.num_steps * self.timestep_fraction)

    def ranges(self):
        """(ok, flag, what it must be) of each flag declared with a range (the JAGG flags':
        beyond_paper/options.py')."""
        return [(RANGES[f.metadata["must"]](getattr(self, f.name)), f.name, f.metadata["must"])
                for f in dataclasses.fields(self) if f.metadata["must"]]


# Flow-GRPO's settings that nothing here varies: fixed, and saved in config.json beside the flags.
FIXED = dict(adv_clip=5.0, weight_decay=1e-4, max_grad_norm=1.0, ema_decay=0.9, ema_every=8,
             probe_decay=0.5)
RESUMABLE = ("epochs", "eval_every", "checkpoint_every", "out", "resume",
             "overwrite")  # what --resume may change
DEFAULT_PROMPTS = ["a photo of a cat sitting on a windowsill",
                   "a red bicycle leaning against a brick wall", "a bowl of ramen with chopsticks",
                   "a lighthouse on a cliff at sunset", "an astronaut riding a horse",
                   "a watercolor painting of a fox in the snow", "a cozy cabin in a pine forest",
                   "a bunch of sunflowers in a vase"]


def parser_of(defaults=True):
    """The command line's parser: each Config field a --flag with its help (booleans get --no-...);
    without defaults, a flag not given is left out of what it parses."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Config):
        if f.type is bool:
            kind = dict(action=argparse.BooleanOptionalAction)
        else:
            kind = dict(type=f.type, choices=f.metadata["choices"])
        default = f.default if defaults else argparse.SUPPRESS
        parser.add_argument("--" + f.name.replace("_", "-"), default=default,
                            help=f.metadata["help"], **kind)
    return parser


def parse(argv=None):
    """Config from the command line."""
    return Config(**vars(parser_of().parse_args(argv)))


def given_flags(argv=None):
    """The fields whose flags argv names: --resume takes the others from the run."""
    return set(vars(parser_of(defaults=False).parse_args(argv)))


def fail(message):  # one line, no traceback
    raise SystemExit(f"error: {message}")


def validate(cfg, given=None):
    """Every bad value ends the run here in one line naming it, before any model loads. Returns
    cfg resolved: the resolution read from the model folder, --out where --resume is, and with
    --resume the run's own flags for those not given (given: the fields the command line named;
    None: all of them)."""
    if cfg.resume and os.path.isfile(checkpoint_path(cfg.resume)) and given is not None:
        saved = read_checkpoint(cfg.resume, mmap=True)["config"]
        keep = {k: v for k, v in saved.items() if k in Config.__dataclass_fields__
                and k not in given and k not in ("out", "resume", "overwrite")}
        cfg = dataclasses.replace(cfg, **keep)
    floats = [(n, v) for n, v in dataclasses.asdict(cfg).items() if isinstance(v, float)]
    finite = [(math.isfinite(v), n, "a finite number") for n, v in floats]
    for ok, name, must in finite + cfg.ranges():  # every float finite, then in its declared range
        if not ok:
            fail(f"--{name.replace('_', '-')} must be {must}, got {getattr(cfg, name)}")
    try:  # JaggOptions' ranges, declared once in beyond_paper/options.py; its message starts with the field
        options.check_options(cfg.jagg_options("jagg"))
    except ValueError as e:
        field, rest = str(e).split(" ", 1)
        fail(f"--{field.replace('_', '-')} {rest}")
    T, world = cfg.trained_steps(), int(os.environ.get("WORLD_SIZE", 1))
    end = cfg.sde_range_end or cfg.num_steps - 1
    checks = [  # those that need more than one flag, or the file system
        (0 <= cfg.sde_range_end <= cfg.num_steps,
         f"--sde-range-end must be in [0, --num-steps {cfg.num_steps}], got {cfg.sde_range_end}"),
        (T >= 1, f"--timestep-fraction {cfg.timestep_fraction} trains none of the "
                 f"{cfg.num_steps} steps: raise it"),
        (cfg.window <= max(T, 2), f"--window {cfg.window} is longer than the {T} trained steps: "
                                  f"use --window <= {T}"),
        (cfg.sde_window <= end, f"--sde-window {cfg.sde_window} does not fit in steps 0 to "
                                f"{end - 1}: use a smaller window or a larger --sde-range-end"),
        (cfg.route != "probe" or cfg.probe_every,
         "--route probe needs the probe: give --probe-every N >= 1"),
        (not cfg.probe_every or cfg.train_batch >= 2,
         "the probe halves a micro-batch: use --train-batch >= 2"),
        (cfg.group_size >= 2 or world > 1, f"--group-size must be >= 2 on one process "
                                           f"(advantages compare a group's samples), got "
                                           f"{cfg.group_size}"),
        (not cfg.fsdp or "WORLD_SIZE" in os.environ,
         "--fsdp shards over torchrun's ranks: torchrun --nproc_per_node N lab/sd_runner.py --fsdp ..."),
        (not (cfg.resume and cfg.overwrite),
         "--resume continues a run, --overwrite deletes it: give one"),
        (not cfg.resume or os.path.isfile(checkpoint_path(cfg.resume)),
         f"--resume {cfg.resume!r} holds no checkpoint ({checkpoint_path(cfg.resume)}): give a "
         f"run's folder; a run stopped before its first checkpoint starts again with --out "
         f"{cfg.resume} --overwrite"),
        (not cfg.resume or cfg.out in (Config.out, cfg.resume),
         f"--resume writes where the run is: drop --out {cfg.out!r} or give --out {cfg.resume!r}")]
    for ok, message in checks:
        if not ok:
            fail(message)
    cfg = dataclasses.replace(cfg, out=cfg.resume or cfg.out, resolution=check_model(cfg))
    load_reward(cfg.reward, check_only=True)
    read_prompts(cfg)  # a missing, binary or empty file ends here
    if cfg.resume:
        check_resume(cfg)
    return cfg


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        fail(f"cannot read {path} ({type(e).__name__}: {str(e)[:200]}); repair or remove it")


def read_prompts(cfg):  # --prompts' lines, or the built-in list
    if not cfg.prompts:
        return DEFAULT_PROMPTS
    try:
        with open(cfg.prompts, encoding="utf-8") as f:
            prompts = [line.strip() for line in f if line.strip()]
    except (OSError, UnicodeDecodeError):
        if not os.path.isfile(cfg.prompts):
            fail(f"--prompts file {cfg.prompts!r} does not exist")
        fail(f"--prompts file {cfg.prompts!r} is not UTF-8 text: give a text file, one prompt a "
             "line")
    if not prompts:
        fail(f"--prompts file {cfg.prompts!r} has no prompts (one a line)")
    return prompts


def claim_out(cfg):
    """Rank 0 locks --out until the run ends (run_folder.claim_folder): refused if in use or
    holding a run."""
    run_files = ("config.json", "metrics.jsonl", "summary.json", "checkpoint.pt", "*.safetensors",
                 "samples_*.png")
    resume = None  # how to continue the run the folder holds, if it has a checkpoint
    if os.path.isfile(checkpoint_path(cfg.out)):
        resume = f"{launcher(int(os.environ.get('WORLD_SIZE', 1)))} --resume {cfg.out}"
    try:
        return run_folder.claim_folder(cfg.out, run_files, cfg.resume, cfg.overwrite, resume)
    except ValueError as e:
        fail(e)


# === 2. THE MODEL: every line that knows SD3. Another family (examples/diffusers_models.py has
# Flux, Qwen-Image, Wan and LTX-Video) replaces this block: check the folder, load, the latents'
# shape, the scheduler's sigmas, encode (and join or pick the conditioning), decode and
# velocity_fn. ===
def check_model(cfg):
    """--resolution resolved and checked from the model folder's json configs (no weights are
    read): a multiple of 16 (the VAE's 8x times the 2x2 patches) and within the transformer's
    position embedding. A hub id:
    --resolution as given, resolved once loaded."""
    if cfg.resolution % 16 != 0 or cfg.resolution < 0:
        fail(f"--resolution must be 0 or a multiple of 16 (the VAE's 8x times the 2x2 patches), "
             f"got {cfg.resolution}")
    path = os.path.expanduser(cfg.model)
    local = cfg.model.startswith((".", "/", "~")) or os.path.exists(cfg.model)
    if not (local or cfg.model.count("/") != 1):
        return cfg.resolution  # a hub id
    if not os.path.isfile(os.path.join(path, "model_index.json")):
        fail(f"--model {cfg.model!r} is not a folder with a diffusers pipeline (model_index.json)")
    index = read_json(os.path.join(path, "model_index.json"))
    if not isinstance(index, dict) or not isinstance(index.get("transformer"), list) \
            or index["transformer"][0] is None:
        fail(f"--model {cfg.model!r} has no transformer in model_index.json: pass a "
             "StableDiffusion3Pipeline folder")
    tc = read_json(os.path.join(path, "transformer", "config.json"))
    if tc.get("_class_name", "SD3Transformer2DModel") != "SD3Transformer2DModel":
        fail(f"--model {cfg.model!r} holds a {tc['_class_name']}: lab/sd_runner.py trains an SD3 "
             "transformer (SD3Transformer2DModel); another family replaces its model block "
             "(examples/diffusers_models.py has the recipes)")
    vc = read_json(os.path.join(path, "vae", "config.json"))
    factor = 2 ** (len(vc.get("block_out_channels", [0] * 4)) - 1)  # the VAE's, as diffusers'
    size = cfg.resolution or min(512, tc["sample_size"] * factor)
    limit = tc["pos_embed_max_size"] * tc["patch_size"] * factor
    if size > limit:
        fail(f"--resolution {size} is above the model's limit of {limit} pixels "
             f"(pos_embed_max_size): give at most {limit}")
    return size


def load_pipeline(cfg, device, dtype):
    """(pipe, transformer): the pipeline frozen on device; trainable a LoRA, or every weight in
    fp32 (--lora-rank 0)."""
    from diffusers import StableDiffusion3Pipeline
    path = os.path.expanduser(cfg.model)
    index = {}
    if os.path.isfile(os.path.join(path, "model_index.json")):
        index = read_json(os.path.join(path, "model_index.json"))
    absent = {k: None for k, v in index.items() if isinstance(v, list) and v[0] is None}
    try:  # parts saved as [null, null] (no T5, say) are passed as None
        pipe = StableDiffusion3Pipeline.from_pretrained(path, dtype=dtype, **absent)
    except Exception as e:
        fail(f"could not load --model {cfg.model!r} ({type(e).__name__}: {str(e)[:300]}); pass a "
             "folder saved with save_pretrained, or a hub id on a machine with network")
    pipe.set_progress_bar_config(disable=True)
    parts = (pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3,
             pipe.transformer)
    for module in filter(None, parts):
        module.to(device).requires_grad_(False)
    if cfg.lora_rank:
        add_lora(pipe.transformer, cfg.lora_rank)
    else:  # full fine-tuning; a frozen copy is the KL reference
        pipe.transformer.to(torch.float32).requires_grad_(True)
    if cfg.gradient_checkpointing:
        pipe.transformer.enable_gradient_checkpointing()
    return pipe, pipe.transformer


def add_lora(transformer, rank):
    """Flow-GRPO's LoRA (alpha = 2 x rank) on the attention projections of both streams, in fp32;
    only it trains."""
    from diffusers.training_utils import cast_training_params
    from peft import LoraConfig
    transformer.requires_grad_(False)
    targets = ["to_k", "to_q", "to_v", "to_out.0", "add_k_proj", "add_q_proj", "add_v_proj",
               "to_add_out"]
    transformer.add_adapter(LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights="gaussian",
                                       target_modules=targets))
    cast_training_params(transformer)  # the LoRA in fp32; the frozen base may stay in bf16


def shard_transformer(transformer):
    """FSDP2: each block one shard group, then the root, resharded after every forward."""
    from torch.distributed.fsdp import fully_shard
    for block in transformer.transformer_blocks:
        fully_shard(block)
    return fully_shard(transformer, reshard_after_forward=True)


def default_resolution(pipe, transformer):  # 512 (Flow-GRPO's), or the model's if smaller
    return min(512, transformer.config.sample_size * pipe.vae_scale_factor)


def latent_shape(pipe, transformer, resolution):
    """One sample's latents, *D = [C, h, w], for images of resolution pixels."""
    h = resolution // pipe.vae_scale_factor
    return (transformer.config.in_channels, h, h)


def scheduler_sigmas(scheduler, num_steps):
    """The pipeline scheduler's T + 1 sigmas from 1 to 0 (Flow-GRPO's), set on a copy of it."""
    scheduler = copy.deepcopy(scheduler)
    scheduler.set_timesteps(num_steps)
    return scheduler.sigmas.float()  # [T+1], the last 0


def fit_prompts(pipe, prompts):
    """The prompts cut, once, to the tokens the pipeline's longest text encoder takes (T5's 256, or
    CLIP's 77 without T5), with one warning: a longer line would cost time and memory at every
    encoding, and a warning each time, for nothing. CLIP sees a prompt's first 77 tokens."""
    import logging
    tokenizer, limit = pipe.tokenizer, pipe.tokenizer.model_max_length  # CLIP's 77
    if pipe.tokenizer_3 is not None:
        tokenizer, limit = pipe.tokenizer_3, 256  # T5's, as encode passes it
    out, cut = [], 0
    for prompt in prompts:
        capped = prompt[: 16 * limit]  # no token is 16 characters: enough to tokenize, bounded
        ids = tokenizer(capped, add_special_tokens=False, verbose=False).input_ids
        if len(ids) >= limit or len(capped) < len(prompt):
            prompt = tokenizer.decode(ids[: limit - 1], skip_special_tokens=True)
            cut += 1
        out.append(prompt)
    if cut:
        print(f"warning: {cut} prompt(s) longer than the {limit} tokens the text encoder takes "
              "were cut to them, once, here")
    # diffusers warns at every encoding of a prompt longer than CLIP's 77 tokens: said here once
    sd3 = "diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3"
    logging.getLogger(sd3).setLevel(logging.ERROR)
    return out


@torch.no_grad()
def encode(pipe, prompts, device):
    """(cond, uncond) text embeddings, each (prompt_embeds [B, L, E], pooled [B, P]); uncond: the
    empty prompt."""
    t5_len = 256  # SD3's T5 tokens
    if pipe.tokenizer_3 is not None:
        t5_len = min(256, pipe.tokenizer_3.model_max_length)
    pe, npe, pooled, npooled = pipe.encode_prompt(
        prompt=prompts, prompt_2=None, prompt_3=None, device=device,
        negative_prompt=[""] * len(prompts), max_sequence_length=t5_len)
    return (pe.float(), pooled.float()), (npe.float(), npooled.float())


def cat_conditioning(conds):
    """One (prompt_embeds, pooled) from chunks' conditionings (encode's), joined on B."""
    return tuple(torch.cat([c[i] for c in conds]) for i in range(2))  # [B, L, E], [B, P]


@torch.no_grad()
def decode(pipe, latents):
    """Latents [B, C, h, w] -> B PIL images; info["finite"]: False where the latents or the pixels
    were not."""
    x = latents.to(pipe.vae.dtype) / pipe.vae.config.scaling_factor
    x = x + (pipe.vae.config.shift_factor or 0.0)
    images = pipe.vae.decode(x, return_dict=False)[0].float()  # [B, 3, H, W] in [-1, 1]
    finite = torch.isfinite(images).flatten(1).all(1) & torch.isfinite(latents).flatten(1).all(1)
    pixels = ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)  # [B, 3, H, W]
    pil = [Image.fromarray(im) for im in pixels.permute(0, 2, 3, 1).cpu().numpy()]  # [H, W, 3]
    for im, ok in zip(pil, finite.tolist()):
        im.info["finite"] = ok
    return pil


def make_velocity_fn(transformer, cond, uncond, guidance_scale, use_bf16):
    """velocity_fn(z [S, B, C, H, W], t [S, B]) -> v [S, B, C, H, W] with classifier-free
    guidance; cond, uncond: (prompt_embeds [B, L, E], pooled [B, P]), repeated as a block per
    step. The unconditional branch runs without graph, as in Flow-GRPO's trainer: the gradient
    flows through s * v_c alone, not the guided velocity's whole derivative s J_c - (s - 1) J_u,
    which would need the unconditional branch's graph and twice the backward."""
    def velocity_fn(z, t):
        S, x = t.shape[0], z.flatten(0, 1)  # x: [S*B, C, H, W], step-major
        timestep = (t.flatten() * 1000).to(x.dtype)  # SD3's timesteps are sigma * 1000
        autocast = contextlib.nullcontext()
        if use_bf16:
            autocast = torch.autocast(x.device.type, dtype=torch.bfloat16)
        with autocast:
            v = transformer(hidden_states=x, timestep=timestep,
                            encoder_hidden_states=cond[0].repeat(S, 1, 1),
                            pooled_projections=cond[1].repeat(S, 1),
                            return_dict=False)[0]  # [S*B, C, H, W]
            if guidance_scale > 1:
                with torch.no_grad():
                    v_u = transformer(hidden_states=x, timestep=timestep,
                                      encoder_hidden_states=uncond[0].repeat(S, 1, 1),
                                      pooled_projections=uncond[1].repeat(S, 1),
                                      return_dict=False)[0]
                v = v_u + guidance_scale * (v - v_u)  # [S*B, C, H, W]
        return v.to(z.dtype).reshape(z.shape)  # [S, B, C, H, W]: fp32 latents under autocast
    return velocity_fn


def make_ref_velocity_fn(transformer, ref_transformer, cond, uncond, guidance_scale, use_bf16):
    """The KL reference's velocity_fn: a frozen copy (full fine-tuning), or the transformer with
    its LoRA off."""
    model = transformer if ref_transformer is None else ref_transformer
    fn = make_velocity_fn(model, cond, uncond, guidance_scale, use_bf16)
    if ref_transformer is not None:
        return fn

    def lora_off(z, t):
        transformer.disable_adapters()
        try:
            return fn(z, t)
        finally:
            transformer.enable_adapters()
    return lora_off


def velocity_fns(cond, uncond, idx, model, transformer, ref_transformer, cfg, use_bf16):
    """(velocity_fn through model, the KL reference's or None) of the samples idx of a rollout."""
    c = tuple(x[idx] for x in cond)  # their conditioning: prompt_embeds [b, L, E], pooled [b, P]
    u = tuple(x[idx] for x in uncond)
    ref_fn = None
    if cfg.beta > 0:
        ref_fn = make_ref_velocity_fn(transformer, ref_transformer, c, u, cfg.guidance_scale,
                                      use_bf16)
    return make_velocity_fn(model, c, u, cfg.guidance_scale, use_bf16), ref_fn


def check_contract(cfg, pipe, transformer, prompts, sigmas, use_bf16):
    """jagg's velocity_fn contract on two different prompts before training: one line if broken."""
    # v of z's shape, equal calls equal, S steps at once equal S single steps
    cond, uncond = encode(pipe, (list(dict.fromkeys(prompts)) * 2)[:2], sigmas.device)
    noise = torch.randn(2, *latent_shape(pipe, transformer, cfg.resolution), device=sigmas.device,
                        generator=torch.Generator(sigmas.device).manual_seed(0))  # [2, C, h, w]
    velocity_fn = make_velocity_fn(transformer.eval(), cond, uncond, cfg.guidance_scale, use_bf16)
    try:
        checks.check_velocity_fn(velocity_fn, noise, sigmas, rtol=2e-2 if use_bf16 else None)
    except ValueError as e:  # NaN weights, say
        fail(f"--model {cfg.model!r} fails jagg's velocity_fn contract on the first prompts: {e}")


# ================================ end of the model block ================================


# === 3. Rewards: reward_fn(images: a list of PIL images, prompts: a list of str) -> B numbers ===
def jpeg_kb(image):
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=95)
    return buf.tell() / 1000


def darkness(image):  # 1 - the mean luminance (ITU-R 601), in [0, 1]: does the loop learn at all?
    return 1 - sum(image.convert("L").tobytes()) / (255 * image.width * image.height)


def jpeg_compressibility(images, prompts):  # DDPO's
    return [-jpeg_kb(im) for im in images]


def jpeg_incompressibility(images, prompts):
    return [jpeg_kb(im) for im in images]


def darkness_reward(images, prompts):
    return [darkness(im) for im in images]


# The built-in rewards: adding one is one line here. Any other is --reward module:function with the
# same signature (lab.mini_sd3:geneval_reward, say); its eval_metrics(images, prompts) -> {name:
# float}, if it has one, is logged as eval/<name>.
REWARDS = {"jpeg_compressibility": jpeg_compressibility,
           "jpeg_incompressibility": jpeg_incompressibility, "darkness": darkness_reward}


def load_reward(name, device="cpu", check_only=False):
    """The reward_fn --reward names, or one line that says why there is none."""
    if name in REWARDS:
        return REWARDS[name]
    if os.path.isdir(os.path.expanduser(name)):
        return None if check_only else pickscore(name, device)
    try:
        module, function = name.split(":")
        return getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError, ValueError) as e:
        fail(f"--reward {name!r} is none of {', '.join(REWARDS)}, no folder, and no importable "
             f"module:function ({type(e).__name__}: {e})")


def pickscore(folder, device):
    """PickScore's reward: logit_scale * cos(image embedding, text embedding) of the CLIP model in
    folder."""
    from transformers import AutoModel, AutoProcessor
    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).eval().to(device)

    def unit(out):
        return torch.nn.functional.normalize(getattr(out, "pooler_output", out), dim=-1)

    @torch.no_grad()
    def reward_fn(images, prompts):
        img = processor(images=images, return_tensors="pt").to(device)
        txt = processor(text=prompts, padding=True, truncation=True, max_length=77,
                        return_tensors="pt").to(device)
        cosine = (unit(model.get_image_features(**img)) * unit(model.get_text_features(**txt)))
        return (model.logit_scale.exp() * cosine.sum(-1)).float().cpu()
    return reward_fn


def rewards_of(reward_fn, images, prompts, name="the reward"):
    """[B] rewards; NaN for a broken sample (decode's info["finite"] False): it is never scored.
    The contract of a reward_fn, checked at every call: one number per image it is given, in
    their order (a list, an array or a tensor [n] or [n, 1]); anything else ends the run in one
    line naming name. A NaN or inf it gives is kept: the caller counts and excludes it."""
    ok = [im.info.get("finite", True) for im in images]
    rewards = torch.full((len(images),), math.nan)  # [B]
    if any(ok):
        n = sum(ok)
        scored = reward_fn([im for im, k in zip(images, ok) if k],
                           [p for p, k in zip(prompts, ok) if k])
        try:
            values = torch.as_tensor(scored, dtype=torch.float32)
        except Exception:  # strings, None, ragged lists
            values = None
        if values is None or values.ndim not in (1, 2) or values.numel() != n or (
                values.ndim == 2 and values.shape[1] != 1):
            got = type(scored).__name__ if values is None else f"shape {tuple(values.shape)}"
            fail(f"--reward {name} returned {got} for {n} images: it must return {n} numbers, "
                 "one per image, in their order")
        rewards[torch.tensor(ok)] = values.reshape(-1)
    return rewards


# === 4. Rollouts and evaluations ===
def sampling_sigmas(cfg, scheduler):
    """A rollout's T + 1 sigmas from 1 to 0: the pipeline scheduler's (Flow-GRPO's), or
    jagg.sigma_schedule's."""
    if cfg.sigma_schedule == "linear":
        return jagg.sigma_schedule(cfg.num_steps, scheduler.config.get("shift", 3.0))
    return scheduler_sigmas(scheduler, cfg.num_steps)  # [T+1]


# An SDE window (--sde-window K): Flow-GRPO-Fast samples K consecutive steps with the SDE and the
# rest with the deterministic ODE (Euler, noise level 0, no log-probability), and trains the K
# steps alone. The window's steps are then a trajectory of K steps like any other: the loss, the
# KL, routing, the probe and every JAGG mode see them and nothing else. Its first step is drawn
# uniform in [low, high - K] anew each epoch, the same on every rank.
def window_start(epoch, size, low, high, seed=0):
    """The first SDE step of epoch's rollouts (epochs count from 1): a window of size steps
    within steps low .. high - 1 of the schedule."""
    if not (0 <= low and size >= 1 and low + size <= high):
        raise ValueError(f"an SDE window of {size} steps does not fit in steps {low} to {high - 1}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return low + int(torch.randint(high - size - low + 1, (1,), generator=g))


@torch.no_grad()
def window_rollout(velocity_fn, noise, sigmas, noise_level, start, size, generator=None):
    """Sample B trajectories of T = len(sigmas) - 1 steps from the noise [B, *D]: steps start ..
    start + size - 1 by the SDE at noise_level, the others by the ODE. Returns (traj, sample): the
    window's steps as a jagg.Trajectory of size steps (its .t holds their sigmas) and the final
    clean samples z_T [B, *D] to reward. start 0 and size T is jagg.rollout, bit for bit."""
    T = len(sigmas) - 1
    if not (0 <= start and size >= 1 and start + size <= T):
        raise ValueError(f"an SDE window of {size} steps from step {start} does not fit in a "
                         f"trajectory of {T} steps")
    velocity_fn = checks.checked(velocity_fn)
    # the ODE (Euler, the SDE step's mean at noise level 0) before the window and after it
    z = checks.ode_rollout(velocity_fn, noise, sigmas[: start + 1])  # [B, *D]
    traj = jagg.rollout(velocity_fn, z, sigmas[start : start + size + 1], noise_level, generator)
    return traj, checks.ode_rollout(velocity_fn, traj.sample, sigmas[start + size :])


def cat_trajectories(trajs):
    """One jagg.Trajectory from several, joined on B (a rollout drawn in chunks)."""
    levels = {traj.noise_level for traj in trajs}
    if len(levels) != 1:
        raise ValueError(f"trajectories drawn at different noise levels cannot form one batch: "
                         f"{levels}")
    tensors = {name: torch.cat([getattr(traj, name) for traj in trajs], dim=1)
               for name in jagg.Trajectory.TENSORS}
    return jagg.Trajectory(**tensors, noise_level=trajs[0].noise_level)


class Stopped(Exception):
    """A stop signal reached every rank mid-epoch: the epoch's work since its checkpoint is lost."""


def stop_now(stop, device):
    """Whether a signal in stop (this rank's) or another rank's stops the run: all ranks call it."""
    return bool(ranks.all_gather_cat(torch.tensor([len(stop)], device=device)).sum())


def launcher(world):  # the command that runs lab/sd_runner.py on world processes
    if world > 1:
        return f"torchrun --nproc_per_node {world} lab/sd_runner.py"
    return "python lab/sd_runner.py"


def stop_message(stop, where, checkpointed, out, world):
    """The line a stopped run ends with: a command that goes on from its checkpoint (or None)."""
    signal = stop[0] if stop else "a signal to another rank"
    if checkpointed is None:
        return (f"stopped by {signal} {where}, before the first checkpoint: start again with "
                "the same command and --overwrite")
    return (f"stopped by {signal} {where}; the checkpoint of epoch {checkpointed} stands: go "
            f"on with {launcher(world)} --resume {out}")


@torch.no_grad()
def sample(pipe, transformer, prompts, cfg, sigmas, generator, use_bf16, window_start=None,
           stop_now=None):
    """Roll out the prompts in chunks of --train-batch in eval mode (with window_start, an SDE
    window of --sde-window steps from there, the ODE elsewhere; without, the SDE throughout).
    Returns (traj [T, B, ...], cond, uncond, images). stop_now() -> True between chunks raises
    Stopped."""
    start, size = 0, len(sigmas) - 1  # jagg.rollout's
    if window_start is not None:
        start, size = window_start, cfg.sde_window
    shape = latent_shape(pipe, transformer, cfg.resolution)  # [C, h, w]
    trajs, conds, unconds, images = [], [], [], []
    for s in range(0, len(prompts), cfg.train_batch):
        if stop_now is not None and stop_now():
            raise Stopped
        chunk = prompts[s : s + cfg.train_batch]
        cond, uncond = encode(pipe, chunk, sigmas.device)
        noise = torch.randn(len(chunk), *shape, generator=generator, device=sigmas.device)
        velocity_fn = make_velocity_fn(transformer.eval(), cond, uncond, cfg.guidance_scale,
                                       use_bf16)
        traj, final = window_rollout(velocity_fn, noise, sigmas, cfg.noise_level, start, size,
                                     generator)
        trajs.append(traj)
        conds.append(cond)
        unconds.append(uncond)
        images += decode(pipe, final)
    cond = cat_conditioning(conds)  # prompt_embeds [B, L, E], pooled [B, P]
    uncond = cat_conditioning(unconds)
    return cat_trajectories(trajs), cond, uncond, images


def evaluation_prompts(cfg, prompts_all):
    return [prompts_all[i % len(prompts_all)] for i in range(cfg.eval_samples)]  # in order, cycled


def evaluation_seed(cfg):  # the evaluation's noise: the same at every evaluation, fixed by --seed
    return cfg.seed + 12345


def draw_evaluation(pipe, transformer, prompts, cfg, sigmas, reward_fn, use_bf16, seed,
                    name="the reward"):
    """(images, rewards [N]) of the prompts, each with its own noise drawn from seed."""
    g = torch.Generator(device=sigmas.device).manual_seed(seed)
    images = sample(pipe, transformer, prompts, cfg, sigmas, g, use_bf16)[3]
    return images, rewards_of(reward_fn, images, prompts, name)


def sample_grid(images, prompts, rewards, cell=96):
    """Images in rows of 4, each with its prompt and reward beneath."""
    rows = -(-len(images) // 4)
    grid = Image.new("RGB", (4 * cell, rows * (cell + 32)), "white")
    small = ImageFont.load_default(size=12)
    for i, (im, p, r) in enumerate(zip(images, prompts, rewards)):
        x, y = (i % 4) * cell, (i // 4) * (cell + 32)
        grid.paste(im.resize((cell, cell), Image.NEAREST), (x, y))
        ImageDraw.Draw(grid).text((x + 3, y + cell + 2), f"{p[:16]}\n{r:.3f}", fill="black",
                                  font=small)
    return grid


def evaluate(epoch, cfg, pipe, transformer, ema, prompts, sigmas, reward_fn, use_bf16):
    """Fixed prompts and noise, the EMA swapped in if kept: rank 0's eval/ figures and picture."""
    if ema is not None:  # the trained weights set aside
        trained = {n: p.detach().clone() for n, p in trainable(transformer).items()}
        load_weights(transformer, ema)
    images, rewards = draw_evaluation(pipe, transformer, prompts, cfg, sigmas, reward_fn,
                                      use_bf16, evaluation_seed(cfg), cfg.reward)
    if ema is not None:
        load_weights(transformer, trained)
    figures = {}
    if dist.is_initialized() and dist.get_rank() != 0:  # under FSDP, rank 0 alone writes
        return figures
    grid = sample_grid(images[:16], prompts[:16], rewards.tolist()[:16])
    atomic_write(os.path.join(cfg.out, f"samples_{epoch:04d}.png"),
                 lambda f: grid.save(f, format="PNG"), "wb")
    ok = rewards.isfinite()  # [N]: a broken sample has no reward, and is counted
    broken = sum(not im.info.get("finite", True) for im in images)
    figures["eval/reward"] = rewards[ok].mean().item()
    figures["eval/nonfinite_samples"] = int((~ok).sum())  # broken, or a NaN or inf reward
    figures["eval/nonfinite_rewards"] = int((~ok).sum()) - broken
    if figures["eval/nonfinite_rewards"]:
        print(f"warning: epoch {epoch}'s evaluation: {figures['eval/nonfinite_rewards']} of "
              f"{len(images)} rewards were not finite; eval/reward is the mean of the other "
              f"{int(ok.sum())}")
    if hasattr(reward_fn, "eval_metrics"):  # a custom reward's own evaluation figures
        metrics = reward_fn.eval_metrics(images, prompts)
        figures.update({f"eval/{k}": v for k, v in metrics.items()})
    return figures


# === 5. Files: the trained weights for users, and one checkpoint OUT/checkpoint.pt, whole or
# ignored (lab/checkpoint.py gathers FSDP's shards and checks a resumed run is this one) ===
def weights_path(folder, lora_rank):  # the trained weights (the EMA if kept), for users
    return os.path.join(folder, "lora.safetensors" if lora_rank else "transformer.safetensors")


def checkpoint_path(run):
    return os.path.join(run, "checkpoint.pt")


def run_identity(cfg):  # checkpoint.run_identity of this run: compared on --resume
    return checkpoint.run_identity(cfg.model, read_prompts(cfg), FIXED)


def save_weights(out, state, lora_rank):
    """The trained weights for users (the EMA if kept), as safetensors, whole or not at all."""
    from safetensors.torch import save
    weights = state["ema"] or state["weights"]
    atomic_write(weights_path(out, lora_rank), lambda f: f.write(save(weights)), "wb")


def save_checkpoint(out, transformer, optimizer, ema, epoch, rows, config, probe_average,
                    identity):
    """Every rank gathers the state (FSDP's shards); rank 0 writes the weights, then the checkpoint
    as one file, each atomically. The checkpoint comes last: a kill or a full disk between the two
    leaves the older checkpoint, which a resumed run trains on from (its weights rewritten), never
    a checkpoint newer than its weights."""
    state = dict(epoch=epoch, config=config, rows=rows, probe_average=probe_average,
                 identity=identity, **checkpoint.gather_state(transformer, optimizer, ema))
    if not dist.is_initialized() or dist.get_rank() == 0:
        save_weights(out, state, config["lora_rank"])
        atomic_write(checkpoint_path(out), lambda f: torch.save(state, f), "wb")


def read_checkpoint(run, mmap=False):  # save_checkpoint's dict, or one line naming it
    keys = ("epoch", "config", "rows", "probe_average", "weights", "ema", "optimizer", "identity")
    try:
        return checkpoint.read(checkpoint_path(run), keys, "lab/sd_runner.py", mmap)
    except ValueError as e:
        fail(e)


def check_resume(cfg):
    """--resume's run is the run these flags would train: its resolved flags (any that changes
    what is trained is refused), its epochs, and its identity (processes, model, prompts, FIXED)."""
    saved = read_checkpoint(cfg.resume, mmap=True)
    flags = dataclasses.asdict(cfg)
    if not cfg.resolution:  # a hub id's resolution is known once it loads: the run's
        flags["resolution"] = saved["config"]["resolution"]
    # --model and --prompts are compared by what they hold (run_identity), not as strings
    differ = checkpoint.changed_flags(saved["config"], flags, RESUMABLE + ("model", "prompts"))
    if differ:
        fail(f"--resume: {', '.join(differ)}; give the run's, or leave the flag out (only "
             "--epochs, --eval-every, --checkpoint-every and --out may change)")
    if cfg.epochs < saved["epoch"]:
        fail(f"--resume: --epochs {cfg.epochs} is below the checkpoint's epoch "
             f"{saved['epoch']}: give --epochs >= {saved['epoch']}")
    differ = checkpoint.changed_identity(saved["identity"], run_identity(cfg), "lab/sd_runner.py")
    if differ:
        fail(f"--resume: {differ[0]}; resuming would train another run than the one saved")


# === 6. Training: the run's setup, the loop from rollout to optimizer step, the summary ===
def pick_device():  # this rank's GPU, else the CPU (CUDA_VISIBLE_DEVICES= runs on the CPU in fp32)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def load_models(cfg, device, use_bf16):
    """(cfg resolved, pipe, prompts, transformer, the KL reference's frozen copy or None)."""
    dtype = torch.bfloat16 if use_bf16 else torch.float32
    pipe, transformer = load_pipeline(cfg, device, dtype)
    prompts = fit_prompts(pipe, read_prompts(cfg))
    resolution = cfg.resolution or default_resolution(pipe, transformer)  # a hub id's, now
    cfg = dataclasses.replace(cfg, resolution=resolution)
    ref_transformer = None  # the KL reference under full fine-tuning: frozen, in the pipe's dtype
    if cfg.lora_rank == 0 and cfg.beta > 0:
        ref_transformer = copy.deepcopy(transformer).requires_grad_(False).to(dtype)
    return cfg, pipe, prompts, transformer, ref_transformer


def setup_training(cfg, transformer, ref_transformer, device, world):
    """(net, params, optimizer, ema): FSDP's shards or DDP's wrapper, AdamW, the EMA if kept."""
    if cfg.fsdp:  # weights, gradients and optimizer state sharded over the ranks; the reference too
        for module in [m for m in (transformer, ref_transformer) if m is not None]:
            shard_transformer(module)
    params = list(trainable(transformer).values())
    net = transformer  # what the training forwards run through: DDP's wrapper under torchrun
    if world > 1 and not cfg.fsdp:
        net = torch.nn.parallel.DistributedDataParallel(
            transformer, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=FIXED["weight_decay"])
    ema = None
    if cfg.ema:
        ema = {n: p.detach().clone() for n, p in trainable(transformer).items()}
    return net, params, optimizer, ema


def resume_run(cfg, transformer, optimizer, ema, rank):
    """(epochs done, rows, probe average, ema): a fresh run's, or --resume's checkpoint's."""
    if not cfg.resume:
        return 0, [], None, ema
    # where the run stopped: weights, optimizer state, EMA, rows, probe average
    ckpt = read_checkpoint(cfg.resume)
    ema = checkpoint.load_state(transformer, optimizer, ckpt, ema)
    if rank == 0:  # the weights file is the checkpoint's, whatever a kill left there
        save_weights(cfg.out, ckpt, cfg.lora_rank)
    return ckpt["epoch"], ckpt["rows"], ckpt["probe_average"], ema


def write_config(cfg, params, device, use_bf16, world, rank):
    """The flags and FIXED, saved in config.json and printed by rank 0: the checkpoints' config."""
    config = {**dataclasses.asdict(cfg), "fixed": FIXED}
    if rank == 0:
        write_json(os.path.join(cfg.out, "config.json"), config)
        print(f"config: {json.dumps(config)}\ntrainable parameters: "
              f"{sum(p.numel() for p in params):,}; device {device}; bf16 {use_bf16}; "
              f"world {world}")
    return config


def rollout_row(epoch, cfg, rewards, broken, start, rank):
    """An epoch's row as its rollouts leave it: the run's method and the rollout/ figures."""
    ok = torch.isfinite(rewards)  # [world * B]: NaN for a broken sample, kept out of the mean
    row = {"epoch": epoch, "method": cfg.method, "mode": cfg.jagg_options().mode_name(cfg.method),
           "train/lr": cfg.lr, "rollout/reward_mean": rewards[ok].mean().item(),
           "rollout/reward_std": rewards[ok].std().item(),
           "rollout/nonfinite_samples": int((~ok).sum())}  # broken, or a NaN or inf reward
    row["rollout/nonfinite_rewards"] = int((~ok).sum()) - broken
    if row["rollout/nonfinite_rewards"] and rank == 0:
        print(f"warning: epoch {epoch}: {row['rollout/nonfinite_rewards']} of "
              f"{len(rewards)} rewards were not finite; those samples are left out of the "
              "advantages")
    if start is not None:
        row["rollout/sde_window_start"] = start
    return row


def probe_row(fns, params, traj, advantages, cfg, world, device):
    """The probe/ figures, the ranks' means: JAGG's gradient against exact on one micro-batch."""
    # The samples one optimizer step averages, all ranks: the probe measures JAGG's error in
    # their noise.
    step_batch = cfg.train_batch * world
    if cfg.steps_per_epoch:
        step_batch = max(1, cfg.prompts_per_epoch * cfg.group_size * world // cfg.steps_per_epoch)
    loss_cfg = cfg.loss_config()
    measured = probe.probe_segments(fns, params, traj, advantages, loss_cfg, cfg.jagg_options(),
                                    step_batch)
    figures = {}
    for key in ("cosine", "error_to_noise", "error", "noise"):  # the ranks' mean
        values = torch.tensor([measured[key]], dtype=torch.float64, device=device)
        name = "probe/grad_cosine" if key == "cosine" else f"probe/{key}"
        figures[name] = ranks.all_gather_cat(values).mean(0).tolist()
    return figures


def optimizer_steps(perm, adv, cfg, generator):
    """The epoch's optimizer steps, [[micro-batch indices, ...] per step], as many on every rank.
    --steps-per-epoch N: Flow-GRPO's N equal steps, zero-advantage samples dropped (not under
    FSDP, whose ranks must run alike), dropped ones put back until N divides the count. 0: one
    step a micro-batch."""
    if not cfg.steps_per_epoch:
        return [[m] for m in perm.split(cfg.train_batch) if len(m)]  # none when every sample broke
    if not cfg.fsdp:
        keep, dropped = perm[adv[perm] != 0], perm[adv[perm] == 0]
        back = torch.randperm(len(dropped), generator=generator)[: -len(keep) % cfg.steps_per_epoch]
        perm = torch.cat([keep, dropped[back]])
        perm = perm[torch.randperm(len(perm), generator=generator)]
    parts = perm.tensor_split(cfg.steps_per_epoch)
    return [list(part.split(cfg.train_batch)) if len(part) else [] for part in parts]


def update_ema(ema, transformer, step):
    """Flow-GRPO's EMA step on the trained weights: decay min((1 + s) / (10 + s), 0.9)."""
    decay = min(step / (9 + step), FIXED["ema_decay"])  # Flow-GRPO's, s = step - 1
    for n, p in trainable(transformer).items():
        ema[n].mul_(decay).add_(p.detach(), alpha=1 - decay)


def epoch_figures(stats):
    """An epoch's train/ and time/ figures from its micro-batches' stats (each optimizer step's
    last with its grad_norm and skipped): the diagnostics' means, the counts' and times' sums."""
    def mean(key):
        return sum(s[key] for s in stats) / len(stats) if stats else math.nan
    steps = [s for s in stats if "grad_norm" in s]  # one per optimizer step
    keys = ["loss", "clipfrac", "approx_kl", "kl", "routed_frac"]
    keys += [k for k in ("rollout_refreshed", "anchor_drift") if stats and k in stats[0]]
    figures = {f"train/{k}": mean(k) for k in keys}
    figures["train/grad_norm"] = sum(s["grad_norm"] for s in steps) / max(len(steps), 1)
    figures["train/grad_rows"] = sum(s["grad_rows"] for s in stats)
    figures["train/skipped_steps"] = sum(s["skipped"] for s in steps)
    figures["train/optimizer_steps"] = sum(not s["skipped"] for s in steps)
    figures["time/grad_seconds"] = sum(s["grad_seconds"] for s in stats)
    return figures


def param_checksums(params):
    """Each rank's sum of the trained weights (whole under FSDP): equal while the ranks agree."""
    sums = torch.stack([(p.full_tensor() if isinstance(p, DTensor) else p).detach().double()
                        .sum() for p in params])
    return ranks.all_gather_cat(sums.sum()[None]).tolist()


def epoch_line(row, epochs):
    """The one line an epoch prints: reward, loss, KL, clipfrac, approx_kl, routed, grad time."""
    skipped = f" skipped {row['train/skipped_steps']}" if row["train/skipped_steps"] else ""
    return (f"epoch {row['epoch']}/{epochs} reward {row['rollout/reward_mean']:.3f} loss "
            f"{row['train/loss']:.4f} kl {row['train/kl']:.4f} clipfrac "
            f"{row['train/clipfrac']:.3f} approx_kl {row['train/approx_kl']:.2e} routed "
            f"{row['train/routed_frac']:.2f} grad {row['time/grad_seconds']:.1f} s{skipped}")


def train(cfg, stop=()):
    """One run; stop: the signals received (run_folder.stop_on_signals), which end it at the next
    optimizer step or rollout chunk, every rank alike: at an epoch's end after its checkpoint,
    mid-epoch without one (its work is redone on resume). Returns (rows, summary)."""
    rank, world = grpo_step.init_distributed(always=cfg.fsdp)
    torch.manual_seed(cfg.seed)  # the same LoRA initialisation on every rank and every run
    device = pick_device()
    use_bf16 = device.type == "cuda"  # bf16 autocast on a GPU
    if use_bf16:
        torch.cuda.set_device(device)
    reward_fn = load_reward(cfg.reward, device)
    cfg, pipe, prompts_all, transformer, ref_transformer = load_models(cfg, device, use_bf16)
    net, params, optimizer, ema = setup_training(cfg, transformer, ref_transformer, device, world)
    start_epoch, rows, probe_avg, ema = resume_run(cfg, transformer, optimizer, ema, rank)
    checkpointed = start_epoch if cfg.resume else None  # the epoch of the newest checkpoint
    identity = run_identity(cfg)
    config = write_config(cfg, params, device, use_bf16, world, rank)  # printed, and saved
    sigmas = sampling_sigmas(cfg, pipe.scheduler).to(device)  # [T+1]
    check_contract(cfg, pipe, transformer, prompts_all, sigmas, use_bf16)  # jagg's, before training
    loss_cfg = cfg.loss_config()
    opts, n_train = cfg.jagg_options(), cfg.trained_steps()
    papers_jagg = cfg.papers_jagg(world)  # jagg.py's own call computes the gradient
    eval_prompts = evaluation_prompts(cfg, prompts_all)
    evaluates = rank == 0 or cfg.fsdp  # under FSDP every rank runs the evaluation's forwards
    if evaluates and start_epoch == 0:
        rows.append({"epoch": 0})
        rows[-1].update(evaluate(0, cfg, pipe, transformer, ema, eval_prompts, sigmas, reward_fn,
                                 use_bf16))
    # Each epoch's generators are seeded by the epoch: a resumed run draws what an uninterrupted
    # one would. The prompts are the same on every rank, the noise differs: a prompt's group
    # spans the ranks.
    for epoch in range(start_epoch + 1, cfg.epochs + 1):
        # --- rollouts: sample and decode; a stop signal ends the epoch at once (Stopped)
        epoch_start = time.perf_counter()
        epoch_seed = cfg.seed * 1_000_003 + epoch
        prompt_gen = torch.Generator().manual_seed(epoch_seed)
        noise_gen = torch.Generator(device=device).manual_seed(epoch_seed * 1009 + rank + 1)
        prompt_ids = torch.randint(len(prompts_all), (cfg.prompts_per_epoch,), generator=prompt_gen)
        prompt_ids = prompt_ids.repeat_interleave(cfg.group_size)  # [B]
        prompts = [prompts_all[i] for i in prompt_ids.tolist()]
        start = None
        if cfg.sde_window:  # the same on every rank
            start = window_start(epoch, cfg.sde_window, 0, cfg.sde_range_end or cfg.num_steps - 1,
                                 seed=cfg.seed)
        stop_check = functools.partial(stop_now, stop, device)  # between the rollout's chunks
        try:
            traj, cond, uncond, images = sample(pipe, transformer, prompts, cfg, sigmas, noise_gen,
                                                use_bf16, start, stop_check)
        except Stopped:
            fail(stop_message(stop, f"in epoch {epoch}'s rollouts", checkpointed, cfg.out, world))
        # --- rewards and group advantages: groups gathered from every rank, a broken sample
        # dropped from its group; then this rank's slice
        rewards = rewards_of(reward_fn, images, prompts, cfg.reward).to(device)  # [B]; NaN: none
        broken = sum(not im.info.get("finite", True) for im in images)  # images that did not decode
        broken = ranks.all_gather_cat(torch.tensor([broken], device=device)).sum().item()
        all_rewards = ranks.all_gather_cat(rewards)  # [world * B]
        all_ids = ranks.all_gather_cat(prompt_ids.to(device))
        ok, adv = torch.isfinite(all_rewards), torch.zeros_like(all_rewards)
        adv[ok] = jagg.group_advantages(all_rewards[ok], all_ids[ok], global_std=cfg.global_std,
                                        clip=FIXED["adv_clip"])
        adv = adv.reshape(world, -1)[rank]  # [B]
        row = rollout_row(epoch, cfg, all_rewards, broken, start, rank)
        perm = torch.randperm(len(prompts), generator=prompt_gen)
        if not cfg.fsdp and (cfg.steps_per_epoch or world == 1):  # broken samples do not train
            perm = perm[ok.reshape(world, -1)[rank].cpu()[perm]]  # (else their steps skip)
        # --- the probe, before training on its micro-batch: JAGG's gradient vs exact per segment
        if cfg.probe_every and epoch % cfg.probe_every == 0:
            probe_start, idx = time.perf_counter(), perm[: cfg.train_batch].to(device)
            # (the lambda runs within this iteration: its late binding of the loop's names is safe)
            row.update(probe_row(
                lambda i: velocity_fns(cond, uncond, idx[i], transformer, transformer,  # noqa: B023
                                       ref_transformer, cfg, use_bf16),
                params, traj.subset(idx).first_steps(n_train), adv[idx], cfg, world, device))
            probe_avg = probe.probe_average(probe_avg, row["probe/grad_cosine"],
                                                 FIXED["probe_decay"])
            row["time/probe_seconds"] = time.perf_counter() - probe_start
        # --- the optimizer steps, each accumulating micro-batches over the first n_train steps
        # of their trajectories
        transformer.train()
        stats, routed = [], None
        steps = optimizer_steps(perm, adv.cpu(), cfg, prompt_gen)
        row["train/samples"] = sum(len(idx) for micro in steps for idx in micro)
        for i, micro in enumerate(steps):
            step = (epoch - 1) * len(steps) + i + 1
            if not micro:
                continue
            optimizer.zero_grad(set_to_none=True)
            for j, idx in enumerate(micro):
                idx = idx.to(device)
                velocity_fn, ref_fn = velocity_fns(cond, uncond, idx, net, transformer,
                                                   ref_transformer, cfg, use_bf16)
                minibatch = traj.subset(idx).first_steps(n_train)
                grad_start = time.perf_counter()
                # DDP: no all-reduce per backward, one per step below; FSDP: none before the last
                with ranks.no_sync_for(net, last=j == len(micro) - 1)():
                    # THE JAGG CALL: the micro-batch's gradient added to .grad (--method exact:
                    # every window exact, Flow-GRPO's per-step backward); with an option beyond
                    # the paper, options.backward_batch, the general form of the same call
                    if papers_jagg:
                        s, routed = jagg.backward_batch(velocity_fn, minibatch, adv[idx], loss_cfg,
                                                         opts.window, opts.jagg_frac, ref_fn)
                        lengths = [b - a for a, b in jagg.window_bounds(n_train, opts.window)]
                        s["routed_frac"] = sum(routed) / max(sum(n >= 3 for n in lengths), 1)
                    else:
                        s, routed = options.backward_batch(
                            velocity_fn, minibatch, adv[idx], loss_cfg, opts, ref_fn, probe_avg)
                s["grad_seconds"] = time.perf_counter() - grad_start
                stats.append(s)
            # The optimizer step: the gradient's mean over the micro-batches and the ranks (one
            # all-reduce), clip_grad_norm_ to max_grad_norm, then optimizer.step(), skipped on
            # every rank alike, with a warning, where a loss or the gradient is not finite (a NaN
            # would poison the weights and Adam's moments for good).
            losses = [s["loss"] for s in stats[-len(micro):]]
            done = ranks.optimizer_step(params, optimizer, losses, micro_batches=len(micro),
                                            max_grad_norm=FIXED["max_grad_norm"], step=step)
            stats[-1].update(done)  # grad_norm, skipped
            finite = not done["skipped"]
            if ema is not None and finite and step % FIXED["ema_every"] == 0:
                update_ema(ema, transformer, step)
            if i + 1 < len(steps) and stop_now(stop, device):  # its steps are redone on resume
                where = f"in epoch {epoch}, after {i + 1} of its {len(steps)} optimizer steps"
                fail(stop_message(stop, where, checkpointed, cfg.out, world))
        # --- logging: the epoch's row (metrics.jsonl, below) and its one line
        row.update(epoch_figures(stats))
        row["time/train_seconds"] = time.perf_counter() - epoch_start  # not the evaluation
        row["routing/routed"] = routed  # the epoch's last optimizer step's, per segment
        row["train/param_checksums"] = param_checksums(params)
        rows.append(row)
        if rank == 0:
            print(epoch_line(row, cfg.epochs), flush=True)
        # --- evaluation and the checkpoint; a stop signal ends the run after its checkpoint
        stopping = stop_now(stop, device)  # every rank alike
        if evaluates and (epoch % cfg.eval_every == 0 or epoch == cfg.epochs) and not stopping:
            row.update(evaluate(epoch, cfg, pipe, transformer, ema, eval_prompts, sigmas, reward_fn,
                                use_bf16))
        if epoch % cfg.checkpoint_every == 0 or epoch == cfg.epochs or stopping:
            save_checkpoint(cfg.out, transformer, optimizer, ema, epoch, rows, config, probe_avg,
                            identity)
            checkpointed = epoch
        if rank == 0:
            metrics = "".join(run_folder.json_text(r) + "\n" for r in rows)
            atomic_write(os.path.join(cfg.out, "metrics.jsonl"), metrics)
        if stopping:
            fail(stop_message(stop, f"after epoch {epoch}", checkpointed, cfg.out, world))
    summary = finish_run(cfg, rows, rank)  # summary.json, on rank 0 (None elsewhere)
    return rows, summary


def summarize(cfg, rows):
    """summary.json: the evaluation curve, times, and the probe's figures per segment position."""
    evals = [(r["epoch"], r["eval/reward"]) for r in rows if "eval/reward" in r]
    trained = [r for r in rows if r["epoch"]]
    routes = cfg.method == "jagg" and cfg.route == "probe"  # the probe's time is training's if so
    epoch_seconds = [r["time/train_seconds"] - (0.0 if routes else r.get("time/probe_seconds", 0.0))
                     for r in trained]
    probes = [{"cosine": r["probe/grad_cosine"], "error": r["probe/error"],
               "noise": r["probe/noise"]} for r in trained if "probe/error" in r]
    pooled = probe.pool_probes(probes) or {}

    def total(key):
        return sum(r.get(key, 0.0) for r in trained)
    return {"method": cfg.method, "mode": cfg.jagg_options().mode_name(cfg.method),
            "weights": cfg.weights, "window": cfg.window, "epochs": cfg.epochs,
            "initial_reward": evals[0][1], "final_reward": evals[-1][1],
            "reward_gain": evals[-1][1] - evals[0][1], "eval_curve": evals,
            "train_seconds": sum(epoch_seconds), "epoch_seconds": epoch_seconds,
            "grad_seconds": total("time/grad_seconds"),
            "probe_seconds": total("time/probe_seconds"),
            "grad_rows": total("train/grad_rows"), "skipped_steps": total("train/skipped_steps"),
            "nonfinite_samples": total("rollout/nonfinite_samples"),
            "probe_cosine_by_position": pooled.get("cosine"),
            "probe_error_to_noise_by_position": pooled.get("error_to_noise"),
            "probe_error_to_noise_stderr_by_position": pooled.get("stderr"),
            "config": dataclasses.asdict(cfg)}


def finish_run(cfg, rows, rank):
    """Every rank done, rank 0 writes summary.json and prints the run's last line; returns it."""
    if dist.is_initialized():
        dist.barrier()
    summary = summarize(cfg, rows) if rank == 0 else None
    if rank == 0:
        write_json(os.path.join(cfg.out, "summary.json"), summary)
        print(f"[{summary['mode']}] eval reward {summary['initial_reward']:.3f} -> "
              f"{summary['final_reward']:.3f} ({cfg.eval_samples} samples), training "
              f"{summary['train_seconds']:.0f} s (gradients {summary['grad_seconds']:.0f} s), "
              f"outputs in {cfg.out}/")
    return summary


# === 7. The command line. Ctrl-C, SIGTERM, SIGHUP stop every rank at its next optimizer step ===
def main(argv=None):
    cfg = validate(parse(argv), given_flags(argv))
    lock = claim_out(cfg) if int(os.environ.get("RANK", 0)) == 0 else None
    world = int(os.environ.get("WORLD_SIZE", 1))

    def go_on():  # how to go on from what the folder holds: a command that works
        if os.path.isfile(checkpoint_path(cfg.out)):
            return f"go on with {launcher(world)} --resume {cfg.out}"
        return "start again with the same command and --overwrite"
    try:
        with run_folder.stop_on_signals() as stop:
            rows, summary = train(cfg, stop)
    except run_folder.WriteError as e:  # a full disk, say: the last checkpoint stands
        fail(f"{e}: free space, then {go_on()}")
    except KeyboardInterrupt:  # a second Ctrl-C acts at once
        fail(f"stopped at once by a second Ctrl-C; {go_on()}")
    finally:
        if lock:
            run_folder.release(lock)
    if not sum(r.get("train/optimizer_steps", 1) for r in rows if r["epoch"]):
        fail(f"no optimizer step was taken in {cfg.epochs} epochs "
             f"({summary and summary['skipped_steps']} skipped as non-finite, "
             f"{summary and summary['nonfinite_samples']} broken samples): the weights are the "
             "initial ones")
    return rows


if __name__ == "__main__":
    main()
    grpo_step.exit_distributed()  # a rank under torchrun leaves here: a shutdown can abort
