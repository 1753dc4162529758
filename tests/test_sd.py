"""train_sd.py end to end on mini_sd3.py's pipeline at a tiny size, built and pretrained in code
(no weights are downloaded): SD3.5's three-encoder path, the real loading code, rollouts, the
shapes reward, JAGG and exact training, compare mode, checkpoint and resume; and the mini task's
checker against rendered ground truth."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

diffusers = pytest.importorskip("diffusers", reason="the optional extra: pip install -e '.[sd]'")
pytest.importorskip("peft", reason="the optional extra: pip install -e '.[sd]'")

import common  # noqa: E402
import jagg  # noqa: E402
import jagg_options  # noqa: E402
import mini_sd3  # noqa: E402
import train_sd  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def tiny_build(tmp_path_factory):
    """mini_sd3.py's pipeline at its tiny size (three text encoders, VAE, MMDiT-X transformer),
    pretrained for seconds and saved with save_pretrained: (folder, pretraining history)."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny_sd3")
    pipe = mini_sd3.build_pipeline("tiny")
    history = mini_sd3.pretrain(pipe, mini_sd3.PretrainConfig(size="tiny", vae_steps=30, steps=40, batch=16, data=256,
                                                              warmup=5), log=lambda *_: None)
    pipe.save_pretrained(str(folder / "pipe"))
    return str(folder / "pipe"), history


@pytest.fixture(scope="session")
def tiny_sd3(tiny_build):
    return tiny_build[0]


# Every step trained, one optimizer step per micro-batch, every sample, per-group std, no EMA: the
# tests below check one feature at a time on that; test_flow_grpo_defaults checks Flow-GRPO's.
PLAIN = ["--timestep-fraction", "1", "--steps-per-epoch", "0", "--no-drop-zero-advantage", "--no-global-std", "--no-ema"]


def run_args(model, out, *extra, plain=True):
    return ["--model", model, "--out", str(out), "--resolution", "16", "--num-steps", "4", "--window", "2",
            "--prompts-per-epoch", "2", "--group-size", "2", "--rollout-batch", "4", "--train-batch", "2",
            "--lora-rank", "4", "--lora-alpha", "4", "--guidance-scale", "2.0", "--clip-range", "0.2",
            "--lr", "1e-2", "--eval-every", "1", "--save-every", "1", "--device", "cpu", *(PLAIN if plain else []), *extra]


