"""lab/toy_baselines.py: each cheap alternative's gradient against one written out here by hand
(autograd of the loss each trainer states), DanceGRPO's random steps unbiased for exact GRPO's
gradient, eff_grpo's JAGG on random windows the paper's JAGG window by window, and the runner."""

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests"))

import jagg  # noqa: E402
from beyond_paper import options  # noqa: E402
import toy_baselines  # noqa: E402
from flows import MLPFlow, as_velocity_fn, toy_batch  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def float64():
    """float64 throughout, so that agreement shows as round-off (~1e-16), not fp32's ~1e-7."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def flat(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def by_hand(model, traj, adv, cfg, steps_of):
    """Autograd of sum_n sum_{k in steps_of[n]} l_{n,k} / (B m): l the clipped surrogate of sample n at
    step k, written here from jagg.sde_step's log-probability; m the steps each sample trains."""
    model.zero_grad(set_to_none=True)
    fn, B = as_velocity_fn(model), traj.z.shape[1]
    m = len(steps_of[0])
    total = 0.0
    for n in range(B):
        for k in steps_of[n]:
            v = fn(traj.z[k : k + 1, n : n + 1], traj.t[k : k + 1, n : n + 1])[0]  # [1, d]
            log_prob = jagg.sde_step(v, traj.z[k, n : n + 1], traj.t[k, n : n + 1], traj.t_next[k, n : n + 1],
                                     cfg.noise_level, prev_sample=traj.z_next[k, n : n + 1])[1]
            ratio = torch.exp(log_prob - traj.log_prob[k, n])
            clipped = ratio.clamp(1 - cfg.clip_range, 1 + cfg.clip_range)
            total = total + torch.maximum(-adv[n] * ratio, -adv[n] * clipped).sum() / (B * m)
    total.backward()
    return flat(model)


def fns_of(model):
    return lambda idx: (as_velocity_fn(model), None)


def test_random_steps_are_the_loss_danceGRPO_states_and_unbiased():
    torch.manual_seed(3)
    model = MLPFlow()
    traj, adv = toy_batch(model, T=6, B=5)
    cfg = jagg.LossConfig(0.7, 0.2)
    steps = [(k, k + 1) for k in range(6)]
    g = torch.Generator().manual_seed(1)
    model.zero_grad(set_to_none=True)
    stats, _ = toy_baselines.subset_gradients(fns_of(model), traj, adv, cfg, steps, 2, g)
    got = flat(model)
    g = torch.Generator().manual_seed(1)
    chosen = [torch.randperm(6, generator=g)[:2].tolist() for _ in range(5)]  # the same draws, in order
    torch.testing.assert_close(got, by_hand(model, traj, adv, cfg, chosen), rtol=1e-10, atol=1e-12)
    assert stats["grad_rows"] == pytest.approx(2.0)  # 2 steps of each sample
    # One step each (K = 1): a trajectory of one step, still each sample's own
    g = torch.Generator().manual_seed(2)
    model.zero_grad(set_to_none=True)
    toy_baselines.subset_gradients(fns_of(model), traj, adv, cfg, steps, 1, g)
    got = flat(model)
    g = torch.Generator().manual_seed(2)
    chosen = [torch.randperm(6, generator=g)[:1].tolist() for _ in range(5)]
    torch.testing.assert_close(got, by_hand(model, traj, adv, cfg, chosen), rtol=1e-10, atol=1e-12)
    # Every step drawn: exact GRPO's gradient (the mean over the steps), as backward_batch computes it.
    model.zero_grad(set_to_none=True)
    toy_baselines.subset_gradients(fns_of(model), traj, adv, cfg, steps, 6, g)
    every = flat(model)
    model.zero_grad(set_to_none=True)
    options.backward_batch(as_velocity_fn(model), traj, adv, cfg, options.JaggOptions(3, 0.0))
    torch.testing.assert_close(every, flat(model), rtol=1e-10, atol=1e-12)
    # Unbiased: the mean over all C(6, 2) pairs, drawn by every sample alike, is exact's gradient.
    import itertools

    pairs = list(itertools.combinations(range(6), 2))
    mean = sum(by_hand(model, traj, adv, cfg, [list(p)] * 5) for p in pairs) / len(pairs)
    torch.testing.assert_close(mean, every, rtol=1e-10, atol=1e-12)


