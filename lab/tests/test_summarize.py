"""lab/summarize.py's tables and their interval arithmetic (lab/stats.py): the retention
tables' 95 % intervals and seed counts."""

import json
import math
import os
import pathlib
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import run_files
import stats
import summarize  # noqa: E402


def test_mean_interval_is_students_t():
    mean, half = stats.mean_interval([1, 2, 3, 4, 5])
    assert mean == 3
    assert half == pytest.approx(2.7764451 * math.sqrt(2.5) / math.sqrt(5), rel=1e-6)
    assert stats.mean_interval([0.7]) == (0.7, 0.0)


def test_t95_is_students_t_and_tends_to_the_normal():
    assert stats.t95(4) == pytest.approx(2.776, abs=5e-4)
    assert stats.t95(1) == pytest.approx(12.706, abs=5e-4)
    assert stats.t95(22) == pytest.approx(2.074, abs=5e-4)
    assert stats.t95(10**6) == pytest.approx(1.96, abs=5e-4)


def test_ratio_interval_is_exact_when_jagg_is_a_fixed_share_of_exact():
    gains = [(0.1, 0.09), (0.3, 0.27), (0.2, 0.18)]
    ratio, half, sd = stats.ratio_interval(gains)
    assert ratio == pytest.approx(0.9)
    assert half == pytest.approx(0.0, abs=1e-12) and sd == pytest.approx(0.0, abs=1e-12)


def test_ratio_interval_covers_the_true_ratio_95_percent_of_the_time():
    """Simulated tables of 10 seeds, exact's and JAGG's gains independent with JAGG's mean 0.9 of
    exact's: the interval holds 0.9 in 93-97 % of 2000 tables."""
    rng = random.Random(0)
    hits = 0
    for _ in range(2000):
        gains = [(rng.gauss(0.2, 0.04), rng.gauss(0.18, 0.04)) for _ in range(10)]
        ratio, half, _ = stats.ratio_interval(gains)
        hits += abs(ratio - 0.9) <= half
    assert 0.93 <= hits / 2000 <= 0.97


@pytest.mark.parametrize("sd", [0.05, 0.2, 0.47])
def test_seeds_for_is_the_fewest_seeds_that_reach_the_half_width(sd):
    n = int(stats.seeds_for(sd, 0.10))
    assert stats.t95(n - 1) * sd / math.sqrt(n) <= 0.10
    assert stats.t95(n - 2) * sd / math.sqrt(n - 1) > 0.10
    assert stats.seeds_for(0.0, 0.10) == "-"


def test_gain_along_run_is_the_mean_evaluation_after_the_start_minus_the_start():
    run = {"initial_reward": 0.5, "eval_curve": [[0, 0.5], [2, 0.6], [4, 0.7], [6, 0.8]]}
    assert run_files.gain_along_run(run) == pytest.approx(0.2)
    assert run_files.gain_along_run({"initial_reward": 0.5}) is None
    assert run_files.gain_along_run({"initial_reward": 0.5, "eval_curve": [[0, 0.5]]}) is None


def test_compare_prints_the_gain_along_the_run_kept(tmp_path, capsys):
    """Two seeds of one mode where JAGG's curve is exact's at 80 % of its rise: along the run
    kept 80.0 % with no spread, in the mode's last column."""
    import json
    folders = []
    for seed, rise in ((0, 0.2), (1, 0.3)):
        curve = lambda k: [[e, 0.5 + k * rise * e / 6] for e in (0, 2, 4, 6)]  # noqa: E731
        run = lambda k: {"eval_curve": curve(k), "initial_reward": 0.5, "reward_gain": k * rise,  # noqa: E731
                         "probe_cosine_by_position": None, "final_evals_used": 1}
        s = {"config": {"seed": seed}, "mode": "jagg", "initial_reward": 0.5, "reward_gain_ratio": 0.8,
             "final_reward": {"exact": 0.5 + rise, "jagg": 0.5 + 0.8 * rise},
             "reward_gain": {"exact": rise, "jagg": 0.8 * rise}, "backward_speedup": 2.0, "train_speedup": 1.5,
             "exact": run(1.0), "jagg": run(0.8)}
        folder = tmp_path / f"seed{seed}"
        folder.mkdir()
        (folder / "summary.json").write_text(json.dumps(s))
        folders.append(str(folder))
    summarize.compare(folders)
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| jagg | 2 |")][0]
    assert row.rstrip(" |").split("|")[-1].strip().startswith("80.0 % (80-80 %), "), row


