"""train_sd.py on its tiny random SD3.5 (--model tiny: SD3.5's three text encoders, VAE and MMDiT-X at a toy
size, built in code; nothing is downloaded). Fast: a bad flag is one line before any work; a short run in
every mode the trainer offers writes what it says and calls the gradient it names; a resumed run equals an
uninterrupted one to the last bit and another config is refused in one line; the SD3 velocity_fn under JAGG
against explicit Jacobian interpolation, and CFG's gradient against a finite difference. Slow: the same
resume under torchrun with two ranks, whose groups span the ranks."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("diffusers", reason="the optional extra: pip install -e '.[sd]'")
pytest.importorskip("peft", reason="the optional extra: pip install -e '.[sd]'")

import jagg  # noqa: E402
import flows  # noqa: E402
import train_sd  # noqa: E402
from beyond_paper import options  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def args_of(out, *extra):
    """A CPU-sized run: T = 4 with the first 3 trained (W = 3: one window), 2 prompts x 2 samples, 2 steps an
    epoch, LoRA rank 4, a clip range the tiny model's ratios can reach."""
    return ["--model", "tiny", "--out", str(out), "--num-steps", "4", "--timestep-fraction", "0.75",
            "--window", "3", "--prompts-per-epoch", "2", "--group-size", "2", "--train-batch", "2",
            "--lora-rank", "4", "--clip-range", "0.2", "--lr", "1e-2", "--eval-every", "1", "--eval-samples", "2",
            "--reward", "darkness", "--epochs", "2", *extra]


def brightness(images, prompts):
    """A reward from outside train_sd.py, named --reward test_sd:brightness."""
    return [1 - train_sd.darkness(im) for im in images]


def one_per_image_short(images, prompts):  # a broken reward: one number too few
    return [0.5] * (len(images) - 1)


def weights_of(out):
    return torch.load(os.path.join(out, "checkpoint.pt"), weights_only=True)["weights"]


def untimed(rows):  # what a run computes, without the seconds it took
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows]


@pytest.mark.parametrize("flags, message", [
    (["--window", "1"], "--window must be in [2, the 9 trained steps], got 1"),
    (["--jagg-frac", "1.5"], "--jagg-frac must be in [0, 1], got 1.5"),
    (["--group-size", "1"], "--group-size must be >= 2"),
    (["--lr", "nan"], "--lr must be > 0, got nan"),
    (["--resolution", "100"], "--resolution must be 0 or a multiple of 16, got 100"),
    (["--reward", "nothing"], "--reward must be one of jpeg_compressibility, jpeg_incompressibility, darkness"),
    (["--prompts", "no/such/file"], "--prompts must be a text file, or empty"),
])
def test_a_bad_flag_is_one_line_before_any_work(flags, message, tmp_path):
    with pytest.raises(SystemExit, match="^error: " + message.replace("[", r"\[").replace("(", r"\(")):
        train_sd.parse_args(["--out", str(tmp_path / "out"), *flags])
    assert not (tmp_path / "out").exists()


