"""The mini SD3's documented settings as lab/sd_runner.py flags (lab/reports/mini_sd3.md), the ones its tables use.

    python lab/sd_runner.py $(python lab/presets.py mini) --method exact --out runs/mini/exact   # any flag after wins
    python lab/presets.py mini-geneval                                                   # prints the flags

mini: the setting that learns darkness on a CPU: full fine-tuning, lr 3e-4, CFG 2.5, clip 0.2, all 10
steps on the shifted linear schedule, per-group std, 4 prompts x 8 samples an epoch in optimizer steps
of 8, no EMA, 15 epochs, 48 evaluation samples. mini-geneval: mini with the GenEval-like reward and what
exact GRPO needed to raise it (LoRA rank 32, global std, 8 prompts an epoch in steps of 16, 12 epochs,
96 evaluation samples). The first call pretrains the mini SD3 (lab/mini_sd3_pipeline.py, about 10
minutes on 2 cores) into runs/cache/.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MINI = ["--reward", "darkness", "--lora-rank", "0", "--lr", "3e-4", "--guidance-scale", "2.5", "--beta", "0.04",
        "--clip-range", "0.2", "--prompts-per-epoch", "4", "--group-size", "8", "--train-batch", "8",
        "--steps-per-epoch", "0", "--timestep-fraction", "1", "--sigma-schedule", "linear", "--no-global-std",
        "--no-ema", "--no-gradient-checkpointing", "--window", "4", "--epochs", "15", "--eval-samples", "48",
        "--eval-every", "2"]
PRESETS = {"mini": MINI,
           "mini-geneval": MINI + ["--reward", "lab.mini_sd3:geneval_reward", "--lora-rank", "32", "--global-std",
                                   "--prompts-per-epoch", "8", "--train-batch", "16", "--epochs", "12",
                                   "--eval-samples", "96"]}


# The lab tools' --reward short names for the mini task's rewards, and lab/sd_runner.py's module:function for each.
REWARDS = {"shapes": "lab.mini_sd3:shapes_reward", "geneval": "lab.mini_sd3:geneval_reward",
           "cover": "lab.mini_sd3:cover_reward", "shapes_cover": "lab.mini_sd3:shapes_cover_reward"}


def mini_pipeline():
    """The pretrained mini SD3's folder (built once), with its prompts.txt."""
    import mini_sd3_pipeline

    folder = mini_sd3_pipeline.cached_pipeline(log=lambda *a: print(*a, file=sys.stderr))
    prompts_file(folder)  # a cache from before prompts.txt was saved has none
    return folder


def flags(name, model="mini"):
    """The preset's lab/sd_runner.py flags, --model and --prompts included (argparse: a later flag wins)."""
    if name not in PRESETS:
        raise SystemExit(f"error: the preset must be one of {', '.join(PRESETS)}, got {name!r}")
    folder = mini_pipeline() if model == "mini" else model
    return ["--model", folder, "--prompts", prompts_file(folder), *PRESETS[name]]


def config(name, *extra, model="mini"):
    """sd_runner.Config of a preset, extra flags after it; model: a pipeline folder, or mini (the cached one)."""
    import sd_runner

    return sd_runner.parse(flags(name, model) + [str(e) for e in extra])


def prompts_file(folder):
    """A mini pipeline's prompts.txt (written if a saved pipeline has none)."""
    import mini_sd3

    path = os.path.join(folder, "prompts.txt")
    if not os.path.isfile(path):
        with open(path, "w") as f:
            f.write("\n".join(mini_sd3.training_prompts()) + "\n")
    return path


def load(cfg, seed=None):
    """(pipe, transformer, cfg with its resolution resolved) on the CPU in fp32, as sd_runner.train loads them;
    seed: torch's seed first (a LoRA's initialisation)."""
    import dataclasses

    import torch
    import sd_runner

    if seed is not None:
        torch.manual_seed(seed)
    pipe, transformer = sd_runner.load_pipeline(cfg, torch.device("cpu"), torch.float32)
    size = cfg.resolution or min(512, transformer.config.sample_size * pipe.vae_scale_factor)
    return pipe, transformer, dataclasses.replace(cfg, resolution=size)


if __name__ == "__main__":
    print(" ".join(flags(sys.argv[1] if len(sys.argv) > 1 else "mini")))