def test_gains_prints_the_mean_gain_its_interval_and_the_spread_of_the_starts(tmp_path, capsys):
    """Three seeds' runs gaining 0.1, 0.2, 0.3 from starts 0.5, 0.6, 0.7: the mean gain 0.2 with the
    t interval of (0.1, 0.2, 0.3), 3 seeds above 0, strict accuracy's gain from metrics.jsonl, and
    the starts' sd (0.1) as one evaluation's sampling error."""
    import json
    folders = []
    for seed, (start, gain) in enumerate(((0.5, 0.1), (0.6, 0.2), (0.7, 0.3))):
        folder = tmp_path / f"seed{seed}"
        folder.mkdir()
        run = {"config": {"seed": seed, "eval_samples": 96}, "initial_reward": start, "final_reward": start + gain,
               "reward_gain": gain, "final_evals_used": 1, "eval_curve": [[0, start], [2, start + gain]]}
        (folder / "summary.json").write_text(json.dumps(run))
        (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
            {"epoch": 0, "eval/strict": 0.25}, {"epoch": 1, "rollout/reward_mean": 0.5},
            {"epoch": 2, "eval/strict": 0.25 + gain / 2}]) + "\n")
        folders.append(str(folder))
    summarize.gains(folders)
    out = capsys.readouterr().out
    half = stats.t95(2) * 0.1 / 3 ** 0.5
    assert f"| gain | 3 | +0.200 ({0.2 - half:+.3f} to {0.2 + half:+.3f}) | 3 |" in out
    assert "| strict accuracy's gain | 3 | +0.100 (" in out
    assert "| 1 | 0.600 → 0.800 | +0.200 | +0.200 | 0.250 → 0.350 |" in out
    assert "independent noise, 96 samples): 0.100" in out