def test_first_steps_are_flow_grpos_loss():
    torch.manual_seed(4)
    model = MLPFlow()
    traj, adv = toy_batch(model, T=6, B=4)
    cfg = jagg.LossConfig(0.7, 0.2)
    model.zero_grad(set_to_none=True)
    stats, _ = toy_baselines.first_steps_gradients(fns_of(model), traj, adv, cfg, 4)
    torch.testing.assert_close(flat(model), by_hand(model, traj, adv, cfg, [[0, 1, 2, 3]] * 4), rtol=1e-10,
                               atol=1e-12)
    assert stats["grad_rows"] == 4


def test_jagg_on_random_windows_is_the_papers_jagg_window_by_window():
    """eff_grpo's: each sample's own windows, JAGG on each; with every window drawn it is the paper's
    JAGG on the whole batch, and with some, the sum of the paper's JAGG on each sample's windows."""
    torch.manual_seed(5)
    model = MLPFlow()
    traj, adv = toy_batch(model, T=8, B=4)
    cfg = jagg.LossConfig(0.7, 0.2)
    windows = [(0, 4), (4, 8)]
    g = torch.Generator().manual_seed(2)
    model.zero_grad(set_to_none=True)
    stats, _ = toy_baselines.subset_gradients(fns_of(model), traj, adv, cfg, windows, 1, g, by_jagg=True)
    got = flat(model)
    assert stats["grad_rows"] == pytest.approx(2.0)  # one window of each sample: 2 rows
    g = torch.Generator().manual_seed(2)
    chosen = [torch.randperm(2, generator=g)[:1].item() for _ in range(4)]
    expected = 0
    for n, w in enumerate(chosen):  # sample n alone, its window by the paper's JAGG, weighted 1 / (B m)
        one = traj.subset([n])
        start, stop = windows[w]
        model.zero_grad(set_to_none=True)
        step_loss = jagg.make_step_loss(one, adv[[n]], start, stop, cfg)
        jagg.backward_jagg_window(as_velocity_fn(model), one.z[start:stop], one.t[start:stop],
                                  lambda i, v: step_loss(i, v) * 8 / (4 * 4))
        expected = expected + flat(model)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    model.zero_grad(set_to_none=True)
    toy_baselines.subset_gradients(fns_of(model), traj, adv, cfg, windows, 2, g, by_jagg=True)
    every = flat(model)
    model.zero_grad(set_to_none=True)
    jagg.backward_batch(as_velocity_fn(model), traj, adv, cfg, window=4)
    torch.testing.assert_close(every, flat(model), rtol=1e-10, atol=1e-12)


def test_the_runner_trains_each_baseline_at_its_cost(tmp_path):
    for baseline, flags, rows in (("random", [], 4), ("first", [], 4), ("window", [], 4),
                                  ("jagg_random", [], 2), ("window", ["--window-jagg"], 2)):
        out = tmp_path / f"{baseline}{len(flags)}"
        toy_baselines.main(["--baseline", baseline, "--trained-steps", "4", *flags, "--method", "jagg",
                            "--epochs", "2", "--group-size", "4", "--pretrain-steps", "5", "--eval-every", "1",
                            "--eval-samples", "8", "--out", str(out)])
        s = json.load(open(out / "summary.json"))
        assert s["grad_rows"] == pytest.approx(rows * 4 * 2), (baseline, flags, s["grad_rows"])  # 4 steps, 2 epochs
        assert s["mode"].startswith(baseline)
    with pytest.raises(SystemExit, match="--trained-steps must be a multiple of --window 4"):
        toy_baselines.main(["--baseline", "jagg_random", "--trained-steps", "6", "--out", str(tmp_path / "x")])


