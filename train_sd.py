"""JAGG-GRPO on a real DiT checkpoint: Stable Diffusion 3 / 3.5 through diffusers.

    python train_sd.py --model stabilityai/stable-diffusion-3.5-medium --method jagg --window 4
    python train_sd.py --preset mini --method compare   # the small SD3 trained here, on a CPU, in the setting
                                                        # that learns (docs/mini_sd3.md, tools/mini_quality.sh)
    torchrun --nproc_per_node=8 train_sd.py --model PATH --method jagg
    python train_sd.py --benchmark --window 4 --random-init [--json]   # exact vs JAGG timing

The algorithm is jagg.py's, unchanged; this file only knows the model. It follows Flow-GRPO's
practice: LoRA on the transformer (or full fine-tuning), classifier-free guidance when sampling
and training, KL to the reference model (the transformer with its adapter disabled), bf16
autocast on a GPU with the SDE math in fp32, gradient checkpointing, AdamW, gradient clipping,
optional EMA, and per-prompt advantages over groups gathered from every rank.

The model is wrapped once, in make_velocity_fn: the SD3 transformer becomes the
velocity_fn(z [S, B, C, H, W], t [S, B]) that jagg.py expects. The unconditional branch of
classifier-free guidance runs without a graph by default: the gradient flows through the
conditional branch only, so neither method pays a backward for it, as in Flow-GRPO's current
train_sd3.py (its compute_log_prob detaches that branch); --cfg-grad both back-propagates
through both branches, as Flow-GRPO's first release did.

Weights cannot be downloaded on the machines this was written on: `--model mini` builds,
pretrains and caches a small SD3 with SD3.5's parts (mini_sd3.py: three text encoders, a VAE,
an MMDiT-X transformer) on a GenEval-like task, whose checker is `--reward shapes`; the tests
run this script end to end on a tiny build of the same pipeline.
"""

import contextlib
import copy
import dataclasses
import io
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image, ImageDraw
from torch.distributed.tensor import DTensor, distribute_tensor
from tqdm import tqdm

import jagg
import jagg_options
from common import all_gather_cat, arg, atomic_write, fail_on, finish_distributed, init_distributed, jagg_flag_checks
from common import mean_over_ranks, mode_name, param_checksums, parse_config, report_benchmark, report_trajectory
from common import bench_modes, benchmark_trajectory, benchmark_window, chart, compare_summary, font, save_png, step_metrics
from common import trained_steps, training_step_bars, writable_folder_check
from common import JaggConfig, probe_cosine_by_position, probe_counts_as_training, probe_error_to_noise_by_position
from common import probe_error_to_noise_stderr_by_position, probe_report, write_json, write_jsonl

SHAPES_REWARDS = ("geneval", "shapes", "shapes_cover", "cover")  # mini_sd3.py's rewards: its prompts only
# --preset mini: the mini SD3's documented setting on a CPU (docs/mini_sd3.md), the one its tables use.
PRESETS = {"mini": dict(model="mini", reward="darkness", full_finetune=True, lr=3e-4, guidance_scale=2.5, beta=0.04,
                        clip_range=0.2, prompts_per_epoch=4, group_size=8, rollout_batch=32, train_batch=8,
                        steps_per_epoch=0, timestep_fraction=1.0, sigma_schedule="linear", global_std=False,
                        drop_zero_advantage=False,
                        ema=False, gradient_checkpointing=False, window=4, epochs=15, eval_samples=48, eval_every=2,
                        final_evals=3, save_every=15)}
# --preset mini-geneval: what exact GRPO needed to raise --reward geneval on the mini SD3 (full
# fine-tuning at the mini preset lowers it): Flow-GRPO's LoRA and global std, and 8 prompts x 8
# samples an epoch in optimizer steps of 16 (docs/mini_sd3.md, tools/mini_quality.sh geneval).
PRESETS["mini-geneval"] = dict(PRESETS["mini"], reward="geneval", full_finetune=False, global_std=True,
                               prompts_per_epoch=8, train_batch=16, epochs=12, eval_samples=96, save_every=12)
REWARDS = ["jpeg_compressibility", "jpeg_incompressibility", "darkness", "pickscore", *SHAPES_REWARDS]
DEFAULT_PROMPTS = [
    "a photo of a cat sitting on a windowsill", "a red bicycle leaning against a brick wall",
    "a bowl of ramen with chopsticks", "a lighthouse on a cliff at sunset", "an astronaut riding a horse",
    "a watercolor painting of a fox in the snow", "a cozy cabin in a pine forest", "a bunch of sunflowers in a vase",
]