def test_train_jagg_then_resume_and_exact(tiny_sd3, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "jagg"
    rows = train_sd.main(run_args(tiny_sd3, out, "--epochs", "1", "--method", "jagg", "--probe-every", "1",
                                  "--window", "3"))
    # An evaluation before training (epoch 0), then the epoch's training and evaluation.
    assert [r["epoch"] for r in rows] == [0, 1] and "eval/reward" in rows[0] and "eval/reward" in rows[1]
    assert rows[1]["train/routed_frac"] == 1.0  # of the windows JAGG may take: the 1-step one is always exact
    assert len(rows[1]["probe/grad_cosine"]) == 2
    assert len(rows[1]["probe/error_to_noise"]) == 2 and rows[1]["probe/error_to_noise"][1] == 0  # the 1-step window
    # T = 4, W = 3: JAGG runs 2 steps with grad on the 3-step window, exact 1 on the 1-step one; 2 minibatches.
    assert rows[1]["train/grad_rows"] == (2 + 1) * 2
    for name in ("metrics.jsonl", "samples_0000.png", "samples_0001.png", "lora.safetensors", "config.json",
                 "checkpoint/weights.safetensors", "checkpoint/optimizer.pt", "checkpoint/state.json"):
        assert (out / name).exists(), name
    lora = load_file(out / "lora.safetensors")
    assert lora and all("lora" in k for k in lora)
    # LoRA's B matrices start at zero: after training they are not.
    assert any(v.abs().sum() > 0 for k, v in lora.items() if "lora_B" in k)

    rows = train_sd.main(run_args(tiny_sd3, out, "--epochs", "2", "--method", "jagg", "--window", "3", "--resume", str(out)))
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    assert json.load(open(out / "checkpoint" / "state.json"))["epoch"] == 2
    lora2 = load_file(out / "lora.safetensors")
    assert any(not torch.equal(lora[k], lora2[k]) for k in lora)
    assert [json.loads(line)["epoch"] for line in open(out / "metrics.jsonl")] == [0, 1, 2]

    rows = train_sd.main(run_args(tiny_sd3, tmp_path / "exact", "--epochs", "1", "--method", "exact", "--beta", "0.1"))
    assert rows[1]["train/routed_frac"] == 0.0 and rows[1]["train/grad_rows"] == 2 * 4
    assert rows[1]["train/kl"] >= 0.0

    # Resuming with a setting the checkpoint's weights depend on is refused up front, naming both values.
    for flags, message in ((["--lora-rank", "8"], "trained with --lora-rank 4, this run asks for --lora-rank 8"),
                           (["--full-finetune"], "trained with --no-full-finetune, this run asks for --full-finetune")):
        with pytest.raises(SystemExit, match=message):
            train_sd.main(run_args(tiny_sd3, out, "--epochs", "3", "--resume", str(out), *flags))
    assert json.load(open(out / "checkpoint" / "state.json"))["epoch"] == 2


def test_shared_anchors_rollout_interiors_and_probe_routing(tiny_sd3, tmp_path):
    """T = 5, W = 3 with shared anchors: segments 0-2 and 2-4; the probe (before training, every
    epoch) routes the better one to JAGG at --jagg-frac 0.5, and a resumed run keeps its average."""
    out = tmp_path / "run"
    args = ["--num-steps", "5", "--window", "3", "--anchors", "shared", "--interior", "rollout", "--route", "probe",
            "--probe-every", "1", "--jagg-frac", "0.5", "--beta", "0.1", "--max-graph-rows", "2"]
    rows = train_sd.main(run_args(tiny_sd3, out, "--epochs", "1", *args))
    row = rows[1]
    assert row["mode"] == "jagg_shared_rollout" and len(row["probe/grad_cosine"]) == 2
    assert row["time/probe_seconds"] > 0 and row["train/skipped_steps"] == 0
    # Both 3-step segments have an interior step, so neither is exact (cosine below 1).
    cosines = row["probe/grad_cosine"]
    assert max(cosines) < 1.0 - 1e-9 and cosines[0] != cosines[1]
    assert row["routing/routed"] == [c == max(cosines) for c in cosines]
    # Rows with grad per optimizer step: the interpolated segment's 2 anchors, the other segment's 2 steps
    # that are not the shared anchor, exact; 2 optimizer steps.
    assert row["train/grad_rows"] == 2 * 4
    state = json.load(open(out / "checkpoint" / "state.json"))
    assert state["probe_average"] == row["probe/grad_cosine"] and state["config"]["anchors"] == "shared"


def test_resumed_run_equals_uninterrupted_run(tiny_sd3, tmp_path):
    from safetensors.torch import load_file

    straight = train_sd.main(run_args(tiny_sd3, tmp_path / "a", "--epochs", "2"))
    train_sd.main(run_args(tiny_sd3, tmp_path / "b", "--epochs", "1"))
    resumed = train_sd.main(run_args(tiny_sd3, tmp_path / "b", "--epochs", "2", "--resume", str(tmp_path / "b")))
    assert straight[2]["rollout/reward_mean"] == pytest.approx(resumed[2]["rollout/reward_mean"], rel=1e-6)
    assert straight[2]["eval/reward"] == pytest.approx(resumed[2]["eval/reward"], rel=1e-6)
    a, b = load_file(tmp_path / "a" / "lora.safetensors"), load_file(tmp_path / "b" / "lora.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_full_finetune_with_ema_prompt_file_and_pickscore(tiny_sd3, tmp_path):
    """The other options: full fine-tuning (a frozen copy as KL reference), EMA weights, prompts
    from a file, and the PickScore reward with a tiny CLIP model saved here."""
    from safetensors.torch import load_file
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    clip_dir = tmp_path / "clip"
    config = CLIPConfig(text_config=dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_hidden_layers=1,
                                         vocab_size=200, max_position_embeddings=77, bos_token_id=0, eos_token_id=1,
                                         pad_token_id=1),
                        vision_config=dict(hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                           num_hidden_layers=1, image_size=32, patch_size=8),
                        projection_dim=16)
    CLIPModel(config).save_pretrained(clip_dir)
    processor = CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size=32),
                              tokenizer=mini_sd3.build_tokenizers()[0])
    processor.save_pretrained(clip_dir)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\n\na blue dog\n")
    out = tmp_path / "full"
    rows = train_sd.main(run_args(tiny_sd3, out, "--epochs", "1", "--full-finetune", "--ema", "--ema-decay", "0.5", "--ema-every", "1",
                                  "--prompts", str(prompts), "--reward", "pickscore", "--reward-model", str(clip_dir),
                                  "--beta", "0.1"))
    assert rows[1]["train/kl"] >= 0 and abs(rows[1]["rollout/reward_mean"]) > 0
    weights = load_file(out / "transformer.safetensors")  # the EMA of all transformer weights
    assert not any("lora" in k for k in weights) and len(weights) > 20
    assert (out / "checkpoint" / "ema.safetensors").exists()
    trained = load_file(out / "checkpoint" / "weights.safetensors")
    assert any(not torch.equal(weights[k], trained[k]) for k in weights)  # EMA lags the trained weights


def test_flow_grpo_defaults(tiny_sd3, tmp_path):
    """Without flags, what Flow-GRPO's geneval_sd3 trains: the first int(T x 0.99) steps (3 of 4
    here), 2 optimizer steps per epoch accumulating micro-batches, global std, an EMA."""
    cfg = train_sd.Config()
    assert (cfg.timestep_fraction, cfg.steps_per_epoch, cfg.global_std, cfg.drop_zero_advantage, cfg.ema, cfg.lr,
            cfg.clip_range, cfg.beta, cfg.guidance_scale) == (0.99, 2, True, True, True, 3e-4, 1e-4, 0.04, 4.5)
    out = tmp_path / "run"
    rows = train_sd.main(run_args(tiny_sd3, out, "--epochs", "1", "--method", "exact", "--prompts-per-epoch", "4",
                                  "--train-batch", "2", plain=False))
    row = rows[1]
    # 8 samples, none with a zero advantage (continuous rewards), in 2 steps of 2 micro-batches of 2;
    # each micro-batch back-propagates its 3 trained steps: 4 x 3 rows.
    assert row["train/samples"] == 8 and row["train/grad_rows"] == 4 * 3
    assert (out / "checkpoint" / "ema.safetensors").exists()