def test_the_mini_sd3s_random_steps_are_one_draw_per_micro_batch():
    """lab/sd_baselines.py's stand-in for jagg.backward_batch: the micro-batch's drawn steps, exactly,
    the loss their mean, against autograd of that loss written out; it draws anew at each call."""
    import sd_baselines

    torch.manual_seed(6)
    model = MLPFlow()
    traj, adv = toy_batch(model, T=6, B=4)
    cfg = jagg.LossConfig(0.7, 0.2)
    gradient = sd_baselines.random_steps(3, torch.Generator().manual_seed(4))
    model.zero_grad(set_to_none=True)
    stats, _ = gradient(as_velocity_fn(model), traj, adv, cfg, 4, 0.0)
    steps = sorted(torch.randperm(6, generator=torch.Generator().manual_seed(4))[:3].tolist())
    got = flat(model)
    torch.testing.assert_close(got, by_hand(model, traj, adv, cfg, [steps] * 4), rtol=1e-10, atol=1e-12)
    assert stats["grad_rows"] == 3
    model.zero_grad(set_to_none=True)
    gradient(as_velocity_fn(model), traj, adv, cfg, 4, 0.0)
    assert not torch.equal(flat(model), got)  # another draw


def test_the_mini_sd3s_random_steps_train_train_sds_run(tmp_path):
    """sd_baselines.main drives lab/sd_runner.py's own loop: each micro-batch back-propagates --random-steps
    of its steps (the rows with grad say so), and sd_runner's call is restored after."""
    import sd_baselines
    import tiny_sd3

    torch.set_default_dtype(torch.float32)  # a diffusers pipeline, as users run it (the fixture restores it)
    pipe = tiny_sd3.build(tmp_path / "pipe")
    flags = ["--model", str(pipe), "--out", str(tmp_path / "run"), "--num-steps", "4", "--timestep-fraction", "1",
             "--prompts-per-epoch", "2", "--group-size", "2", "--train-batch", "2", "--steps-per-epoch", "0",
             "--lora-rank", "4", "--epochs", "1", "--eval-samples", "2", "--reward", "darkness", "--method", "exact"]
    rows = sd_baselines.main(["--random-steps", "2", "--", *flags])
    assert rows[1]["train/grad_rows"] == 2 * 2  # 2 micro-batches, 2 of the 4 steps each
    assert jagg.backward_batch is sd_baselines.PAPER_GRADIENTS
    with pytest.raises(SystemExit):  # a JAGG option would bypass the baseline
        sd_baselines.main(["--random-steps", "2", "--", *flags, "--anchors", "shared", "--overwrite"])


def test_equal_cost_table_pairs_each_mode_with_exact_of_its_seed(tmp_path, capsys):
    """summarize.py equal_cost on folders written here: the gain kept per seed is the mode's gain
    over exact's of the same seed, the rows and times shares of exact's, and the picture is drawn."""
    import summarize

    gains = {"exact": [0.5, 0.4, 0.6], "jagg_w4": [0.45, 0.4, 0.54], "random8": [0.25, 0.3, 0.3]}
    for mode, values in gains.items():
        for seed, gain in enumerate(values):
            rows, seconds = {"exact": (160, 10.0), "jagg_w4": (80, 6.0), "random8": (80, 9.0)}[mode]
            folder = tmp_path / mode / f"seed{seed}"
            folder.mkdir(parents=True)
            (folder / "summary.json").write_text(json.dumps(
                {"reward_gain": gain, "grad_rows": rows, "train_seconds": seconds + seed}))
    points = summarize.equal_cost(str(tmp_path), str(tmp_path / "equal_cost.png"))
    out = capsys.readouterr().out
    assert "| jagg_w4 | 50 % |" in out and "| random8 | 50 % |" in out and "| exact | 100 % | 100 % (±0) |" in out
    kept = [0.9, 1.0, 0.9]  # jagg_w4's gains over exact's, seed by seed
    assert points["jagg_w4"][1] == pytest.approx(100 * sum(kept) / 3)
    assert points["random8"][1] == pytest.approx(100 * (0.5 + 0.75 + 0.5) / 3)
    assert points["jagg_w4"][0] == pytest.approx(100 * (6 / 10 + 7 / 11 + 8 / 12) / 3)  # the time, of exact's
    assert points["random8"][4] == "random steps (DanceGRPO)" and (tmp_path / "equal_cost.png").stat().st_size > 1000
    # with a routing mode and a one-process timing: the timing is the cost axis, routing its own picture
    for seed, gain in enumerate([0.5, 0.4, 0.6]):
        folder = tmp_path / "early0.5" / f"seed{seed}"
        folder.mkdir(parents=True)
        (folder / "summary.json").write_text(json.dumps({"reward_gain": gain, "grad_rows": 120, "train_seconds": 9.0}))
    (tmp_path / "timing.json").write_text(json.dumps({"seconds": {"exact": 2.0, "jagg_w4": 1.2, "early0.5": 1.6}}))
    points = summarize.equal_cost(str(tmp_path), str(tmp_path / "ec.png"), str(tmp_path / "timing.json"))
    assert points["jagg_w4"][0] == pytest.approx(60.0) and points["early0.5"][:2] == pytest.approx((80.0, 100.0))
    assert "random8" not in points and "| random8 | 50 % | 91 % (±2) | - |" in capsys.readouterr().out  # no timing
    assert (tmp_path / "ec_routing.png").stat().st_size > 1000
    # --versus random8: the last column pairs each seed with random8's gain kept (0.5, 0.75, 0.5)
    summarize.equal_cost(str(tmp_path), versus="random8")
    out = capsys.readouterr().out
    diff = 100 * sum(j - r for j, r in zip(kept, [0.5, 0.75, 0.5])) / 3  # jagg_w4's minus random8's
    assert "minus random8's gain kept" in out and f"| {diff:+.1f} (" in out.split("| jagg_w4 |")[1].split("\n")[0]