def test_paired_splits_the_spread_of_jagg_minus_exact_into_the_evaluations_and_the_runs(tmp_path, capsys):
    """Four seeds, two draws a model; exact scores 0.6 and the base 0.5 at every draw (gain 0.1),
    JAGG 0.6 + t_s ± 0.01 (t_s = ±0.02). Where the ±0.01 is the same for every seed (draw 1 +, draw
    2 -: a draw's luck common to all seeds), averaging seeds does not shrink it: the interval counts
    it at its 1 degree of freedom. Where it alternates between seeds it is the evaluation's error
    within a seed and averages out. The ratio's linearisation is (JAGG - exact) / 0.1 here."""
    import json

    def write(signs, name):
        paths = []
        for seed, (ts, sign) in enumerate(zip(t, signs)):
            models = [{"model": "base", "mode": "base", "draws": [0.5, 0.5]}] if seed == 0 else []
            models += [{"model": f"s{seed}/exact", "mode": "exact", "draws": [0.6, 0.6]},
                       {"model": f"s{seed}/jagg", "mode": "jagg", "draws": [0.6 + ts + sign * 0.01, 0.6 + ts - sign * 0.01]}]
            paths.append(tmp_path / f"{name}{seed}.json")
            paths[-1].write_text(json.dumps({"models": models}))
        return [str(p) for p in paths]

    t = [0.02, -0.02, 0.02, -0.02]
    runs_var, common_var = stats.sd_of(t) ** 2, 0.0002  # sd(+0.01, -0.01)² = 0.0002
    # common: the variance of the mean is runs_var / 4 seeds + common_var / 2 draws; Satterthwaite's df
    var = runs_var / 4 + common_var / 2
    df = var ** 2 / ((runs_var / 4) ** 2 / 3 + (common_var / 2) ** 2 / 1)
    half = stats.t95(int(df)) * var ** 0.5
    summarize.paired(write([1, 1, 1, 1], "common"))
    out = capsys.readouterr().out
    assert "base model: 0.500 (mean of 2 draws)" in out
    assert (f"| jagg | 4 | 2 | +0.000 ({-half:+.3f} to {half:+.3f}) | {common_var ** 0.5:.4f} | {common_var ** 0.5:.4f} "
            f"| {runs_var ** 0.5:.4f} | 100.0 % ({100 - 1000 * half:.0f}-{100 + 1000 * half:.0f} %) |") in out
    # with no evaluation error only the runs' own spread is left: the seeds a plain t interval needs
    assert f", {stats.seeds_for(runs_var ** 0.5 / 0.1, 0.10)} |" in out

    # alternating: one draw's error 0.01·√2 within each seed, nothing common; the runs' own variance
    # is what the seeds' means keep after the error's 0.0002 / 2 draws (0.02² exactly)
    summarize.paired(write([1, -1, 1, -1], "alternate"))
    out = capsys.readouterr().out
    half = stats.t95(3) * stats.sd_of(t) / 2
    assert (f"| jagg | 4 | 2 | +0.000 ({-half:+.3f} to {half:+.3f}) | {0.01 * 2 ** 0.5:.4f} | 0.0000 | 0.0200 "
            f"| 100.0 % ({100 - 1000 * half:.0f}-{100 + 1000 * half:.0f} %) |") in out
    # at 2 draws a seed's mean spreads by sd(t) (a plain t interval's seeds); with no evaluation
    # error by the runs' 0.02; and no number of draws takes the runs' own spread to ±10 at 4 seeds
    seeds = f"{stats.seeds_for(stats.sd_of(t) / 0.1, 0.10)}, {stats.seeds_for(0.2, 0.10)}"
    assert f"| {seeds} | never |" in out
    paths = [pathlib.Path(p) for p in write([1, 1, 1, 1], "common")]

    # No base model's draws, or a JAGG run drawn more often than its exact twin: refused, named.
    (tmp_path / "nobase.json").write_text(json.dumps({"models": json.loads(paths[1].read_text())["models"]}))
    with pytest.raises(SystemExit, match="no file holds the base model's draws"):
        summarize.paired([str(tmp_path / "nobase.json")])
    models = json.loads(paths[0].read_text())["models"]
    models[2]["draws"].append(0.6)
    (tmp_path / "uneven.json").write_text(json.dumps({"models": models}))
    with pytest.raises(SystemExit, match="has 3 draws, the exact run 2"):
        summarize.paired([str(tmp_path / "uneven.json")])
    with pytest.raises(SystemExit, match="fewer than 2 seeds"):
        summarize.paired([str(paths[0])])
    later = json.loads(paths[1].read_text())["models"]
    for m in later:
        m["draws"].append(0.6)
    (tmp_path / "three.json").write_text(json.dumps({"models": later}))
    with pytest.raises(SystemExit, match="the base model has 2 draws"):
        summarize.paired([str(paths[0]), str(tmp_path / "three.json")])


def test_two_way_matches_the_textbook_mean_squares():
    """A seeds x draws table with a run effect, a draw effect common to all seeds and noise: the
    variance of its mean is (MS_rows + MS_cols - MS_rest) / (n k), with Satterthwaite's degrees of
    freedom over the three mean squares, computed here from the table's two-way decomposition."""
    rng = random.Random(3)
    n, k = 6, 5
    run, draw = [rng.gauss(0, 0.3) for _ in range(n)], [rng.gauss(0, 0.3) for _ in range(k)]
    x = [[run[i] + draw[j] + rng.gauss(0, 0.1) for j in range(k)] for i in range(n)]
    g = sum(map(sum, x)) / (n * k)
    r = [sum(row) / k for row in x]
    c = [sum(x[i][j] for i in range(n)) / n for j in range(k)]
    msr = k * sum((v - g) ** 2 for v in r) / (n - 1)
    msc = n * sum((v - g) ** 2 for v in c) / (k - 1)
    mse = sum((x[i][j] - r[i] - c[j] + g) ** 2 for i in range(n) for j in range(k)) / ((n - 1) * (k - 1))
    assert msr > mse and msc > mse  # no component clipped
    comp = stats.two_way(x)
    var, df = stats.mean_variance(comp, n, k)
    assert var == pytest.approx((msr + msc - mse) / (n * k))
    assert df == pytest.approx((msr + msc - mse) ** 2 / (msr ** 2 / (n - 1) + msc ** 2 / (k - 1)
                                                                + mse ** 2 / ((n - 1) * (k - 1))))
    assert comp["runs"] == pytest.approx((msr - mse) / k) and comp["common"] == pytest.approx((msc - mse) / n)