def test_every_flag_has_help_and_a_bad_value_on_the_command_line_is_one_line(tmp_path):
    help_text = subprocess.run([sys.executable, "train_sd.py", "--help"], cwd=ROOT, capture_output=True, text=True).stdout
    assert all("--" + f.name.replace("_", "-") in help_text for f in train_sd.fields(train_sd.Args))
    run = subprocess.run([sys.executable, "train_sd.py", "--out", "/proc/no_such_folder/run", "--model", "tiny"],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 1 and run.stderr.strip().splitlines() == [
        "error: --out '/proc/no_such_folder/run' cannot be made (No such file or directory): give a folder you can write"]


@pytest.mark.parametrize("mode, flags, calls, rows", [
    ("exact", ["--jagg-frac", "0"], "paper", 3),  # 3 trained steps, each with grad
    ("jagg", [], "paper", 2),  # one window of 3: its 2 end steps
    ("routed", ["--jagg-frac", "0.5", "--num-steps", "8", "--timestep-fraction", "0.75"], "paper", 2 + 3),
    ("fast", ["--fast"], "options", 2),
    ("full", ["--lora-rank", "0", "--no-ema"], "paper", 2),  # every weight, a frozen copy as the KL's reference
])
def test_each_mode_trains_and_writes_what_it_says(mode, flags, calls, rows, tmp_path, monkeypatch):
    """Each mode calls the gradient it names once per micro-batch, with its W and jagg_frac; rows with grad
    per micro-batch as the mode counts them; the run's files, and no temporary one."""
    seen, paper, general = [], jagg.backward_batch, options.backward_batch
    monkeypatch.setattr(jagg, "backward_batch", lambda *a, **k: seen.append(("paper", a[4:6])) or paper(*a, **k))
    monkeypatch.setattr(options, "backward_batch", lambda *a, **k: seen.append(("options", a[4])) or general(*a, **k))
    out = tmp_path / mode
    rows_seen = train_sd.train(train_sd.parse_args(args_of(out, *flags)))
    assert len(seen) == 2 * 2 and {name for name, _ in seen} == {calls}  # 2 epochs x 2 micro-batches of 2
    frac = float(flags[flags.index("--jagg-frac") + 1]) if "--jagg-frac" in flags else 1.0
    if calls == "paper":
        assert {a for _, a in seen} == {(3, frac)}
    else:
        assert {(o.window, o.jagg_frac, o.anchors, o.interior) for _, o in seen} == {(3, 1.0, "shared", "rollout")}
    assert [r["epoch"] for r in rows_seen] == [0, 1, 2] and rows_seen[1]["train/grad_rows"] == 2 * rows
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pt", "config.json", "metrics.jsonl", "samples_0000.png",
                                                     "samples_0001.png", "samples_0002.png", "weights.safetensors"]
    assert [json.loads(line)["epoch"] for line in open(out / "metrics.jsonl")] == [0, 1, 2]
    assert any(not torch.equal(w, w0) for w, w0 in zip(weights_of(out).values(), initial_weights(flags).values()))


def test_route_velocity_routes_by_the_cosine_rule(tmp_path, monkeypatch):
    seen = flows.routes_by_the_velocity_score(monkeypatch)
    flags = ["--jagg-frac", "0.5", "--num-steps", "8", "--timestep-fraction", "0.75", "--route", "velocity"]
    train_sd.train(train_sd.parse_args(args_of(tmp_path / "v", *flags)))
    assert seen == ["velocity"] * 4  # 2 epochs x 2 micro-batches


def initial_weights(flags):
    """The trainable weights a run of these flags starts from (seed 0)."""
    args = train_sd.parse_args(args_of("unused", *flags))
    torch.manual_seed(args.seed)
    pipe = train_sd.load_pipeline(args, torch.device("cpu"), torch.float32)
    return {n: p.detach().clone() for n, p in train_sd.trainable(pipe.transformer).items()}


def test_a_reward_must_give_one_finite_number_per_image(tmp_path):
    with pytest.raises(SystemExit, match="^error: --reward test_sd:one_per_image_short returned 1 numbers, 0 not finite,"
                                         " for 2 images: it must return one finite number per image$"):
        train_sd.train(train_sd.parse_args(args_of(tmp_path / "r", "--reward", "test_sd:one_per_image_short")))
    rows = train_sd.train(train_sd.parse_args(args_of(tmp_path / "b", "--reward", "test_sd:brightness", "--epochs", "1")))
    assert 0 < rows[-1]["eval/reward"] < 1


def test_the_saved_weights_are_flow_grpos_ema_of_the_trained_ones(tmp_path):
    """8 optimizer steps: the EMA is updated once, at step 8 with decay 8 / 17, from the starting weights;
    weights.safetensors holds it, computed here from the start and the checkpoint's trained weights."""
    from safetensors.torch import load_file

    flags = ["--steps-per-epoch", "4"]
    train_sd.train(train_sd.parse_args(args_of(tmp_path / "e", *flags)))  # 2 epochs x 4 steps
    start, trained, saved = initial_weights(flags), weights_of(tmp_path / "e"), load_file(tmp_path / "e" / "weights.safetensors")
    decay = 8 / 17
    assert set(saved) == set(trained) and any(not torch.equal(trained[n], start[n]) for n in trained)
    for n in saved:
        torch.testing.assert_close(saved[n], decay * start[n] + (1 - decay) * trained[n])