@dataclass
class Config(JaggConfig):
    # --- model and data
    model: str = arg("stabilityai/stable-diffusion-3.5-medium", "diffusers StableDiffusion3Pipeline: hub id or local "
                     "directory; mini: the small SD3 of mini_sd3.py, pretrained once and cached in runs/cache")
    prompts: str = arg("", "text file with one prompt a line; empty: a small built-in list (--model mini: its task's 48)")
    reward: str = arg("jpeg_compressibility", "reward function; darkness: 1 - mean luminance, a check that the loop "
                                              "learns at all (any working GRPO loop raises it quickly); geneval: "
                                              "mini_sd3.py's GenEval-style score with partial credit (each object's "
                                              "colour and its shape by overlap with a fitted template, counts as "
                                              "1 - |N - N_ref| / N_ref, the relation by position; evaluations also "
                                              "log the strict all-correct accuracy per kind); shapes: "
                                              "mini_sd3.py's GenEval-like checker (colours, "
                                              "shapes, counts, left/right) for --model mini's prompts; shapes_cover: its "
                                              "mean with how much of the image the asked colours cover; cover: that "
                                              "coverage alone (dense: layout and colour)", choices=REWARDS)
    reward_model: str = arg("", "for --reward pickscore: local directory of a CLIP model and processor (PickScore)")
    resolution: int = arg(0, "image size in pixels; 0: 512 (Flow-GRPO's) for SD3/SD3.5 and the benchmark, the size "
                             "a --model mini was trained at", valid="0 or >= 16")
    out: str = arg("runs/sd", "output folder: metrics.jsonl, sample grids, weights, checkpoint")
    resume: str = arg("", "continue from the checkpoint in this output folder (--method compare with --exact-from: "
                          "a compare's folder, whose jagg/ run continues, e.g. to train a finished table longer)")
    exact_from: str = arg("", "--method compare: take exact GRPO from this finished run (a compare's DIR/exact, or a "
                              "--method exact run) instead of training it again; its settings must match this "
                              "run's but for the JAGG flags. Its last evaluation is redrawn from its saved weights "
                              "for samples.png")
    seed: int = arg(0, "random seed; ranks add their rank to the sampling seed", valid=">= 0")
    preset: str = arg("", "start from a documented setting, any flag given still winning: mini = the mini SD3's "
                          "setting that learns on a CPU (docs/mini_sd3.md: --model mini, full fine-tuning, lr 3e-4, "
                          "CFG 2.5, clip 0.2, all 10 steps, per-group std, 4 optimizer steps of 8 samples per epoch, "
                          "no EMA, darkness, 15 epochs); mini-geneval = mini with --reward geneval and what exact GRPO "
                          "needed to raise it (LoRA, global std, 8 prompts an epoch in steps of 16, 12 epochs, 96 "
                          "evaluation samples); empty: Flow-GRPO's geneval_sd3 defaults below",
                      choices=["", *PRESETS])
    # --- what to run (the JAGG flags are common.JaggConfig's)
    method: str = arg("jagg", "exact (Flow-GRPO), jagg, or compare (exact, then jagg, from the same model and seed, "
                              "into --out/exact and --out/jagg, with summary.json and pictures in --out)",
                      choices=["exact", "jagg", "compare"])
    # --- GRPO
    epochs: int = arg(100, "GRPO epochs (each: rollouts of --prompts-per-epoch prompts, then training)", valid=">= 1")
    num_steps: int = arg(10, "T, sampling steps of a rollout (Flow-GRPO trains with 10)", valid=">= 2")
    timestep_fraction: float = arg(0.99, "train the first int(T x this) steps of each rollout, in order (Flow-GRPO's "
                                         "timestep_fraction: 0.99 trains steps 0-8 of 10; the last, sigma 0.009 -> 0 "
                                         "in SD3's schedule, gets no gradient); 1: every step", valid="(0, 1]")
    sde_window: int = arg(0, "train an SDE window of this many consecutive steps (Flow-GRPO-Fast, MixGRPO): they are "
                             "sampled by the SDE and trained, every other step by the ODE (noise 0, no log-probability, "
                             "no gradient); --timestep-fraction is then unused, and --window must be at most this. 0: "
                             "every trained step is an SDE step, as Flow-GRPO", valid=">= 0")
    sde_placement: str = arg("random", "where the SDE window sits each epoch: random (Flow-GRPO-Fast: its first step "
                                       "uniform in the range, drawn each epoch) or slide (MixGRPO: from the range's "
                                       "start, one step later every --sde-slide-every epochs, then staying at its end)",
                             choices=list(jagg_options.PLACEMENTS))
    sde_range_start: int = arg(0, "the SDE window lies within steps --sde-range-start .. --sde-range-end - 1",
                               valid=">= 0")
    sde_range_end: int = arg(0, "end of the SDE window's range (exclusive); 0: --num-steps - 1 (the last step, to "
                                "sigma 0, is never stochastic)", valid=">= 0")
    sde_slide_every: int = arg(1, "--sde-placement slide: epochs between one-step moves (MixGRPO's shift interval)",
                               valid=">= 1")
    sigma_schedule: str = arg("scheduler", "the sampling steps' sigmas: scheduler (SD3's FlowMatchEulerDiscreteScheduler, "
                                           "as Flow-GRPO samples: 1, 0.960, ..., 0.278, 0.009, 0 at T = 10) or linear "
                                           "(jagg.sigma_schedule: the shifted linspace 1, ..., 0.25, 0)",
                              choices=["scheduler", "linear"])
    guidance_scale: float = arg(4.5, "classifier-free guidance scale: v_u + scale (v_c - v_u); 1: no guidance (the "
                                      "conditional branch alone; below 1 would move away from the prompt)", valid=">= 1")
    cfg_grad: str = arg("cond", "which CFG branches training back-propagates through: cond (the unconditional one "
                                "without graph, as Flow-GRPO's current trainer: half the backward, a biased gradient) "
                                "or both (Flow-GRPO's first release: the exact derivative of the guided velocity)", choices=["cond", "both"])
    noise_level: float = arg(0.7, "SDE noise level a of Flow-GRPO's sampler, std_t = a sqrt(sigma / (1 - sigma)) "
                                  "(Flow-GRPO: 0.7; 0 would be the ODE, which has no log-probability)", valid="(0, 1]")
    prompts_per_epoch: int = arg(2, "prompts sampled each epoch (the same on every rank; Flow-GRPO's geneval_sd3: 48, "
                                    "CPU-sized here)", valid=">= 1")
    group_size: int = arg(8, "samples per prompt on each rank; a group is all ranks' samples of a prompt (Flow-GRPO: "
                             "24 over all ranks, CPU-sized here)", valid=">= 1")
    rollout_batch: int = arg(8, "samples per rollout forward pass", valid=">= 1")
    steps_per_epoch: int = arg(2, "optimizer steps per epoch, each the mean gradient of its share of the epoch's samples "
                                  "in micro-batches of --train-batch (Flow-GRPO's gradient accumulation: 2); 0: one "
                                  "optimizer step per micro-batch", valid=">= 0")
    train_batch: int = arg(4, "samples per micro-batch (one forward and backward; Flow-GRPO: 9)", valid=">= 1")
    drop_zero_advantage: bool = arg(True, "train only on samples with a nonzero advantage, topped up with dropped ones "
                                          "to a multiple of the optimizer steps (Flow-GRPO's); --no-drop-zero-advantage: "
                                          "every sample")
    lr: float = arg(3e-4, "AdamW learning rate (Flow-GRPO's geneval_sd3)", valid="> 0")
    lr_schedule: str = arg("constant", "constant (Flow-GRPO's) or cosine (decay to 0 over --epochs: the policy settles, "
                                       "so the final reward is a plateau, not the last update's jitter)",
                           choices=["constant", "cosine"])
    weight_decay: float = arg(1e-4, "AdamW weight decay", valid=">= 0")
    clip_range: float = arg(1e-4, "GRPO ratio clip range (Flow-GRPO uses 1e-4)", valid="(0, 1)")
    beta: float = arg(0.04, "KL weight to the reference model, Flow-GRPO's term and scale (0: no reference forward)", valid=">= 0")
    adv_clip: float = arg(5.0, "advantages are clipped to [-adv_clip, adv_clip]", valid="> 0")
    global_std: bool = arg(True, "advantages: each prompt's mean subtracted, divided by the std of all the epoch's "
                                 "rewards over all ranks (Flow-GRPO's global_std); --no-global-std: each group's std")
    max_grad_norm: float = arg(1.0, "gradient clipping norm", valid="> 0")
    lora_rank: int = arg(32, "LoRA rank on the transformer's attention projections", valid=">= 1")
    lora_alpha: int = arg(64, "LoRA alpha", valid=">= 1")
    full_finetune: bool = arg(False, "train all transformer weights instead of a LoRA")
    gradient_checkpointing: bool = arg(True, "recompute activations in the backward pass to save memory")
    mixed_precision: str = arg("auto", "bf16 autocast (SDE math stays fp32), fp32, or auto (bf16 on GPU)",
                               choices=["auto", "bf16", "fp32"])
    ema: bool = arg(True, "keep an EMA of the trained weights, used for evaluation and saved (Flow-GRPO's)")
    ema_decay: float = arg(0.9, "EMA decay, warmed up as Flow-GRPO's: min((1 + s) / (10 + s), this) at optimizer step s", valid="[0, 1)")
    ema_every: int = arg(8, "update the EMA every N optimizer steps (Flow-GRPO: 8)", valid=">= 1")
    eval_every: int = arg(10, "every N epochs, sample fixed prompts with fixed noise (EMA weights if kept): eval/reward and a grid", valid=">= 1")
    eval_samples: int = arg(8, "samples per evaluation: the prompts in order, cycled, each with its own fixed noise", valid=">= 1")
    final_evals: int = arg(1, "final reward in summary.json: the mean of the last N evaluations after training started", valid=">= 1")
    save_every: int = arg(10, "write a checkpoint every N epochs", valid=">= 1")
    device: str = arg("auto", "cuda, cpu, or auto")
    fsdp: bool = arg(False, "under torchrun, shard the transformer over the ranks with FSDP2 (fully_shard every block, "
                            "then the root; the frozen reference too), for models whose weights, gradients and optimizer "
                            "state do not fit on one GPU each; without it, DistributedDataParallel. Every sample is "
                            "trained (no zero-advantage drop): FSDP's ranks must run the same forwards")
    # --- benchmark
    benchmark: bool = arg(False, "time one window's gradient exact vs JAGG on the conditional branch, then one whole "
                                 "training step (--num-steps, CFG, KL reference at --beta, rollout) in every mode; "
                                 "write benchmark.json and benchmark.png to --out, then exit")
    random_init: bool = arg(False, "benchmark: build the transformer from its config alone (no weights needed); the "
                                   "benchmark uses gradient checkpointing only if a GPU runs out of memory without it")
    bench_size: str = arg("auto", "benchmark transformer with --random-init: sd35-medium, cpu (7.8M parameters), tiny; "
                                  "auto: sd35-medium on GPU, cpu on CPU", choices=["auto", "sd35-medium", "cpu", "tiny"])
    bench_batch: int = arg(0, "benchmark batch size B (0: 4 on GPU, 2 on CPU)", valid=">= 0")
    bench_train: str = arg("full", "benchmark: what is trained, every weight (full) or a LoRA of --lora-rank on the "
                                   "attention projections (lora, as training adds it: Flow-GRPO's setting)",
                           choices=["full", "lora"])
    bench_checkpointing: bool = arg(False, "benchmark with gradient checkpointing on (training's default; the backward "
                                           "recomputes each forward)")
    bench_repeats: int = arg(5, "timed repeats per method (medians are reported)", valid=">= 1")
    json: bool = arg(False, "benchmark: print one JSON object instead of a table")

    def validate(self):
        """Every bad value is reported before any model is loaded; the output folder is checked last."""
        checks = jagg_flag_checks(self) + [
            (not self.fsdp or "WORLD_SIZE" in os.environ,
             "--fsdp shards the transformer over torchrun's ranks: run it as torchrun --nproc_per_node N train_sd.py --fsdp ..."),
            (not (self.fsdp and self.benchmark), "--benchmark times one process: leave out --fsdp"),
            (not self.sde_window or self.sde_range_start + self.sde_window <= self.sde_range(),
             f"--sde-window {self.sde_window} does not fit in steps {self.sde_range_start} to {self.sde_range() - 1} "
             f"(--sde-range-start, --sde-range-end; --num-steps {self.num_steps}): use a smaller window or a wider range"),
            (self.sde_range_end <= self.num_steps, f"--sde-range-end must be at most --num-steps {self.num_steps}, got "
                                                   f"{self.sde_range_end}"),
            (self.resolution % 16 == 0,
             f"--resolution must be a multiple of 16 (the VAE's 8x times the transformer's 2x2 patches), got "
             f"{self.resolution}: use {max(16, round(self.resolution / 16) * 16)}, or 0 for the model's own"),
        ]
        if self.benchmark:
            if not self.random_init:
                checks.append(_model_exists(self.model))
        else:
            checks += [
                (self.group_size >= 2 or int(os.environ.get("WORLD_SIZE", 1)) > 1,
                 f"--group-size must be >= 2 on one process (advantages compare a group's samples), got {self.group_size}"),
                (self.reward != "pickscore" or os.path.isdir(self.reward_model),
                 f"--reward pickscore needs --reward-model, a local directory with a CLIP model and processor; got {self.reward_model!r}"),
                (not self.prompts or os.path.isfile(self.prompts), f"--prompts file {self.prompts!r} does not exist"),
                (not self.prompts or not os.path.isfile(self.prompts) or bool(read_prompts(self.prompts)),
                 f"--prompts file {self.prompts!r} has no prompts (one a line; blank lines are skipped)"),
                (not (self.method == "compare" and self.resume and not self.exact_from),
                 "--method compare trains both methods from the start; --resume a compare with --exact-from "
                 "(only its jagg/ run is trained), or one of its runs with --method exact|jagg --out DIR/exact|jagg "
                 "--resume DIR/exact|jagg"),
                (not self.resume or os.path.isfile(os.path.join(self.resume_folder(), "checkpoint", "state.json")),
                 f"--resume {self.resume!r} holds no checkpoint (expected {self.resume_folder()}/checkpoint/state.json)"),
                _model_exists(self.model),
                (not self.exact_from or self.method == "compare",
                 f"--exact-from is for --method compare (got --method {self.method})"),
                *self.exact_from_checks(),
                self.shapes_prompt_check(),
            ]
        fail_on(checks)
        if self.resume and not self.benchmark:
            fail_on(self.resume_checks())
        fail_on([writable_folder_check(self.out)])

    def sde_range(self):
        """The end (exclusive) of the steps an SDE window may cover."""
        return self.sde_range_end or self.num_steps - 1

    def sde_window_start(self, epoch):
        """The first SDE step of epoch's rollouts (the same on every rank), or None without a window."""
        if not self.sde_window:
            return None
        return jagg_options.window_start(self.sde_placement, epoch, self.sde_window, self.sde_range_start,
                                         self.sde_range(), self.sde_slide_every, self.seed)

    def shapes_prompt_check(self):
        """--reward shapes scores prompts of mini_sd3.py's grammar only: say which one is not."""
        if self.reward not in SHAPES_REWARDS or (self.prompts and not os.path.isfile(self.prompts)):
            return True, ""
        import mini_sd3

        for p in default_prompts(self):
            try:
                mini_sd3.parse(p)
            except ValueError as e:
                where = f"--prompts {self.prompts!r}" if self.prompts else "the built-in SD prompts (use --model mini)"
                return False, f"--reward shapes: {where}: {e}"
        return True, ""

    # Flags that change JAGG's run but not exact GRPO's: --exact-from may differ in these alone.
    JAGG_ONLY_FLAGS = ("method", "out", "resume", "exact_from", "preset",  # preset: only a way to set the others
                       *(f.name for f in dataclasses.fields(JaggConfig)))

    def exact_from_checks(self):
        """--exact-from: a finished exact run whose settings are this run's but for JAGG_ONLY_FLAGS."""
        if not self.exact_from or self.method != "compare":
            return []
        summary = os.path.join(self.exact_from, "summary.json")
        if not os.path.isfile(summary):
            return [(False, f"--exact-from {self.exact_from!r} holds no finished run (expected {summary})")]
        with open(summary) as f:
            ex = json.load(f)
        if ex.get("method") != "exact":
            return [(False, f"--exact-from {self.exact_from!r} is a {ex.get('method')!r} run; give the folder of an "
                            f"exact one (a compare's DIR/exact)")]
        ours, defaults = dataclasses.asdict(self), dataclasses.asdict(Config())
        saved = ex["config"]
        weights = weights_path(self.exact_from, saved.get("full_finetune", False))
        if not os.path.isfile(weights):
            return [(False, f"--exact-from {self.exact_from!r} has no saved weights ({weights}): samples.png redraws "
                            f"its final samples from them")]
        # 0 resolution means the model's own: compare what the run used
        differ = [k for k in ours if k not in self.JAGG_ONLY_FLAGS and k != "resolution"
                  and saved.get(k, defaults[k]) != ours[k]]
        if self.resolution and saved.get("resolution") != self.resolution:
            differ.append("resolution")
        return [(not differ, f"--exact-from {self.exact_from!r} was trained with other settings: " + ", ".join(
            f"--{k.replace('_', '-')} {saved.get(k, defaults[k])} there, {ours[k]} here" for k in differ))]

    # The settings a checkpoint's weights depend on: resuming with others cannot load them.
    CHECKPOINT_FLAGS = ("full_finetune", "lora_rank", "lora_alpha")

    def resume_folder(self):
        """The run --resume continues: the folder itself, or a compare's jagg/ (exact GRPO is --exact-from's)."""
        return os.path.join(self.resume, "jagg") if self.method == "compare" else self.resume

    def resume_checks(self):
        """Compare the run to the checkpoint's saved config, flag by flag."""
        state = os.path.join(self.resume_folder(), "checkpoint", "state.json")
        with open(state) as f:
            saved = json.load(f).get("config")
        if saved is None and os.path.isfile(os.path.join(self.resume_folder(), "config.json")):  # older checkpoints
            with open(os.path.join(self.resume_folder(), "config.json")) as f:
                saved = json.load(f)
        def flag(key, value):
            name = key.replace("_", "-")
            return (f"--{name}" if value else f"--no-{name}") if isinstance(value, bool) else f"--{name} {value}"

        checks = []
        for key in self.CHECKPOINT_FLAGS:
            if saved is None or key not in saved:  # nothing recorded to compare with
                continue
            was, now = flag(key, saved[key]), flag(key, getattr(self, key))
            checks.append((saved[key] == getattr(self, key),
                           f"--resume {self.resume!r}: the checkpoint was trained with {was}, "
                           f"this run asks for {now}; resume with {was}"))
        return checks