def test_retention_pairs_each_mode_with_exact_and_the_papers_mode_seed_by_seed(tmp_path, capsys):
    """lab/toy_quality.sh's layout, OUT/<mode>/seed<S>/summary.json: gain kept per seed is the
    mode's gain over exact's of the same seed; the paired difference is to the paper's mode."""
    import json

    gains = {"exact": [0.5, 0.4, 0.6], "paper": [0.45, 0.4, 0.54], "shared_rollout": [0.5, 0.36, 0.6]}
    for mode, values in gains.items():
        for seed, gain in enumerate(values):
            folder = tmp_path / mode / f"seed{seed}"
            folder.mkdir(parents=True)
            (folder / "summary.json").write_text(json.dumps({"reward_gain": gain, "grad_steps": 8 * 320,
                                                             "config": {"steps": 80, "minibatches": 4}}))
    (tmp_path / "paper" / "seed3").mkdir()  # an unfinished run: left out, as every mode lacks seed 3
    summarize.retention(str(tmp_path))
    out = capsys.readouterr().out
    kept_paper, kept_shared = [0.9, 1.0, 0.9], [1.0, 0.9, 1.0]
    mean, half = stats.mean_interval(kept_paper)
    assert f"| paper | 8 | {100 * mean:.1f} % ({100 * (mean - half):.1f}-{100 * (mean + half):.1f} %)" in out
    diff, dhalf = stats.mean_interval([s - p for s, p in zip(kept_shared, kept_paper)])
    assert f"| {100 * diff:+.1f} ({100 * (diff - dhalf):+.1f} to {100 * (diff + dhalf):+.1f}) points |" in out
    assert "3 seeds (0-2)" in out and "| 90.0 % (seed 0) |" in out


def _compare_run(folder, seed, window, epochs, seconds, slope, gain_kept=1.0):
    """A lab/sd_runner.py compare summary whose exact and JAGG runs rise linearly in training time
    (reward 0.1 + slope x seconds), an epoch taking `seconds`, evaluated every 2 epochs."""
    def run(mode, slope):
        config = {"seed": seed, "sde_window": window, "reward": "darkness"}
        curve = [[e, 0.1 + slope * e * seconds] for e in range(0, epochs + 1, 2)]
        return {"mode": mode, "config": config, "epochs": epochs, "epoch_seconds": [seconds] * epochs,
                "train_seconds": seconds * epochs, "eval_curve": curve, "initial_reward": 0.1,
                "reward_gain": curve[-1][1] - 0.1}
    summary = {"config": {"seed": seed, "sde_window": window}, "exact": run("exact", slope),
               "jagg": run("jagg", slope * gain_kept)}
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps(summary))
    return str(folder)


def test_wallclock_compares_settings_at_the_same_training_time(tmp_path, capsys):
    """Every step: 10 s an epoch for 4 epochs; a window: 5 s an epoch for 8 epochs, learning twice
    as fast per second. At the shared 40 s budget (curves averaged at 32, 36 and 40 s) the window's
    gain is twice every step's, and the window's JAGG, learning 3/4 as fast as the window's exact,
    reaches 150 % of every step's exact gain."""
    paths = []
    for seed in (0, 1):
        paths.append(_compare_run(tmp_path / f"paper_seed{seed}", seed, 0, 4, 10.0, 0.001, gain_kept=0.5))
        paths.append(_compare_run(tmp_path / f"window_seed{seed}", seed, 4, 8, 5.0, 0.002, gain_kept=0.75))
    table = summarize.wallclock(paths)
    assert list(table) == ["all steps, exact", "all steps, the paper's JAGG", "window of 4, exact",
                           "window of 4, the paper's JAGG"]
    assert table["all steps, exact"]["gain_at_budget"] == pytest.approx(0.036)
    assert table["window of 4, exact"]["gain_at_budget"] == pytest.approx(0.072)
    assert table["window of 4, exact"]["ratio_to_first"][0] == pytest.approx(2.0)
    assert table["window of 4, the paper's JAGG"]["ratio_to_first"][0] == pytest.approx(1.5)
    assert table["all steps, the paper's JAGG"]["minus_first"][0] == pytest.approx(-0.018)
    assert table["window of 4, exact"]["seconds_an_epoch"] == pytest.approx(5.0)
    assert "window of 4, exact | 2 | 8 | 5.0 |" in capsys.readouterr().out


