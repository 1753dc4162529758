"""The mini SD3 as the lab uses it: its checker against rendered ground truth, the pipeline
lab/mini_sd3_pipeline.py builds and pretrains, its rewards through lab/sd_runner.py --reward
lab.mini_sd3:NAME, the presets, and the comparison of separately trained runs
(lab/compare_runs.py) with their redrawn evaluations (lab/eval_noise.py)."""

import json
import os
import random

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("diffusers", reason="the optional extra: pip install -e '.[sd]'")

import compare_runs  # noqa: E402
import eval_noise  # noqa: E402
import mini_sd3  # noqa: E402
import mini_sd3_pipeline
import presets  # noqa: E402
import sd_runner  # noqa: E402


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory):
    """The mini SD3 pipeline at its tiny size, pretrained for seconds and saved: (folder,
    history)."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("mini") / "pipe"
    pipe = mini_sd3_pipeline.build_pipeline("tiny")
    cfg = mini_sd3_pipeline.PretrainConfig(size="tiny", vae_steps=30, steps=40, batch=16, data=256,
                                           warmup=5)
    history = mini_sd3_pipeline.pretrain(pipe, cfg, log=lambda *_: None)
    pipe.save_pretrained(str(folder))
    return str(folder), history


def run_args(model, out, *extra):
    return ["--model", model, "--prompts", presets.prompts_file(model), "--out", str(out), "--num-steps", "4",
            "--window", "2", "--prompts-per-epoch", "2", "--group-size", "2", "--train-batch", "2", "--lora-rank", "4",
            "--guidance-scale", "2.0", "--clip-range", "0.2", "--lr", "1e-2", "--eval-every", "1",
            "--timestep-fraction", "1", "--steps-per-epoch", "0", "--no-global-std", "--no-ema", *extra]


def test_checker_scores_ground_truth_high_and_each_mistake_low():
    rng = random.Random(0)
    for prompts in mini_sd3.all_prompts():
        scores = [mini_sd3.score(mini_sd3.render(p, rng), p) for p in rng.choices(prompts, k=60)]
        assert sum(scores) / len(scores) > 0.9

    def mean_score(asked, drawn):
        return sum(mini_sd3.score(mini_sd3.render(drawn, rng), asked) for _ in range(20)) / 20

    assert mean_score("a red circle", "a blue circle") < 0.05  # colour
    for asked, drawn in (("a red circle", "a red square"), ("a green triangle", "a green circle"),
                         ("a blue square", "a blue triangle")):
        assert mean_score(asked, drawn) < 0.1  # shape
    assert mean_score("a red circle left of a blue square", "a red circle right of a blue square") < 0.1  # order
    assert mean_score("two yellow squares", "a yellow square") < 0.3  # count
    assert 0.3 < mean_score("a red circle left of a blue square", "a red circle left of a blue triangle") < 0.6
    blank, red = Image.new("RGB", (32, 32), mini_sd3.BACKGROUND), Image.new("RGB", (32, 32), mini_sd3.COLORS["red"])
    assert mini_sd3.score(blank, "two red circles") == 0.0
    assert mini_sd3.coverage(blank, "a red circle") == 0.0 and mini_sd3.coverage(red, "a red circle") == 1.0
    assert mini_sd3.coverage(red, "a blue circle left of a green square") == 0.0
    drawn = mini_sd3.render("a red circle left of a blue square", rng)
    assert 0.2 < mini_sd3.coverage(drawn, "a red circle left of a blue square") < 0.6
    assert mini_sd3.score_cover(drawn, "a red circle left of a blue square") == pytest.approx(
        0.5 * mini_sd3.score(drawn, "a red circle left of a blue square")
        + 0.5 * mini_sd3.coverage(drawn, "a red circle left of a blue square"))
    with pytest.raises(ValueError, match="not in the mini SD3 grammar"):
        mini_sd3.score(blank, "a photo of a cat")


def test_mini_pipeline_loads_with_three_encoders_and_pretraining_lowers_the_loss(tiny_build):
    from diffusers import StableDiffusion3Pipeline

    folder, history = tiny_build
    assert history["vae"][1] < history["vae"][0] and history["flow"][1] < history["flow"][0]
    pipe = StableDiffusion3Pipeline.from_pretrained(folder)
    assert all(m is not None for m in (pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3,
                                       pipe.tokenizer, pipe.tokenizer_2, pipe.tokenizer_3))
    assert type(pipe.text_encoder_3).__name__ == "T5EncoderModel" and pipe.scheduler.config.shift == 3.0
    prompt = "a yellow triangle left of a green square"  # every word one token for CLIP and T5
    assert len(pipe.tokenizer(prompt).input_ids) == 8 + 2 and len(pipe.tokenizer_3(prompt).input_ids) == 8 + 1
    cond, _ = sd_runner.encode(pipe, ["a red circle", "two blue squares"], "cpu")
    t5_part = cond[0][:, mini_sd3_pipeline.MAX_TOKENS:]  # [B, 16, E]: CLIP's 16 tokens come first
    assert t5_part.abs().sum() > 0 and not torch.allclose(t5_part[0], t5_part[1])


def test_the_presets_are_train_sd_flags_and_a_later_flag_wins(tiny_build):
    folder = tiny_build[0]
    mini, geneval = presets.config("mini", model=folder), presets.config("mini-geneval", "--lr", "1e-4", model=folder)
    assert (mini.reward, mini.lora_rank, mini.global_std, mini.prompts_per_epoch, mini.clip_range, mini.sigma_schedule,
            mini.steps_per_epoch, mini.ema) == ("darkness", 0, False, 4, 0.2, "linear", 0, False)
    assert (geneval.reward, geneval.lora_rank, geneval.global_std, geneval.prompts_per_epoch, geneval.train_batch,
            geneval.epochs, geneval.eval_samples, geneval.lr) == ("lab.mini_sd3:geneval_reward", 32, True, 8, 16, 12,
                                                                 96, 1e-4)
    assert sd_runner.read_prompts(mini) == mini_sd3.training_prompts()


def test_geneval_reward_trains_and_logs_strict_accuracy_per_kind(tiny_build, tmp_path):
    rows = sd_runner.main(run_args(tiny_build[0], tmp_path / "g", "--epochs", "1", "--method", "exact", "--reward",
                                  "lab.mini_sd3:geneval_reward", "--eval-samples", "48"))
    for row in rows:  # the 48 prompts in order: 12 single, 12 count, 24 relation
        assert 0 <= row["eval/strict"] <= 1 and {"eval/strict_single", "eval/strict_count", "eval/strict_relation"} <= set(row)
        assert 0 <= row["eval/reward"] <= 1
    assert rows[1]["train/grad_rows"] > 0


def test_compare_runs_and_redrawn_evaluations(tiny_build, tmp_path, capsys, monkeypatch):
    """Exact once, JAGG separately, compared by lab/compare_runs.py (the quality tables' way, once
    lab/sd_runner.py --exact-from): the summary a --method compare writes, the final reward the mean of the
    last evaluations, settings checked; then lab/eval_noise.py's independent draws of the same runs."""
    folder, out = tiny_build[0], tmp_path / "seed0"
    common = ["--epochs", "2", "--eval-samples", "6", "--reward", "lab.mini_sd3:shapes_reward"]
    sd_runner.main(run_args(folder, out / "exact", "--method", "exact", *common))
    sd_runner.main(run_args(folder, out / "jagg", "--method", "jagg", "--anchors", "shared", "--interior", "rollout",
                           "--probe-every", "1", *common))
    sd_runner.main(run_args(folder, tmp_path / "other", "--method", "jagg", *common, "--lr", "2e-2"))
    with pytest.raises(SystemExit, match=r"--lr 0.01 \(exact\), 0.02 \(jagg\)"):  # other settings: refused
        compare_runs.main([str(out / "exact"), str(tmp_path / "other"), "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="give an exact run, then a jagg run"):
        compare_runs.main([str(out / "jagg"), str(out / "exact"), "--out", str(tmp_path / "x")])
    capsys.readouterr()
    result = compare_runs.main([str(out / "exact"), str(out / "jagg"), "--out", str(out), "--final-evals", "2"])
    assert "note:" not in capsys.readouterr().out  # the redrawn final evaluations are the recorded ones
    ex = json.load(open(out / "exact" / "summary.json"))
    assert result["exact"]["final_reward"] == pytest.approx((ex["eval_curve"][1][1] + ex["eval_curve"][2][1]) / 2)
    assert result["mode"] == "jagg_shared_rollout" and result["initial_reward"] == result["jagg"]["initial_reward"]
    assert json.load(open(out / "summary.json")) == result
    assert (out / "samples.png").exists() and (out / "reward_curves.png").exists()

    with pytest.raises(SystemExit):  # a folder without a finished run: refused before any work
        eval_noise.main([str(tmp_path / "nothing"), "--draws", "2"])
    base, exact = eval_noise.main([str(out / "exact"), "--draws", "2", "--out", str(tmp_path / "noise.json")])
    assert base["model"] == base["mode"] == "base" and base["fixed_noise_eval"] == ex["eval_curve"][0][1]
    assert exact["mode"] == "exact" and exact["seed"] == ex["config"]["seed"]
    assert exact["fixed_noise_eval"] == ex["eval_curve"][-1][1]
    assert len(exact["draws"]) == 2 and json.load(open(tmp_path / "noise.json"))["models"][1]["draws"] == exact["draws"]
    # 3 draws asked of a file holding 2: only the third is drawn, equal to a fresh 3-draw run's
    calls, real_draw = [], sd_runner.draw_evaluation
    monkeypatch.setattr(sd_runner, "draw_evaluation", lambda *a, **k: calls.append(a[7]) or real_draw(*a, **k))
    _, grown = eval_noise.main([str(out / "exact"), "--draws", "3", "--out", str(tmp_path / "noise.json")])
    monkeypatch.undo()
    assert calls == [eval_noise.NOISE_SEED + 2] * 2 and grown["draws"][:2] == exact["draws"]
    [fresh] = eval_noise.main([str(out / "exact"), "--draws", "3", "--no-base"])
    assert fresh["draws"] == pytest.approx(grown["draws"], abs=1e-6)
    _, cfg, (pipe, transformer, sigmas, bf16) = compare_runs.load_run(str(out / "exact"))
    prompts = sd_runner.evaluation_prompts(cfg, sd_runner.read_prompts(cfg))
    draws = [sd_runner.draw_evaluation(pipe, transformer, prompts, cfg, sigmas, lambda ims, ps: [0.0] * len(ims), bf16,
                                      seed)[0] for seed in (sd_runner.evaluation_seed(cfg), eval_noise.NOISE_SEED, eval_noise.NOISE_SEED + 1)]
    pixels = [torch.tensor(np.stack([np.asarray(im) for im in images]), dtype=torch.float32) for images in draws]
    assert not torch.equal(pixels[1], pixels[2]) and not torch.equal(pixels[0], pixels[1])  # independent noise


def test_mini_quality_refuses_bad_settings_before_any_run(tmp_path):
    import subprocess

    for env, message in (({"TABLE": "windows"}, "TABLE must be retention or window, got 'windows'"),
                         ({"TABLE": "window", "WINDOW": "0"}, "WINDOW must be a whole number above 0, got '0'"),
                         ({"TABLE": "window", "WINDOW": "4", "WINDOW_RANGE_END": "3"},
                          "WINDOW_RANGE_END (3) must be at least WINDOW (4)"),
                         ({"TABLE": "window", "LR_CONTROL": "fast"}, "LR_CONTROL must be a learning rate above 0")):
        done = subprocess.run(["bash", os.path.join(os.path.dirname(compare_runs.__file__), "mini_quality.sh"),
                               "darkness", str(tmp_path / "table")], env={**os.environ, **env}, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 1 and message in done.stdout
        assert not (tmp_path / "table").exists()