def test_presets_set_the_documented_settings_and_flags_still_win():
    """--preset mini is the darkness tables' setting; mini-geneval is it with what exact GRPO needed
    to raise geneval (docs/mini_sd3.md); a flag on the command line wins over either."""
    parse = lambda *argv: common.parse_config(train_sd.Config, list(argv), presets=train_sd.PRESETS)  # noqa: E731
    mini, geneval = parse("--preset", "mini"), parse("--preset", "mini-geneval")
    assert (mini.model, mini.reward, mini.full_finetune, mini.global_std, mini.prompts_per_epoch, mini.clip_range) == (
        "mini", "darkness", True, False, 4, 0.2)
    assert (geneval.model, geneval.reward, geneval.full_finetune, geneval.global_std, geneval.prompts_per_epoch,
            geneval.train_batch, geneval.epochs, geneval.eval_samples) == ("mini", "geneval", False, True, 8, 16, 12, 96)
    same = [f.name for f in dataclasses.fields(train_sd.Config) if getattr(mini, f.name) == getattr(geneval, f.name)]
    assert "guidance_scale" in same and "lr" in same and "timestep_fraction" in same  # the rest is the mini's
    assert parse("--preset", "mini-geneval", "--lr", "1e-4", "--full-finetune").lr == 1e-4
    assert parse("--preset", "mini-geneval", "--full-finetune").full_finetune is True
    assert parse().model == train_sd.Config().model  # no preset: Flow-GRPO's defaults


def test_optimizer_steps_drop_zero_advantages_as_flow_grpo():
    """Zero-advantage samples are dropped, dropped ones put back until the count divides into the
    steps; each step's samples in micro-batches of --train-batch; --steps-per-epoch 0: one step
    per micro-batch, as many as all samples would fill."""
    adv = torch.tensor([0.5, 0.0, -0.5, 0.0, 1.0, 0.0, 0.0, -1.0, 0.2, 0.0])
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    cfg = train_sd.Config(steps_per_epoch=2, train_batch=2)
    steps = train_sd.optimizer_steps(perm, adv, cfg, g)
    used = torch.cat([i for micro in steps for i in micro])
    assert len(steps) == 2 and all(len(i) <= 2 for micro in steps for i in micro)
    assert set(torch.nonzero(adv).flatten().tolist()) <= set(used.tolist())  # every informative sample trains
    assert len(used) == 6 and len(set(used.tolist())) == 6  # 5 nonzero, topped up by one to divide into 2 steps
    assert [sum(len(i) for i in micro) for micro in steps] == [3, 3]
    keep_all = train_sd.optimizer_steps(perm, adv, dataclasses.replace(cfg, drop_zero_advantage=False), g)
    assert sorted(torch.cat([i for m in keep_all for i in m]).tolist()) == list(range(10))
    old = train_sd.optimizer_steps(perm, adv, dataclasses.replace(cfg, steps_per_epoch=0, drop_zero_advantage=False), g)
    assert [m[0].tolist() for m in old] == [i.tolist() for i in perm.split(2)]  # one step per micro-batch, in order
    sparse = train_sd.optimizer_steps(perm, adv, dataclasses.replace(cfg, steps_per_epoch=0), g)
    assert len(sparse) == 5 and sum(len(m) for m in sparse) == 3  # 5 informative samples: 3 steps, 2 left empty


@pytest.mark.parametrize("mode", [(), ("--window", "3", "--anchors", "shared", "--interior", "rollout",
                                      "--max-graph-rows", "2")], ids=["paper", "shared-rollout-rows2"])
def test_torchrun_two_ranks_share_groups_and_stay_in_sync(tiny_sd3, tmp_path, mode):
    # shared-rollout-rows2: anchors 0, 2, 3 back-propagated one chunk at a time, the next chunk's
    # forward before this chunk's backward (the path DDP's own all-reduce cannot follow).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train_sd.py",
           *run_args(tiny_sd3, tmp_path, "--epochs", "1", "--group-size", "1", "--train-batch", "1", *mode)]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")][1]  # epoch 1 (0 is the first eval)
    a, b = row["train/param_checksums"]
    assert a == b  # bit for bit: both ranks sum identical parameters in the same order
    # One sample per prompt per rank: groups exist only across ranks, so a nonzero loss
    # gradient (a changed LoRA) shows the advantages were computed on the gathered rewards.
    from safetensors.torch import load_file

    assert any(v.abs().sum() > 0 for k, v in load_file(tmp_path / "lora.safetensors").items() if "lora_B" in k)