def test_resume_equals_an_uninterrupted_run_and_refuses_another_run(tmp_path):
    whole, part = tmp_path / "whole", tmp_path / "part"
    rows = train_sd.train(train_sd.parse_args(args_of(whole, "--epochs", "3")))
    train_sd.train(train_sd.parse_args(args_of(part, "--epochs", "1")))
    resumed = train_sd.train(train_sd.parse_args(args_of(part, "--epochs", "3", "--resume", str(part))))
    assert untimed(resumed) == untimed(rows)  # every figure of every epoch, to the last bit
    assert all(torch.equal(a, b) for a, b in zip(weights_of(whole).values(), weights_of(part).values()))
    with pytest.raises(SystemExit, match=rf"^error: --out '{whole}' holds a run: go on with --resume {whole}"):
        train_sd.train(train_sd.parse_args(args_of(whole)))
    for flags, differs in ((["--lr", "0.02"], "lr 0.01 -> 0.02"), (["--model", "other"], "model 'tiny' -> 'other'")):
        with pytest.raises(SystemExit, match=rf"^error: --resume '{whole}' would train another run: {differs} "
                                             r"\(only --epochs, more, and --eval-every may change\)$"):
            train_sd.train(train_sd.parse_args(args_of(whole, "--resume", str(whole), *flags)))


def torchrun(*args, n=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", "train_sd.py", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(ROOT, "tests")})


@pytest.mark.slow
def test_torchrun_two_ranks_resume_bit_for_bit_and_refuse_another_world_size(tmp_path):
    """Two ranks (gloo on the CPU): a group spans the ranks, every backward runs in DDP's no_sync with one
    all-reduce a step; 1 epoch then --resume to 3 equals 3 epochs to the last bit; one process may not resume
    a two-rank run."""
    whole, part = tmp_path / "whole", tmp_path / "part"
    for run in (torchrun(*args_of(whole, "--epochs", "3")), torchrun(*args_of(part, "--epochs", "1")),
                torchrun(*args_of(part, "--epochs", "3", "--resume", str(part)))):
        assert run.returncode == 0, run.stderr[-3000:]
    assert json.load(open(whole / "config.json"))["world"] == 2

    def metrics(out):
        return untimed(json.loads(line) for line in open(out / "metrics.jsonl"))
    assert metrics(whole) == metrics(part)
    assert all(torch.equal(a, b) for a, b in zip(weights_of(whole).values(), weights_of(part).values()))
    with pytest.raises(SystemExit, match=r"would train another run: world size 2 -> 1"):
        train_sd.train(train_sd.parse_args(args_of(whole, "--resume", str(whole))))


# --- The SD3 block against trusted references


def tiny_transformer():
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    return SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=1,
                                 attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                 caption_projection_dim=16, pooled_projection_dim=16, pos_embed_max_size=8,
                                 dual_attention_layers=(0,), qk_norm="rms_norm").double()