def _model_exists(model):
    """A local path must exist; anything else is taken as a hub id and checked when loading."""
    if model == "mini":  # built and cached on first use
        return True, ""
    local = model.startswith((".", "/", "~")) or os.path.exists(model) or model.count("/") != 1
    return (not local or os.path.isdir(os.path.expanduser(model)),
            f"--model {model!r} is not a directory with a diffusers StableDiffusion3Pipeline (model_index.json)")


def read_prompts(path):
    with open(path) as f:
        return [line.strip() for line in f if line.strip()]


def default_prompts(cfg):
    """--prompts, else the mini model's task prompts (--model mini or --reward shapes), else a small list."""
    if cfg.prompts:
        return read_prompts(cfg.prompts)
    if cfg.model == "mini" or cfg.reward in SHAPES_REWARDS:
        import mini_sd3

        return mini_sd3.training_prompts()
    return DEFAULT_PROMPTS


# =====================================================================================
# The model: loading, LoRA, and the velocity_fn that jagg.py sees
# =====================================================================================


def load_pipeline(cfg, device, dtype):
    from diffusers import StableDiffusion3Pipeline

    path = mini_model_path() if cfg.model == "mini" else os.path.expanduser(cfg.model)
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
        add_lora(transformer, cfg.lora_rank, cfg.lora_alpha)
    if cfg.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    return pipe, transformer


def shard_transformer(transformer):
    """FSDP2: each transformer block sharded over the ranks as one group, then the root (the
    embeddings, the norms, the output layer). Parameter names stay the same; the root, too, is
    sharded again after every forward, so that outside them every parameter is its shard (the EMA,
    the checkpoints and the checksums read them there)."""
    from torch.distributed.fsdp import fully_shard

    for block in transformer.transformer_blocks:
        fully_shard(block)
    return fully_shard(transformer, reshard_after_forward=True)


def add_lora(transformer, rank, alpha):
    """Flow-GRPO's LoRA: on the attention projections of both streams; only it is trained."""
    from peft import LoraConfig

    transformer.requires_grad_(False)
    transformer.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian",
                                       target_modules=["to_k", "to_q", "to_v", "to_out.0", "add_k_proj",
                                                       "add_q_proj", "add_v_proj", "to_add_out"]))
    for p in transformer.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # LoRA weights in fp32; the frozen base may stay in bf16


def mini_model_path():
    """The cached mini SD3 (mini_sd3.py): the first process pretrains it (about 10 minutes on 2 CPU
    cores, once), the other ranks wait for it."""
    import mini_sd3

    if _is_main():
        mini_sd3.cached_pipeline()
    if dist.is_initialized():
        dist.barrier()
    return mini_sd3.cached_pipeline()  # built by now: only its folder


def default_resolution(pipe, cfg):
    """--resolution 0: the mini model's own size, else 512 (Flow-GRPO's for SD3.5)."""
    if cfg.resolution:
        return cfg.resolution
    return pipe.transformer.config.sample_size * pipe.vae_scale_factor if cfg.model == "mini" else 512


