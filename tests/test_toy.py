"""train_toy.py end to end: a short seeded GRPO run, the torchrun path, the benchmark, bad input."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

import train_toy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def base_ckpt(tmp_path_factory):
    """A quickly pretrained toy DiT (the demo pretrains longer; this is enough to learn the modes)."""
    path = tmp_path_factory.mktemp("base") / "toy_base.pt"
    cfg = train_toy.Config(pretrain_steps=400, pretrain_batch=256)
    model_cfg = train_toy.ToyDiTConfig(num_classes=len(train_toy.PROMPTS), hidden=cfg.hidden, depth=cfg.depth)
    train_toy.pretrain(cfg, model_cfg, str(path), rank=0)
    return str(path)


def quick(base_ckpt, out, *extra):
    return ["--base-ckpt", base_ckpt, "--out", str(out), "--eval-samples", "128", "--eval-every", "5", *extra]


def test_short_grpo_run_raises_reward_for_both_methods(base_ckpt, tmp_path):
    train_toy.main(quick(base_ckpt, tmp_path, "--steps", "15", "--probe-every", "5"))
    top = json.load(open(tmp_path / "summary.json"))
    assert top["method"] == "compare"
    for method in ("exact", "jagg"):
        s = json.load(open(tmp_path / method / "summary.json"))
        for key in ("method", "initial_reward", "final_reward", "backward_seconds", "train_seconds", "grad_steps"):
            assert key in s
        assert s["method"] == method
        assert s["final_reward"] > s["initial_reward"] + 0.05, s
        rows = [json.loads(line) for line in open(tmp_path / method / "metrics.jsonl")]
        assert len(rows) == 15 and all("train/clipfrac" in r and "time/backward_seconds" in r for r in rows)
    ex, jg = top["exact"], top["jagg"]
    assert top["initial_reward"] == ex["initial_reward"]
    for key in ("final_reward", "backward_seconds", "train_seconds", "grad_steps"):
        assert top[key] == {"exact": ex[key], "jagg": jg[key]}
    # Same seed and checkpoint: the same starting point; JAGG ran 2 of every 4 steps with grad.
    assert ex["initial_reward"] == jg["initial_reward"]
    assert ex["grad_steps"] == 2 * jg["grad_steps"]
    cos = jg["probe_grad_cosine_per_window"]
    assert len(cos) == 4 and all(0.3 < c < 1.0 for c in cos)
    for picture in ("samples.png", "reward_curves.png", "trajectories.png"):
        assert (tmp_path / picture).stat().st_size > 1000
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]


def test_torchrun_ranks_stay_in_sync(base_ckpt, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train_toy.py",
           "--method", "compare", "--jagg-frac", "0.5", "--steps", "3", "--probe-every", "0",
           *quick(base_ckpt, tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    base = torch.load(base_ckpt, weights_only=True)["model"]
    for method in ("exact", "jagg"):  # exact ends each batch on an exact step, jagg (0.5) on a JAGG window
        s = json.load(open(tmp_path / method / "summary.json"))
        assert s["world_size"] == 2
        # Each rank trained on its own rollouts; DDP averaged the gradients, so the weights agree...
        a, b = s["param_checksums"]
        assert a == pytest.approx(b, rel=1e-9, abs=1e-9)
        # ...and they did move away from the base model.
        assert abs(a - sum(v.double().sum().item() for v in base.values())) > 1e-6


def test_benchmark_prints_ratios_and_writes_json(base_ckpt, tmp_path, capsys):
    train_toy.main(quick(base_ckpt, tmp_path, "--benchmark", "--bench-batch", "16", "--bench-repeats", "1"))
    out = capsys.readouterr().out
    assert "backward speedup" in out and "whole window-gradient speedup" in out
    results = json.load(open(tmp_path / "benchmark.json"))["results"]
    assert set(results) == {"4", "8"}
    for r in results.values():
        assert r["backward_speedup"] > 0 and r["step_speedup"] > 0
        assert r["jagg"]["fwd_nograd"] > 0 and r["exact"]["fwd_nograd"] == 0


@pytest.mark.parametrize("args, message", [
    (["--window", "1"], "--window must be >= 2"),
    (["--window", "17"], "longer than the trajectory"),
    (["--jagg-frac", "1.5"], r"--jagg-frac must be in \[0, 1\]"),
    (["--jagg-frac", "-0.5"], r"--jagg-frac must be in \[0, 1\]"),
    (["--base-ckpt", "/nonexistent/base.pt"], "does not exist"),
])
def test_bad_input_fails_before_touching_files(tmp_path, args, message):
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=message):
        train_toy.main(["--out", str(out), *args])
    assert not out.exists()


def test_corrupt_or_mismatched_checkpoint_is_a_clear_error(base_ckpt, tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"this is not a checkpoint")
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="corrupt or not a toy DiT checkpoint"):
        train_toy.main(["--base-ckpt", str(bad), "--out", str(out)])
    with pytest.raises(SystemExit, match="another size"):
        train_toy.main(["--base-ckpt", base_ckpt, "--hidden", "32", "--out", str(out)])
    assert not out.exists()


def test_help_documents_every_flag():
    proc = subprocess.run([sys.executable, "train_toy.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0
    for f in dataclasses.fields(train_toy.Config):
        assert "--" + f.name.replace("_", "-") in proc.stdout