def test_equal_cost_errors_routing_each_window_as_its_rule_says():
    """lab/equal_cost_error.py's routing at jagg_frac 0.5 over two windows: velocity is the paper's
    routing (jagg.backward_batch); late is exact on the first window and JAGG on the second, early the
    reverse; cosine gives JAGG the window whose JAGG gradient has the higher cosine to its exact one,
    each window's two gradients computed here one by one."""
    import types

    import equal_cost_error

    torch.manual_seed(6)
    model = MLPFlow()
    traj, adv = toy_batch(model, T=8, B=4)
    cfg = jagg.LossConfig(0.7, 0.2)
    fn = as_velocity_fn(model)
    batch = types.SimpleNamespace(fns=lambda idx: (fn, None), traj=traj, adv=adv)
    methods = equal_cost_error.methods(8, list(model.parameters()))

    def got(name):
        model.zero_grad(set_to_none=True)
        methods[name](batch, cfg, None)
        return flat(model)

    def window(start, by_jagg):  # one window's gradient, as backward_batch weights it
        model.zero_grad(set_to_none=True)
        backward = jagg.backward_jagg_window if by_jagg else jagg.backward_exact
        backward(fn, traj.z[start : start + 4], traj.t[start : start + 4], jagg.make_step_loss(traj, adv, start,
                                                                                              start + 4, cfg))
        return flat(model)

    model.zero_grad(set_to_none=True)
    jagg.backward_batch(fn, traj, adv, cfg, window=4, jagg_frac=0.5)
    torch.testing.assert_close(got("velocity0.5"), flat(model), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got("late0.5"), window(0, False) + window(4, True), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got("early0.5"), window(0, True) + window(4, False), rtol=1e-10, atol=1e-12)
    cos = [torch.nn.functional.cosine_similarity(window(s, True), window(s, False), dim=0) for s in (0, 4)]
    best = 0 if cos[0] > cos[1] else 4
    expected = window(best, True) + window(4 - best, False)
    torch.testing.assert_close(got("cosine0.5"), expected, rtol=1e-10, atol=1e-12)


def test_equal_cost_timing_times_every_method_and_the_sde_windows(tmp_path):
    """lab/equal_cost_error.py toy --time: one process, every non-oracle method, exact GRPO and the SDE
    windows each get a positive median, written to --out."""
    import equal_cost_error

    seconds = equal_cost_error.main(["toy", "--time", "8", "--batches", "2", "--out", str(tmp_path / "t.json")])
    expected = {"exact", "jagg_w4", "jagg_w8", "random8", "random4", "first8", "first4", "jagg_random8_w4", "window8",
                "window4", "window8_jagg_w4"} | {f"{how}{f}" for how in ("velocity", "early", "late", "step_error")
                                                 for f in ("0.5", "0.75")}
    fast = {"shared_rollout_w4", "shared_rollout_w8", "window8_shared_rollout_w4", "window4_shared_rollout_w4"}
    expected |= fast | {m + "_rows2" for m in fast}  # the fast modes, alone and inside the windows, bounded too
    assert set(seconds) == expected and all(s > 0 for s in seconds.values())
    assert json.load(open(tmp_path / "t.json"))["seconds"] == seconds
    # The mini's T = 10: JAGG's windows 0-3, 4-7, 8-9 back-propagate 2 + 2 + 2 rows, at W = 8 2 + 2, so
    # the alternatives train K = 6 and 4 steps (lab/mini_equal_cost.sh's runs), not T / 2 and T / 4.
    assert set(equal_cost_error.methods(10)) == {"jagg_w4", "random6", "first6", "jagg_w8", "random4", "first4",
                                                 "shared_rollout_w4", "shared_rollout_w8", "shared_rollout_w4_rows2",
                                                 "shared_rollout_w8_rows2"}


