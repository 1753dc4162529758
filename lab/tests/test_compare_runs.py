"""lab/compare_runs.py on two runs of tests/tiny_sd3.py's pipeline: train exact, train JAGG with the
same settings, compare (what lab/sd_runner.py --method compare did in one process)."""

import json
import os
import sys

import pytest

pytest.importorskip("diffusers", reason="the optional extra: pip install -e '.[sd]'")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests"))

import compare_runs  # noqa: E402
import tiny_sd3  # noqa: E402
import sd_runner  # noqa: E402


def test_compare_two_runs_of_one_model_and_seed(tmp_path, capsys):
    tiny = tiny_sd3.build(tmp_path / "pipe")
    common = ["--model", tiny, "--num-steps", "4", "--prompts-per-epoch", "2", "--group-size", "2", "--train-batch",
              "2", "--lora-rank", "4", "--guidance-scale", "2.0", "--clip-range", "0.2", "--lr", "1e-2", "--eval-every",
              "1", "--eval-samples", "4", "--reward", "darkness", "--timestep-fraction", "1", "--steps-per-epoch", "0",
              "--no-global-std", "--no-ema", "--epochs", "2", "--probe-every", "1", "--anchors", "shared",
              "--interior", "rollout", "--weights", "index", "--window", "2"]
    out = tmp_path / "cmp"
    for method in ("exact", "jagg"):
        sd_runner.main(common + ["--method", method, "--out", str(out / method)])
    comparison = compare_runs.main([str(out / "exact"), str(out / "jagg"), "--out", str(out), "--no-samples"])
    for key in ("mode", "initial_reward", "final_reward", "reward_gain", "reward_gain_ratio", "train_speedup",
                "grad_speedup", "grad_rows_ratio"):
        assert key in comparison, key
    assert comparison["mode"] == "jagg_shared_rollout" and comparison["weights"] == "index"
    assert set(comparison["final_reward"]) == set(comparison["reward_gain"]) == {"exact", "jagg"}
    saved = json.load(open(out / "summary.json"))
    assert len(saved["jagg"]["probe_cosine_by_position"]) == 3  # anchors 0, 1, 2, 3: three segments
    ex = saved["exact"]
    assert ex["final_reward"] == ex["eval_curve"][-1][1] and ex["initial_reward"] == saved["jagg"]["initial_reward"]
    assert len(ex["epoch_seconds"]) == 2 and sum(ex["epoch_seconds"]) == pytest.approx(ex["train_seconds"])
    for name in ("exact/metrics.jsonl", "jagg/metrics.jsonl", "exact/summary.json", "jagg/lora.safetensors"):
        assert (out / name).exists(), name
    assert "kept" in capsys.readouterr().out
