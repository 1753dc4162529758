"""Markdown tables for the README from the runs' own files, so that no number is copied by hand.

    python lab/summarize.py compare runs/toy runs/toy_seed1 ...          # train_toy.py / lab/sd_runner.py compare runs
    python lab/summarize.py routing --exact runs/toy,runs/toy_seed1 runs/route_probe_seed0 ...
    python lab/summarize.py bench runs/sd_bench_w4/benchmark.json ...    # lab/sd_benchmark.py's
    python lab/summarize.py toybench runs/toy_bench/benchmark.json       # lab/toy_benchmark.py
    python lab/summarize.py settings runs/bench_full runs/bench_lora ...  # lab/sd_benchmark.py's side by side
    python lab/summarize.py curves runs/a runs/b ... [--last 3] [--png F] # single runs: their evaluation curves
    python lab/summarize.py gains runs/mini_geneval/paper_seed*/exact     # one method over seeds: does it raise the reward
    python lab/summarize.py paired runs/noise_seed*.json                  # lab/eval_noise.py's draws: the spread's sources
    python lab/summarize.py retention runs/toy_quality                    # lab/toy_quality.sh: every mode over seeds
    python lab/summarize.py wallclock OUT/paper_seed0 OUT/window_seed0 ... [--png F]  # JAGG or an SDE window
    python lab/summarize.py equal_cost runs/toy_equal_cost [--png F]      # lab/toy_equal_cost.sh: at equal cost

Each reads a fresh runs folder or the same runs packed into one JSONL file (lab/run_files.py pack; the
kept runs in lab/results/ are packed): a packed file stands for its folder, so
    python lab/summarize.py compare 'lab/results/mini_sd3/tables/cover.jsonl/paper_seed[0-9]'
    python lab/summarize.py retention lab/results/quality/toy.jsonl
"""

import argparse
import json
import math
import os

from bench import TRAINING_MODES
from run_files import (
    exact_gain,
    expand,
    gain_along_run,
    grad_rows_per_step,
    initial_reward,
    load,
    probe_cosines,
    routing_figures,
    runs_by_mode,
    side,
    strict_curve,
    timed_curve,
)
from stats import (
    half_width,
    mean_interval,
    needed,
    ratio_interval,
    sd_of,
    seeds_for,
    two_way,
)

MODES = list(TRAINING_MODES)  # the benchmarks' modes, in their order: exact, then each JAGG mode (JaggOptions.mode_name)


def cosines(values):
    return ", ".join(f"{c:.2f}" for c in values) if values else "-"


def fmt(x):
    return "-" if x is None else f"{x:.3f}"


def noise(run):
    """lab/sd_runner.py runs: the evaluation noise, as the standard deviation of the evaluations the
    final reward averages, and the gain in units of it."""
    n = run.get("final_evals_used", 1)
    last = [v for _, v in run["eval_curve"][-n:]]
    if len(last) < 2:
        return "-"
    sd = sd_of(last)
    return f"{sd:.3f} ({run['reward_gain'] / sd:.1f}x)" if sd > 0 else "0"


def compare(runs):
    """One row per compare run, then the mean and the worst gain kept per mode."""
    sd = any("eval_curve" in load(run)["exact"] for run in runs)
    print("| seed | mode | reward, exact | reward, JAGG | gain kept | gradient "
          "| training step (rollouts incl.) "
          "| probe cosine per segment |" + (" exact: eval noise (gain / noise) |" if sd else ""))
    print("|---|---|---|---|---|---|---|---|" + ("---|" if sd else ""))
    kept = {}
    for run in runs:
        s = load(run)
        ratio = s["reward_gain_ratio"]
        kept.setdefault(s["mode"], []).append(ratio)
        start = initial_reward(s)
        print(f"| {s['config']['seed']} | {s['mode']} | {start:.3f} → {side(s, 'final_reward', 'exact'):.3f} "
              f"| {start:.3f} → {side(s, 'final_reward', 'jagg'):.3f} "
              f"| {'-' if ratio is None else f'{100 * ratio:.1f} %'} "
              f"| {s.get('grad_speedup', s.get('backward_speedup')):.2f}x | {s['train_speedup']:.2f}x | {cosines(probe_cosines(s['jagg']))} |"
              + (f" {noise(s['exact'])} |" if "eval_curve" in s["exact"] else ""))
    print()
    print("| mode | seeds | gain kept, mean (95 % interval) | gain kept, worst | ratio of mean gains (95 % interval) "
          "| JAGG's gain - exact's, mean (95 % interval) | seeds for ±10 points: mean, ratio |"
          + (" gain along the run kept: ratio of means (95 % interval), seeds for ±10 |" if sd else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if sd else ""))
    for mode, ratios in kept.items():
        ratios = [r for r in ratios if r is not None]
        runs_of = [load(run) for run in runs if load(run)["mode"] == mode]
        gains = [(side(r, "reward_gain", "exact"), side(r, "reward_gain", "jagg")) for r in runs_of]
        if ratios:
            mean, half = mean_interval(ratios)
            diff, dhalf = mean_interval([j - e for e, j in gains])
            ratio, rhalf, rsd = ratio_interval(gains)
            print(f"| {mode} | {len(ratios)} | {100 * mean:.1f} % ({100 * (mean - half):.0f}-{100 * (mean + half):.0f} %) "
                  f"| {100 * min(ratios):.1f} % | {100 * ratio:.1f} % ({100 * (ratio - rhalf):.0f}-{100 * (ratio + rhalf):.0f} %) "
                  f"| {diff:+.3f} ({diff - dhalf:+.3f} to {diff + dhalf:+.3f}) "
                  f"| {seeds_for(sd_of(ratios), 0.10)}, {seeds_for(rsd, 0.10)} |" + (f" {along(runs_of)} |" if sd else ""))