def test_frontier_marks_the_modes_nothing_beats_and_names_the_best_within_each_budget(tmp_path, capsys):
    """summarize.py frontier on folders written here: a mode is on the frontier unless another is both
    cheaper and higher in mean gain kept; per budget the best within it, and its runner-up is not its
    _rows2 twin (the same gradient), paired seed by seed."""
    import summarize

    gains = {"exact": [0.5, 0.4, 0.6], "jagg_w4": [0.45, 0.4, 0.54], "window8": [0.5, 0.36, 0.6],
             "fast": [0.5, 0.4, 0.57], "fast_rows2": [0.5, 0.4, 0.57], "window4": [0.3, 0.2, 0.3]}
    cost = {"exact": 2.0, "jagg_w4": 1.5, "window8": 1.3, "fast": 0.9, "fast_rows2": 0.92, "window4": 0.8}
    for mode, values in gains.items():
        for seed, gain in enumerate(values):
            folder = tmp_path / "runs" / mode / f"seed{seed}"
            folder.mkdir(parents=True)
            (folder / "summary.json").write_text(json.dumps({"reward_gain": gain, "grad_rows": 8, "train_seconds": 1.0}))
    (tmp_path / "timing.json").write_text(json.dumps({"seconds": cost}))
    points, on_frontier = summarize.frontier([str(tmp_path / "runs")], str(tmp_path / "timing.json"),
                                             str(tmp_path / "f.png"), budgets=(30, 50, 70))
    out = capsys.readouterr().out
    kept = {m: [g / e for g, e in zip(v, gains["exact"])] for m, v in gains.items()}
    assert points["fast"][:2] == pytest.approx((45.0, 100 * sum(kept["fast"]) / 3))
    # window8 (65 %, 96.7 %) and jagg_w4 (75 %, 93.3 %) are beaten by fast (45 %, 98.3 %); its twin ties
    # its gain, and a tie beats nothing
    assert sorted(on_frontier) == ["exact", "fast", "fast_rows2", "window4"]
    lines = {line.split(" |")[0]: line for line in out.splitlines() if line.startswith("| ") and " %" in line}
    assert "none: the cheapest mode takes 40 %" in lines["| 30 %"]
    assert "fast (45 %)" in lines["| 50 %"] and "window4 (40 %)" in lines["| 50 %"]  # not fast_rows2
    diff = 100 * sum(a - b for a, b in zip(kept["fast"], kept["window4"])) / 3
    assert f"| {diff:+.1f} (" in lines["| 50 %"]
    assert "window8 (65 %)" in lines["| 70 %"] and (tmp_path / "f.png").stat().st_size > 1000


def test_toy_run_time_times_each_mode_against_exact_in_turn(tmp_path, capsys):
    """lab/toy_run_time.py: short runs of exact and the modes asked for, in turn, from a base model, their
    medians written in lab/equal_cost_error.py --time's format; a bad count is one line."""
    import toy_dit
    import toy_run_time
    import train_toy

    base = str(tmp_path / "base.pt")
    train_toy.save_base_model(toy_dit.pretrain(steps=5, seed=0, batch=16), base)
    toy_run_time.main(["--epochs", "1", "--repeats", "1", "--modes", "jagg_w4", "window8_shared_rollout_w4",
                       "--base-ckpt", base, "--out", str(tmp_path / "t.json")])
    out = capsys.readouterr().out
    assert "| exact | 100 % | 100 % |" in out and "| window8_shared_rollout_w4 |" in out
    seconds = json.loads((tmp_path / "t.json").read_text())["seconds"]
    assert set(seconds) == {"exact", "jagg_w4", "window8_shared_rollout_w4"} and all(s > 0 for s in seconds.values())
    with pytest.raises(SystemExit):
        toy_run_time.main(["--epochs", "0"])