def test_jagg_on_the_sd3_velocity_fn_equals_endpoint_interpolation():
    """JAGG's one backward through make_velocity_fn equals sum_k [(1-alpha_k) g_k^T J_a + alpha_k g_k^T J_b]
    built from 2W separate vector-Jacobian products; its cosine to exact is below 1."""
    transformer = tiny_transformer()
    params, (W, B) = list(transformer.parameters()), (4, 2)
    cond = (torch.randn(B, 5, 16, dtype=torch.float64), torch.randn(B, 16, dtype=torch.float64))
    uncond = (torch.zeros_like(cond[0]), torch.zeros_like(cond[1]))
    velocity_fn = train_sd.make_velocity_fn(transformer, cond, uncond, 3.0, use_bf16=False)
    traj = jagg.rollout(velocity_fn, torch.randn(B, 4, 8, 8, dtype=torch.float64), jagg.sigma_schedule(8).double(), 0.7)
    cfg, adv, (a, b) = jagg.LossConfig(noise_level=0.7, clip_range=0.2), torch.tensor([1.0, -1.0]).double(), (2, 2 + W)
    z, t = traj.z[a:b], traj.t[a:b]

    def grad():
        return torch.cat([p.grad.flatten() for p in params])

    transformer.zero_grad(set_to_none=True)
    jagg.backward_jagg_window(velocity_fn, z, t, jagg.make_step_loss(traj, adv, a, b, cfg))
    g_jagg, expected = grad(), 0
    step_loss, alpha = jagg.make_step_loss(traj, adv, a, b, cfg), jagg.interpolation_weights(t)  # alpha [W, B]
    for k in range(W):
        with torch.no_grad():
            v_k = velocity_fn(z[k : k + 1], t[k : k + 1])[0]
        (g_k,) = torch.autograd.grad(step_loss(k, v_k.requires_grad_(True)), v_k)  # [B, C, H, W]
        for end, weight in ((0, 1 - alpha[k]), (W - 1, alpha[k])):
            transformer.zero_grad(set_to_none=True)
            (velocity_fn(z[end : end + 1], t[end : end + 1])[0] * weight[:, None, None, None] * g_k).sum().backward()
            expected = expected + grad()
    torch.testing.assert_close(g_jagg, expected, rtol=1e-7, atol=1e-10)
    transformer.zero_grad(set_to_none=True)
    jagg.backward_exact(velocity_fn, z, t, jagg.make_step_loss(traj, adv, a, b, cfg))
    assert 0.0 < torch.nn.functional.cosine_similarity(g_jagg, grad(), dim=0).item() < 1.0 - 1e-9


def test_the_cfg_gradient_flows_through_the_conditional_branch_alone():
    """As Flow-GRPO's current trainer: the gradient of <v, u> with v = v_u + s (v_c - v_u) is s times the
    conditional branch's alone, not the guided velocity's derivative (its finite difference along a random
    direction of the weights, which the gradient through both branches, written out here, matches)."""
    transformer = tiny_transformer()
    params, (B, s) = list(transformer.parameters()), (2, 3.0)
    cond = (torch.randn(B, 5, 16, dtype=torch.float64), torch.randn(B, 16, dtype=torch.float64))
    uncond = (torch.zeros_like(cond[0]), torch.zeros_like(cond[1]))
    z, t = torch.randn(1, B, 4, 8, 8, dtype=torch.float64), torch.full((1, B), 0.6, dtype=torch.float64)
    u = torch.randn_like(z)

    def grad_of(velocity_fn):
        transformer.zero_grad(set_to_none=True)
        (velocity_fn(z, t) * u).sum().backward()
        return torch.cat([p.grad.flatten() for p in params])

    def branch(c):  # one branch with graph, as make_velocity_fn calls the transformer
        return transformer(hidden_states=z[0], timestep=t.flatten() * 1000, encoder_hidden_states=c[0],
                           pooled_projections=c[1], return_dict=False)[0][None]

    both = grad_of(lambda z, t: branch(uncond) + s * (branch(cond) - branch(uncond)))
    cond_only = grad_of(train_sd.make_velocity_fn(transformer, cond, uncond, s, False))
    direction, eps = [torch.randn_like(p) for p in params], 1e-4  # round-off near 1e-9: eps no smaller

    def value(sign):
        with torch.no_grad():
            for p, d in zip(params, direction):
                p.add_(sign * eps * d)
            out = (train_sd.make_velocity_fn(transformer, cond, uncond, s, False)(z, t) * u).sum().item()
            for p, d in zip(params, direction):
                p.sub_(sign * eps * d)
        return out

    finite_difference, d = (value(1) - value(-1)) / (2 * eps), torch.cat([x.flatten() for x in direction])
    assert torch.dot(both, d).item() == pytest.approx(finite_difference, rel=1e-3)
    assert abs(torch.dot(cond_only, d).item() - finite_difference) > 0.05 * abs(finite_difference)
    torch.testing.assert_close(cond_only, s * grad_of(train_sd.make_velocity_fn(transformer, cond, None, 1.0, False)))
