"""The lab's measuring tools: the benchmark harness (lab/bench.py), the SD3 benchmark of every mode
(lab/sd_benchmark.py), the toy's (lab/toy_benchmark.py), FSDP's memory per rank (lab/fsdp_memory.py), the charts' ticks
(lab/charts.py) and the gradient-signal statistics (lab/gradient_signal.py)."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import bench
import charts
import jagg
from beyond_paper import options

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import flows  # noqa: E402  (tests/flows.py: the small flows and batches of the top level's tests)


class MLPFlow(torch.nn.Module):
    """A small nonlinear velocity field v(z, t) for the harness's checks."""

    def __init__(self, d=3, h=64):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(d + 1, h), torch.nn.Tanh(), torch.nn.Linear(h, d)).double()

    def forward(self, z, t):  # z [S, B, d], t [S, B]
        return self.net(torch.cat([z, t[..., None]], -1))


def batch(model, T=10, B=16, d=3):
    sigmas = jagg.sigma_schedule(T).double()
    traj = jagg.rollout(model, torch.randn(B, d, dtype=torch.float64), sigmas, 0.7)
    return traj, torch.randn(B, dtype=torch.float64)


def test_benchmark_window_reports_each_part():
    torch.manual_seed(9)
    model, cfg = MLPFlow(), jagg.LossConfig(noise_level=0.7, clip_range=0.2)
    traj, adv = batch(model, T=4, B=8)
    out = bench.benchmark_window(model, model.parameters(), traj.z, traj.t, jagg.make_step_loss(traj, adv, 0, 4, cfg),
                                 repeats=2)
    assert set(out) == {"exact", "jagg"}
    assert out["exact"]["fwd_nograd"] == 0.0 and out["jagg"]["fwd_nograd"] > 0.0
    for m in out.values():
        assert m["backward"] > 0 and m["total"] == pytest.approx(m["fwd_graph"] + m["fwd_nograd"] + m["backward"])


def test_saved_bytes_fall_with_the_bound():
    """saved_bytes_peak on whole training steps (T = 10, W = 4): shared anchors hold 4 rows, the paper's
    windows 2; a bound of 2 rows with rollout interiors saves no more than the paper's windows, and a
    bound of 1 with forward interiors saves what exact does (one row at a time)."""
    torch.manual_seed(24)
    model, cfg = MLPFlow(h=256), jagg.LossConfig(noise_level=0.7, clip_range=0.2)
    traj, adv = batch(model, T=10, B=64)

    def saved(anchors="window", interior="forward", rows=None, frac=1.0):
        def step():
            model.zero_grad(set_to_none=True)
            options.backward_batch(model, traj, adv, cfg, options.JaggOptions(
                4, frac, anchors=anchors, interior=interior, max_graph_rows=rows))
        return bench.saved_bytes_peak(step)

    exact, paper = saved(frac=0.0), saved()
    shared, shared_2 = saved("shared", "rollout"), saved("shared", "rollout", 2)
    assert shared > paper > exact > 0
    assert shared_2 < shared and shared_2 <= paper
    assert saved("shared", "forward", 1) == exact == saved("window", "forward", 1)
    assert bench.mode_settings("jagg_shared_rollout_rows2") == ("shared", "rollout", 2)
    assert bench.mode_settings("exact") == ("window", "forward", None)


def sd_benchmark(tmp_path, *flags):
    pytest.importorskip("diffusers")
    import sd_benchmark

    return sd_benchmark.main(["--size", "tiny", "--window", "4", "--repeats", "1", "--device", "cpu", "--out",
                              str(tmp_path), *flags])