def test_jagg_on_sd3_transformer_equals_endpoint_interpolation(tiny_sd3):
    """JAGG's one backward equals sum_k [(1-alpha_k) g_k^T J_a + alpha_k g_k^T J_b] computed with
    2W separate vector-Jacobian products, on the real SD3 transformer; its cosine to exact is < 1."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    transformer = SD3Transformer2DModel.from_pretrained(tiny_sd3, subfolder="transformer").double()
    params = list(transformer.parameters())
    W, B, tc = 4, 2, transformer.config
    cond = (torch.randn(B, 5, tc.joint_attention_dim, dtype=torch.float64), torch.randn(B, tc.pooled_projection_dim, dtype=torch.float64))
    uncond = (torch.zeros_like(cond[0]), torch.zeros_like(cond[1]))
    velocity_fn = train_sd.make_velocity_fn(transformer, cond, uncond, 3.0, use_bf16=False)
    sigmas = jagg.sigma_schedule(8, 3.0).double()
    traj = jagg.rollout(velocity_fn, torch.randn(B, 4, 8, 8, dtype=torch.float64), sigmas, 0.7)
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    a, b = 2, 2 + W
    z, t = traj.z[a:b], traj.t[a:b]

    def flat():
        return torch.cat([p.grad.flatten() for p in params])

    transformer.zero_grad(set_to_none=True)
    jagg_options.backward_jagg(velocity_fn, z, t, jagg.make_step_loss(traj, adv, a, b, cfg))
    g_jagg = flat()

    # The reference: each step's upstream gradient, sent through each endpoint separately.
    step_loss = jagg.make_step_loss(traj, adv, a, b, cfg)
    alpha = jagg.interpolation_weights(t)  # [W, B]
    expected = torch.zeros_like(g_jagg)
    for k in range(W):
        with torch.no_grad():
            v_k = velocity_fn(z[k : k + 1], t[k : k + 1])[0]
        v_k.requires_grad_(True)
        (g_k,) = torch.autograd.grad(step_loss(k, v_k), v_k)  # [B, C, H, W]
        for end, weight in ((0, 1 - alpha[k]), (W - 1, alpha[k])):
            transformer.zero_grad(set_to_none=True)
            v_end = velocity_fn(z[end : end + 1], t[end : end + 1])[0]
            (v_end * weight[:, None, None, None] * g_k).sum().backward()
            expected += flat()
    torch.testing.assert_close(g_jagg, expected, rtol=1e-7, atol=1e-10)

    transformer.zero_grad(set_to_none=True)
    jagg.backward_exact(velocity_fn, z, t, jagg.make_step_loss(traj, adv, a, b, cfg))
    cos = torch.nn.functional.cosine_similarity(g_jagg, flat(), dim=0).item()
    print(f"tiny SD3 transformer, W = {W}: cosine(JAGG, exact) = {cos:.4f}")
    assert 0.0 < cos < 1.0 - 1e-9


def test_cfg_grad_both_is_the_derivative_of_the_guided_velocity(tiny_sd3):
    """--cfg-grad both: the gradient of <v, u> with v = v_u + s (v_c - v_u) equals its finite
    difference along a random direction of the weights (the true derivative); cond alone differs
    from it and equals s times the conditional branch's own gradient."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    transformer = SD3Transformer2DModel.from_pretrained(tiny_sd3, subfolder="transformer").double()
    params = list(transformer.parameters())
    B, tc, s = 2, transformer.config, 3.0
    cond = (torch.randn(B, 5, tc.joint_attention_dim, dtype=torch.float64), torch.randn(B, tc.pooled_projection_dim, dtype=torch.float64))
    uncond = (torch.zeros_like(cond[0]), torch.zeros_like(cond[1]))
    z, t = torch.randn(1, B, 4, 8, 8, dtype=torch.float64), torch.full((1, B), 0.6, dtype=torch.float64)
    u = torch.randn_like(z)

    def grad_of(uncond_grad, scale=s, un=uncond):
        transformer.zero_grad(set_to_none=True)
        (train_sd.make_velocity_fn(transformer, cond, un, scale, False, uncond_grad)(z, t) * u).sum().backward()
        return torch.cat([p.grad.flatten() for p in params])

    both, cond_only = grad_of(True), grad_of(False)
    direction = [torch.randn_like(p) for p in params]
    eps = 1e-4  # the value has round-off near 1e-9 (float32 timestep embeddings): not smaller

    def value(sign):
        with torch.no_grad():
            for p, d in zip(params, direction):
                p.add_(sign * eps * d)
            out = (train_sd.make_velocity_fn(transformer, cond, uncond, s, False)(z, t) * u).sum().item()
            for p, d in zip(params, direction):
                p.sub_(sign * eps * d)
        return out

    finite_difference = (value(1) - value(-1)) / (2 * eps)
    flat_direction = torch.cat([d.flatten() for d in direction])
    assert torch.dot(both, flat_direction).item() == pytest.approx(finite_difference, rel=1e-3)
    assert abs(torch.dot(cond_only, flat_direction).item() - finite_difference) > 0.05 * abs(finite_difference)
    torch.testing.assert_close(cond_only, s * grad_of(False, scale=1.0, un=None))