def test_wallclock_budget_is_the_shortest_run_and_needs_every_setting_per_seed(tmp_path):
    # the window's runs end at 20 s: every setting is read at 16, 18 and 20 s
    paths = [_compare_run(tmp_path / "a", 0, 0, 4, 10.0, 0.001), _compare_run(tmp_path / "b", 0, 4, 4, 5.0, 0.001)]
    assert summarize.wallclock(paths)["all steps, exact"]["gain_at_budget"] == pytest.approx(0.018)
    with pytest.raises(SystemExit, match="missing"):
        summarize.wallclock(paths + [_compare_run(tmp_path / "c", 1, 0, 4, 10.0, 0.001)])


def test_reward_at_interpolates_and_refuses_times_outside_the_curve():
    curve = [(0.0, 0.1), (10.0, 0.3), (20.0, 0.2)]
    assert summarize.reward_at(curve, 5.0) == pytest.approx(0.2)
    assert summarize.reward_at(curve, 15.0) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="outside"):
        summarize.reward_at(curve, 21.0)
    # a run kept before epoch_seconds existed: its total spread evenly over the epochs
    old = {"train_seconds": 40.0, "epochs": 4, "eval_curve": [[0, 0.1], [2, 0.2], [4, 0.3]]}
    assert run_files.timed_curve(old) == [(0.0, 0.1), (20.0, 0.2), (40.0, 0.3)]


def test_wallclock_takes_single_runs_and_names_learning_rates_when_they_differ(tmp_path):
    paths = [_compare_run(tmp_path / "a", 0, 0, 4, 10.0, 0.001)]
    single = json.loads((tmp_path / "a" / "summary.json").read_text())["exact"]
    single["config"] = dict(single["config"], lr=3e-3)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "summary.json").write_text(json.dumps(single))
    for p in paths:  # the compare run's own learning rate
        s = json.loads(pathlib.Path(p, "summary.json").read_text())
        for part in ("exact", "jagg"):
            s[part]["config"]["lr"] = 3e-4
        pathlib.Path(p, "summary.json").write_text(json.dumps(s))
    table = summarize.wallclock(paths + [str(tmp_path / "b")])
    assert list(table) == ["all steps, exact, lr 0.0003", "all steps, the paper's JAGG, lr 0.0003", "all steps, exact, lr 0.003"]


# --- Both layouts of the runs' files: the kept runs' (packed, lab/run_files.py) and train_toy.py's
RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"
ROOT = str(pathlib.Path(__file__).resolve().parents[2])


def test_the_kept_toy_retention_table_remakes_from_the_kept_files(capsys):
    """lab/results/quality/toy.jsonl holds the old train_toy.py's summaries (grad_steps, config steps),
    packed: the table lab/reports/quality.md cites comes out of them, as lab/README.md says."""
    summarize.retention(str(RESULTS / "quality" / "toy.jsonl"))
    out = capsys.readouterr().out
    assert "20 seeds (0-19); exact GRPO's gain +0.501" in out
    assert "| paper | 8 | 96.7 % (94.1-99.3 %) |" in out and "| shared_rollout | 6 | 96.8 % (93.9-99.7 %) |" in out
    assert "| exact | 16 |" in out


