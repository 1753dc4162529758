"""The evaluation's own sampling error: each model's evaluation redrawn with independent noise.

    python lab/eval_noise.py runs/mini_geneval/paper_seed0/exact runs/mini_geneval/paper_seed0/jagg ... --draws 4
    python lab/eval_noise.py runs/mini_geneval/paper_seed*/exact --draws 4 --out runs/eval_noise.json
    python lab/eval_noise.py OUT/paper_seed0/exact OUT/paper_seed0/jagg OUT/shared_seed0/jagg --out seed0.json
        # then lab/summarize.py paired seed*.json: how much of JAGG - exact's spread is the evaluation's

A lab/sd_runner.py run evaluates with one fixed noise draw per sample (--seed's), the same at every
epoch, so the spread of its last evaluations is the model's drift between epochs, not the error
of the evaluation. This tool loads each finished run's final weights (and the base model, from the
first run's settings) and draws the run's evaluation --draws more times, each with its own noise
seed: the same prompts, sampler and reward. The standard deviation of those means is the
sampling error of one evaluation of --eval-samples samples, the number to set beside a gain and
beside the spread between seeds. Writes every draw to --out (JSON) and prints a table. An --out
that already holds draws of the same models keeps them and draws only the missing ones up to
--draws (draw k's noise is always --noise-seed + k), so a table of 4 draws grows to 16 for the cost
of 12. Give each seed's file its own --noise-seed (lab/gpu_mini_quality.sh does): with one
noise for all seeds a draw's luck is partly common to them, and averaging seeds does not shrink
that part (lab/summarize.py paired measures it).
"""

import argparse
import json
import os
import statistics
import sys

from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from run_folder import write_json  # noqa: E402

NOISE_SEED = 7_000_000  # draw k uses NOISE_SEED + k: far from lab/sd_runner.py's seed + 12345 for any usual --seed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="finished single lab/sd_runner.py runs (a folder with summary.json and the "
                                                "saved weights: a compare's DIR/exact or DIR/jagg)")
    parser.add_argument("--draws", type=int, default=4, help="independent noise draws per model (>= 2)")
    parser.add_argument("--no-base", action="store_true", help="skip the base model (the first run's settings, untrained)")
    parser.add_argument("--noise-seed", type=int, default=NOISE_SEED,
                        help=f"draw k uses this seed + k (default {NOISE_SEED}); a seed's own, e.g. {NOISE_SEED} + "
                             f"1000 x the run's seed, keeps the seeds' evaluation errors independent")
    parser.add_argument("--out", default="", help="also write the draws to this JSON file")
    args = parser.parse_args(argv)
    if args.draws < 2:
        parser.error(f"--draws must be at least 2 for a standard deviation, got {args.draws}")
    import sd_runner
    from compare_runs import load_run

    for run in args.runs:
        if not os.path.isfile(os.path.join(run, "summary.json")):
            parser.error(f"{run!r} holds no finished run (no summary.json); give a compare's DIR/exact or DIR/jagg")
        with open(os.path.join(run, "summary.json")) as f:
            weights = sd_runner.weights_path(run, json.load(f)["config"]["lora_rank"])
        if not os.path.isfile(weights):
            parser.error(f"{run!r} has no saved weights ({weights})")

    models = ([("base", args.runs[0], False)] if not args.no_base else []) + [(run, run, True) for run in args.runs]
    kept = previous_draws(args.out, args.draws, args.noise_seed)
    results = []
    bar = tqdm(total=sum(args.draws - len(kept.get(name, {}).get("draws", [])) for name, _, _ in models),
               desc="evaluations", dynamic_ncols=True)
    for name, folder, trained in models:
        summary, cfg, (pipe, transformer, sigmas, use_bf16) = load_run(folder, trained=trained)
        prompts = sd_runner.evaluation_prompts(cfg, sd_runner.read_prompts(cfg))
        reward_fn = sd_runner.load_reward(cfg.reward, sigmas.device)
        fixed = summary["eval_curve"][0 if not trained else -1][1]
        old = kept.get(name, {})
        if old and (old.get("eval_samples"), old.get("fixed_noise_eval")) != (cfg.eval_samples, fixed):
            # another evaluation size, or weights that have changed since (a run trained on in place
            # ends with another evaluation): not the same model's draws, drawn again
            print(f"note: {name}'s draws in {args.out} are of another evaluation or model; drawn again")
            bar.total += len(old["draws"])
            old = {}
        means, strict = list(old.get("draws", [])), list(old.get("strict_draws", []))
        for k in range(len(means), args.draws):
            images, rewards = sd_runner.draw_evaluation(pipe, transformer, prompts, cfg, sigmas, reward_fn, use_bf16,
                                                       args.noise_seed + k)
            means.append(rewards.mean().item())
            if hasattr(reward_fn, "eval_metrics"):  # the GenEval-like reward's strict accuracy
                strict.append(reward_fn.eval_metrics(images, prompts)["strict"])
            bar.update()
        results.append({"model": name, "mode": summary["mode"] if trained else "base", "seed": cfg.seed,
                        "reward": cfg.reward, "eval_samples": cfg.eval_samples, "draws": means,
                        "mean": statistics.mean(means), "sd": statistics.stdev(means),
                        "fixed_noise_eval": fixed, **({"strict_draws": strict} if strict else {})})
    bar.close()
    print(f"| model | evaluation, fixed noise | mean of {args.draws} independent draws | sd of one evaluation "
          f"(sampling error) |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r['model']} | {r['fixed_noise_eval']:.3f} | {r['mean']:.3f} | {r['sd']:.4f} |")
    sds = [r["sd"] for r in results]
    rms = (sum(s * s for s in sds) / len(sds)) ** 0.5
    print(f"\nroot-mean-square sampling error of one evaluation of {results[0]['eval_samples']} samples: {rms:.4f}; "
          f"of a gain (two independent evaluations): {rms * 2 ** 0.5:.4f}")
    if args.out:
        write_json(args.out, {"draws": args.draws, "noise_seed": args.noise_seed, "rms_sd": rms, "models": results})
        print(f"wrote {args.out}")
    return results


def previous_draws(path, draws, noise_seed):
    """{model: its entry} from an earlier --out file drawn with this noise seed, each cut to at most
    `draws` draws (draw k has the same noise in any run of this tool); {} when there is none."""
    if not path or not os.path.isfile(path):
        return {}
    with open(path) as f:
        old = json.load(f)
    if old.get("noise_seed") != noise_seed:
        print(f"note: {path} was drawn with --noise-seed {old.get('noise_seed')}, not {noise_seed}; drawn again")
        return {}
    if old.get("draws", 0) > draws:
        print(f"note: {path} holds {old['draws']} draws a model; it is rewritten with the first {draws}")
    return {m["model"]: {**m, "draws": m["draws"][:draws],
                         **({"strict_draws": m["strict_draws"][:draws]} if "strict_draws" in m else {})}
            for m in old["models"]}


if __name__ == "__main__":
    main()