def test_benchmark_json_has_the_keys(tmp_path):
    proc = subprocess.run([sys.executable, "train_sd.py", "--benchmark", "--random-init", "--bench-size", "tiny",
                           "--window", "4", "--bench-repeats", "1", "--json", "--out", str(tmp_path / "bench")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("window", "params", "device", "exact_backward_s", "jagg_backward_s", "backward_speedup",
                "exact_step_s", "jagg_step_s", "step_speedup", "num_steps", "guidance_scale", "beta", "rollout_s"):
        assert key in result, key
    assert result["window"] == 4 and result["device"] == "cpu" and result["params"] > 0
    assert result["jagg_fwd_nograd_s"] > 0 and result["gradient_checkpointing"] is False
    assert (result["num_steps"], result["guidance_scale"], result["beta"]) == (10, 4.5, 0.04)  # Flow-GRPO's setting
    modes = {"exact", "jagg", "jagg_shared", "jagg_rollout", "jagg_shared_rollout"}
    for key in ("train_s", "train_speedup", "epoch_speedup", "backward_rows"):
        assert set(result[key]) == modes, key
    # Flow-GRPO's 9 trained steps of 10: windows 0-3, 4-7, 8 (2 + 2 + 1 rows), shared anchors 0, 3, 6, 8.
    assert result["trained_steps"] == 9
    assert result["backward_rows"] == {"exact": 9, "jagg": 5, "jagg_shared": 4, "jagg_rollout": 5, "jagg_shared_rollout": 4}
    for m in modes:
        assert result["epoch_speedup"][m] == pytest.approx(
            (result["rollout_s"] + result["train_s"]["exact"]) / (result["rollout_s"] + result["train_s"][m]))
        # With beta > 0 every mode runs the reference model; with rollout interiors on the anchors only.
        assert result["train_parts_s"][m]["fwd_ref"] > 0
    assert "peak_mem_gb" not in result  # CUDA only
    saved = json.load(open(tmp_path / "bench" / "benchmark.json"))
    assert saved["result"] == result and (tmp_path / "bench" / "benchmark.png").stat().st_size > 1000


def test_benchmark_on_a_saved_model(tiny_sd3, tmp_path, capsys):
    result = train_sd.main(["--benchmark", "--model", tiny_sd3, "--resolution", "64", "--window", "3",
                            "--bench-repeats", "1", "--device", "cpu", "--num-steps", "4", "--out", str(tmp_path)])
    assert result["config"] == tiny_sd3 and result["window"] == 3 and result["tokens"] == (64 // 8 // 2) ** 2 + 77
    assert "whole window-gradient speedup" in capsys.readouterr().out
    # T = 4 at Flow-GRPO's timestep fraction 0.99: steps 0-2 trained; W = 3: one window, anchors 0 and 2.
    assert result["num_steps"] == 4 and result["trained_steps"] == 3
    assert result["backward_rows"] == {"exact": 3, "jagg": 2, "jagg_rollout": 2, "jagg_shared": 2, "jagg_shared_rollout": 2}


@pytest.mark.parametrize("extra, message", [
    (["--model", "/nonexistent/sd3"], "is not a directory"),
    (["--window", "5"], "longer than the 4 trained steps"),
    (["--timestep-fraction", "0.2"], "train at least one of the --num-steps 4 steps"),
    (["--reward", "pickscore"], "needs --reward-model"),
    (["--prompts", "EMPTY"], "has no prompts"),
    (["--prompts", "/nonexistent/prompts.txt"], "does not exist"),
    (["--resume", "/nonexistent/run"], "holds no checkpoint"),
    (["--out", "/proc/x"], "cannot be created or written to"),
    (["--route", "probe"], "--route probe routes by the probe's measurements"),
    (["--anchors", "shared", "--probe-decay", "1.0"], r"--probe-decay must be in \[0, 1\)"),
    (["--interior", "rollout", "--max-graph-rows", "1"], "--max-graph-rows must be 0 \\(no bound\\) or >= 2 with --interior rollout"),
])
def test_bad_input_fails_before_any_work(tiny_sd3, tmp_path, extra, message):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    extra = [str(empty) if e == "EMPTY" else e for e in extra]
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=message):
        train_sd.main(run_args(tiny_sd3, out, *extra))
    assert not out.exists()


def test_unknown_reward_is_rejected_with_the_choices(tiny_sd3, tmp_path):
    proc = subprocess.run([sys.executable, "train_sd.py", *run_args(tiny_sd3, tmp_path / "out", "--reward", "aesthetic")],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice: 'aesthetic'" in proc.stderr and "jpeg_compressibility" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_help_documents_every_flag():
    proc = subprocess.run([sys.executable, "train_sd.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0
    for f in dataclasses.fields(train_sd.Config):
        assert "--" + f.name.replace("_", "-") in proc.stdout


def test_ema_weights_are_swapped_in_and_restored():
    model = torch.nn.Linear(2, 2)
    model.bias.requires_grad_(False)
    trained = model.weight.detach().clone()
    ema = {"weight": torch.zeros(2, 2)}
    with train_sd.ema_weights(model, ema):
        assert torch.equal(model.weight, torch.zeros(2, 2))
    assert torch.equal(model.weight, trained)
    with train_sd.ema_weights(model, None):
        assert torch.equal(model.weight, trained)


# ------------------------------------------------------------------ the mini SD3: task, checker, builder


def test_checker_scores_ground_truth_high_and_each_mistake_low():
    import random

    rng = random.Random(0)
    single, count, relation = mini_sd3.all_prompts()
    for prompts in (single, count, relation):
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
    # One of two objects wrong: half credit, GenEval's all-or-nothing made graded.
    assert 0.3 < mean_score("a red circle left of a blue square", "a red circle left of a blue triangle") < 0.6
    blank = Image.new("RGB", (32, 32), mini_sd3.BACKGROUND)
    assert mini_sd3.score(blank, "two red circles") == 0.0
    # shapes_cover: half the score, half how much of the image the asked colours cover (full at COVER)
    red = Image.new("RGB", (32, 32), mini_sd3.COLORS["red"])
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
    # Every word of the grammar is one token for CLIP and for T5 (bos/eos aside): prompts are read, not spelled.
    prompt = "a yellow triangle left of a green square"
    assert len(pipe.tokenizer(prompt).input_ids) == 8 + 2 and len(pipe.tokenizer_3(prompt).input_ids) == 8 + 1
    # The T5 half of the embeddings carries the prompt (a T5-less pipeline would give zeros there).
    cond, _ = train_sd.encode(pipe, ["a red circle", "two blue squares"], "cpu")
    t5_part = cond[0][:, mini_sd3.MAX_TOKENS:]  # [B, 16, E]: CLIP's 16 tokens come first
    assert t5_part.abs().sum() > 0 and not torch.allclose(t5_part[0], t5_part[1])


def test_geneval_reward_trains_and_logs_strict_accuracy_per_kind(tiny_sd3, tmp_path):
    rows = train_sd.main(run_args(tiny_sd3, tmp_path / "g", "--epochs", "1", "--method", "exact", "--reward", "geneval",
                                  "--eval-samples", "48"))
    for row in rows:  # the 48 prompts in order: 12 single, 12 count, 24 relation
        assert 0 <= row["eval/strict"] <= 1 and {"eval/strict_single", "eval/strict_count", "eval/strict_relation"} <= set(row)
        assert 0 <= row["eval/reward"] <= 1
    assert rows[1]["train/grad_rows"] > 0


def test_compare_trains_both_from_one_model_and_summarises(tiny_sd3, tmp_path, capsys, monkeypatch):
    out = tmp_path / "cmp"
    comparison = train_sd.main(run_args(tiny_sd3, out, "--epochs", "2", "--method", "compare", "--probe-every", "1",
                                        "--anchors", "shared", "--interior", "rollout", "--eval-samples", "6",
                                        "--final-evals", "2", "--lr-schedule", "cosine", "--reward", "shapes",
                                        "--weights", "index"))
    for key in ("mode", "initial_reward", "final_reward", "reward_gain", "reward_gain_ratio", "train_speedup",
                "backward_speedup"):
        assert key in comparison, key
    assert comparison["mode"] == "jagg_shared_rollout" and comparison["weights"] == "index"
    assert set(comparison["final_reward"]) == set(comparison["reward_gain"]) == {"exact", "jagg"}
    saved = json.load(open(out / "summary.json"))
    assert saved["jagg"]["probe_cosine_by_position"] and len(saved["jagg"]["probe_cosine_by_position"]) == 3  # anchors 0, 1, 2, 3
    ex = saved["exact"]
    # final: the mean of the last two evaluations after training started (epochs 1 and 2)
    assert ex["final_reward"] == pytest.approx((ex["eval_curve"][1][1] + ex["eval_curve"][2][1]) / 2)
    assert ex["initial_reward"] == saved["jagg"]["initial_reward"]  # same model, same evaluation noise
    # each epoch's training time, for reward against wall-clock (summarize.py wallclock)
    assert len(ex["epoch_seconds"]) == 2 and sum(ex["epoch_seconds"]) == pytest.approx(ex["train_seconds"])
    for name in ("reward_curves.png", "samples.png", "exact/metrics.jsonl", "jagg/metrics.jsonl", "exact/summary.json",
                 "jagg/lora.safetensors"):
        assert (out / name).exists(), name
    rows = [json.loads(line) for line in open(out / "exact" / "metrics.jsonl")]
    assert rows[1]["train/lr"] == pytest.approx(1e-2) and rows[2]["train/lr"] == pytest.approx(0.5e-2)

    # --exact-from: the paper's mode against the same exact run, not trained again. Its final
    # evaluation, redrawn from the saved weights, is the one the run recorded (no note printed).
    again = tmp_path / "cmp_paper"
    args = run_args(tiny_sd3, again, "--epochs", "2", "--method", "compare", "--eval-samples", "6", "--final-evals", "2",
                    "--lr-schedule", "cosine", "--reward", "shapes", "--exact-from", str(out / "exact"))
    with pytest.raises(SystemExit, match=r"--lr 0.01 there, 0.02 here"):  # other settings: refused before any work
        train_sd.main([*args, "--lr", "2e-2"])
    with pytest.raises(SystemExit, match=r"is a 'jagg' run"):
        train_sd.main([*args[:-1], str(out / "jagg")])
    assert not again.exists()
    capsys.readouterr()
    paper = train_sd.main(args)
    assert "note:" not in capsys.readouterr().out
    assert paper["mode"] == "jagg" and not (again / "exact").exists()
    assert paper["exact"] == ex and paper["reward_gain"]["exact"] == comparison["reward_gain"]["exact"]
    assert (again / "samples.png").exists() and (again / "jagg" / "summary.json").exists()

    # --resume a compare with --exact-from (how a finished table is trained longer): JAGG stopped
    # after epoch 1, then continued to 2, is the uninterrupted JAGG above; the base is redrawn.
    resumed = tmp_path / "cmp_resumed"
    train_sd.main(run_args(tiny_sd3, resumed / "jagg", "--epochs", "1", "--method", "jagg", "--eval-samples", "6",
                           "--final-evals", "2", "--lr-schedule", "cosine", "--reward", "shapes"))
    with pytest.raises(SystemExit, match=r"holds no checkpoint \(expected .*cmp_paper.jagg.jagg/checkpoint"):
        train_sd.main([*args, "--resume", str(again / "jagg")])  # the compare's folder, not its jagg/
    capsys.readouterr()
    cont = train_sd.main([*args[:3], str(resumed), *args[4:], "--resume", str(resumed)])
    assert "note:" not in capsys.readouterr().out
    assert cont["exact"] == ex and [e for e, _ in cont["jagg"]["eval_curve"]] == [0, 1, 2]
    for (_, a), (_, b) in zip(cont["jagg"]["eval_curve"], paper["jagg"]["eval_curve"]):
        assert a == pytest.approx(b, rel=1e-5)
    assert cont["reward_gain"]["jagg"] == pytest.approx(paper["reward_gain"]["jagg"], rel=1e-4, abs=1e-6)
    assert (resumed / "samples.png").exists()

    # tools/eval_noise.py on the same runs: each draw its own noise, the base model first, the
    # fixed-noise evaluations the runs recorded beside them, the draws written out.
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
    import eval_noise

    with pytest.raises(SystemExit):  # a folder without a finished run: refused before any work
        eval_noise.main([str(tmp_path / "nothing"), "--draws", "2"])
    base, exact = eval_noise.main([str(out / "exact"), "--draws", "2", "--out", str(tmp_path / "noise.json")])
    assert base["model"] == base["mode"] == "base" and base["fixed_noise_eval"] == ex["eval_curve"][0][1]
    assert exact["mode"] == "exact" and exact["seed"] == ex["config"]["seed"]  # what summarize.py paired pairs by
    assert exact["fixed_noise_eval"] == ex["eval_curve"][-1][1]
    assert len(exact["draws"]) == 2 and json.load(open(tmp_path / "noise.json"))["models"][1]["draws"] == exact["draws"]
    # the same --out asked for 3 draws keeps the 2 it holds and draws only the third, which equals
    # a fresh 3-draw run's (draw k's noise is NOISE_SEED + k)
    calls = []
    real_draw = train_sd.draw_evaluation
    monkeypatch.setattr(train_sd, "draw_evaluation", lambda *a, **k: calls.append(k["noise_seed"]) or real_draw(*a, **k))
    _, grown = eval_noise.main([str(out / "exact"), "--draws", "3", "--out", str(tmp_path / "noise.json")])
    monkeypatch.undo()
    assert calls == [eval_noise.NOISE_SEED + 2] * 2 and grown["draws"][:2] == exact["draws"]
    [fresh] = eval_noise.main([str(out / "exact"), "--draws", "3", "--no-base"])
    assert fresh["draws"] == pytest.approx(grown["draws"], abs=1e-6)
    # --noise-seed N: draw k uses N + k; a file drawn with another noise seed is drawn again
    calls.clear()
    monkeypatch.setattr(train_sd, "draw_evaluation", lambda *a, **k: calls.append(k["noise_seed"]) or real_draw(*a, **k))
    eval_noise.main([str(out / "exact"), "--draws", "2", "--no-base", "--noise-seed", "5", "--out",
                     str(tmp_path / "noise.json")])
    monkeypatch.undo()
    assert calls == [5, 6] and json.load(open(tmp_path / "noise.json"))["noise_seed"] == 5
    # draws of a model whose final evaluation has changed since (trained on in place) are drawn again
    stale = json.load(open(tmp_path / "noise.json"))
    stale["models"][0]["fixed_noise_eval"] += 1.0
    (tmp_path / "noise.json").write_text(json.dumps(stale))
    calls.clear()
    monkeypatch.setattr(train_sd, "draw_evaluation", lambda *a, **k: calls.append(k["noise_seed"]) or real_draw(*a, **k))
    eval_noise.main([str(out / "exact"), "--draws", "2", "--no-base", "--noise-seed", "5", "--out",
                     str(tmp_path / "noise.json")])
    monkeypatch.undo()
    assert calls == [5, 6]
    _, run_cfg, (pipe, transformer, sigmas, bf16) = train_sd.load_run(str(out / "exact"))
    prompts = train_sd.evaluation_prompts(run_cfg, train_sd.default_prompts(run_cfg))
    draws = [train_sd.draw_evaluation(pipe, transformer, prompts, run_cfg, sigmas, lambda ims, ps: torch.zeros(len(ims)),
                                      bf16, noise_seed)[0] for noise_seed in (None, eval_noise.NOISE_SEED, eval_noise.NOISE_SEED + 1)]
    pixels = [torch.tensor(np.stack([np.asarray(im) for im in images]), dtype=torch.float32) for images in draws]
    assert not torch.equal(pixels[1], pixels[2]) and not torch.equal(pixels[0], pixels[1])  # independent noise per draw


@pytest.mark.parametrize("extra, message", [
    (["--prompts", "CAT", "--reward", "shapes"], "not in the mini SD3 grammar"),
    (["--method", "compare", "--resume", "RUN"], "--method compare trains both methods from the start"),
    (["--eval-samples", "0"], "--eval-samples must be >= 1"),
])
def test_mini_flags_fail_before_any_work(tiny_sd3, tmp_path, extra, message):
    cat = tmp_path / "cat.txt"
    cat.write_text("a red circle\na photo of a cat\n")
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    (run / "checkpoint" / "state.json").write_text("{}")
    extra = [str(cat) if e == "CAT" else str(run) if e == "RUN" else e for e in extra]
    with pytest.raises(SystemExit, match=message):
        train_sd.main(run_args(tiny_sd3, tmp_path / "out", *extra))
    assert not (tmp_path / "out").exists()


def test_benchmark_with_a_bound_on_graph_rows_reports_saved_memory(tmp_path, capsys):
    result = train_sd.main(["--benchmark", "--random-init", "--bench-size", "tiny", "--window", "4", "--bench-repeats", "1",
                            "--max-graph-rows", "2", "--device", "cpu", "--out", str(tmp_path)])
    # Bounded again: the modes the bound changes (the paper's windows hold 2 rows already).
    assert set(result["train_s"]) == set(common.TRAINING_MODES) | {"jagg_shared_rows2", "jagg_shared_rollout_rows2"}
    assert set(result["saved_gb"]) == set(result["train_s"])
    # The same network rows with grad; the shared modes' 4 anchors are held 2 at a time.
    assert result["backward_rows"]["jagg_shared_rollout_rows2"] == result["backward_rows"]["jagg_shared_rollout"] == 4
    saved = result["saved_gb"]
    assert saved["jagg_shared_rollout_rows2"] < saved["jagg_shared_rollout"]
    assert saved["jagg_shared_rollout_rows2"] <= saved["jagg"] * 1.001 and saved["exact"] < saved["jagg"]
    assert "saved MiB" in capsys.readouterr().out


def test_benchmark_in_the_users_configuration_lora_and_checkpointing(tmp_path, capsys):
    result = train_sd.main(["--benchmark", "--random-init", "--bench-size", "tiny", "--window", "4", "--bench-repeats", "1",
                            "--bench-train", "lora", "--lora-rank", "4", "--bench-checkpointing", "--device", "cpu",
                            "--out", str(tmp_path)])
    assert result["train"] == "lora" and result["lora_rank"] == 4 and result["gradient_checkpointing"] is True
    assert 0 < result["trained_params"] < result["params"]
    assert "LoRA rank 4 trained" in capsys.readouterr().out
    assert result["backward_rows"]["jagg_shared_rollout"] == 4 and result["train_s"]["exact"] > 0
    saved = json.load(open(tmp_path / "benchmark.json"))
    assert saved["config"]["bench_train"] == "lora" and saved["config"]["bench_checkpointing"] is True


def test_sde_window_trains_its_steps_alone_and_the_whole_trajectory_is_todays_run(tiny_sd3, tmp_path):
    """--sde-window K: the rollout is stochastic and trained on K steps only, the window placed per
    epoch; a window over the whole trajectory (T = 4, range 0-3) is today's run, bit for bit."""
    from safetensors.torch import load_file

    today = train_sd.main(run_args(tiny_sd3, tmp_path / "today", "--epochs", "1", "--window", "4"))
    whole = train_sd.main(run_args(tiny_sd3, tmp_path / "whole", "--epochs", "1", "--window", "4", "--sde-window", "4",
                                   "--sde-range-end", "4"))
    for key in ("rollout/reward_mean", "train/loss", "train/grad_rows", "eval/reward"):
        assert today[1][key] == whole[1][key], key
    a, b = load_file(tmp_path / "today" / "lora.safetensors"), load_file(tmp_path / "whole" / "lora.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = train_sd.main(run_args(tiny_sd3, tmp_path / "slide", "--epochs", "2", "--window", "3", "--sde-window", "3",
                                  "--num-steps", "6", "--sde-placement", "slide", "--anchors", "shared",
                                  "--interior", "rollout", "--probe-every", "1"))
    assert [r["rollout/sde_window_start"] for r in rows[1:]] == [0, 1]  # MixGRPO's slide, one step an epoch
    assert rows[1]["train/grad_rows"] == 2 * 2 and len(rows[1]["probe/grad_cosine"]) == 1  # one segment: 2 anchors
    with pytest.raises(SystemExit, match="--sde-window 6 does not fit in steps 0 to 4"):
        train_sd.main(run_args(tiny_sd3, tmp_path / "bad", "--num-steps", "6", "--sde-window", "6"))


def test_torchrun_fsdp_trains_checkpoints_and_resumes(tiny_sd3, tmp_path):
    """train_sd.py --fsdp on two ranks: the ranks stay in sync, a run stopped after one epoch and
    resumed from its checkpoint equals an uninterrupted one, and full fine-tuning with a sharded
    frozen reference and a sharded EMA trains too."""
    from safetensors.torch import load_file

    def torchrun(out, *extra):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train_sd.py",
               *run_args(tiny_sd3, out, "--fsdp", "--window", "3", *extra)]
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [json.loads(line) for line in open(out / "metrics.jsonl")]

    torchrun(tmp_path / "resumed", "--epochs", "1")
    resumed = torchrun(tmp_path / "resumed", "--epochs", "2", "--resume", str(tmp_path / "resumed"))
    straight = torchrun(tmp_path / "straight", "--epochs", "2")
    for rows in (resumed, straight):
        assert [r["epoch"] for r in rows] == [0, 1, 2]
        a, b = rows[-1]["train/param_checksums"]
        assert a == b  # both ranks' whole parameters, bit for bit
    assert resumed[-1]["train/param_checksums"] == straight[-1]["train/param_checksums"]
    x, y = load_file(tmp_path / "resumed" / "lora.safetensors"), load_file(tmp_path / "straight" / "lora.safetensors")
    assert all(torch.equal(x[k], y[k]) for k in x) and any(v.abs().sum() > 0 for k, v in x.items() if "lora_B" in k)
    full = torchrun(tmp_path / "full", "--epochs", "1", "--full-finetune", "--beta", "0.1", "--ema", "--ema-every", "1",
                    "--anchors", "shared", "--interior", "rollout")
    assert full[-1]["train/kl"] >= 0 and full[-1]["train/skipped_steps"] == 0
    a, b = full[-1]["train/param_checksums"]
    assert a == b and (tmp_path / "full" / "transformer.safetensors").exists()


def test_fsdp_needs_torchrun(tiny_sd3, tmp_path):
    with pytest.raises(SystemExit, match="--fsdp shards the transformer over torchrun's ranks"):
        train_sd.main(run_args(tiny_sd3, tmp_path / "out", "--fsdp"))


def test_fsdp_memory_per_rank_state_halves_and_activations_stay(tmp_path):
    """tools/fsdp_memory.py at 1 and 2 ranks: each rank holds half the weights, gradients and AdamW
    state (to the shards' rounding), and every mode saves the same activations as on one rank."""
    for n in (1, 2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
               "tools/fsdp_memory.py", "--size", "tiny", "--out", str(tmp_path)]
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = (json.load(open(tmp_path / f"ranks{n}.json")) for n in (1, 2))
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert two[key] < 0.55 * one[key], key
    assert two["saved_bytes"] == one["saved_bytes"] and len(one["saved_bytes"]) == 5