def test_the_kept_mini_sd3_compare_table_remakes_from_the_kept_files(capsys):
    """The kept lab/sd_runner.py compare summaries ({key: {exact, jagg}}, probe_cosine_by_position),
    packed: each run named FILE.jsonl/NAME, or all of a pattern's."""
    tables = RESULTS / "mini_sd3" / "tables" / "darkness.jsonl"
    runs = [f"{tables}/{mode}_seed{s}" for mode in ("paper", "shared") for s in range(5)]
    assert run_files.expand([f"{tables}/paper_seed[0-4]", f"{tables}/shared_seed*"]) == runs
    summarize.compare(runs)
    out = capsys.readouterr().out
    assert "| jagg | 5 | 110.1 % (75-145 %) | 71.2 % | 109.7 % (76-143 %) |" in out
    assert "| jagg_shared_rollout | 5 | 110.4 % (94-126 %) |" in out


def test_the_kept_frontiers_remake_from_the_kept_files(capsys):
    """lab/reports/equal_cost.md's fast-mode section: the frontier and budget rows it quotes come out of
    the kept second set (toy_2.jsonl, mini_2.jsonl) and their one-process timings."""
    kept = RESULTS / "equal_cost"
    _, toy = summarize.frontier([str(kept / "toy_2.jsonl")], str(kept / "toy_timing_2.json"))
    out = capsys.readouterr().out
    assert "20 seeds" in out and "window8_shared_rollout_w4" in toy and "jagg_w4" not in toy
    assert "| window8_shared_rollout_w4 | 25 % | 45 % | 98.3 % (95.5-101.1 %) | yes |" in out
    assert "| 50 % | window8_shared_rollout_w4 (45 %): 98.3 % (95.5-101.1 %) | window4 (43 %)" in out
    _, mini = summarize.frontier([str(kept / "mini_2.jsonl")], str(kept / "mini_timing_2.json"))
    out = capsys.readouterr().out
    assert "5 seeds" in out and "| first6 | 60 % | 74 % | 231.5 % (185.7-277.3 %) | yes |" in out
    assert sorted(mini) == ["first6", "shared_rollout_w8", "window4", "window8_shared_rollout_w4"]


@pytest.fixture(scope="module")
def toy_runs(tmp_path_factory):
    """Today's lab/toy_options.py (the runner of lab/toy_quality.sh), tiny: OUT/<mode>/seed<S> for
    exact and the paper's JAGG (lab/toy_quality.sh's layout) and probe-routed compare runs, from a toy
    DiT pretrained for a few steps."""

    import toy_dit
    import train_toy

    import toy_options  # lab/ is on the path
    root = tmp_path_factory.mktemp("toy_runs")
    base = str(root / "base.pt")
    train_toy.save_base_model(toy_dit.pretrain(steps=20, seed=0, batch=64), base)
    quick = ["--base-ckpt", base, "--epochs", "2", "--num-steps", "8", "--group-size", "4", "--minibatches", "1",
             "--eval-samples", "16", "--eval-every", "2"]
    for seed in (0, 1):
        for mode, flags in (("exact", ["--method", "exact"]), ("paper", ["--method", "jagg"])):
            toy_options.main([*quick, *flags, "--seed", str(seed), "--out", str(root / "quality" / mode / f"seed{seed}")])
        toy_options.main([*quick, "--seed", str(seed), "--route", "probe", "--probe-every", "1",
                        "--jagg-frac", "0.5", "--out", str(root / f"route_seed{seed}")])
    return root


def test_retention_reads_todays_toy_runs(toy_runs, capsys):
    """grad_rows and config epochs (the kept runs: grad_steps, steps): the rows per optimizer step."""
    summarize.retention(str(toy_runs / "quality"))
    out = capsys.readouterr().out
    assert "2 seeds (0-1)" in out and "| exact | 8 | 100.0 % (100.0-100.0 %) |" in out and "| paper | 4 |" in out
    run = json.load(open(toy_runs / "quality" / "paper" / "seed0" / "summary.json"))  # T = 8, W = 4: 2 windows of 2 rows
    assert "grad_steps" not in run and run_files.grad_rows_per_step(run) == 4