def along(runs_of):
    """The ratio of the mean gains along the run (gain_along_run) of exact and JAGG, with its 95 %
    interval and the seeds ±10 points would take."""
    gains = [(gain_along_run(r["exact"]), gain_along_run(r["jagg"])) for r in runs_of]
    if any(e is None or j is None for e, j in gains):
        return "-"
    ratio, half, rsd = ratio_interval(gains)
    return f"{100 * ratio:.1f} % ({100 * (ratio - half):.0f}-{100 * (ratio + half):.0f} %), {seeds_for(rsd, 0.10)}"


def routing(runs, exact):
    """Probe-routed runs against exact GRPO's gain of the same seed (--exact: compare runs or exact runs)."""
    gains = {load(run)["config"]["seed"]: exact_gain(run) for run in exact.split(",")}
    print("| seed | route | reward gain (% of exact's) | mean cosine, routed to JAGG | mean cosine, kept exact "
          "| fraction routed per segment |")
    print("|---|---|---|---|---|---|")
    for run in runs:
        seed = load(run)["config"]["seed"]
        if seed not in gains:
            raise SystemExit(f"error: {run} is seed {seed}, and --exact gives no run of it; add one")
        route, gain, routed, kept, frac = routing_figures(run)
        print(f"| {seed} | {route} | {gain:.3f} ({100 * gain / gains[seed]:.0f} %) "
              f"| {fmt(routed)} | {fmt(kept)} | {cosines(frac)} |")


def training_step_rows(r, scale, unit, setting=None):
    """The rows of one W of a benchmark's training-step table (times times scale, in unit): every
    mode it timed (with --max-graph-rows also the bounded "<mode>_rows<k>"), the activations
    saved for backward where measured, peak memory on CUDA; setting: a first column, if given."""
    for m in r["train_s"]:
        gb = r.get("saved_gb", {}).get(m)
        saved = "" if gb is None else f" {gb:.1f} GiB |" if gb >= 1 else f" {1024 * gb:.1f} MiB |"
        mem = f" {r['peak_mem_gb'][m]:.1f} GiB |" if "peak_mem_gb" in r else ""
        print((f"| {setting} " if setting else "")
              + f"| {r['window']} | {m} | {r['backward_rows'][m]} | {scale * r['train_s'][m]:.{1 if scale > 1 else 3}f} {unit} "
              f"| {r['train_speedup'][m]:.2f}x | {r['epoch_speedup'][m]:.2f}x |{saved}{mem}")


def bench(files):
    """lab/sd_benchmark.py's training-step table, one benchmark.json per configuration and W: what is
    trained, checkpointing and B; saved activations and peak memory where measured."""
    results = [load(path) for path in files]
    results = [r.get("result", r) for r in results]
    saved = all("saved_gb" in r for r in results)
    mem = all("peak_mem_gb" in r for r in results)
    print("| setting | W | mode | rows with grad | training step | x training step | x epoch (with rollout) |"
          + (" saved for backward |" if saved else "") + (" peak memory |" if mem else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if saved else "") + ("---|" if mem else ""))
    for r in results:
        train = "full" if r.get("train", "full") == "full" else f"LoRA r{r.get('lora_rank')}"
        setting = f"{train}{', checkpointing' if r.get('gradient_checkpointing') else ''}, B = {r['batch']}"
        training_step_rows(r, 1.0, "s", setting)