def test_sd_benchmark_times_every_mode_in_flow_grpos_setting(tmp_path):
    result = sd_benchmark(tmp_path, "--json")
    for key in ("window", "params", "device", "exact_backward_s", "jagg_backward_s", "backward_speedup",
                "exact_step_s", "jagg_step_s", "step_speedup", "num_steps", "guidance_scale", "beta", "rollout_s"):
        assert key in result, key
    assert result["window"] == 4 and result["device"] == "cpu" and result["params"] > 0
    assert result["jagg_fwd_nograd_s"] > 0 and result["gradient_checkpointing"] is False
    assert (result["num_steps"], result["guidance_scale"], result["beta"]) == (10, 4.5, 0.04)  # Flow-GRPO's setting
    modes = set(bench.TRAINING_MODES)
    for key in ("train_s", "train_speedup", "epoch_speedup", "backward_rows"):
        assert set(result[key]) == modes, key
    # Flow-GRPO's 9 trained steps of 10: windows 0-3, 4-7, 8 (2 + 2 + 1 rows), shared anchors 0, 3, 6, 8.
    assert result["trained_steps"] == 9
    assert result["backward_rows"] == {"exact": 9, "jagg": 5, "jagg_shared": 4, "jagg_rollout": 5, "jagg_shared_rollout": 4}
    for m in modes:
        assert result["epoch_speedup"][m] == pytest.approx(
            (result["rollout_s"] + result["train_s"]["exact"]) / (result["rollout_s"] + result["train_s"][m]))
        assert result["train_parts_s"][m]["fwd_ref"] > 0  # beta > 0: every mode runs the reference
    assert "peak_mem_gb" not in result  # CUDA only
    saved = json.load(open(tmp_path / "benchmark.json"))
    assert saved["result"] == result and (tmp_path / "benchmark.png").stat().st_size > 1000