def autocast(device, enabled):
    return torch.autocast(device.type, dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


def make_velocity_fn(transformer, cond, uncond, guidance_scale, use_bf16, uncond_grad=False):
    """velocity_fn(z [S, B, C, H, W], t [S, B]) -> v [S, B, C, H, W] with classifier-free guidance.

    cond, uncond: (prompt_embeds [B, L, E], pooled [B, P]) of the B samples. The conditional
    branch carries the graph when grad is enabled. The unconditional one does too with
    uncond_grad (Flow-GRPO's first release: v = v_u + s (v_c - v_u) back-propagates as
    s J_c - (s - 1) J_u, the true derivative of the guided velocity, at twice the backward);
    without it, it runs without graph and the gradient flows through s * v_c alone (cheaper, and
    biased: it ignores that the update also moves v_u), as Flow-GRPO's current trainer does."""

    def velocity_fn(z, t):
        S, B = t.shape
        x = z.reshape(S * B, *z.shape[2:])  # [S*B, C, H, W]
        timestep = (t.reshape(S * B) * 1000).to(x.dtype)  # SD3's timesteps are sigma * 1000
        with autocast(x.device, use_bf16):
            v = transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=cond[0].repeat(S, 1, 1),
                            pooled_projections=cond[1].repeat(S, 1), return_dict=False)[0]  # [S*B, C, H, W]
            if guidance_scale > 1:
                with contextlib.nullcontext() if uncond_grad else torch.no_grad():
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
    # T5 tokens: SD3's 256, or fewer when the T5 tokenizer is shorter (the mini model's 16).
    t5_len = min(256, pipe.tokenizer_3.model_max_length) if pipe.tokenizer_3 is not None else 256
    pe, npe, pooled, npooled = pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None, device=device,
                                                  do_classifier_free_guidance=True, negative_prompt=[""] * len(prompts),
                                                  max_sequence_length=t5_len)
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
def sample(pipe, transformer, prompts, cfg, sigmas, generator, use_bf16, window_start=None):
    """Roll out the SDE sampler for prompts in chunks of cfg.rollout_batch; with window_start, an
    SDE window of cfg.sde_window steps from that step and the ODE elsewhere.

    Returns (traj, cond, uncond, images): trajectories over all B samples (the window's steps
    only, with a window), their text embeddings and the decoded images."""
    device = sigmas.device
    C, h = pipe.transformer.config.in_channels, cfg.resolution // pipe.vae_scale_factor
    trajs, conds, unconds, images = [], [], [], []
    for s in tqdm(range(0, len(prompts), cfg.rollout_batch), desc="rollouts", leave=False, disable=not _is_main()):
        chunk = prompts[s : s + cfg.rollout_batch]
        cond, uncond = encode(pipe, chunk, device)
        noise = torch.randn(len(chunk), C, h, h, generator=generator, device=device)  # [b, C, h, w]
        velocity_fn = make_velocity_fn(transformer, cond, uncond, cfg.guidance_scale, use_bf16)
        if window_start is None:
            traj = jagg.rollout(velocity_fn, noise, sigmas, cfg.noise_level, generator=generator)
            final = traj.sample
        else:
            traj, final = jagg_options.window_rollout(velocity_fn, noise, sigmas, cfg.noise_level, window_start,
                                                      cfg.sde_window, generator=generator)
        trajs.append(traj), conds.append(cond), unconds.append(uncond)
        images += decode(pipe, final)
    traj = jagg_options.cat_trajectories(trajs)  # [T, B, C, h, w] and the like
    cond = tuple(torch.cat([c[i] for c in conds]) for i in range(2))  # ([B, L, E], [B, P])
    uncond = tuple(torch.cat([c[i] for c in unconds]) for i in range(2))
    return traj, cond, uncond, images


def check_model(pipe, transformer, prompts, cfg, sigmas, use_bf16):
    """jagg_options.check_velocity_fn on two different prompts, before any training: v of z's shape, equal
    calls equal, and S steps at once equal to S single steps (conditioning repeated as a block).
    A few forwards; its own noise, so the run's random streams are untouched."""
    transformer.eval()
    cond, uncond = encode(pipe, list(dict.fromkeys(prompts))[:2] * (2 if len(set(prompts)) < 2 else 1), sigmas.device)
    h = cfg.resolution // pipe.vae_scale_factor
    g = torch.Generator(device=sigmas.device).manual_seed(0)
    noise = torch.randn(len(cond[0]), pipe.transformer.config.in_channels, h, h, generator=g, device=sigmas.device)
    jagg_options.check_velocity_fn(make_velocity_fn(transformer, cond, uncond, cfg.guidance_scale, use_bf16), noise, sigmas,
                                   rtol=2e-2 if use_bf16 else None)


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


def darkness(image):
    """1 - the image's mean luminance (ITU-R 601 weights), in [0, 1]."""
    return 1 - int(np.asarray(image.convert("L"), dtype=np.int64).sum()) / (255 * image.width * image.height)


def strict_accuracy(images, prompts):
    """{"eval/strict": ..., "eval/strict_<kind>": ...}: the share of images mini_sd3.geneval_strict
    counts all correct, overall and per kind of prompt (single, count, relation)."""
    import mini_sd3

    details = [mini_sd3.geneval_details(im, p) for im, p in zip(images, prompts)]
    out = {"eval/strict": sum(d["strict"] for d in details) / len(details)}
    for kind in ("single", "count", "relation"):
        of_kind = [d["strict"] for d in details if d["kind"] == kind]
        if of_kind:
            out[f"eval/strict_{kind}"] = sum(of_kind) / len(of_kind)
    return out


def make_reward_fn(cfg, device):
    """reward_fn(images, prompts) -> tensor [B]."""
    if cfg.reward == "jpeg_compressibility":  # DDPO's: smaller files, simpler images
        return lambda images, prompts: torch.tensor([-jpeg_kb(im) for im in images])
    if cfg.reward == "jpeg_incompressibility":
        return lambda images, prompts: torch.tensor([jpeg_kb(im) for im in images])
    if cfg.reward == "darkness":  # a check of the loop, as DDPO's compressibility: no prompt, one global number
        return lambda images, prompts: torch.tensor([darkness(im) for im in images])
    if cfg.reward in SHAPES_REWARDS:  # GenEval in miniature: colours, shapes, counts, left/right
        import mini_sd3

        fn = {"geneval": mini_sd3.geneval, "shapes": mini_sd3.score, "shapes_cover": mini_sd3.score_cover,
              "cover": mini_sd3.coverage}[cfg.reward]
        return lambda images, prompts: torch.tensor([fn(im, p) for im, p in zip(images, prompts)])
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


def full_state(tensors):
    """{name: tensor} as whole fp32 CPU tensors, FSDP's shards gathered (a collective: every rank calls it)."""
    return {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu().contiguous()
            for n, t in tensors.items()}


def trainable_state(transformer):
    return full_state({n: p for n, p in transformer.named_parameters() if p.requires_grad})


def as_param(w, p):
    """A saved whole tensor w laid out as the parameter p: sharded like it under FSDP."""
    w = w.to(p.device, p.dtype)
    return distribute_tensor(w, p.device_mesh, p.placements) if isinstance(p, DTensor) else w


def weights_path(folder, full_finetune):
    """Where a finished run keeps its trained weights (the EMA if kept)."""
    return os.path.join(folder, "transformer.safetensors" if full_finetune else "lora.safetensors")


def load_weights(transformer, weights):
    """Copy saved trainable weights {name: tensor} into the transformer; ValueError if they are
    not this model's trainable parameters."""
    params = dict(transformer.named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and n not in weights]
    if missing or any(n not in params for n in weights):
        raise ValueError(f"the checkpoint's weights do not match this model ({len(missing)} missing); "
                         f"same --lora-rank / --full-finetune as the run that saved them?")
    with torch.no_grad():
        for n, w in weights.items():
            params[n].copy_(as_param(w, params[n]))


def save_weights(path, state):
    from safetensors.torch import save

    atomic_write(path, lambda f: f.write(save(state)), mode="wb")


