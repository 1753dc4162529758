"""Compare a finished JAGG run with a finished exact one trained with the same settings: the quality
tables' way of training exact GRPO once per seed and every JAGG mode against it.

    python lab/sd_runner.py $(python lab/presets.py mini) --method exact --seed 0 --out OUT/paper_seed0/exact
    python lab/sd_runner.py $(python lab/presets.py mini) --method jagg --seed 0 --out OUT/paper_seed0/jagg
    python lab/compare_runs.py OUT/paper_seed0/exact OUT/paper_seed0/jagg --out OUT/paper_seed0 --final-evals 3

writes OUT/paper_seed0/summary.json (what lab/summarize.py compare reads), with the final reward of each run the mean of its last --final-evals evaluations after epoch 0,
and samples.png (the base model, exact's and JAGG's final models on the same prompts and noise, redrawn
from the saved weights) and reward_curves.png. The runs' settings must be equal but for the JAGG flags.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sd_runner  # noqa: E402
import run_folder  # noqa: E402
from charts import chart, compare_grid, save_png  # noqa: E402

# Flags that change JAGG's run but not exact GRPO's, or only where a run writes: they may differ.
FREE = ("method", "out", "resume", "window", "jagg_frac", "anchors", "interior", "weights", "max_graph_rows", "route",
        "probe_every", "eval_every")


def load_run(folder, trained=True):
    """A finished run: (summary, its Config, (pipe, transformer, sigmas, use_bf16)), its final weights
    loaded (trained=False: the base model's)."""
    import torch
    from safetensors.torch import load_file

    summary = json.load(open(os.path.join(folder, "summary.json")))
    cfg = sd_runner.Config(**{k: v for k, v in summary["config"].items() if k in sd_runner.Config.__dataclass_fields__})
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    pipe, transformer = sd_runner.load_pipeline(cfg, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    if trained:
        sd_runner.load_weights(transformer, load_file(sd_runner.weights_path(folder, cfg.lora_rank)))
    return summary, cfg, (pipe, transformer, sd_runner.sampling_sigmas(cfg, pipe.scheduler).to(device),
                          device.type == "cuda")


def with_final(summary, final_evals):
    """summary with final_reward (and reward_gain) the mean of its last final_evals evaluations after epoch 0."""
    later = [v for e, v in summary["eval_curve"] if e > 0][-final_evals:] or [summary["eval_curve"][-1][1]]
    final = sum(later) / len(later)
    return {**summary, "final_reward": final, "reward_gain": final - summary["initial_reward"],
            "final_evals_used": len(later)}


def comparison(ex, jg, config):
    """A comparison's summary.json: both runs' summaries, the share of exact's reward gain JAGG kept, the speedups."""
    def ratio(key):
        return ex[key] / jg[key] if jg[key] else None
    return {"method": "compare", "mode": jg["mode"], "weights": config["weights"], "initial_reward": ex["initial_reward"],
            **{k: {"exact": ex[k], "jagg": jg[k]} for k in ("final_reward", "reward_gain", "grad_seconds",
                                                            "train_seconds", "grad_rows")},
            "reward_gain_ratio": jg["reward_gain"] / ex["reward_gain"] if ex["reward_gain"] else None,
            "grad_speedup": ratio("grad_seconds"), "train_speedup": ratio("train_seconds"),
            "grad_rows_ratio": ratio("grad_rows"), "exact": ex, "jagg": jg, "config": config}


def settings_check(ex, jg):
    """One line naming every setting the two runs differ in but the JAGG flags, or None."""
    if ex.get("method") != "exact" or jg.get("method") != "jagg":
        return f"give an exact run, then a jagg run (got {ex.get('method')!r}, {jg.get('method')!r})"
    a, b = ex["config"], jg["config"]
    differ = [k for k in a if k not in FREE and a.get(k) != b.get(k)]
    return None if not differ else "the runs were trained with other settings: " + ", ".join(
        f"--{k.replace('_', '-')} {a.get(k)} (exact), {b.get(k)} (jagg)" for k in differ)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("exact", help="a finished lab/sd_runner.py --method exact run")
    parser.add_argument("jagg", help="a finished lab/sd_runner.py --method jagg run with the same settings")
    parser.add_argument("--out", required=True, help="where summary.json, samples.png and reward_curves.png go")
    parser.add_argument("--final-evals", type=int, default=1, help="the final reward: the mean of the last N evaluations")
    parser.add_argument("--no-samples", action="store_true", help="skip samples.png (it redraws three evaluations)")
    args = parser.parse_args(argv)
    for run in (args.exact, args.jagg):
        if not os.path.isfile(os.path.join(run, "summary.json")):
            parser.error(f"{run!r} holds no finished run (no summary.json)")
    ex, jg = (json.load(open(os.path.join(run, "summary.json"))) for run in (args.exact, args.jagg))
    problem = settings_check(ex, jg)
    if problem:
        raise SystemExit(f"error: {problem}")
    ex, jg = with_final(ex, args.final_evals), with_final(jg, args.final_evals)
    result = comparison(ex, jg, jg["config"])
    result["exact_run"], result["jagg_run"] = args.exact, args.jagg
    run_folder.write_json(os.path.join(args.out, "summary.json"), result)
    save_png(os.path.join(args.out, "reward_curves.png"), chart(
        {m: s["eval_curve"] for m, s in (("exact", ex), ("jagg", jg))},
        f"evaluation reward ({jg['config']['reward']}, {jg['config']['eval_samples']} samples, fixed noise)",
        "GRPO epoch", "mean reward"))
    if not args.no_samples:
        draw_samples(args, ex, jg)
    print(f"JAGG ({jg['mode']}) kept {100 * (result['reward_gain_ratio'] or 0):.1f}% of exact GRPO's reward gain "
          f"({jg['reward_gain']:+.3f} vs {ex['reward_gain']:+.3f}, the mean of the last {args.final_evals} "
          f"evaluations); gradients {result['grad_speedup']:.2f}x faster, training {result['train_speedup']:.2f}x")
    if jg.get("probe_cosine_by_position"):
        print("the probe per segment: cosine " + " ".join(f"{c:.3f}" for c in jg["probe_cosine_by_position"])
              + "; JAGG's error against a step's noise, ± 95 %: " + " ".join(f"{e:.3f} ±{1.96 * s:.3f}" for e, s in zip(
                  jg["probe_error_to_noise_by_position"], jg["probe_error_to_noise_stderr_by_position"])))
    return result


def draw_samples(args, ex, jg):
    """samples.png: 12 evaluation samples spread over the prompt list, the base model and both final
    models, redrawn with the runs' evaluation noise (a note where a redrawn final evaluation differs)."""
    columns = {}
    for name, folder, trained in (("base", args.exact, False), ("exact", args.exact, True), ("jagg", args.jagg, True)):
        summary, cfg, (pipe, transformer, sigmas, use_bf16) = load_run(folder, trained)
        cfg = sd_runner.dataclasses.replace(cfg, resolution=cfg.resolution or min(
            512, transformer.config.sample_size * pipe.vae_scale_factor))
        prompts = sd_runner.evaluation_prompts(cfg, sd_runner.read_prompts(cfg))
        images, rewards = sd_runner.draw_evaluation(pipe, transformer, prompts, cfg, sigmas,
                                                   sd_runner.load_reward(cfg.reward), use_bf16,
                                                   sd_runner.evaluation_seed(cfg))
        epoch, recorded = summary["eval_curve"][-1 if trained else 0]
        if abs(rewards.mean().item() - recorded) > 1e-4:
            print(f"note: {name}'s redrawn evaluation scores {rewards.mean().item():.4f}, the run recorded "
                  f"{recorded:.4f} (another machine or thread count?); samples.png shows the redrawn one")
        columns[name if not trained else f"{name} (epoch {epoch})"] = (images, rewards.tolist())
    n = min(len(prompts), len(sd_runner.read_prompts(cfg)))  # 12 samples spread over the prompt list
    shown = sorted({i * n // min(12, n) for i in range(min(12, n))})
    grid = compare_grid([prompts[i] for i in shown], {name: ([ims[i] for i in shown], [r[i] for i in shown])
                                                      for name, (ims, r) in columns.items()})
    save_png(os.path.join(args.out, "samples.png"), grid)


if __name__ == "__main__":
    main(sys.argv[1:])