def test_the_gpu_equal_cost_script_runs_on_a_cpu_in_its_tiny_setting(tmp_path):
    """lab/gpu_equal_cost.sh, the one command for a lent GPU: on the CPU at the tiny size, every mode it names
    is timed at W = 4 and 8, with its rows with grad, in Flow-GRPO's configuration (LoRA on a batch of 9 there,
    2 here), and the SDE windows of 8 and 4 exact, with the paper's JAGG and with the fast mode, bounded too."""
    import subprocess

    run = subprocess.run(["bash", os.path.join(ROOT, "lab", "gpu_equal_cost.sh"), str(tmp_path), "--size", "tiny",
                          "--device", "cpu", "--batch", "2", "--repeats", "1"], capture_output=True, text=True,
                         cwd=ROOT, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    for W in (4, 8):
        result = json.load(open(tmp_path / f"w{W}" / "benchmark.json"))["result"]
        assert (result["window"], result["trained_steps"], result["num_steps"], result["beta"], result["train"]) == (
            W, 9, 10, 0.04, "lora")
        assert set(result["train_speedup"]) == set(bench.TRAINING_MODES) | {"jagg_shared_rows2", "jagg_shared_rollout_rows2"}
        windows = {name: row["rows"] for name, row in result["sde_windows"].items() if name.startswith("window")}
        fast = {4: (4, 2), 8: (2, 2)}[W]  # the window of 8 and of 4 with shared anchors at W = min(K, W)
        assert windows == {"window of 8, exact": 8, "window of 8, jagg": {4: 4, 8: 2}[W],
                           "window of 8, jagg_shared_rollout": fast[0], "window of 8, jagg_shared_rollout_rows2": fast[0],
                           "window of 4, exact": 4, "window of 4, jagg": 2, "window of 4, jagg_shared_rollout": fast[1],
                           "window of 4, jagg_shared_rollout_rows2": fast[1]}
    assert "x step" in run.stdout and "window of 8, jagg_shared_rollout" in run.stdout


def test_sd_benchmark_with_a_bound_on_graph_rows_reports_saved_memory(tmp_path, capsys):
    result = sd_benchmark(tmp_path, "--max-graph-rows", "2")
    assert set(result["train_s"]) == set(bench.TRAINING_MODES) | {"jagg_shared_rows2", "jagg_shared_rollout_rows2"}
    assert set(result["saved_gb"]) == set(result["train_s"])
    assert result["backward_rows"]["jagg_shared_rollout_rows2"] == result["backward_rows"]["jagg_shared_rollout"] == 4
    saved = result["saved_gb"]
    assert saved["jagg_shared_rollout_rows2"] < saved["jagg_shared_rollout"]
    assert saved["jagg_shared_rollout_rows2"] <= saved["jagg"] * 1.001 and saved["exact"] < saved["jagg"]
    assert "saved MiB" in capsys.readouterr().out


def test_sd_benchmark_in_the_users_configuration_lora_and_checkpointing(tmp_path, capsys):
    result = sd_benchmark(tmp_path, "--train", "lora", "--lora-rank", "4", "--checkpointing")
    assert result["train"] == "lora" and result["lora_rank"] == 4 and result["gradient_checkpointing"] is True
    assert 0 < result["trained_params"] < result["params"] and "LoRA rank 4 trained" in capsys.readouterr().out
    assert result["backward_rows"]["jagg_shared_rollout"] == 4 and result["train_s"]["exact"] > 0
    saved = json.load(open(tmp_path / "benchmark.json"))
    assert saved["config"]["train"] == "lora" and saved["config"]["checkpointing"] is True


def test_toy_benchmark_times_every_mode_and_writes_what_summarize_reads(tmp_path, capsys):
    """lab/toy_benchmark.py (the old train_toy.py --benchmark) on a toy DiT pretrained for a few steps:
    both W, every mode with the toy's rows (T = 16, all trained), and summarize's toy tables from its file."""
    import summarize
    import toy_benchmark
    import toy_dit

    import train_toy

    train_toy.save_base_model(toy_dit.pretrain(steps=5, seed=0, batch=64), str(tmp_path / "base.pt"))
    out = tmp_path / "bench"
    results = toy_benchmark.main(["--base-ckpt", str(tmp_path / "base.pt"), "--batch", "16", "--repeats", "1",
                                  "--out", str(out)])
    assert set(results) == {4, 8}
    assert results[4]["backward_rows"] == {"exact": 16, "jagg": 8, "jagg_shared": 6, "jagg_rollout": 8,
                                           "jagg_shared_rollout": 6}
    assert results[8]["backward_rows"]["jagg"] == 4 and results[8]["window"] == 8
    for r in results.values():
        assert r["backward_speedup"] > 0 and r["train_speedup"]["exact"] == 1.0 and r["rollout_s"] > 0
    saved = json.load(open(out / "benchmark.json"))
    assert set(saved["results"]) == {"4", "8"} and (out / "benchmark.png").stat().st_size > 1000
    capsys.readouterr()
    summarize.toybench([str(out / "benchmark.json")])
    summarize.window_level([str(out / "benchmark.json")])
    lines = capsys.readouterr().out.splitlines()
    assert "| 4 | jagg_shared_rollout | 6 |" in "\n".join(lines) and "| 8 | JAGG |" in "\n".join(lines)
    with pytest.raises(SystemExit, match="--windows must each be in"):
        toy_benchmark.main(["--windows", "20", "--out", str(out)])


def test_fsdp_memory_per_rank_state_halves_and_activations_stay(tmp_path):
    """lab/fsdp_memory.py at 1 and 2 ranks: each rank holds half the weights, gradients and AdamW state
    (to the shards' rounding), and every mode saves the same activations as on one rank."""
    pytest.importorskip("diffusers")
    for n in (1, 2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
               "lab/fsdp_memory.py", "--size", "tiny", "--out", str(tmp_path)]
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = (json.load(open(tmp_path / f"ranks{n}.json")) for n in (1, 2))
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert two[key] < 0.55 * one[key], key
    assert two["saved_bytes"] == one["saved_bytes"] and len(one["saved_bytes"]) == 5


@pytest.mark.parametrize("low, high", [(0.181, 0.733), (0, 80), (0, 48), (20.8, 80.2), (0.75, 0.97), (-0.02, 0.3),
                                       (3.2, 3.9), (0, 250), (1e-4, 7e-4)])
def test_chart_ticks_are_round_and_cover_the_data(low, high):
    ticks, lo, hi = charts.nice_ticks(low, high)
    step = ticks[1] - ticks[0]
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert any(abs(mantissa - m) < 1e-6 for m in (1, 2, 5)), ticks
    assert all(abs(t / step - round(t / step)) < 1e-6 for t in ticks), ticks  # multiples of the step
    assert lo <= low and hi >= high and 3 <= len(ticks) <= 7
    labels = [charts.tick_label(t, ticks) for t in ticks]
    assert len(set(labels)) == len(labels) and all(float(s) == pytest.approx(t) for s, t in zip(labels, ticks))
    assert (low, high) != (0, 80) or labels == ["0", "20", "40", "60", "80"]
    assert (low, high) != (0.181, 0.733) or labels == ["0.0", "0.2", "0.4", "0.6", "0.8"]
    assert (low, high) != (0, 48) or labels == ["0", "10", "20", "30", "40", "50"]  # not 0-60: the tightest round axis


def test_gradient_signal_stats_on_known_gradients():
    """Batches g_k = s + noise with a known signal s: JAGG equal to exact keeps everything with no
    error; half of exact keeps half; exact plus independent noise of a known size keeps the signal
    (about 1) and reports that noise's share of the batch's own."""
    from gradient_signal import signal_stats

    g = torch.Generator().manual_seed(0)
    P, K = 20000, 12
    s = torch.randn(P, generator=g, dtype=torch.float64) * 0.5  # |s|^2 = P / 4
    exact = [s + torch.randn(P, generator=g, dtype=torch.float64) for _ in range(K)]  # noise variance P
    same = signal_stats(exact, exact)
    assert same["probe_cosine"] == pytest.approx(1.0) and same["error_to_noise"] == 0.0
    assert same["signal_kept"] == pytest.approx(1.0)
    assert same["batch_agreement"] == pytest.approx(0.25 / 1.25, abs=0.02)  # |s|^2 / (|s|^2 + noise)
    half = signal_stats(exact, [0.5 * x for x in exact])
    assert half["signal_kept"] == pytest.approx(0.5) and half["probe_cosine"] == pytest.approx(1.0)
    noisy = signal_stats(exact, [x + 0.5 * torch.randn(P, generator=g, dtype=torch.float64) for x in exact])
    assert noisy["error_to_noise"] == pytest.approx(0.25, rel=0.05)  # (0.5^2 P) / P
    assert noisy["signal_kept"] == pytest.approx(1.0, abs=0.1)
    assert noisy["signal_kept_stderr"] < 0.1 and 0 < noisy["batch_agreement_stderr"] < 0.05
    wrong = signal_stats(exact, [-x for x in exact])  # the opposite direction loses the signal
    assert wrong["signal_kept"] == pytest.approx(-1.0)


def test_time_gradients_times_exact_against_the_options_and_leaves_their_gradient():
    """bench.time_gradients: both gradients timed (medians of the repeats), the rows with grad each
    computes (T = 8, W = 4: exact 8 steps, JAGG 2 of each window's 4), and params left with the last call's
    gradient, which is options.backward_batch's of that method (so the timed work is the training work)."""
    torch.manual_seed(11)
    model = flows.MLPFlow()
    traj, adv = flows.toy_batch(model, T=8, B=4)
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2, beta=0.0)
    opts, params = options.JaggOptions(4), list(model.parameters())
    times = bench.time_gradients(flows.as_velocity_fn(model), params, traj, adv, cfg, opts, repeats=2)
    assert {m: t["grad_rows"] for m, t in times.items()} == {"exact": 8, "jagg": 2 * 2}
    assert all(0 < t["backward_s"] <= t["step_s"] for t in times.values())
    last = [p.grad.clone() for p in params]  # repeats = 2: the last round runs exact last (the order alternates)
    for p in params:
        p.grad = None
    options.backward_batch(flows.as_velocity_fn(model), traj, adv, cfg, dataclasses.replace(opts, jagg_frac=0.0))
    assert all(torch.equal(a, p.grad) for a, p in zip(last, params))