def checkpoint_state(transformer, optimizer, ema):
    """(weights, optimizer state, EMA) as whole tensors, FSDP's shards gathered through
    torch.distributed.checkpoint's state-dict API (every rank calls it; rank 0 writes them): one
    format for DDP, FSDP and one process, the optimizer's state keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    optim = get_optimizer_state_dict(transformer, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                       cpu_offload=True))
    return trainable_state(transformer), optim, None if ema is None else full_state(ema)


def save_checkpoint(out, state, epoch, rows, config, probe_average):
    """Write out/checkpoint/ as a whole (state: checkpoint_state's): into a temporary folder, then
    renamed into place."""
    weights, optim, ema = state
    final, tmp = os.path.join(out, "checkpoint"), os.path.join(out, ".checkpoint.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_weights(os.path.join(tmp, "weights.safetensors"), weights)
    if ema is not None:
        save_weights(os.path.join(tmp, "ema.safetensors"), ema)
    torch.save(optim, os.path.join(tmp, "optimizer.pt"))  # tensors and numbers only: loaded with weights_only
    write_jsonl(os.path.join(tmp, "metrics.jsonl"), rows)
    # --resume checks the config; the probe's average lets a resumed run route as an uninterrupted one would.
    write_json(os.path.join(tmp, "state.json"), {"epoch": epoch, "config": config, "probe_average": probe_average})
    old = os.path.join(out, ".checkpoint.old")
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(folder, transformer, optimizer):
    """(epoch, EMA laid out as the parameters, metrics rows, probe average) of folder's checkpoint,
    its weights and optimizer state loaded (sharded under FSDP). Safe: safetensors and
    torch.load(weights_only=True)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    ckpt = os.path.join(folder, "checkpoint")
    try:
        load_weights(transformer, load_file(os.path.join(ckpt, "weights.safetensors")))
        set_optimizer_state_dict(transformer, optimizer, options=StateDictOptions(full_state_dict=True),
                                 optim_state_dict=torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=True))
        ema = load_file(os.path.join(ckpt, "ema.safetensors")) if os.path.exists(os.path.join(ckpt, "ema.safetensors")) else None
        if ema is not None:
            params = dict(transformer.named_parameters())
            ema = {n: as_param(w, params[n]) for n, w in ema.items()}
        state = json.load(open(os.path.join(ckpt, "state.json")))
        rows = [json.loads(line) for line in open(os.path.join(ckpt, "metrics.jsonl"))]
    except Exception as e:
        raise SystemExit(f"error: cannot resume from {ckpt}: {e}") from None
    return state["epoch"], ema, rows, state.get("probe_average")


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


def compare_grid(prompts, columns, cell=96, gap=12):
    """Rows of prompts, one column per model: {name: (images, rewards)}; each image with its score."""
    label_w, head = 300, 44
    img = Image.new("RGB", (label_w + (cell + gap) * len(columns), head + len(prompts) * (cell + 22)), "white")
    d = ImageDraw.Draw(img)
    small = font(13)
    for j, name in enumerate(columns):
        d.multiline_text((label_w + j * (cell + gap) + cell / 2, 6), name.replace(" (", "\n("), fill="black", font=small,
                         anchor="ma", align="center")
    for i, p in enumerate(prompts):
        y = head + i * (cell + 22)
        d.text((8, y + cell / 2), p, fill="black", font=small, anchor="lm")
        for j, (images, rewards) in enumerate(columns.values()):
            x = label_w + j * (cell + gap)
            img.paste(images[i].resize((cell, cell), Image.NEAREST), (x, y))
            d.text((x + cell / 2, y + cell + 3), f"{rewards[i]:.2f}", fill="black", font=small, anchor="mt")
    return img


# =====================================================================================
# Training: the whole loop in one place
# =====================================================================================


def pick_device(cfg):
    """(device, use_bf16): this rank's GPU if there is one (or --device), bf16 autocast on GPU."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    return device, cfg.mixed_precision == "bf16" or (cfg.mixed_precision == "auto" and device.type == "cuda")


def evaluation_prompts(cfg, prompts_all):
    """The evaluation's prompts: the prompt list in order, cycled to --eval-samples."""
    return [prompts_all[i % len(prompts_all)] for i in range(cfg.eval_samples)]


def draw_evaluation(pipe, transformer, prompts, cfg, sigmas, reward_fn, use_bf16, noise_seed=None):
    """The evaluation: the prompts (evaluation_prompts), each with its own noise fixed by --seed
    (or by noise_seed: tools/eval_noise.py's independent draws). Returns (images, rewards [N])."""
    transformer.eval()
    g = torch.Generator(device=sigmas.device).manual_seed(cfg.seed + 12345 if noise_seed is None else noise_seed)
    _, _, _, images = sample(pipe, transformer, prompts, cfg, sigmas, g, use_bf16)
    return images, reward_fn(images, prompts)


def sampling_sigmas(cfg, shift):
    """The T + 1 sigmas of a rollout [T + 1], 1 to 0: SD3's scheduler's (what Flow-GRPO samples
    with; its last step is a small one, 0.009 -> 0 at T = 10) or jagg.sigma_schedule's linspace."""
    if cfg.sigma_schedule == "linear":
        return jagg.sigma_schedule(cfg.num_steps, shift)
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(cfg.num_steps)
    return scheduler.sigmas.float()  # [T+1], the last 0


def optimizer_steps(perm, adv, cfg, generator):
    """The epoch's optimizer steps: [[micro-batch sample indices, ...] per step], every rank the same
    number of steps (their all-reduces pair up). Flow-GRPO's: samples with a zero advantage are
    dropped, then random dropped ones put back until the count divides into --steps-per-epoch
    equal steps; each step's samples in micro-batches of at most --train-batch. With
    --steps-per-epoch 0, one step per micro-batch of the epoch's perm order, as many as all
    samples would fill (a step left without samples still joins the ranks' all-reduce)."""
    n_steps = cfg.steps_per_epoch or math.ceil(len(perm) / cfg.train_batch)
    keep = perm
    if cfg.drop_zero_advantage and not cfg.fsdp:  # FSDP: every rank must run as many micro-batches
        nonzero = adv[perm] != 0
        keep, dropped = perm[nonzero], perm[~nonzero]
        short = -len(keep) % n_steps if cfg.steps_per_epoch else 0
        back = dropped[torch.randperm(len(dropped), generator=generator)[:short]]
        keep = torch.cat([keep, back])[torch.randperm(len(keep) + len(back), generator=generator)]
    if not cfg.steps_per_epoch:
        micro = list(keep.split(cfg.train_batch))
        return [[m] for m in micro] + [[] for _ in range(n_steps - len(micro))]
    return [list(part.split(cfg.train_batch)) if len(part) else [] for part in keep.tensor_split(n_steps)]