def test_a_packed_runs_folder_reads_as_the_folder(toy_runs, tmp_path, capsys):
    """lab/run_files.py pack: a fresh runs folder packed into one JSONL file (the kept runs' format)
    gives the same tables as the folder, metrics.jsonl's rows included (routing reads the JAGG side's)."""
    run_files.main(["pack", str(toy_runs / "quality"), str(tmp_path / "quality.jsonl")])
    run_files.main(["pack", str(toy_runs), str(tmp_path / "all.jsonl")])
    capsys.readouterr()
    tables = []
    for quality, runs in ((str(toy_runs / "quality"), [str(toy_runs / f"route_seed{s}") for s in (0, 1)]),
                          (str(tmp_path / "quality.jsonl"), run_files.expand([f"{tmp_path}/all.jsonl/route_seed*"]))):
        summarize.retention(quality)
        summarize.compare(runs)
        summarize.routing(runs, ",".join(runs))
        tables.append(capsys.readouterr().out)
    assert tables[0] == tables[1] and "2 seeds (0-1)" in tables[0] and "| 1 | probe |" in tables[0]
    rows = [json.loads(line) for line in open(toy_runs / "route_seed0" / "jagg" / "metrics.jsonl")]
    assert run_files.metrics(f"{tmp_path}/all.jsonl/route_seed0/jagg") == rows and rows


def test_compare_and_routing_read_todays_toy_compare_runs(toy_runs, capsys):
    """train_toy.py's compare summary holds each method's summary (probe: pool_probes' figures), the
    routing figures come from the JAGG side's metrics.jsonl (epoch, probe/cosine, routing/routed)."""
    runs = [str(toy_runs / f"route_seed{s}") for s in (0, 1)]
    summarize.compare(runs)
    out = capsys.readouterr().out
    s = json.load(open(toy_runs / "route_seed0" / "summary.json"))
    start, ex, jg = s["exact"]["initial_reward"], s["exact"]["final_reward"], s["jagg"]["final_reward"]
    cos = summarize.cosines(s["jagg"]["probe"]["cosine"])
    assert f"| 0 | jagg | {start:.3f} → {ex:.3f} | {start:.3f} → {jg:.3f} |" in out and f"| {cos} |" in out
    assert len(s["jagg"]["probe"]["cosine"]) == 2 and "| jagg | 2 |" in out
    summarize.routing(runs, ",".join(runs))
    out = capsys.readouterr().out
    route, gain, routed, kept, frac = run_files.routing_figures(runs[0])
    assert (route, gain, frac) == ("probe", s["jagg"]["reward_gain"], s["jagg"]["routed_frac_by_position"])
    assert f"| 0 | probe | {gain:.3f} ({100 * gain / s['exact']['reward_gain']:.0f} %) |" in out
    # W = 4 of T = 8, --jagg-frac 0.5: one of the 2 windows goes to JAGG each step, so both means exist and weigh the same probes
    rows = [json.loads(line) for line in open(toy_runs / "route_seed0" / "jagg" / "metrics.jsonl")]
    pairs = [(c, f) for r in rows for c, f in zip(r["probe/cosine"], r["routing/routed"])]
    assert routed == pytest.approx(sum(c * f for c, f in pairs) / sum(f for _, f in pairs))
    assert kept == pytest.approx(sum(c * (1 - f) for c, f in pairs) / sum(1 - f for _, f in pairs))
    assert sum(frac) == pytest.approx(1.0)


def test_toy_pictures_draw_the_probe_from_todays_metrics(toy_runs, tmp_path):
    """lab/toy_pictures.py (the probe pictures, drawn apart from the demo) on a compare run: its JAGG side's."""
    from PIL import Image

    import toy_pictures

    toy_pictures.main([str(toy_runs / "route_seed0"), "--out", str(tmp_path)])
    for name in ("probe.png", "score_vs_cosine.png"):
        assert Image.open(tmp_path / name).size == (780, 420)
    with pytest.raises(SystemExit, match="has no probes"):
        toy_pictures.main([str(toy_runs / "quality" / "paper" / "seed0"), "--out", str(tmp_path)])