def settings(files):
    """Several lab/sd_benchmark.py runs of one W side by side, one column per setting (what is
    trained, checkpointing, B): each mode's training-step speedup over exact and its saved activations."""
    results = [r.get("result", r) for r in (load(path) for path in files)]
    names = [("full" if r.get("train", "full") == "full" else f"LoRA r{r.get('lora_rank')}")
             + (", checkpointing" if r.get("gradient_checkpointing") else "") for r in results]
    modes = sorted(dict.fromkeys(m for r in results for m in r["train_s"]),
                   key=lambda m: (MODES.index(m.partition("_rows")[0]), m))  # each mode, then its bounded run
    print("| mode | rows with grad | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(results))
    for m in modes:
        rows = next(r["backward_rows"][m] for r in results if m in r["backward_rows"])
        cells = [f"{r['train_speedup'][m]:.2f}x, {1024 * r['saved_gb'][m]:.1f} MiB" if m in r["train_s"] else "–"
                 for r in results]
        print(f"| {m} | {rows} | " + " | ".join(cells) + " |")


def toybench(files):
    """The toy's training-step table (lab/toy_benchmark.py): its benchmark.json holds every W, in seconds; shown in ms."""
    results = [load(path)["results"] for path in files]
    saved = all("saved_gb" in r for x in results for r in x.values())  # training_step_rows adds the column
    print("| W | mode | rows with grad | training step | x training step | x epoch (with rollout) |"
          + (" saved for backward |" if saved else ""))
    print("|---|---|---|---|---|---|" + ("---|" if saved else ""))
    for x in results:
        for w, r in x.items():
            training_step_rows({**r, "window": int(w)}, 1000.0, "ms")


def window_level(files):
    """One window's gradient, exact vs JAGG: lab/sd_benchmark.py's benchmark.json (s) or lab/toy_benchmark.py's (ms)."""
    print("| W | method | graph forwards | no-graph forwards | backward | total | backward speedup | total speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for path in files:
        r = load(path)
        if "results" in r:  # the toy's: {W: {"exact": {...}, "jagg": {...}, ...}}, in ms
            runs = [(int(W), x["exact"], x["jagg"], x, 1000.0) for W, x in r["results"].items()]
        else:
            x = r.get("result", r)
            e = {"fwd_graph": x["exact_fwd_graph_s"], "backward": x["exact_backward_s"], "total": x["exact_step_s"]}
            j = {"fwd_graph": x["jagg_fwd_graph_s"], "fwd_nograd": x["jagg_fwd_nograd_s"],
                 "backward": x["jagg_backward_s"], "total": x["jagg_step_s"]}
            runs = [(x["window"], e, j, x, 1.0)]
        for W, e, j, x, scale in runs:
            f = "{:.1f}" if scale > 1 else "{:.3f}"
            print(f"| {W} | exact | {f.format(scale * e['fwd_graph'])} | 0 | {f.format(scale * e['backward'])} "
                  f"| {f.format(scale * e['total'])} | | |")
            print(f"| {W} | JAGG | {f.format(scale * j['fwd_graph'])} | {f.format(scale * j['fwd_nograd'])} "
                  f"| {f.format(scale * j['backward'])} | {f.format(scale * j['total'])} | **{x['backward_speedup']:.2f}x** "
                  f"| **{x['step_speedup']:.2f}x** |")


def curves(paths, last, png=""):
    """Single lab/sd_runner.py runs (exact or jagg): start, highest evaluation, the mean and spread of
    the last `last` evaluations, training time; for runs with different methods but one setting.
    png: also draw the curves, one line per run named by its mode."""
    runs = [load(path) for path in paths]
    # the settings that differ between the runs (their output folders aside), as flags
    differ = [k for k in runs[0]["config"] if k != "out" and len({json.dumps(r["config"].get(k)) for r in runs}) > 1]
    print(f"| run | mode | settings | start | highest (epoch) | mean of the last {last} evaluations | training (s) "
          f"| gradients (s) |")
    print("|---|---|---|---|---|---|---|---|")
    drawn = {}
    for path, s in zip(paths, runs):
        curve = s["eval_curve"]
        tail = [v for _, v in curve[-last:]]
        mean, sd = sum(tail) / len(tail), sd_of(tail)
        epoch, top = max(curve[1:] or curve, key=lambda c: c[1])
        flags = " ".join(f"--{k.replace('_', '-')} {s['config'][k]}" for k in differ) or "-"
        print(f"| {os.path.basename(os.path.normpath(path))} | {s['mode']} | {flags} | {curve[0][1]:.3f} | {top:.3f} ({epoch}) "
              f"| {mean:.3f} ± {sd:.3f} | {s['train_seconds']:.0f} | {s.get('grad_seconds', s.get('backward_seconds')):.0f} |")
        drawn[s["mode"] if s["mode"] not in drawn else path] = curve
    if png:
        from charts import chart, save_png

        config = load(paths[0])["config"]
        save_png(png, chart(drawn, f"evaluation reward ({config['reward']}, {config['eval_samples']} samples, fixed noise)",
                            "GRPO epoch", "mean reward"))
        print(f"\nwrote {png}")


def gains(paths):
    """Single lab/sd_runner.py runs of one setting over seeds (e.g. every seed's exact run): per seed the
    reward at the start and at the end (the final reward, the mean of its last evaluations), the
    gain along the run, and GenEval's strict accuracy where logged; then the mean gain with its
    95 % interval and how many seeds rose. Each seed evaluates the same base model with its own
    noise, so the spread of the start values is one evaluation's sampling error."""
    runs = [load(path) for path in paths]
    along = [gain_along_run(s) for s in runs]
    strict = []  # (start, end) of each run's strict accuracy, the end as its final reward's evaluations; None if unlogged
    for path, s in zip(paths, runs):
        curve, n = strict_curve(path), s.get("final_evals_used", 1)
        strict.append((curve[0][1], sum(v for _, v in curve[-n:]) / len(curve[-n:])) if len(curve) > 1 else None)
    print("| seed | reward: start → end | gain | gain along the run | strict accuracy: start → end |")
    print("|---|---|---|---|---|")
    for s, a, st in zip(runs, along, strict):
        print(f"| {s['config']['seed']} | {s['initial_reward']:.3f} → {s['final_reward']:.3f} | {s['reward_gain']:+.3f} "
              f"| {'-' if a is None else f'{a:+.3f}'} | {'-' if st is None else f'{st[0]:.3f} → {st[1]:.3f}'} |")
    print()
    rows = [("gain", [s["reward_gain"] for s in runs])]
    if None not in along:
        rows.append(("gain along the run", along))
    if None not in strict:
        rows.append(("strict accuracy's gain", [end - start for start, end in strict]))
    print("| statistic | seeds | mean (95 % interval) | seeds above 0 |")
    print("|---|---|---|---|")
    for name, xs in rows:
        mean, half = mean_interval(xs)
        print(f"| {name} | {len(xs)} | {mean:+.3f} ({mean - half:+.3f} to {mean + half:+.3f}) | {sum(x > 0 for x in xs)} |")
    starts = [s["initial_reward"] for s in runs]
    samples = runs[0]["config"].get("eval_samples", "?")
    print(f"\none evaluation's sampling error (the spread of the {len(starts)} seeds' start values, the same model "
          f"under independent noise, {samples} samples): {sd_of(starts):.3f}")


def setting_name(run, with_lr=False):
    """A lab/sd_runner.py run's setting in words: where it trains (every step, or an SDE window), how,
    and (with_lr) at which learning rate."""
    config = run["config"]
    where = f"window of {config['sde_window']}" if config.get("sde_window") else "all steps"
    how = {"exact": "exact", "jagg": "the paper's JAGG", "jagg_shared_rollout": "shared + rollout"}.get(run["mode"], run["mode"])
    return f"{where}, {how}" + (f", lr {config['lr']:g}" if with_lr else "")


def reward_at(curve, seconds):
    """The reward at a training time, by linear interpolation between the evaluations around it."""
    for (t0, r0), (t1, r1) in zip(curve, curve[1:]):
        if t0 <= seconds <= t1:
            return r0 if t1 == t0 else r0 + (r1 - r0) * (seconds - t0) / (t1 - t0)
    raise ValueError(f"{seconds:.1f} s is outside the curve's 0 to {curve[-1][0]:.1f} s")


BUDGET_POINTS = (0.8, 0.9, 1.0)  # the gain at a time budget averages the curve here, as the final reward its last evaluations


def wallclock(paths, png=""):
    """Reward against training time for several settings over the same seeds (lab/sd_runner.py compare
    runs, each giving its exact run and its JAGG run, as lab/mini_quality.sh with TABLE=window
    makes them, and single runs; settings that differ in the learning rate are named with it).
    Per setting: epochs, seconds an epoch, the gain at its own end, and the gain at the same
    budget of training time, the shortest of the seed's runs (the mean of each curve at 80, 90 and
    100 % of it), beside the first setting's (every step, exact), seed by seed, with 95 % intervals.
    Returns the table as {setting: {statistic: value}}."""
    all_runs = []
    for path in paths:
        s = load(path)
        if "jagg" in s:  # a compare run: its exact and JAGG runs, each with the compare's seed
            all_runs += [dict(s[part], config=dict(s[part].get("config", s["config"]), seed=s["config"]["seed"]))
                         for part in ("exact", "jagg")]
        else:
            all_runs.append(s)
    with_lr = len({r["config"].get("lr") for r in all_runs}) > 1
    by_seed = {}
    for run in all_runs:
        by_seed.setdefault(run["config"]["seed"], {}).setdefault(setting_name(run, with_lr), run)
    names = list(dict.fromkeys(n for settings in by_seed.values() for n in settings))
    missing = [(seed, n) for seed, settings in by_seed.items() for n in names if n not in settings]
    if missing:
        raise SystemExit(f"error: every seed needs every setting; missing {missing}")
    seeds = sorted(by_seed)
    curves = {seed: {n: timed_curve(r) for n, r in by_seed[seed].items()} for seed in seeds}
    budget = {seed: min(r["train_seconds"] for r in by_seed[seed].values()) for seed in seeds}
    at_budget = {seed: {n: sum(reward_at(curves[seed][n], f * budget[seed]) for f in BUDGET_POINTS) / len(BUDGET_POINTS)
                        - r["initial_reward"] for n, r in by_seed[seed].items()} for seed in seeds}
    print(f"| setting | seeds | epochs | seconds an epoch | gain at its end, mean (95 % interval) "
          f"| gain at the same training time, mean (95 % interval) | at the same time: minus {names[0]}'s, mean "
          f"(95 % interval) | at the same time: ratio to {names[0]}'s (95 % interval) |")
    print("|---|---|---|---|---|---|---|---|")
    table = {}
    for n in names:
        runs = [by_seed[seed][n] for seed in seeds]
        end, end_half = mean_interval([r["reward_gain"] for r in runs])
        same, same_half = mean_interval([at_budget[seed][n] for seed in seeds])
        diff, diff_half = mean_interval([at_budget[seed][n] - at_budget[seed][names[0]] for seed in seeds])
        ratio, ratio_half, _ = ratio_interval([(at_budget[seed][names[0]], at_budget[seed][n]) for seed in seeds])
        per_epoch = sum(r["train_seconds"] / r["epochs"] for r in runs) / len(runs)
        table[n] = {"gain_at_end": end, "gain_at_budget": same, "minus_first": (diff, diff_half),
                    "ratio_to_first": (ratio, ratio_half), "seconds_an_epoch": per_epoch}
        print(f"| {n} | {len(runs)} | {runs[0]['epochs']} | {per_epoch:.1f} | {end:+.3f} ({end - end_half:+.3f} to "
              f"{end + end_half:+.3f}) | {same:+.3f} ({same - same_half:+.3f} to {same + same_half:+.3f}) "
              f"| {diff:+.3f} ({diff - diff_half:+.3f} to {diff + diff_half:+.3f}) "
              f"| {100 * ratio:.0f} % ({100 * (ratio - ratio_half):.0f}-{100 * (ratio + ratio_half):.0f} %) |")
    print("\nthe budget per seed (the shortest run's training time): "
          + ", ".join(f"seed {seed} {budget[seed]:.0f} s" for seed in seeds))
    if png:
        from charts import chart, save_png

        # each setting's mean curve over seeds, on a grid up to where every seed's run of it reaches
        series = {}
        for n in names:
            of_n = [curves[seed][n] for seed in seeds]
            end = min(c[-1][0] for c in of_n)
            grid = [end * i / 40 for i in range(41)]
            series[n] = [(t / 60, sum(reward_at(c, t) for c in of_n) / len(of_n)) for t in grid]
        config = by_seed[seeds[0]][names[0]]["config"]
        save_png(png, chart(series, f"evaluation reward against training time ({config['reward']}, mean of "
                                    f"{len(seeds)} seeds)", "training minutes (rollouts and optimizer steps)",
                            "mean reward", size=(1000, 440)))
        print(f"\nwrote {png}")
    return table


def paired(paths):
    """lab/eval_noise.py's draws of each seed's final models, exact and JAGG (one --out file a
    seed, the base model's draws in any one of them). Draw k has the same noise for every model
    of a seed (for every seed too, unless each file was drawn with its own --noise-seed), so JAGG -
    exact is paired draw by draw, and its gain over the base too. Per mode,
    JAGG - exact's spread split by two_way into one draw's paired error (within a seed), the part
    of a draw's error common to all seeds, and the runs' own spread (what the seeds' means keep
    once the evaluation's share is taken out); intervals that count all three; the ratio of mean
    gains over the base with its interval (ratio_interval's linearisation, drawn by draw); and the
    seeds ±10 points take at these draws and with no evaluation error at all (the most that
    evaluating with more samples can buy), and the draws it takes at these seeds."""
    files = [load(path)["models"] for path in paths]
    base = [m for models in files for m in models if m.get("mode") == "base"]
    if not base:
        raise SystemExit("error: no file holds the base model's draws; run lab/eval_noise.py without --no-base "
                         "on one seed")
    base = base[0]["draws"]
    by_mode = {}  # mode -> [(exact's draws, JAGG's draws) per seed]
    for path, models in zip(paths, files):
        exact = [m for m in models if m.get("mode") == "exact"]
        if len(exact) != 1:
            raise SystemExit(f"error: {path} holds {len(exact)} exact runs; give each seed's file one exact run "
                             f"and its JAGG runs")
        for m in models:
            if m.get("mode") not in (None, "exact") and len(m["draws"]) != len(exact[0]["draws"]):
                raise SystemExit(f"error: {path}: {m['model']} has {len(m['draws'])} draws, the exact run "
                                 f"{len(exact[0]['draws'])}; pair them with the same --draws")
            if m.get("mode") not in (None, "base", "exact"):
                by_mode.setdefault(m["mode"], []).append((exact[0]["draws"], m["draws"]))
    k = len(base)
    if any(len(e) != k for pairs in by_mode.values() for e, _ in pairs):
        raise SystemExit(f"error: the base model has {k} draws and the runs another number; draw every file with "
                         f"the same --draws")
    if any(len(pairs) < 2 for pairs in by_mode.values()):
        raise SystemExit("error: a mode with fewer than 2 seeds has no spread between seeds; give 2 or more seeds' files")
    b = sum(base) / k
    print(f"base model: {b:.3f} (mean of {k} draws)\n")
    print("| mode | seeds | draws a model | JAGG - exact: mean (95 % interval) | one draw's paired error | the part "
          "common to all seeds | the runs' own spread | ratio of mean gains (95 % interval) | seeds for ±10 "
          "points: at these draws, with no evaluation error | draws for ±10 points at these seeds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode in sorted(by_mode, key=MODES.index):
        pairs = by_mode[mode]
        n = len(pairs)
        d = two_way([[jk - ek for ek, jk in zip(e, j)] for e, j in pairs])
        gains = [(sum(e) / k - b, sum(j) / k - b) for e, j in pairs]
        ratio = sum(j for _, j in gains) / sum(e for e, _ in gains)
        mean_exact = sum(e for e, _ in gains) / n
        # ratio_interval's linearised values, draw by draw against the base's same draw
        u = two_way([[(jk - bk - ratio * (ek - bk)) / mean_exact for ek, jk, bk in zip(e, j, base)] for e, j in pairs])
        d_half, r_half = half_width(d, n, k), half_width(u, n, k)
        clean = {**u, "common": 0.0, "rest": 0.0}
        print(f"| {mode} | {n} | {k} | {d['mean']:+.3f} ({d['mean'] - d_half:+.3f} to {d['mean'] + d_half:+.3f}) "
              f"| {d['within']:.4f} | {math.sqrt(d['common']):.4f} | {math.sqrt(d['runs']):.4f} "
              f"| {100 * ratio:.1f} % ({100 * (ratio - r_half):.0f}-{100 * (ratio + r_half):.0f} %) "
              f"| {needed(u, 0.10, draws=k)}, {needed(clean, 0.10, draws=k)} | {needed(u, 0.10, seeds=n)} |")


def retention(folder):
    """lab/toy_quality.sh's table: OUT/<mode>/seed<S>/summary.json (or OUT packed, the kept runs) for
    exact and each JAGG mode. Per
    mode over the seeds every mode finished: the gain kept (JAGG's reward gain over exact's of the
    same seed), its mean with a 95 % t interval, the ratio of mean gains with its interval, the
    paired difference to the paper's mode with its interval, and the worst seed."""
    runs = runs_by_mode(folder)
    modes = sorted(runs, key=lambda m: (m != "exact", m != "paper", m))
    seeds = sorted(set.intersection(*(set(r) for r in runs.values())))
    exact = {s: runs["exact"][s]["reward_gain"] for s in seeds}
    kept = {m: {s: runs[m][s]["reward_gain"] / exact[s] for s in seeds} for m in modes}
    print(f"{len(seeds)} seeds ({seeds[0]}-{seeds[-1]}); exact GRPO's gain {sum(exact.values()) / len(seeds):+.3f} "
          f"(from {min(exact.values()):+.3f} to {max(exact.values()):+.3f})")
    print()
    print("| mode | rows with grad | gain kept, mean (95 % interval) | ratio of mean gains (95 % interval) "
          "| minus the paper's mode, paired (95 % interval) | worst seed |")
    print("|---|---|---|---|---|---|")
    for m in modes:
        mean, half = mean_interval(list(kept[m].values()))
        ratio, rhalf, _ = ratio_interval([(exact[s], runs[m][s]["reward_gain"]) for s in seeds])
        diff, dhalf = mean_interval([kept[m][s] - kept["paper"][s] for s in seeds])
        worst = min(seeds, key=lambda s: kept[m][s])
        paired_text = "-" if m == "paper" else f"{100 * diff:+.1f} ({100 * (diff - dhalf):+.1f} to {100 * (diff + dhalf):+.1f}) points"
        rows = grad_rows_per_step(runs[m][seeds[0]])
        print(f"| {m} | {rows} | {100 * mean:.1f} % ({100 * (mean - half):.1f}-"
              f"{100 * (mean + half):.1f} %) | {100 * ratio:.1f} % ({100 * (ratio - rhalf):.1f}-{100 * (ratio + rhalf):.1f} %) "
              f"| {paired_text} | {100 * kept[m][worst]:.1f} % (seed {worst}) |")


# The equal-cost comparison (lab/toy_equal_cost.sh, lab/mini_equal_cost.sh): each mode against exact
# GRPO of the same seed. Its cost twice: the rows with grad, counted, and the training time
# (rollouts included), measured in the same runs.
EQUAL_COST_GROUPS = {"exact": "exact GRPO", "jagg": "JAGG", "random": "random steps (DanceGRPO)",
                     "first": "first steps (Flow-GRPO)", "window": "SDE window (Flow-GRPO-Fast)",
                     "velocity": "routing: free score", "late": "routing: late windows first",
                     "early": "routing: early windows first", "probe": "routing: the probe",
                     "step_error": "routing: estimated error", "shared": "fast: shared anchors (OURS)"}
FAST_IN_WINDOW = "SDE window, fast mode inside (OURS)"  # window8_shared_rollout_w4's kind


def equal_cost_group(mode):
    """The kind of a mode's name: jagg_w4 -> JAGG, random8 -> random steps, jagg_random8_w4 ->
    JAGG (on random windows), window8_jagg_w4 -> SDE window, velocity0.5 -> routing, ..."""
    if mode.startswith("jagg_random"):
        return "JAGG on random windows (eff_grpo)"
    if mode.startswith("window") and "shared" in mode:
        return FAST_IN_WINDOW
    for prefix, group in EQUAL_COST_GROUPS.items():
        if mode.startswith(prefix):
            return group
    return mode


def equal_cost(folder, png="", timing="", versus="jagg_w4"):
    """OUT/<mode>/seed<S>/summary.json of every mode (or OUT packed, the kept runs): per mode
    over the seeds every mode finished, its rows with grad and training time as shares of exact's
    (time: the mean of the per-seed ratios), the gain kept (JAGG's reward gain over exact's of the
    same seed: mean with its 95 % t interval), the ratio of mean gains with its interval, and the
    paired difference of the gain kept to versus's (default jagg_w4, the paper's JAGG); png: the picture. timing: a
    lab/equal_cost_error.py --time JSON, whose one-process medians are then the cost axis (a
    column of its own; the runs' own times were measured on a machine that other runs shared).
    Routing's modes, beside exact and jagg_w4, get a picture of their own: png's name + _routing."""
    runs = runs_by_mode(folder)
    modes = sorted(runs)
    seeds = sorted(set.intersection(*(set(r) for r in runs.values())))
    exact = {s: runs["exact"][s] for s in seeds}
    print(f"{len(seeds)} seeds; exact GRPO's gain {mean_interval([exact[s]['reward_gain'] for s in seeds])[0]:+.3f}")
    print()
    measured = {}
    if timing:
        measured = load(timing)["seconds"]
    print("| mode | rows with grad, of exact's | training time, of exact's |"
          + (" one training step, timed in one process, of exact's |" if measured else "")
          + f" gain kept, mean (95 % interval) | ratio of mean gains (95 % interval) | minus {versus}'s gain kept, "
          "paired (95 % interval) |")
    print("|---" * (7 if measured else 6) + "|")
    points, order = {}, sorted(modes, key=lambda m: (m != "exact", -runs[m][seeds[0]]["grad_rows"], m))
    for m in order:
        rows = runs[m][seeds[0]]["grad_rows"] / exact[seeds[0]]["grad_rows"]
        time_mean, time_half = mean_interval([runs[m][s]["train_seconds"] / exact[s]["train_seconds"] for s in seeds])
        kept = [runs[m][s]["reward_gain"] / exact[s]["reward_gain"] for s in seeds]
        mean, half = mean_interval(kept)
        ratio, rhalf, _ = ratio_interval([(exact[s]["reward_gain"], runs[m][s]["reward_gain"]) for s in seeds])
        paired = "-"
        if versus in runs and m != versus:
            diff, dhalf = mean_interval([k - runs[versus][s]["reward_gain"] / exact[s]["reward_gain"]
                                         for k, s in zip(kept, seeds)])
            paired = f"{100 * diff:+.1f} ({100 * (diff - dhalf):+.1f} to {100 * (diff + dhalf):+.1f}) points"
        step = ""
        if measured:
            step = f"{100 * measured[m] / measured['exact']:.0f} % | " if m in measured else "- | "
        print(f"| {m} | {100 * rows:.0f} % | {100 * time_mean:.0f} % (±{100 * time_half:.0f}) | {step}"
              f"{100 * mean:.1f} % ({100 * (mean - half):.1f}-{100 * (mean + half):.1f} %) "
              f"| {100 * ratio:.1f} % ({100 * (ratio - rhalf):.1f}-{100 * (ratio + rhalf):.1f} %) | {paired} |")
        cost = 100 * measured[m] / measured["exact"] if m in measured else 100 * time_mean
        if not measured or m in measured:
            points[m] = (cost, 100 * mean, 100 * (mean - half), 100 * (mean + half), equal_cost_group(m))
    if png:
        from charts import interval_scatter, save_png

        how = "one training step timed in one process" if measured else "the runs' training time"
        routing = ("velocity", "late", "early", "probe", "step_error")
        for picture, keep in ((png, lambda m: not m.startswith(routing)),  # the alternatives; then routing
                              (png.replace(".png", "_routing.png"), lambda m: m in ("exact", "jagg_w4")
                               or m.startswith(routing))):
            chosen = {m: p for m, p in points.items() if keep(m)}
            if len(chosen) > 2 or picture == png:
                what = "JAGG and the cheap alternatives" if picture == png else "which windows JAGG takes"
                save_png(picture, interval_scatter(chosen, f"{what}: reward gain kept against cost, "
                                                   f"{len(seeds)} seeds", f"{how}, % of exact GRPO's (rollouts "
                                                   "included)", "gain kept, % of exact's (95 % interval)",
                                                   reference=100.0))
    return points


# Which to run at a given budget (lab/reports/equal_cost.md): every method of several equal-cost runs
# folders or packed files on one cost axis, a training step timed in one process, and its Pareto frontier.
def frontier(paths, timing, png="", budgets=(25, 50, 75)):
    """Every mode of the runs in paths (OUT/<mode>/seed<S> folders or their packed files: the same seeds, the
    same exact runs), over the seeds every mode finished: its rows with grad, its training step timed in one
    process (timing: a lab/equal_cost_error.py --time JSON that times every mode), the gain kept (mean, 95 %
    interval) and whether it is on the Pareto frontier (no other mode both cheaper and higher in mean gain
    kept). Then per budget (% of exact's step), the best mode within it by mean, the runner-up (not its
    _rows2 twin, which trains the same gradient), and their paired difference, seed by seed: a frontier
    mode whose interval overlaps the runner-up's is not a sure winner. png: the picture, the frontier
    drawn through its modes (the _rows2 twins left out: each sits on its twin's point, a little to the right)."""
    runs = {}
    for path in paths:
        for m, by_seed in runs_by_mode(path).items():
            runs.setdefault(m, {}).update(by_seed)
    seconds = load(timing)["seconds"]
    untimed = sorted(set(runs) - set(seconds))
    runs = {m: r for m, r in runs.items() if m in seconds}
    seeds = sorted(set.intersection(*(set(r) for r in runs.values())))
    kept = {m: [runs[m][s]["reward_gain"] / runs["exact"][s]["reward_gain"] for s in seeds] for m in runs}
    cost = {m: 100 * seconds[m] / seconds["exact"] for m in runs}
    gain = {m: 100 * mean_interval(kept[m])[0] for m in runs}
    on_frontier = [m for m in runs if not any(cost[o] < cost[m] and gain[o] > gain[m] for o in runs)]
    print(f"{len(seeds)} seeds; one training step timed in one process ({timing})"
          + (f"; not timed, left out: {', '.join(untimed)}" if untimed else ""))
    print()
    print("| mode | rows with grad, of exact's | one training step, of exact's | gain kept, mean (95 % interval) "
          "| on the frontier |")
    print("|---|---|---|---|---|")
    points = {}
    for m in sorted(runs, key=lambda m: (-cost[m], m)):
        mean, half = mean_interval(kept[m])
        rows = runs[m][seeds[0]]["grad_rows"] / runs["exact"][seeds[0]]["grad_rows"]
        print(f"| {m} | {100 * rows:.0f} % | {cost[m]:.0f} % | {100 * mean:.1f} % ({100 * (mean - half):.1f}-"
              f"{100 * (mean + half):.1f} %) | {'yes' if m in on_frontier else ''} |")
        points[m] = (cost[m], 100 * mean, 100 * (mean - half), 100 * (mean + half), equal_cost_group(m))
    print()
    print("| budget, % of exact's step | best within it: gain kept | runner-up: gain kept | best minus runner-up, "
          "paired (95 % interval) |")
    print("|---|---|---|---|")
    for budget in budgets:
        within = sorted((m for m in runs if cost[m] <= budget), key=lambda m: -gain[m])
        if not within:
            print(f"| {budget} % | none: the cheapest mode takes {min(cost.values()):.0f} % | | |")
            continue
        twin = within[0].removesuffix("_rows2")  # the best's twin with or without the bound: the same gradient
        within = within[:1] + [m for m in within[1:] if m.removesuffix("_rows2") != twin]
        cells = []
        for m in within[:2]:
            mean, half = mean_interval(kept[m])
            cells.append(f"{m} ({cost[m]:.0f} %): {100 * mean:.1f} % ({100 * (mean - half):.1f}-{100 * (mean + half):.1f} %)")
        diff = ""
        if len(within) > 1:
            d, h = mean_interval([a - b for a, b in zip(kept[within[0]], kept[within[1]])])
            diff = f"{100 * d:+.1f} ({100 * (d - h):+.1f} to {100 * (d + h):+.1f}) points"
        print(f"| {budget} % | {cells[0]} | {cells[1] if len(cells) > 1 else '-'} | {diff} |")
    if png:
        from charts import interval_scatter, save_png

        order = [EQUAL_COST_GROUPS[k] for k in ("exact", "jagg", "random", "first", "window", "early", "step_error",
                                                 "shared")] + [FAST_IN_WINDOW]  # a colour each
        drawn = {m: p for m, p in sorted(points.items(), key=lambda mp: order.index(mp[1][4]) if mp[1][4] in order
                                         else len(order)) if not m.endswith("_rows2")}  # a twin sits on its own point
        line = sorted((m for m in on_frontier if m in drawn), key=lambda m: cost[m])
        save_png(png, interval_scatter(drawn, f"which to run at a given cost: reward gain kept, {len(seeds)} seeds",
                                       "one training step timed in one process, % of exact GRPO's (rollouts "
                                       "included)", "gain kept, % of exact's (95 % interval)", reference=100.0,
                                       frontier=line, colours=order))
    return points, on_frontier


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("table", choices=["compare", "routing", "bench", "settings", "toybench", "window", "curves", "gains",
                                          "paired", "retention", "wallclock", "equal_cost", "frontier"],
                        help="which table: compare runs, routing runs, SD benchmark (training step, settings side by "
                             "side, or window level), toy benchmark, single runs' evaluation curves, one "
                             "method's gain over seeds, eval_noise.py's paired draws of exact and JAGG, "
                             "every step or an SDE window: the reward at the same training time")
    parser.add_argument("paths", nargs="+", help="run folders (summary.json inside), benchmark.json files or "
                                                 "(paired) lab/eval_noise.py --out files; or packed runs, "
                                                 "FILE.jsonl/NAME or FILE.jsonl/PATTERN (lab/run_files.py); "
                                                 "retention, equal_cost: one runs folder or its packed FILE.jsonl; "
                                                 "frontier: several, their modes taken together")
    parser.add_argument("--exact", default="", help="routing: comma-separated compare runs giving exact GRPO's gain per seed")
    parser.add_argument("--last", type=int, default=3, help="curves: how many final evaluations to average")
    parser.add_argument("--timing", default="", help="equal_cost, frontier: a lab/equal_cost_error.py --time JSON, "
                                                      "the cost axis measured in one process")
    parser.add_argument("--versus", default="jagg_w4", help="equal_cost: the mode each mode is paired with, "
                                                             "seed by seed, in the last column")
    parser.add_argument("--png", default="", help="curves, wallclock: also draw them into this PNG file")
    args = parser.parse_args()
    if args.table not in ("retention", "equal_cost", "frontier"):  # a packed file's patterns become its runs
        args.paths = expand(args.paths)
        args.exact = ",".join(expand(args.exact.split(","))) if args.exact else ""
    if args.table == "compare":
        compare(args.paths)
    elif args.table == "routing":
        routing(args.paths, args.exact)
    elif args.table == "bench":
        bench(args.paths)
    elif args.table == "settings":
        settings(args.paths)
    elif args.table == "toybench":
        toybench(args.paths)
    elif args.table == "curves":
        curves(args.paths, args.last, args.png)
    elif args.table == "gains":
        gains(args.paths)
    elif args.table == "paired":
        paired(args.paths)
    elif args.table == "retention":
        retention(args.paths[0])
    elif args.table == "wallclock":
        wallclock(args.paths, args.png)
    elif args.table == "equal_cost":
        equal_cost(args.paths[0], args.png, args.timing, args.versus)
    elif args.table == "frontier":
        frontier(args.paths, args.timing, args.png)
    else:
        window_level(args.paths)


if __name__ == "__main__":
    main()