def train(cfg):
    rank, world = init_distributed(always=cfg.fsdp)
    torch.manual_seed(cfg.seed)  # the same LoRA initialisation on every rank and every run
    device, use_bf16 = pick_device(cfg)
    prompts_all = default_prompts(cfg)
    reward_fn = make_reward_fn(cfg, device)
    pipe, transformer = load_pipeline(cfg, device, torch.bfloat16 if use_bf16 else torch.float32)
    cfg = dataclasses.replace(cfg, resolution=default_resolution(pipe, cfg))
    ref_transformer = None
    if cfg.full_finetune and cfg.beta > 0:  # a frozen copy, in the pipeline's precision (bf16 on GPU)
        ref_transformer = copy.deepcopy(transformer).requires_grad_(False).to(pipe.vae.dtype)
    if cfg.fsdp:  # weights, gradients and optimizer state sharded; the reference too
        shard_transformer(transformer)
        if ref_transformer is not None:
            shard_transformer(ref_transformer)
    params = [p for p in transformer.parameters() if p.requires_grad]
    net = transformer if cfg.fsdp or world == 1 else torch.nn.parallel.DistributedDataParallel(
        transformer, device_ids=[device.index] if device.type == "cuda" else None)

    def no_sync(i, n):
        """The engine's accumulation switch for micro-batch i of n of an optimizer step: DDP's no_sync
        around all of them (jagg_options all-reduces once per step), FSDP's around all but the last."""
        if world > 1 and not cfg.fsdp:
            return net.no_sync
        return (lambda: jagg_options.fsdp_no_sync(transformer)) if cfg.fsdp and i < n - 1 else contextlib.nullcontext
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    ema = {n: p.detach().clone() for n, p in transformer.named_parameters() if p.requires_grad} if cfg.ema else None

    start_epoch, rows, probe_avg = 0, [], None
    if cfg.resume:
        start_epoch, saved_ema, rows, probe_avg = load_checkpoint(cfg.resume, transformer, optimizer)
        ema = saved_ema if cfg.ema and saved_ema is not None else ema
    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
        write_json(os.path.join(cfg.out, "config.json"), dataclasses.asdict(cfg))
        print("config: " + json.dumps(dataclasses.asdict(cfg)))
        print(f"trainable parameters: {sum(p.numel() for p in params):,}; device {device}; bf16 {use_bf16}; world {world}")

    sigmas = sampling_sigmas(cfg, pipe.scheduler.config.get("shift", 3.0)).to(device)  # [T+1]
    check_model(pipe, transformer, prompts_all, cfg, sigmas, use_bf16)
    loss_cfg = jagg.LossConfig(noise_level=cfg.noise_level, clip_range=cfg.clip_range, beta=cfg.beta)
    opts = cfg.jagg_options(cfg.method)  # exact: every window exact (jagg_frac 0)
    n_train = trained_steps(cfg)  # Flow-GRPO's int(T * timestep_fraction): the first steps, in order
    # The samples an optimizer step's gradient averages, all ranks: the probe's error_to_noise is in its noise.
    step_batch = cfg.train_batch * world if not cfg.steps_per_epoch else max(
        1, cfg.prompts_per_epoch * cfg.group_size * world // cfg.steps_per_epoch)
    eval_prompts = evaluation_prompts(cfg, prompts_all)
    evaluated = {}  # epoch -> (images, rewards) of the evaluations: the first and the last are drawn

    def evaluate(epoch, row):
        """Fixed prompts and noise, the EMA weights if kept: a reward curve and a grid of samples."""
        with ema_weights(transformer, ema):
            images, rewards = draw_evaluation(pipe, transformer, eval_prompts, cfg, sigmas, reward_fn, use_bf16)
        evaluated[epoch] = (images, rewards.tolist())
        if rank != 0:  # under FSDP every rank draws the evaluation (its forwards gather the weights)
            return
        save_png(os.path.join(cfg.out, f"samples_{epoch:04d}.png"),
                 sample_grid(images[:16], eval_prompts[:16], rewards.tolist()[:16]))
        row["eval/reward"] = rewards.mean().item()
        if cfg.reward == "geneval":  # GenEval's strict accuracy beside the graded score, overall and per kind
            row.update(strict_accuracy(images, eval_prompts))

    def lr_at(epoch):
        if cfg.lr_schedule == "cosine":  # by epoch, so a resumed run has the rate an uninterrupted one would
            return cfg.lr * 0.5 * (1 + math.cos(math.pi * (epoch - 1) / cfg.epochs))
        return cfg.lr

    evaluates = rank == 0 or cfg.fsdp  # FSDP: every rank runs the evaluation's forwards, rank 0 keeps it
    if evaluates and start_epoch == 0:
        rows.append({"epoch": 0})
        evaluate(0, rows[-1])
    # The prompts of an epoch are the same on every rank (shared seed); the noise differs per rank,
    # so a prompt's group is spread over the ranks and advantages use the gathered rewards.
    # Generators are seeded per epoch, so a resumed run draws what an uninterrupted one would.
    bar = tqdm(range(start_epoch + 1, cfg.epochs + 1), desc=f"GRPO {cfg.method}", disable=rank != 0, dynamic_ncols=True)
    for epoch in bar:
        epoch_start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(epoch)
        # --- rollouts: sample, decode, reward
        prompt_gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
        noise_gen = torch.Generator(device=device).manual_seed((cfg.seed * 1_000_003 + epoch) * 1009 + rank + 1)
        pick = torch.randint(len(prompts_all), (cfg.prompts_per_epoch,), generator=prompt_gen)  # [P]
        prompt_ids = pick.repeat_interleave(cfg.group_size)  # [B]
        prompts = [prompts_all[i] for i in prompt_ids.tolist()]
        transformer.eval()
        window_start = cfg.sde_window_start(epoch)  # None: every trained step an SDE step
        traj, cond, uncond, images = sample(pipe, transformer, prompts, cfg, sigmas, noise_gen, use_bf16, window_start)
        rewards = reward_fn(images, prompts).to(device)  # [B]
        # --- advantages over groups gathered from all ranks, then this rank's slice
        all_rewards, all_ids = all_gather_cat(rewards), all_gather_cat(prompt_ids.to(device))
        adv = jagg.group_advantages(all_rewards, all_ids, global_std=cfg.global_std, clip=cfg.adv_clip)
        adv = adv.reshape(world, -1)[rank]  # [B]

        row = {"epoch": epoch, "method": cfg.method, "mode": mode_name(cfg.method, cfg.anchors, cfg.interior),
               "rollout/reward_mean": all_rewards.mean().item(),
               "rollout/reward_std": all_rewards.std().item()}
        if window_start is not None:
            row["rollout/sde_window_start"] = window_start
        perm = torch.randperm(len(prompts), generator=prompt_gen)

        def fns(idx_d, model):
            """The velocity_fn (CFG) and the reference's for the samples idx_d."""
            c, u = tuple(x[idx_d] for x in cond), tuple(x[idx_d] for x in uncond)
            ref_fn = make_ref_velocity_fn(transformer, ref_transformer, c, u, cfg, use_bf16) if cfg.beta > 0 else None
            return make_velocity_fn(model, c, u, cfg.guidance_scale, use_bf16, cfg.cfg_grad == "both"), ref_fn

        # --- the fidelity probe, on a few samples before training on them: the cosine of the mode's
        # gradient to the exact one per segment (averaged over ranks, so that all ranks route alike)
        if cfg.probe_every and epoch % cfg.probe_every == 0:
            start = time.perf_counter()
            idx_d = perm[: cfg.probe_batch].to(device)
            probe = jagg_options.probe_segments(lambda i: fns(idx_d[i], transformer), params,
                                                traj.subset(idx_d).first_steps(n_train), adv[idx_d], loss_cfg,
                                                cfg.jagg_options(), step_batch)
            row["probe/grad_cosine"] = mean_over_ranks(probe["cosine"], device)
            for key in ("error_to_noise", "error", "noise"):  # the ratio, and its two parts for averages over probes
                row[f"probe/{key}"] = mean_over_ranks(probe[key], device)
            probe_avg = jagg_options.probe_average(probe_avg, row["probe/grad_cosine"], cfg.probe_decay)
            row["time/probe_seconds"] = time.perf_counter() - start

        # --- training: the epoch's optimizer steps, each accumulating micro-batches of train_batch
        # samples over the first n_train steps of their trajectories (Flow-GRPO's timestep_fraction)
        transformer.train()
        step_stats, routed = [], None
        steps = optimizer_steps(perm, adv.cpu(), cfg, prompt_gen)
        row["train/samples"] = sum(len(idx) for micro in steps for idx in micro)
        for i, micro in enumerate(steps):
            step = (epoch - 1) * len(steps) + i + 1
            optimizer.zero_grad(set_to_none=True)
            micro_stats = []
            for j, idx in enumerate(micro):
                idx_d = idx.to(device)
                velocity_fn, ref_fn = fns(idx_d, net)
                stats, routed = jagg_options.accumulate_gradients(
                    velocity_fn, traj.subset(idx_d).first_steps(n_train), adv[idx_d], loss_cfg, opts,
                    ref_velocity_fn=ref_fn, no_sync=no_sync(j, len(micro)), probe_cosines=probe_avg)
                micro_stats.append(stats)
            done = jagg_options.optimizer_step(params, optimizer, [s["loss"] for s in micro_stats], micro_batches=len(micro),
                                       max_grad_norm=cfg.max_grad_norm, step=step)
            if micro_stats:
                micro_stats[-1].update(done)
            step_stats += micro_stats
            if ema is not None and not done["skipped"] and step % cfg.ema_every == 0:
                decay = min(step / (9 + step), cfg.ema_decay)  # Flow-GRPO's min((1 + s) / (10 + s), 0.9), s = step - 1
                with torch.no_grad():
                    for n, p in transformer.named_parameters():
                        if p.requires_grad:
                            ema[n].mul_(decay).add_(p.detach().to(ema[n].device), alpha=1 - decay)
        row.update(step_metrics(step_stats))
        row["time/train_seconds"] = time.perf_counter() - epoch_start  # rollouts, probe, training; not evaluation
        row["train/lr"] = lr_at(epoch)
        row["routing/routed"] = routed  # the epoch's last optimizer step, per segment
        row["train/param_checksums"] = param_checksums(params)  # equal on every rank: DDP kept them in sync
        rows.append(row)
        bar.set_postfix(reward=f"{row['rollout/reward_mean']:.3f}", kl=f"{row['train/kl']:.4f}",
                        clipfrac=f"{row['train/clipfrac']:.3f}", bwd=f"{row['time/backward_seconds']:.1f}s",
                        **({"skipped": row["train/skipped_steps"]} if row["train/skipped_steps"] else {}))
        if evaluates and (epoch % cfg.eval_every == 0 or epoch == cfg.epochs):
            evaluate(epoch, row)
        if epoch % cfg.save_every == 0 or epoch == cfg.epochs:
            state = checkpoint_state(transformer, optimizer, ema)  # every rank: FSDP gathers the shards
            if rank == 0:
                save_checkpoint(cfg.out, state, epoch, rows, dataclasses.asdict(cfg), probe_avg)
                save_weights(weights_path(cfg.out, cfg.full_finetune), state[2] if ema is not None else state[0])
        if rank == 0:
            write_jsonl(os.path.join(cfg.out, "metrics.jsonl"), rows)
    if dist.is_initialized():
        dist.barrier()
    summary = summarize(cfg, rows) if rank == 0 else None
    if rank == 0:
        write_json(os.path.join(cfg.out, "summary.json"), summary)
        print(f"[{summary['mode']}] eval reward {summary['initial_reward']:.3f} -> {summary['final_reward']:.3f} "
              f"(mean of the last {summary['final_evals_used']} evaluations of {cfg.eval_samples} samples), "
              f"training {summary['train_seconds']:.0f} s (backward {summary['backward_seconds']:.0f} s), "
              f"outputs in {cfg.out}/")
    return rows, summary, evaluated


def summarize(cfg, rows):
    """A run's summary.json: rewards (the final one the mean of the last --final-evals
    evaluations after epoch 0), times, and the probe's mean cosine per segment."""
    evals = [(r["epoch"], r["eval/reward"]) for r in rows if "eval/reward" in r]
    later = [v for e, v in evals if e > 0][-cfg.final_evals:] or [evals[-1][1]]
    final = sum(later) / len(later)
    trained = [r for r in rows if r["epoch"] > 0]
    # each epoch's rollouts and optimizer steps, and the probe only where it routes (else it is a diagnostic)
    routes = probe_counts_as_training(cfg.method, cfg.route)
    epoch_seconds = [r.get("time/train_seconds", 0.0) - (0.0 if routes else r.get("time/probe_seconds", 0.0))
                     for r in trained]
    return {
        "method": cfg.method, "mode": mode_name(cfg.method, cfg.anchors, cfg.interior), "weights": cfg.weights,
        "initial_reward": evals[0][1], "final_reward": final, "final_evals_used": len(later),
        "reward_gain": final - evals[0][1],
        "eval_curve": evals,
        "train_seconds": sum(epoch_seconds), "epoch_seconds": epoch_seconds,  # reward against wall-clock
        "backward_seconds": sum(r["time/backward_seconds"] for r in trained),
        "grad_seconds": sum(r["time/grad_seconds"] for r in trained),
        "probe_seconds": sum(r.get("time/probe_seconds", 0.0) for r in trained),
        "grad_steps": sum(r["train/grad_rows"] for r in trained),  # network rows with grad (the name summary.json had)
        "skipped_steps": sum(r["train/skipped_steps"] for r in trained),
        "window": cfg.window, "epochs": cfg.epochs,
        "probe_cosine_by_position": probe_cosine_by_position(trained),
        "probe_error_to_noise_by_position": probe_error_to_noise_by_position(trained),
        "probe_error_to_noise_stderr_by_position": probe_error_to_noise_stderr_by_position(trained),
        "config": dataclasses.asdict(cfg),
    }


# =====================================================================================
# Benchmark: a window's gradient and a whole training step, exact vs JAGG's modes, on the SD3 transformer
# =====================================================================================

SD3_CONFIGS = {
    # SD3.5-medium's transformer (MMDiT-X; 2.24B parameters by our count): 24 blocks, dual attention in blocks 0-12.
    "sd35-medium": dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                        num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                        pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                        dual_attention_layers=tuple(range(13)), qk_norm="rms_norm"),
    # A reduced SD3 transformer (7.8M parameters) whose window gradient a 2-core CPU times in minutes.
    "cpu": dict(sample_size=32, patch_size=2, in_channels=16, num_layers=6, attention_head_dim=32,
                num_attention_heads=6, joint_attention_dim=192, caption_projection_dim=192,
                pooled_projection_dim=192, out_channels=16, pos_embed_max_size=32),
    # For tests only.
    "tiny": dict(sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
                 num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                 pooled_projection_dim=16, out_channels=4, pos_embed_max_size=8),
}


def benchmark(cfg):
    """One window's gradient on the conditional branch alone (the backward JAGG shrinks, as
    before), then one whole trajectory's training computation in every mode, as train() runs it:
    the trained steps of --num-steps (--timestep-fraction, Flow-GRPO's 9 of 10 by default),
    classifier-free guidance with the no-graph unconditional branch, the KL reference at --beta,
    and one rollout of the same batch. Interleaved, medians of repeats."""
    from diffusers import SD3Transformer2DModel

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
    use_bf16 = cfg.mixed_precision == "bf16" or (cfg.mixed_precision == "auto" and device.type == "cuda")
    torch.manual_seed(cfg.seed)
    if cfg.random_init:
        size = cfg.bench_size if cfg.bench_size != "auto" else ("sd35-medium" if device.type == "cuda" else "cpu")
        with torch.device(device):  # initialised where it runs: SD3.5-medium's 2.24B parameters take seconds on a GPU
            transformer = SD3Transformer2DModel(**SD3_CONFIGS[size])
    else:
        size = cfg.model
        transformer = SD3Transformer2DModel.from_pretrained(os.path.expanduser(cfg.model), subfolder="transformer")
    transformer.to(device, torch.bfloat16 if use_bf16 else torch.float32)
    if cfg.bench_train == "lora":
        add_lora(transformer, cfg.lora_rank, cfg.lora_alpha)
        transformer.to(device)
    params = [p for p in transformer.parameters() if p.requires_grad]  # every weight, or the LoRA's
    if cfg.bench_checkpointing:
        transformer.enable_gradient_checkpointing()
    tc = transformer.config
    B = cfg.bench_batch or (4 if device.type == "cuda" else 2)
    W, T, L = cfg.window, cfg.num_steps, 77
    # The reduced configurations at their own size; SD3.5-medium or a real model at --resolution.
    h = tc.sample_size if size in ("cpu", "tiny") else (cfg.resolution or 512) // 8  # latent side
    cond = (torch.randn(B, L, tc.joint_attention_dim, device=device), torch.randn(B, tc.pooled_projection_dim, device=device))
    uncond = (torch.randn(B, L, tc.joint_attention_dim, device=device), torch.randn(B, tc.pooled_projection_dim, device=device))
    velocity_fn = make_velocity_fn(transformer, cond, uncond, cfg.guidance_scale, use_bf16)  # CFG, as training runs it
    cond_only = make_velocity_fn(transformer, cond, None, 1.0, use_bf16)  # the window-level rows: what JAGG shrinks
    # The KL reference: the transformer itself (window_gradients calls it without grad), which costs
    # what the adapter-disabled LoRA model or a frozen copy costs.
    ref_fn = velocity_fn if cfg.beta > 0 else None
    sigmas = sampling_sigmas(cfg, 3.0).to(device)  # [T+1]
    noise = torch.randn(B, tc.in_channels, h, h, device=device)  # [B, C, h, w]
    traj = jagg.rollout(velocity_fn, noise, sigmas, cfg.noise_level)
    adv = torch.randn(B, device=device)  # [B]
    loss_cfg = jagg.LossConfig(noise_level=cfg.noise_level, clip_range=cfg.clip_range, beta=cfg.beta)
    window_loss = jagg.make_step_loss(traj, adv, 0, W, jagg.LossConfig(noise_level=cfg.noise_level, clip_range=cfg.clip_range))

    def measure():
        t_window = benchmark_window(cond_only, params, traj.z[:W], traj.t[:W], window_loss, repeats=cfg.bench_repeats)
        t_traj = benchmark_trajectory(velocity_fn, params, traj.first_steps(trained_steps(cfg)), adv, loss_cfg, W, ref_fn,
                                      repeats=cfg.bench_repeats,
                                           modes=bench_modes(cfg.max_graph_rows),
                                           rollout_fn=lambda: jagg.rollout(velocity_fn, noise, sigmas, cfg.noise_level))
        # JAGG or an SDE window: a window of K steps trained exactly, and with JAGG inside it at W = K.
        # Its rollout calls the network at the same T steps as a full one (the ODE steps too).
        t_sde = {K: benchmark_trajectory(velocity_fn, params, traj.first_steps(K), adv, loss_cfg, K, ref_fn,
                                         repeats=cfg.bench_repeats, modes=("exact", "jagg", "jagg_shared_rollout"))
                 for K in SDE_WINDOWS if K <= T}
        return t_window, t_traj, t_sde

    # No gradient checkpointing unless the largest joint anchor batch does not fit: the benchmark
    # times the plain forward and backward passes where it can.
    checkpointing = cfg.bench_checkpointing
    try:
        t, t_traj, t_sde = measure()
    except torch.cuda.OutOfMemoryError:
        if device.type != "cuda" or checkpointing:
            raise
        checkpointing = True
        print("out of GPU memory without gradient checkpointing: timing every mode again with it")
        for p in params:
            p.grad = None
        torch.cuda.empty_cache()
        transformer.enable_gradient_checkpointing()
        t, t_traj, t_sde = measure()
    result = {
        "window": W, "trained_steps": trained_steps(cfg), "params": sum(p.numel() for p in transformer.parameters()),
        "trained_params": sum(p.numel() for p in params), "train": cfg.bench_train,
        "lora_rank": cfg.lora_rank if cfg.bench_train == "lora" else None, "device": str(
            torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
        "config": size, "batch": B, "tokens": (h // tc.patch_size) ** 2 + L, "bf16": use_bf16, "repeats": cfg.bench_repeats,
        "gradient_checkpointing": checkpointing,
        "exact_backward_s": t["exact"]["backward"], "jagg_backward_s": t["jagg"]["backward"],
        "exact_fwd_graph_s": t["exact"]["fwd_graph"], "jagg_fwd_graph_s": t["jagg"]["fwd_graph"],
        "jagg_fwd_nograd_s": t["jagg"]["fwd_nograd"],
        "exact_step_s": t["exact"]["total"], "jagg_step_s": t["jagg"]["total"],
        "num_steps": T, "guidance_scale": cfg.guidance_scale, "beta": cfg.beta,
    }
    with contextlib.redirect_stdout(io.StringIO()) if cfg.json else contextlib.nullcontext():
        trained = "all trained" if cfg.bench_train == "full" else \
            f"LoRA rank {cfg.lora_rank} trained: {result['trained_params'] / 1e6:.2f}M"
        print(f"SD3 transformer '{size}', {result['params'] / 1e6:.1f}M parameters ({trained}), {result['device']}, "
              f"B = {B}, {result['tokens']} tokens, bf16 {use_bf16}, gradient checkpointing {checkpointing}, "
              f"medians of {cfg.bench_repeats} interleaved repeats")
        print(f"\n-- one window's gradient, conditional branch only (W = {W})")
        result.update(report_benchmark(t, W))
        print(f"\n-- one training step: a whole trajectory (T = {T}, the first {trained_steps(cfg)} trained, "
              f"CFG {cfg.guidance_scale}, beta {cfg.beta}, W = {W})")
        result.update(report_trajectory(t_traj, W))
        print(f"\n-- JAGG or an SDE window: a window of K steps trained (--sde-window K), exact and with JAGG at W = K; "
              f"its rollout takes the same T = {T} network calls")
        result["sde_windows"] = report_sde_windows(result, t_sde)
    write_json(os.path.join(cfg.out, "benchmark.json"), {"config": dataclasses.asdict(cfg), "result": result})
    save_png(os.path.join(cfg.out, "benchmark.png"), training_step_bars(
        {W: result}, 1.0, "s", f"SD3 '{size}' on {result['device']}: one GRPO training step "
                               f"(T = {T}, CFG {cfg.guidance_scale}, beta {cfg.beta}, B = {B})"))
    if cfg.json:
        print(json.dumps(result))
    return result


SDE_WINDOWS = (3, 4)  # the benchmark's SDE windows: Flow-GRPO-Fast's 3 (geneval), MixGRPO's 4


def report_sde_windows(result, t_sde):
    """Print the full trajectory's modes beside each SDE window's, as one table of what an epoch
    costs: rows with grad, training step, epoch (rollout + step), activations saved for backward.
    Returns {"<setting>": {those}}."""
    rollout = result["rollout_s"]
    rows = {f"all {result['trained_steps']} steps, {m}": (result["backward_rows"][m], result["train_s"][m],
                                                          result["saved_gb"][m])
            for m in ("exact", "jagg", "jagg_shared_rollout") if m in result["train_s"]}
    for K, t in t_sde.items():
        rows.update({f"window of {K}, {m}": (int(t[m]["backward_rows"]), t[m]["train_s"], t[m]["saved_gb"]) for m in t})
    base = rows[f"all {result['trained_steps']} steps, exact"]
    print(f"{'setting':>36} {'rows':>5} {'step (s)':>9} {'x step':>7} {'epoch (s)':>10} {'x epoch':>8} {'saved MiB':>10}")
    out = {}
    for name, (n, step, saved) in rows.items():
        out[name] = {"rows": n, "train_s": step, "epoch_s": rollout + step, "saved_gb": saved}
        print(f"{name:>36} {n:>5} {step:>9.3f} {base[1] / step:>6.2f}x {rollout + step:>10.3f} "
              f"{(rollout + base[1]) / (rollout + step):>7.2f}x {1024 * saved:>10.1f}")
    return out


def load_run(folder, trained=True):
    """A finished single run (exact or jagg): (summary, its Config, (pipe, transformer, sigmas,
    use_bf16)) with its saved final weights loaded, or the base model's with trained=False."""
    with open(os.path.join(folder, "summary.json")) as f:
        summary = json.load(f)
    run_cfg = Config(**{k: v for k, v in summary["config"].items() if k in Config.__dataclass_fields__})
    device, use_bf16 = pick_device(run_cfg)
    pipe, transformer = load_pipeline(run_cfg, device, torch.bfloat16 if use_bf16 else torch.float32)
    if trained:
        load_final_weights(transformer, folder, run_cfg)
    sigmas = sampling_sigmas(run_cfg, pipe.scheduler.config.get("shift", 3.0)).to(device)
    return summary, run_cfg, (pipe, transformer, sigmas, use_bf16)


def load_final_weights(transformer, folder, run_cfg):
    """A finished run's saved final weights (its LoRA, or every weight) into the transformer."""
    from safetensors.torch import load_file

    load_weights(transformer, load_file(weights_path(folder, run_cfg.full_finetune)))


def reuse_exact(cfg, base):
    """--exact-from: (None, summary, evaluated) of the finished exact run, as train() returns them.
    evaluated holds the base model's evaluation (base: JAGG's, drawn from the same model with
    the same noise; None: a resumed JAGG run drew none, so it is drawn here) and the final one,
    redrawn from the run's saved weights."""
    summary, ex_cfg, (pipe, transformer, sigmas, use_bf16) = load_run(cfg.exact_from, trained=False)
    prompts, reward_fn = evaluation_prompts(ex_cfg, default_prompts(ex_cfg)), make_reward_fn(ex_cfg, sigmas.device)
    if base is None:
        images, rewards = draw_evaluation(pipe, transformer, prompts, ex_cfg, sigmas, reward_fn, use_bf16)
        base = (images, rewards.tolist())
    load_final_weights(transformer, cfg.exact_from, ex_cfg)
    images, rewards = draw_evaluation(pipe, transformer, prompts, ex_cfg, sigmas, reward_fn, use_bf16)
    last_epoch, last_reward = summary["eval_curve"][-1]
    if abs(rewards.mean().item() - last_reward) > 1e-4:
        print(f"note: the redrawn final evaluation of {cfg.exact_from} scores {rewards.mean().item():.4f}, the run "
              f"recorded {last_reward:.4f} (another machine or thread count?); samples.png shows the redrawn one")
    return None, summary, {0: base, last_epoch: (images, rewards.tolist())}


def compare(cfg):
    """Exact GRPO, then JAGG in the mode the flags ask for, from the same model and seed (so the
    same LoRA initialisation, prompts and evaluation noise); summary.json with the toy's
    comparison keys, the reward curves and the samples before and after, side by side."""
    runs = {}
    for method in ("jagg",) if cfg.exact_from else ("exact", "jagg"):
        runs[method] = train(dataclasses.replace(cfg, method=method, out=os.path.join(cfg.out, method),
                                                 resume=cfg.resume and cfg.resume_folder()))  # only jagg/ resumes
    if not _is_main():
        return None
    if cfg.exact_from:  # exact GRPO from a finished run: its summary, its base and final samples redrawn
        runs["exact"] = reuse_exact(cfg, base=runs["jagg"][2].get(0))  # a resumed run drew no epoch 0
    ex, jg = runs["exact"][1], runs["jagg"][1]
    comparison = compare_summary(ex, jg, dataclasses.asdict(cfg))
    write_json(os.path.join(cfg.out, "summary.json"), comparison)
    save_png(os.path.join(cfg.out, "reward_curves.png"), chart(
        {m: runs[m][1]["eval_curve"] for m in ("exact", "jagg")},
        f"evaluation reward ({cfg.reward}, {cfg.eval_samples} samples, fixed noise)", "GRPO epoch", "mean reward"))
    evals = {m: runs[m][2] for m in ("exact", "jagg")}
    first, last = min(evals["exact"]), {m: max(e) for m, e in evals.items()}
    prompts = default_prompts(cfg)
    # 12 evaluation samples spread over the prompt list (the mini task's: single, count, relation)
    n = min(cfg.eval_samples, len(prompts))
    rows_shown = sorted({i * n // min(12, n) for i in range(min(12, n))})
    columns = {"base": evals["exact"][first], **{f"{m} (epoch {last[m]})": evals[m][last[m]] for m in ("exact", "jagg")}}
    columns = {name: ([ims[i] for i in rows_shown], [r[i] for i in rows_shown]) for name, (ims, r) in columns.items()}
    save_png(os.path.join(cfg.out, "samples.png"), compare_grid([prompts[i] for i in rows_shown], columns))
    print(f"JAGG ({jg['mode']}) kept {100 * (comparison['reward_gain_ratio'] or 0):.1f}% of exact GRPO's reward gain "
          f"({jg['reward_gain']:+.3f} vs {ex['reward_gain']:+.3f}); backward {comparison['backward_speedup']:.2f}x faster, "
          f"training (rollouts included) {comparison['train_speedup']:.2f}x, "
          f"{comparison['grad_steps_ratio']:.2f}x fewer network rows with grad")
    if jg["probe_cosine_by_position"]:
        print(probe_report(jg))
    print(f"wrote {cfg.out}/: summary.json, reward_curves.png, samples.png, "
          + (f"jagg/ (exact: {cfg.exact_from})" if cfg.exact_from else "exact/, jagg/"))
    return comparison


def main(argv=None):
    cfg = parse_config(Config, argv, description=__doc__.split("\n")[0], presets=PRESETS)
    cfg.validate()
    if cfg.benchmark:
        return benchmark(cfg)
    if cfg.method == "compare":
        return compare(cfg)
    return train(cfg)[0]


if __name__ == "__main__":
    main(sys.argv[1:])
    finish_distributed()
