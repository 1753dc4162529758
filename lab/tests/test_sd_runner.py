"""lab/sd_runner.py's contracts (the frozen runner of the kept SD3 runs) on a tiny random SD3 pipeline built in code (tests/tiny_sd3.py: SD3.5's
three text encoders, VAE and MMDiT-X transformer; nothing is downloaded). Fast: every bad flag is
refused in one line before any model loads, one short run end to end, the SD3 velocity_fn under
JAGG against explicit Jacobian interpolation and CFG's gradient against a finite difference, the
optimizer steps. Slow (-m slow): resume equals an uninterrupted run, torchrun with DDP and FSDP,
full fine-tuning with EMA and PickScore, Flow-GRPO's defaults, the SDE window."""

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("diffusers", reason="the optional extra: pip install -e '.[sd]'")
pytest.importorskip("peft", reason="the optional extra: pip install -e '.[sd]'")

import jagg  # noqa: E402
from beyond_paper import options  # noqa: E402
import tiny_sd3  # noqa: E402
import sd_runner  # noqa: E402
from flows import MLPFlow, as_velocity_fn, explicit_anchor_gradient, reference_gradient, toy_batch  # noqa: E402
import checkpoint, run_folder  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
slow = pytest.mark.slow


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return tiny_sd3.build(tmp_path_factory.mktemp("tiny_sd3") / "pipe")


# Every step trained, one optimizer step per micro-batch of every sample, per-group std, no EMA: the
# tests check one feature at a time on that; test_flow_grpo_defaults checks Flow-GRPO's.
PLAIN = ["--timestep-fraction", "1", "--steps-per-epoch", "0", "--no-global-std", "--no-ema"]


def run_args(model, out, *extra, plain=True):
    return ["--model", model, "--out", str(out), "--num-steps", "4", "--window", "2", "--prompts-per-epoch", "2",
            "--group-size", "2", "--train-batch", "2", "--lora-rank", "4", "--guidance-scale", "2.0",
            "--clip-range", "0.2", "--lr", "1e-2", "--eval-every", "1", "--eval-samples", "4", "--reward", "darkness",
            *(PLAIN if plain else []), *extra]


def brightness(images, prompts):
    """A reward defined outside train_sd.py, named as --reward test_sd_runner:brightness."""
    return [1 - sd_runner.darkness(im) for im in images]


brightness.eval_metrics = lambda images, prompts: {"count": float(len(images))}


# ------------------------------------------------------------------ flags: refused before any work


def out_of_range(cfg, name):
    """The first of a few probing values that Config.ranges refuses for the flag name."""
    kind = type(getattr(cfg, name))
    for value in ((-10**6, -2, -1, 0, 1, 2, 7, 10**6) if kind is int else (-1e6, -1.5, -1.0, 0.0, 0.5, 1.0, 1.5, 1e6)):
        if not dict((n, ok) for ok, n, _ in dataclasses.replace(cfg, **{name: kind(value)}).ranges())[name]:
            return kind(value)
    raise AssertionError(f"--{name}: no probing value is out of its range")


def test_every_declared_range_refuses_a_value_in_one_line_naming_the_flag(tmp_path):
    """Each range of Config.ranges (and each JAGG option's, declared in beyond_paper/options.py) refuses a value
    outside it with one line 'error: --flag must be ..., got value', and nothing is created."""
    cfg = sd_runner.Config()
    names = [n for _, n, _ in cfg.ranges()]
    assert len(names) >= 18 and len(set(names)) == len(names)  # each declared once
    cases = [(n, out_of_range(cfg, n)) for n in names] + [("window", 1), ("jagg_frac", 1.5), ("max_graph_rows", 0)]
    for name, bad in cases:
        flag, out = "--" + name.replace("_", "-"), tmp_path / name
        with pytest.raises(SystemExit) as e:
            sd_runner.main(["--model", "/nonexistent", "--out", str(out), flag, str(bad)])
        message = str(e.value.code)
        assert message.startswith(f"error: {flag} must be") and f"got {bad}" in message and "\n" not in message, message
        assert not out.exists()
    with pytest.raises(SystemExit, match="--lr must be a finite number, got nan"):
        sd_runner.main(["--lr", "nan", "--out", str(tmp_path / "x")])


@pytest.mark.parametrize("extra, message", [
    (["--model", "/nonexistent/sd3"], "is not a folder with a diffusers pipeline"),
    (["--window", "5"], "longer than the 4 trained steps"),
    (["--timestep-fraction", "0.2"], "trains none of the 4 steps"),
    (["--reward", "aesthetic"], "--reward 'aesthetic' is none of jpeg_compressibility"),
    (["--reward", "test_sd_runner:nothing"], "no importable module:function"),
    (["--prompts", "EMPTY"], "has no prompts"),
    (["--prompts", "/nonexistent/prompts.txt"], "does not exist"),
    (["--resume", "/nonexistent/run"], "holds no checkpoint"),
    (["--resume", "RUN"], "holds no checkpoint"),  # a run killed while writing its first checkpoint
    (["--out", "/proc/x"], "cannot be created or written to"),
    (["--route", "probe"], "--route probe needs the probe"),
    (["--interior", "rollout", "--max-graph-rows", "1"], "--max-graph-rows must be an integer >= 2 with rollout"),
    (["--sde-window", "4"], "--sde-window 4 does not fit in steps 0 to 2"),
    (["--group-size", "1"], "--group-size must be >= 2 on one process"),
    (["--prompts", "BINARY"], "is not UTF-8 text"),
    (["--model", "BROKEN"], r"model_index.json \(JSONDecodeError"),
    (["--model", "NOTRANSFORMER"], "has no transformer in model_index.json"),
    (["--resolution", "48"], "--resolution 48 is above the model's limit of 32 pixels"),
    (["--resume", "RUN", "--overwrite"], "--resume continues a run, --overwrite deletes it: give one"),
    (["--fsdp"], "--fsdp shards over torchrun's ranks"),
])
def test_bad_input_fails_before_any_work(tiny, tmp_path, extra, message):
    (tmp_path / "empty.txt").write_text("\n  \n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".tmp-killed").write_bytes(b"half a checkpoint")
    (tmp_path / "binary.txt").write_bytes(bytes(range(256)))
    for name, index in (("broken", "{not json"), ("notransformer", '{"vae": ["diffusers", "AutoencoderKL"]}')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model_index.json").write_text(index)
    names = {"EMPTY": "empty.txt", "RUN": "run", "BINARY": "binary.txt", "BROKEN": "broken", "NOTRANSFORMER": "notransformer"}
    extra = [str(tmp_path / names[e]) if e in names else e for e in extra]
    with pytest.raises(SystemExit, match=message):
        sd_runner.main(run_args(tiny, tmp_path / "out", *extra))
    assert not (tmp_path / "out").exists()


def test_a_bad_flag_is_one_line_without_traceback(tmp_path):
    """As a user meets it: one line on stderr, in seconds, and nothing written."""
    start = time.perf_counter()
    run = subprocess.run([sys.executable, os.path.join(ROOT, "lab", "sd_runner.py"), "--out", str(tmp_path / "out"),
                          "--noise-level", "3"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.returncode != 0 and run.stderr.strip().splitlines() == ["error: --noise-level must be in (0, 1], got 3.0"]
    assert time.perf_counter() - start < 60 and os.listdir(tmp_path) == []


# ------------------------------------------------------------------ a run's folder


WHOLE = dict(rows=[{"epoch": 0}], probe_average=None, weights={"w": torch.ones(2)}, ema=None, optimizer={})


def fake_checkpoint(tiny, out, epoch, **state):
    """OUT/checkpoint.pt holding a run_args run's config and identity at epoch, and state (no
    weights unless given)."""
    cfg = sd_runner.validate(sd_runner.parse(run_args(tiny, out)))
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"epoch": epoch, "config": {**dataclasses.asdict(cfg), "fixed": sd_runner.FIXED},
                "identity": sd_runner.run_identity(cfg), **state}, out / "checkpoint.pt")
    return out / "checkpoint.pt"


def cli(*args, cwd):
    return subprocess.run([sys.executable, os.path.join(ROOT, "lab", "sd_runner.py"), *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "lab", "tests"), os.path.join(ROOT, "tests")])})


def test_resume_refuses_what_changes_the_run_before_any_model_loads(tiny, tmp_path):
    """Each changed flag named with the run's value and the new one; --epochs below the checkpoint's epoch
    refused; --epochs (more) and --eval-every may change, and --help says so; a checkpoint that is not whole refused."""
    out = tmp_path / "run"
    fake_checkpoint(tiny, out, 6, **WHOLE)
    run = cli(*run_args(tiny, out, "--window", "3", "--lr", "1", "--seed", "5", "--resume", str(out)), cwd=tmp_path)
    assert run.returncode != 0 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    for named in ("--window 3 differs from the run's 2", "--lr 1.0 differs from the run's 0.01",
                  "--seed 5 differs from the run's 0",
                  "only --epochs, --eval-every, --checkpoint-every and --out may change"):
        assert named in run.stderr, run.stderr
    run = cli(*run_args(tiny, out, "--epochs", "4", "--resume", str(out)), cwd=tmp_path)
    assert run.stderr.strip() == "error: --resume: --epochs 4 is below the checkpoint's epoch 6: give --epochs >= 6"
    fake_checkpoint(tiny, out, 6)  # no weights: the flags below pass, the checkpoint does not
    run = cli(*run_args(tiny, out, "--epochs", "9", "--eval-every", "3", "--resume", str(out)), cwd=tmp_path)  # allowed
    assert run.stderr.strip().splitlines() == [f"error: cannot resume: {out}/checkpoint.pt is not a whole lab/sd_runner.py "
                                               f"checkpoint (ValueError: it has no ema, optimizer, probe_average, rows, "
                                               f"weights); the run cannot go on from it: start it again in another "
                                               f"--out, or here with --overwrite (which deletes its files)"]
    help = " ".join(cli("--help", cwd=tmp_path).stdout.split())
    assert "only --epochs (more), --eval-every, --checkpoint-every and --out may change" in help
    assert "--overwrite" in help and "imported at start (its module's code runs" in help


def test_a_checkpoint_is_whole_or_refused_in_one_line_and_a_killed_saves_temporary_goes(tiny, tmp_path):
    """One file, written to a temporary and renamed (a kill leaves the old checkpoint or the new one); a cut,
    garbage or foreign file is refused in one line naming it; --resume removes a killed save's temporary."""
    out = tmp_path / "run"
    path = fake_checkpoint(tiny, out, 2, **WHOLE)
    assert sd_runner.read_checkpoint(out)["weights"]["w"].tolist() == [1.0, 1.0]  # whole: read
    whole = path.read_bytes()
    for broken, why in ((whole[: len(whole) // 2], "(RuntimeError: "),
                        (b"{", "(UnpicklingError: it holds more than tensors and plain data"),
                        (None, "(ValueError: it has no ema, optimizer, probe_average, rows, weights)")):
        fake_checkpoint(tiny, out, 2) if broken is None else path.write_bytes(broken)
        with pytest.raises(SystemExit) as e:
            sd_runner.read_checkpoint(out)
        message = str(e.value.code)
        assert message.startswith(f"error: cannot resume: {path} is not a whole lab/sd_runner.py checkpoint {why}"), message
        assert message.endswith("here with --overwrite (which deletes its files)") and "\n" not in message
        assert "weights_only" not in message  # torch's advice would unpickle, and run, what the file holds
    (out / ".tmp-killed").write_bytes(b"half")
    sd_runner.claim_out(sd_runner.Config(out=str(out), resume=str(out))).close()
    assert sorted(p.name for p in out.iterdir()) == [".lock", "checkpoint.pt"]


def test_an_output_folder_belongs_to_one_run(tiny, tmp_path):
    """A folder holding a run is refused without --resume or --overwrite, a folder in use (its lock held)
    is refused, both before any model loads; nothing of the old run is touched."""
    import fcntl

    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    run = cli(*run_args(tiny, out, "--epochs", "1"), cwd=tmp_path)
    assert run.returncode != 0 and run.stderr.strip().splitlines() == [  # no checkpoint: nothing to resume
        f"error: --out '{out}' holds a run (summary.json): start afresh with --overwrite, or pick another folder"]
    with open(out / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another run holds the folder
        run = cli(*run_args(tiny, out, "--epochs", "1", "--overwrite"), cwd=tmp_path)
    assert "is in use by another process" in run.stderr and len(run.stderr.strip().splitlines()) == 1
    assert (out / "summary.json").read_text() == "{}"


def test_json_has_no_bare_nan(tmp_path):
    sd_runner.write_json(tmp_path / "a.json", {"reward": float("nan"), "curve": [[0, float("inf")]]})
    assert json.load(open(tmp_path / "a.json")) == {"reward": None, "curve": [[0, None]]}


# ------------------------------------------------------------------ one short run, and the model's pieces


def test_one_short_run_end_to_end_with_a_reward_from_outside(tiny, tmp_path, monkeypatch):
    """One epoch of JAGG (W = 3 over T = 4: a 3-step window and an exact 1-step one) with the probe,
    a reward named module:function whose eval_metrics are logged, and the run folder's files; the
    gradient is jagg.py's own call, once per micro-batch."""
    out, calls, backward_batch = tmp_path / "run", [], jagg.backward_batch
    monkeypatch.setattr(jagg, "backward_batch", lambda *a, **k: calls.append(a[4:]) or backward_batch(*a, **k))
    rows = sd_runner.main(run_args(tiny, out, "--epochs", "1", "--window", "3", "--probe-every", "1",
                                  "--reward", "test_sd_runner:brightness"))
    assert [(W, frac, callable(ref_fn)) for W, frac, ref_fn in calls] == [(3, 1.0, True)] * 2  # beta 0.04
    assert [r["epoch"] for r in rows] == [0, 1] and rows[1]["eval/count"] == 4.0
    assert rows[1]["train/routed_frac"] == 1.0 and rows[1]["mode"] == "jagg"
    assert rows[1]["train/grad_rows"] == (2 + 1) * 2  # 2 anchors + 1 exact step, 2 micro-batches
    assert len(rows[1]["probe/grad_cosine"]) == 2 and rows[1]["probe/error_to_noise"][1] == 0  # the 1-step window
    assert sorted(p.name for p in out.iterdir()) == [".lock", "checkpoint.pt", "config.json", "lora.safetensors",
                                                     "metrics.jsonl", "samples_0000.png", "samples_0001.png",
                                                     "summary.json"]  # and no temporary file
    config = json.load(open(out / "config.json"))
    assert config["reward"] == "test_sd_runner:brightness" and config["fixed"] == sd_runner.FIXED
    assert json.load(open(out / "summary.json"))["probe_cosine_by_position"] is not None


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
    velocity_fn = sd_runner.make_velocity_fn(transformer, cond, uncond, 3.0, use_bf16=False)
    traj = jagg.rollout(velocity_fn, torch.randn(B, 4, 8, 8, dtype=torch.float64), jagg.sigma_schedule(8).double(), 0.7)
    cfg, adv, (a, b) = jagg.LossConfig(noise_level=0.7, clip_range=0.2), torch.tensor([1.0, -1.0]).double(), (2, 2 + W)
    z, t = traj.z[a:b], traj.t[a:b]

    def grad():
        return torch.cat([p.grad.flatten() for p in params])

    transformer.zero_grad(set_to_none=True)
    options.backward_jagg(velocity_fn, z, t, jagg.make_step_loss(traj, adv, a, b, cfg))
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
    cond_only = grad_of(sd_runner.make_velocity_fn(transformer, cond, uncond, s, False))
    direction, eps = [torch.randn_like(p) for p in params], 1e-4  # round-off near 1e-9: eps no smaller

    def value(sign):
        with torch.no_grad():
            for p, d in zip(params, direction):
                p.add_(sign * eps * d)
            out = (sd_runner.make_velocity_fn(transformer, cond, uncond, s, False)(z, t) * u).sum().item()
            for p, d in zip(params, direction):
                p.sub_(sign * eps * d)
        return out

    finite_difference, d = (value(1) - value(-1)) / (2 * eps), torch.cat([x.flatten() for x in direction])
    assert torch.dot(both, d).item() == pytest.approx(finite_difference, rel=1e-3)
    assert abs(torch.dot(cond_only, d).item() - finite_difference) > 0.05 * abs(finite_difference)
    torch.testing.assert_close(cond_only, s * grad_of(sd_runner.make_velocity_fn(transformer, cond, None, 1.0, False)))


def test_optimizer_steps_drop_zero_advantages_as_flow_grpo():
    """--steps-per-epoch N: zero-advantage samples dropped, dropped ones put back until N divides the
    count, each step in micro-batches of --train-batch; 0: one step per micro-batch of every sample."""
    adv = torch.tensor([0.5, 0.0, -0.5, 0.0, 1.0, 0.0, 0.0, -1.0, 0.2, 0.0])
    perm, g = torch.randperm(10, generator=torch.Generator().manual_seed(0)), torch.Generator().manual_seed(1)
    cfg = sd_runner.Config(steps_per_epoch=2, train_batch=2)
    steps = sd_runner.optimizer_steps(perm, adv, cfg, g)
    used = torch.cat([i for micro in steps for i in micro])
    assert len(steps) == 2 and all(len(i) <= 2 for micro in steps for i in micro)
    assert set(torch.nonzero(adv).flatten().tolist()) <= set(used.tolist())  # every informative sample trains
    assert len(used) == 6 and len(set(used.tolist())) == 6  # 5 nonzero, topped up by one to divide into 2 steps
    assert [sum(len(i) for i in micro) for micro in steps] == [3, 3]
    every = sd_runner.optimizer_steps(perm, adv, dataclasses.replace(cfg, steps_per_epoch=0), g)
    assert [m[0].tolist() for m in every] == [i.tolist() for i in perm.split(2)]  # one step per micro-batch, in order
    fsdp = sd_runner.optimizer_steps(perm, adv, dataclasses.replace(cfg, fsdp=True), g)
    assert sorted(torch.cat([i for m in fsdp for i in m]).tolist()) == list(range(10))  # FSDP: every sample


def test_a_full_disk_is_one_line_and_the_last_checkpoint_stands(tiny, tmp_path, monkeypatch):
    """A write that fails (ENOSPC at the first picture, then at the second epoch's) ends the run in one line
    naming the file, with no temporary file left, and says how to go on: --overwrite before any checkpoint,
    --resume after one, whose checkpoint is whole."""
    from PIL import Image

    out, save = tmp_path / "run", Image.Image.save
    for full_at, then in (("samples_0000.png", "start again with the same command and --overwrite"),
                          ("samples_0002.png", f"go on with python lab/sd_runner.py --resume {out}")):
        def png(image, fp, *args, **kwargs):
            written.append(kwargs.get("format"))
            if written.count("PNG") > cut and kwargs.get("format") == "PNG":  # the samples_*.png, one an evaluation
                raise OSError(28, "No space left on device")
            return save(image, fp, *args, **kwargs)
        written, cut = [], 0 if full_at == "samples_0000.png" else 2
        monkeypatch.setattr(Image.Image, "save", png)
        with pytest.raises(SystemExit) as e:
            sd_runner.main(run_args(tiny, out, "--epochs", "2", "--overwrite"))
        message = str(e.value.code)
        assert message.startswith(f"error: cannot write {out}/{full_at} (No space left on device)"), message
        assert message.endswith(then) and "\n" not in message
        assert not list(out.glob(".tmp-*"))
    assert sd_runner.read_checkpoint(out)["epoch"] == 1  # epoch 1's checkpoint stands, whole


def test_the_run_folder_helpers_refuse_and_name_what_is_wrong(tmp_path):
    """the run-folder section (lab/run_folder.py), which both trainers use: flags compared with a run's, a folder
    holding a run refused and cleared only on overwrite, a signal recorded rather than raised."""
    import signal

    assert checkpoint.changed_flags({"lr": 0.1, "epochs": 4, "seed": 0}, {"lr": 0.2, "epochs": 9, "seed": 0},
                                      ("epochs",)) == ["--lr 0.2 differs from the run's 0.1"]
    out = tmp_path / "run"
    (out / "jagg").mkdir(parents=True)
    (out / "jagg" / "checkpoint.pt").write_bytes(b"x")
    (out / "notes.txt").write_text("mine")
    (out / "jagg" / ".tmp-killed").write_text("")
    with pytest.raises(ValueError, match=r"holds a run \(jagg/checkpoint.pt\): continue it with go on"):
        run_folder.claim_folder(str(out), ("*.json", "*/*.pt"), resume_command="go on")
    run_folder.claim_folder(str(out), ("*.json", "*/*.pt"), overwrite=True).close()
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [".lock", "jagg", "notes.txt"]
    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN under a background shell
    with run_folder.stop_on_signals() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
    assert stop == ["SIGINT"] and signal.getsignal(signal.SIGINT) is before


def test_atomic_write_leaves_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "summary.json"
    sd_runner.write_json(path, {"reward": 1.0})

    def half_then_crash(f):
        f.write('{"reward": ')
        raise KeyboardInterrupt  # an interrupted run

    with pytest.raises(KeyboardInterrupt):
        sd_runner.atomic_write(path, half_then_crash)
    assert path.read_text() == '{\n  "reward": 1.0\n}'
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary file left behind
    assert path.stat().st_mode & 0o777 == 0o644  # readable by others, not mkstemp's 0600


def test_the_papers_call_trains_unless_an_option_or_another_routing_asks_for_the_general_one():
    """Config.papers_jagg: jagg.backward_batch for the paper's flags (and --method exact), where the route is
    jagg.py's earliest-first schedule or moot (--jagg-frac 0 or 1), on any number of ranks; else
    options.backward_batch (the runner's default route, velocity, at --jagg-frac 0.5)."""
    def papers(*flags, world=1):
        return sd_runner.parse(list(flags)).papers_jagg(world)
    assert papers() and papers("--method", "exact") and papers("--jagg-frac", "0.5", "--window", "3", "--route", "early")
    assert papers(world=4) and papers("--method", "exact", "--jagg-frac", "0.5", world=4)
    assert papers("--jagg-frac", "0.5", "--route", "early", world=2)  # a fixed schedule: the ranks agree
    assert not papers("--jagg-frac", "0.5") and not papers("--jagg-frac", "0.5", "--route", "late")
    for flag in (["--anchors", "shared"], ["--interior", "rollout"], ["--weights", "index"],
                 ["--max-graph-rows", "2"]):
        assert not papers(*flag), flag


# ------------------------------------------------------------------ the SDE window (Flow-GRPO-Fast)


@pytest.mark.usefixtures("float64")
def test_window_rollout_is_the_sde_inside_and_the_ode_outside():
    torch.manual_seed(23)
    model = MLPFlow()
    fn, sigmas, noise = as_velocity_fn(model), jagg.sigma_schedule(8), torch.randn(5, 3)
    full = jagg.rollout(fn, noise, sigmas, 0.7, generator=torch.Generator().manual_seed(1))
    whole, sample = sd_runner.window_rollout(fn, noise, sigmas, 0.7, 0, 8, generator=torch.Generator().manual_seed(1))
    assert all(torch.equal(getattr(full, n), getattr(whole, n)) for n in jagg.Trajectory.TENSORS)  # bit for bit
    assert torch.equal(sample, full.sample)
    traj, sample = sd_runner.window_rollout(fn, noise, sigmas, 0.7, 2, 3, generator=torch.Generator().manual_seed(1))
    assert traj.z.shape == (3, 5, 3) and torch.equal(traj.t[:, 0], sigmas[2:5])
    z = noise.clone()
    with torch.no_grad():
        for k in range(2):  # the ODE before the window: Euler, no noise drawn
            z = z + fn(z[None], sigmas[k].expand(1, 5))[0] * (sigmas[k + 1] - sigmas[k])
        torch.testing.assert_close(traj.z[0], z, rtol=1e-12, atol=1e-12)
        z = traj.z_next[-1]
        for k in range(5, 8):  # and after it, to the clean sample
            z = z + fn(z[None], sigmas[k].expand(1, 5))[0] * (sigmas[k + 1] - sigmas[k])
    torch.testing.assert_close(sample, z, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="does not fit"):
        sd_runner.window_rollout(fn, noise, sigmas, 0.7, 6, 3)


def test_window_placement_follows_flow_grpo_fast():
    """Flow-GRPO-Fast's placement: the first step uniform in [low, high - K], drawn anew each epoch
    and the same for the same epoch and seed (every rank draws alike)."""
    starts = [sd_runner.window_start(e, 3, 1, 7) for e in range(1, 200)]
    assert set(starts) == {1, 2, 3, 4} and starts == [sd_runner.window_start(e, 3, 1, 7) for e in range(1, 200)]
    assert starts != [sd_runner.window_start(e, 3, 1, 7, seed=1) for e in range(1, 200)]
    with pytest.raises(ValueError, match="does not fit in steps 0 to 2"):
        sd_runner.window_start(1, 4, 0, 3)


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("fields, anchors", [({}, (0, 3)), ({"anchors": "shared", "interior": "rollout"}, (0, 3))])
def test_exact_and_jagg_inside_a_window_against_autograd_and_explicit_jacobians(fields, anchors):
    """A window of 4 SDE steps in 10: exact training on it is autograd of the window's summed loss,
    and JAGG on it (W = 4, one segment) is the explicit interpolation of Jacobians."""
    torch.manual_seed(24)
    model = MLPFlow()
    traj, sample = sd_runner.window_rollout(as_velocity_fn(model), torch.randn(6, 3), jagg.sigma_schedule(10), 0.7,
                                               3, 4, generator=torch.Generator().manual_seed(2))
    adv = jagg.group_advantages(-sample.norm(dim=-1), torch.arange(6) // 3)
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2)

    def grad(frac):
        model.zero_grad(set_to_none=True)
        options.backward_batch(as_velocity_fn(model), traj, adv, cfg, options.JaggOptions(4, frac, **fields))
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    step_loss = jagg.make_step_loss(traj, adv, 0, 4, cfg)
    _, expected_exact = reference_gradient(model, traj.z, traj.t, step_loss)
    torch.testing.assert_close(grad(0.0), expected_exact, rtol=1e-10, atol=1e-12)
    v_old = traj.v if fields.get("interior") == "rollout" else None
    expected = explicit_anchor_gradient(model, traj.z, traj.t, step_loss, anchors, v_old)
    torch.testing.assert_close(grad(1.0), expected, rtol=1e-9, atol=1e-10)
    assert (expected - expected_exact).norm() > 1e-6 * expected_exact.norm()



def test_trajectories_drawn_at_different_noise_levels_do_not_join():
    torch.manual_seed(21)
    traj, _ = toy_batch(MLPFlow(), T=4, B=4)
    other = jagg.Trajectory(**{f: getattr(traj, f) for f in jagg.Trajectory.TENSORS}, noise_level=1.0)
    with pytest.raises(ValueError, match="different noise levels"):
        sd_runner.cat_trajectories([traj, other])
    assert sd_runner.cat_trajectories([traj, traj]).z.shape[1] == 8


# ------------------------------------------------------------------ end to end (slow)


@slow
def test_train_jagg_then_resume_and_exact(tiny, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "jagg"
    rows = sd_runner.main(run_args(tiny, out, "--epochs", "1", "--window", "3"))
    lora = load_file(out / "lora.safetensors")
    assert lora and all("lora" in k for k in lora)
    assert any(v.abs().sum() > 0 for k, v in lora.items() if "lora_B" in k)  # B starts at zero: trained
    rows = sd_runner.main(run_args(tiny, out, "--epochs", "2", "--window", "3", "--resume", str(out)))
    assert [r["epoch"] for r in rows] == [0, 1, 2] and sd_runner.read_checkpoint(out)["epoch"] == 2
    assert any(not torch.equal(lora[k], v) for k, v in load_file(out / "lora.safetensors").items())
    assert [json.loads(line)["epoch"] for line in open(out / "metrics.jsonl")] == [0, 1, 2]
    rows = sd_runner.main(run_args(tiny, tmp_path / "exact", "--epochs", "1", "--method", "exact", "--beta", "0.1"))
    assert rows[1]["train/routed_frac"] == 0.0 and rows[1]["train/grad_rows"] == 2 * 4 and rows[1]["train/kl"] >= 0.0
    # Resuming with a setting the checkpoint's weights depend on is refused up front, naming both values.
    for flags, was, now in ((["--lora-rank", "8"], 4, 8), (["--lora-rank", "0"], 4, 0)):
        with pytest.raises(SystemExit, match=f"--resume: --lora-rank {now} differs from the run's {was};"):
            sd_runner.main(run_args(tiny, out, "--epochs", "3", "--window", "3", "--resume", str(out), *flags))
    assert sd_runner.read_checkpoint(out)["epoch"] == 2


@slow
def test_shared_anchors_rollout_interiors_and_probe_routing(tiny, tmp_path):
    """T = 5, W = 3 with shared anchors: segments 0-2 and 2-4; the probe (every epoch, before training)
    routes the better one to JAGG at --jagg-frac 0.5, and the checkpoint keeps its average."""
    out = tmp_path / "run"
    rows = sd_runner.main(run_args(tiny, out, "--epochs", "1", "--num-steps", "5", "--window", "3", "--anchors",
                                  "shared", "--interior", "rollout", "--route", "probe", "--probe-every", "1",
                                  "--jagg-frac", "0.5", "--beta", "0.1", "--max-graph-rows", "2"))
    row = rows[1]
    assert row["mode"] == "jagg_shared_rollout" and row["time/probe_seconds"] > 0 and row["train/skipped_steps"] == 0
    cosines = row["probe/grad_cosine"]  # both segments have an interior step: neither is exact
    assert len(cosines) == 2 and max(cosines) < 1.0 - 1e-9 and cosines[0] != cosines[1]
    assert row["routing/routed"] == [c == max(cosines) for c in cosines]
    # Rows with grad a micro-batch: the routed segment's 2 anchors, the other's 2 steps but the shared anchor.
    assert row["train/grad_rows"] == 2 * 4
    state = sd_runner.read_checkpoint(out)
    assert state["probe_average"] == cosines and state["config"]["anchors"] == "shared"


@slow
def test_resumed_run_equals_uninterrupted_run(tiny, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    straight = sd_runner.main(run_args(tiny, tmp_path / "a", "--epochs", "2", "--ema"))
    sd_runner.main(run_args(tiny, tmp_path / "b", "--epochs", "1", "--ema"))
    real = torch.save

    def killed_while_writing(obj, f, *args, **kwargs):  # a kill halfway through epoch 2's checkpoint
        if isinstance(obj, dict) and obj.get("epoch") == 2:
            f.write(b"half a checkpoint")
            raise KeyboardInterrupt
        real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", killed_while_writing)
    with pytest.raises(SystemExit, match="stopped at once by a second Ctrl-C"):
        sd_runner.main(run_args(tiny, tmp_path / "b", "--epochs", "2", "--ema", "--overwrite"))
    monkeypatch.undo()
    assert sd_runner.read_checkpoint(tmp_path / "b")["epoch"] == 1  # epoch 1's stands
    (tmp_path / "b" / ".tmp-killed").write_bytes(b"half a checkpoint")  # what a SIGKILL there leaves
    resumed = sd_runner.main(run_args(tiny, tmp_path / "b", "--epochs", "2", "--ema", "--resume", str(tmp_path / "b")))
    assert not [p for p in os.listdir(tmp_path / "b") if p.startswith(".tmp-")]  # no leftover
    assert straight[2]["rollout/reward_mean"] == pytest.approx(resumed[2]["rollout/reward_mean"], rel=1e-6)
    assert straight[2]["eval/reward"] == pytest.approx(resumed[2]["eval/reward"], rel=1e-6)
    a, b = load_file(tmp_path / "a" / "lora.safetensors"), load_file(tmp_path / "b" / "lora.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


@slow
def test_full_finetune_with_ema_prompt_file_and_pickscore(tiny, tmp_path):
    """Full fine-tuning (a frozen copy as the KL reference), EMA weights, prompts from a file, and the
    PickScore reward (--reward FOLDER) with a tiny CLIP model saved here."""
    from safetensors.torch import load_file
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    clip_dir = tmp_path / "clip"
    CLIPModel(CLIPConfig(text_config=dict(hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                          num_hidden_layers=1, vocab_size=200, max_position_embeddings=77,
                                          bos_token_id=0, eos_token_id=1, pad_token_id=1),
                         vision_config=dict(hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                            num_hidden_layers=1, image_size=32, patch_size=8),
                         projection_dim=16)).save_pretrained(clip_dir)
    CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size=32),
                  tokenizer=CLIPTokenizer.from_pretrained(os.path.join(tiny, "tokenizer"))).save_pretrained(clip_dir)
    (tmp_path / "prompts.txt").write_text("a red cat\n\na blue dog\n")
    out = tmp_path / "full"
    rows = sd_runner.main(run_args(tiny, out, "--epochs", "1", "--lora-rank", "0", "--ema", "--prompts",
                                  str(tmp_path / "prompts.txt"), "--reward", str(clip_dir), "--beta", "0.1"))
    assert rows[1]["train/kl"] >= 0 and abs(rows[1]["rollout/reward_mean"]) > 0
    weights = load_file(out / "transformer.safetensors")  # the EMA of every transformer weight
    ckpt = sd_runner.read_checkpoint(out)
    assert not any("lora" in k for k in weights) and len(weights) > 20 and ckpt["ema"].keys() == weights.keys()
    trained = ckpt["weights"]
    assert any(not torch.equal(weights[k], trained[k]) for k in weights)  # the EMA lags the trained weights


@slow
def test_flow_grpo_defaults(tiny, tmp_path):
    """Without flags, Flow-GRPO's geneval_sd3: the first int(T x 0.99) steps (3 of 4 here), 2 optimizer
    steps an epoch accumulating micro-batches, global std, an EMA."""
    out = tmp_path / "run"
    rows = sd_runner.main(run_args(tiny, out, "--epochs", "1", "--method", "exact", "--prompts-per-epoch", "4",
                                  plain=False))
    # 8 samples, none with a zero advantage (continuous rewards), in 2 steps of 2 micro-batches of 2;
    # each micro-batch back-propagates its 3 trained steps: 4 x 3 rows.
    assert rows[1]["train/samples"] == 8 and rows[1]["train/grad_rows"] == 4 * 3
    assert sd_runner.read_checkpoint(out)["ema"] is not None


def torchrun(args, n=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", "lab/sd_runner.py", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@slow
@pytest.mark.parametrize("mode", [(), ("--window", "3", "--anchors", "shared", "--interior", "rollout",
                                      "--max-graph-rows", "2")], ids=["paper", "shared-rollout-rows2"])
def test_torchrun_two_ranks_share_groups_and_stay_in_sync(tiny, tmp_path, mode):
    # shared-rollout-rows2: anchors 0, 2, 3 back-propagated one chunk at a time, the next chunk's
    # forward before this chunk's backward (the path DDP's own all-reduce cannot follow).
    from safetensors.torch import load_file

    torchrun(run_args(tiny, tmp_path, "--epochs", "1", "--group-size", "1", "--train-batch", "1", *mode))
    a, b = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")][1]["train/param_checksums"]
    assert a == b  # bit for bit: both ranks sum identical parameters in the same order
    # One sample per prompt per rank: groups exist only across ranks, so a changed LoRA shows that the
    # advantages came from the gathered rewards.
    assert any(v.abs().sum() > 0 for k, v in load_file(tmp_path / "lora.safetensors").items() if "lora_B" in k)


@slow
def test_torchrun_fsdp_trains_checkpoints_and_resumes(tiny, tmp_path):
    """--fsdp on two ranks: the ranks stay in sync, a run stopped after one epoch and resumed equals an
    uninterrupted one, and full fine-tuning with a sharded frozen reference and a sharded EMA trains."""
    from safetensors.torch import load_file

    def rows_of(out, *extra):
        torchrun(run_args(tiny, out, "--fsdp", "--window", "3", *extra))
        return [json.loads(line) for line in open(out / "metrics.jsonl")]

    rows_of(tmp_path / "resumed", "--epochs", "1")
    resumed = rows_of(tmp_path / "resumed", "--epochs", "2", "--resume", str(tmp_path / "resumed"))
    straight = rows_of(tmp_path / "straight", "--epochs", "2")
    for rows in (resumed, straight):
        assert [r["epoch"] for r in rows] == [0, 1, 2] and len(set(rows[-1]["train/param_checksums"])) == 1
    assert resumed[-1]["train/param_checksums"] == straight[-1]["train/param_checksums"]
    x, y = load_file(tmp_path / "resumed" / "lora.safetensors"), load_file(tmp_path / "straight" / "lora.safetensors")
    assert all(torch.equal(x[k], y[k]) for k in x) and any(v.abs().sum() > 0 for k, v in x.items() if "lora_B" in k)
    full = rows_of(tmp_path / "full", "--epochs", "1", "--lora-rank", "0", "--beta", "0.1", "--ema", "--anchors",
                   "shared", "--interior", "rollout")
    assert full[-1]["train/kl"] >= 0 and full[-1]["train/skipped_steps"] == 0
    assert len(set(full[-1]["train/param_checksums"])) == 1 and (tmp_path / "full" / "transformer.safetensors").exists()


@slow
def test_sde_window_trains_its_steps_alone_and_a_window_of_the_whole_trajectory_is_the_plain_run(tiny, tmp_path):
    """--sde-window K: stochastic and trained on K steps only, placed per epoch; a window over the
    whole trajectory (T = 4, range 0-3) is the run without --sde-window, bit for bit."""
    from safetensors.torch import load_file

    plain = sd_runner.main(run_args(tiny, tmp_path / "plain", "--epochs", "1", "--window", "4"))
    whole = sd_runner.main(run_args(tiny, tmp_path / "whole", "--epochs", "1", "--window", "4", "--sde-window", "4",
                                   "--sde-range-end", "4"))
    for key in ("rollout/reward_mean", "train/loss", "train/grad_rows", "eval/reward"):
        assert plain[1][key] == whole[1][key], key
    a, b = load_file(tmp_path / "plain" / "lora.safetensors"), load_file(tmp_path / "whole" / "lora.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = sd_runner.main(run_args(tiny, tmp_path / "win", "--epochs", "2", "--window", "3", "--sde-window", "3",
                                  "--num-steps", "6", "--anchors", "shared", "--interior", "rollout", "--probe-every", "1"))
    starts = [r["rollout/sde_window_start"] for r in rows[1:]]
    assert starts == [sd_runner.window_start(e, 3, 0, 5) for e in (1, 2)]  # Flow-GRPO-Fast's draw
    assert rows[1]["train/grad_rows"] == 2 * 2 and len(rows[1]["probe/grad_cosine"]) == 1  # one segment: 2 anchors


def nan_letter_pipeline(tiny, folder):
    """tiny's pipeline whose CLIP encoders embed the letter z as NaN: a prompt with a z samples NaN latents."""
    import shutil

    from transformers import CLIPTextModelWithProjection

    shutil.copytree(tiny, folder)
    for part in ("text_encoder", "text_encoder_2"):
        encoder = CLIPTextModelWithProjection.from_pretrained(os.path.join(folder, part))
        with torch.no_grad():
            encoder.text_model.embeddings.token_embedding.weight[2 + 2 * 25 : 2 + 2 * 26] = float("nan")
        encoder.save_pretrained(os.path.join(folder, part))
    return str(folder)


def nan_reward(images, prompts):
    return [float("nan")] * len(images)


@slow
def test_broken_samples_get_no_reward_and_a_run_without_a_step_fails(tiny, tmp_path):
    model = nan_letter_pipeline(tiny, tmp_path / "nan_pipe")
    (tmp_path / "prompts.txt").write_text("abc\nbcd\nzzz\n")
    rows = sd_runner.main(run_args(model, tmp_path / "run", "--epochs", "2", "--prompts", str(tmp_path / "prompts.txt"),
                                  "--prompts-per-epoch", "3", "--eval-samples", "3"))
    assert all(r["eval/nonfinite_samples"] == 1 and 0 <= r["eval/reward"] <= 1 for r in rows)  # zzz, unscored
    broken = [r["rollout/nonfinite_samples"] for r in rows[1:]]
    assert sum(broken) > 0 and all(r["train/skipped_steps"] == 0 for r in rows[1:])  # dropped, not trained on
    assert all(r["rollout/nonfinite_samples"] % 2 == 0 for r in rows[1:])  # whole groups of 2 of zzz
    run = cli(*run_args(tiny, tmp_path / "none", "--epochs", "1", "--reward", "test_sd_runner:nan_reward"), cwd=tmp_path)
    assert run.returncode != 0 and run.stderr.strip().splitlines()[-1].startswith("error: no optimizer step was taken")
    assert "NaN" not in (tmp_path / "none" / "summary.json").read_text()


def test_a_non_finite_loss_skips_the_step_on_the_weights_and_the_run_says_so(tiny, tmp_path, monkeypatch):
    """A NaN loss (as bf16 rollouts of real models give) in every micro-batch: each optimizer step is
    skipped with a warning, the LoRA weights stay the initial ones, and the run ends in one line saying
    no step was taken."""
    real = jagg.backward_batch  # the call the default flags train with

    def nan_loss(*args, **kwargs):
        stats, routed = real(*args, **kwargs)
        stats["loss"] = float("nan")
        return stats, routed
    monkeypatch.setattr(jagg, "backward_batch", nan_loss)
    out = tmp_path / "run"
    with pytest.warns(RuntimeWarning, match="skipped: non-finite loss"), \
            pytest.raises(SystemExit, match="no optimizer step was taken"):
        sd_runner.main(run_args(tiny, out, "--epochs", "1"))
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert rows[-1]["train/skipped_steps"] >= 1 and rows[-1]["train/optimizer_steps"] == 0
    weights = sd_runner.read_checkpoint(out)["weights"]  # LoRA starts with B = 0; any step moves it
    lora_b = [w for name, w in weights.items() if "lora_B" in name]
    assert lora_b and all((w == 0).all() for w in lora_b)


@slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_a_signal_stops_the_run_at_once_and_the_command_it_prints_goes_on(tiny, tmp_path, sig):
    """SIGTERM (a cluster's preemption) or SIGHUP (a closed terminal) once the first epoch is done:
    the run stops at the next optimizer step or rollout chunk, in one line that names the checkpoint
    that stands and a command; that command, as printed (no flag of the run given again, --epochs
    aside), continues the run."""
    import re
    import shlex
    import signal

    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "lab", "sd_runner.py"), *run_args(tiny, out, "--epochs", "50",
                            "--eval-every", "50")], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("epoch 1/"):
            proc.send_signal(getattr(signal, sig))
            break
    err = proc.communicate(timeout=300)[1]
    last = err.strip().splitlines()[-1]
    assert proc.returncode != 0 and last.startswith(f"error: stopped by {sig} "), err
    match = re.search(r"the checkpoint of epoch (\d+) stands: go on with (python lab/sd_runner.py --resume \S+)$", last)
    assert match, last
    epoch, command = int(match.group(1)), shlex.split(match.group(2))
    assert sd_runner.read_checkpoint(out)["epoch"] == epoch >= 1
    rows = sd_runner.main([*command[2:], "--epochs", str(epoch + 1)])  # the printed command, one epoch more
    assert [r["epoch"] for r in rows] == list(range(epoch + 2))
    assert json.load(open(out / "config.json"))["lr"] == 1e-2  # the run's flags, not the defaults


# ------------------------------------------------------------------ a long run: the same run, or refused


def test_resume_with_the_folder_alone_takes_the_runs_flags(tiny, tmp_path):
    """--resume DIR without the run's flags continues the run with them (the command a stopped run
    prints); a flag given again must be the run's; --epochs may grow."""
    out = tmp_path / "run"
    fake_checkpoint(tiny, out, 1, **WHOLE)
    cfg = sd_runner.validate(sd_runner.parse(["--resume", str(out)]), sd_runner.given_flags(["--resume", str(out)]))
    assert (cfg.model, cfg.lr, cfg.window, cfg.epochs, cfg.out) == (tiny, 1e-2, 2, 100, str(out))
    argv = ["--resume", str(out), "--epochs", "3", "--lr", "0.01"]
    assert sd_runner.validate(sd_runner.parse(argv), sd_runner.given_flags(argv)).epochs == 3
    argv = ["--resume", str(out), "--window", "3"]
    with pytest.raises(SystemExit, match="--window 3 differs from the run's 2; give the run's, or leave the flag out"):
        sd_runner.validate(sd_runner.parse(argv), sd_runner.given_flags(argv))


def test_resume_refuses_another_process_count_model_prompts_or_fixed_setting(tiny, tmp_path, monkeypatch):
    """What makes the run beyond its flags, each refused in one line naming it: the process count
    (either way), --model resolving to another model (the same string from another folder), the
    prompts file's contents, a FIXED constant. The same model moved elsewhere is the same model."""
    import shutil

    def resume(out, *extra):
        argv = ["--resume", str(out), *extra]
        return sd_runner.validate(sd_runner.parse(argv), sd_runner.given_flags(argv))

    out = tmp_path / "run"
    fake_checkpoint(tiny, out, 1, **WHOLE)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match=r"the run trained on 1 process\(es\) and this one has 2: resume it with one"):
        resume(out)
    monkeypatch.delenv("WORLD_SIZE")
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    state["identity"]["processes"] = 2
    torch.save(state, out / "checkpoint.pt")
    with pytest.raises(SystemExit, match="resume it with torchrun --nproc_per_node 2"):
        resume(out)
    # --model ../tiny typed in two folders that each have their own ../tiny
    for name in ("a", "b"):
        shutil.copytree(tiny, tmp_path / name / "tiny")
        (tmp_path / name / "cwd").mkdir()
    config = tmp_path / "b" / "tiny" / "scheduler" / "scheduler_config.json"
    config.write_text(config.read_text().replace('"shift": 3.0', '"shift": 2.0'))
    monkeypatch.chdir(tmp_path / "a" / "cwd")
    out = tmp_path / "relative"
    fake = sd_runner.validate(sd_runner.parse(run_args("../tiny", out)))
    out.mkdir()
    torch.save({"epoch": 1, "config": {**dataclasses.asdict(fake), "fixed": sd_runner.FIXED},
                "identity": sd_runner.run_identity(fake), **WHOLE}, out / "checkpoint.pt")
    monkeypatch.chdir(tmp_path / "b" / "cwd")
    with pytest.raises(SystemExit, match=f"--model is {tmp_path / 'b' / 'tiny'}, not the model the run trained "
                                         f"\\({tmp_path / 'a' / 'tiny'}\\)"):
        resume(out)
    shutil.move(tmp_path / "a" / "tiny", tmp_path / "b" / "moved")  # the run's model, moved: the same model
    assert resume(out, "--model", str(tmp_path / "b" / "moved")).model == str(tmp_path / "b" / "moved")
    monkeypatch.chdir(tmp_path)
    # the prompts file and a FIXED constant
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\na blue dog\n")
    out = tmp_path / "prompted"
    fake = sd_runner.validate(sd_runner.parse(run_args(tiny, out, "--prompts", str(prompts))))
    out.mkdir()
    torch.save({"epoch": 1, "config": {**dataclasses.asdict(fake), "fixed": sd_runner.FIXED},
                "identity": sd_runner.run_identity(fake), **WHOLE}, out / "checkpoint.pt")
    assert resume(out).prompts == str(prompts)
    prompts.write_text("a red cat\na green dog\n")
    with pytest.raises(SystemExit, match="the prompts are not the run's"):
        resume(out)
    prompts.write_text("a red cat\na blue dog\n")
    monkeypatch.setitem(sd_runner.FIXED, "max_grad_norm", 0.5)
    with pytest.raises(SystemExit, match="lab/sd_runner.py's FIXED max_grad_norm is 0.5, the run's 1.0: restore it"):
        resume(out)


def test_a_reward_must_give_one_finite_number_per_image(tmp_path):
    """The reward contract, checked at every call: a scalar, a wrong length, strings or None end the
    run in one line naming the reward, what it gave and what it owes; a column [n, 1] is accepted;
    a NaN or inf is kept, for the caller to count."""
    from PIL import Image

    images, prompts = [Image.new("RGB", (8, 8)) for _ in range(3)], ["a", "b", "c"]
    for scored, gave in ((0.5, "shape ()"), ([1.0, 2.0], "shape (2,)"), (["x", "y", "z"], "list"),
                         (None, "NoneType"), (torch.ones(3, 2), "shape (3, 2)")):
        with pytest.raises(SystemExit) as e:
            sd_runner.rewards_of(lambda ims, ps, s=scored: s, images, prompts, "my:reward")
        assert str(e.value.code) == (f"error: --reward my:reward returned {gave} for 3 images: it must return "
                                     "3 numbers, one per image, in their order")
    assert sd_runner.rewards_of(lambda ims, ps: torch.ones(3, 1), images, prompts).tolist() == [1.0] * 3
    images[1].info["finite"] = False  # a broken sample is not scored: the reward owes 2 numbers
    got = sd_runner.rewards_of(lambda ims, ps: [float("inf"), 0.5][: len(ims)], images, prompts)
    assert math.isinf(got[0]) and math.isnan(got[1]) and got[2] == 0.5


def test_another_family_in_the_model_folder_is_one_line(tiny, tmp_path):
    import shutil

    folder = tmp_path / "flux_in_sd3"
    shutil.copytree(tiny, folder)
    config = folder / "transformer" / "config.json"
    config.write_text(config.read_text().replace('"SD3Transformer2DModel"', '"FluxTransformer2DModel"'))
    with pytest.raises(SystemExit, match=f"--model '{folder}' holds a FluxTransformer2DModel: lab/sd_runner.py trains an "
                                         "SD3 transformer"):
        sd_runner.main(run_args(str(folder), tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_long_prompt_line_is_cut_once_with_one_warning(tiny, capsys):
    """A 1 MB line is cut, once, to the tokens T5 takes, in about a second; a short one is left."""
    pipe, _ = sd_runner.load_pipeline(sd_runner.Config(model=tiny, lora_rank=0), torch.device("cpu"), torch.float32)
    long = "a red cat on a mat " * 50_000
    start = time.perf_counter()
    fitted = sd_runner.fit_prompts(pipe, [long, "a blue dog"])
    assert time.perf_counter() - start < 30 and fitted[1] == "a blue dog" and len(fitted[0]) < 2000
    assert capsys.readouterr().out.count("warning: 1 prompt(s) longer than the 256 tokens") == 1
    assert sd_runner.fit_prompts(pipe, fitted) == fitted  # cut once: cutting again changes nothing


def test_a_lock_names_its_process_and_a_fork_does_not_keep_it(tmp_path):
    """The run holding --out is named by its process id; a process the run forked (a reward's
    worker) does not keep the folder locked once the run has ended."""
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, 'lab'); import run_folder; "
                               f"lock = run_folder.claim_folder({str(out)!r}, ()); print('ready', flush=True); "
                               "time.sleep(60)"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "ready"
    with pytest.raises(ValueError, match=f"is in use by process {holder.pid} "):
        run_folder.claim_folder(str(out), ())
    holder.kill()
    holder.wait()
    lock = run_folder.claim_folder(str(out), ())
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the forked worker lives on after the run (its fork hooks have run by now)
        os.write(write, b"forked")
        time.sleep(3)
        os._exit(0)
    assert os.read(read, 6) == b"forked"
    run_folder.release(lock)
    run_folder.release(run_folder.claim_folder(str(out), ()))  # free while the child still lives
    os.waitpid(child, 0)


@slow
def test_weights_and_checkpoint_agree_after_a_kill_between_their_writes(tiny, tmp_path, monkeypatch):
    """The weights are written before the checkpoint: a kill between the two leaves epoch 1's
    checkpoint beside epoch 2's weights, and --resume rewrites them and trains epoch 2 again, ending
    where an uninterrupted run ends; a kill after the last checkpoint, before summary.json, leaves a
    run that --resume finishes without training, its weights the checkpoint's."""
    from safetensors.torch import load_file

    sd_runner.main(run_args(tiny, tmp_path / "straight", "--epochs", "2"))
    real = run_folder.atomic_write

    writes = []

    def killed_at_the_second_checkpoint(path, data, mode="w"):
        if os.path.basename(path) == "checkpoint.pt":
            writes.append(path)
            if len(writes) == 2:
                raise KeyboardInterrupt
        return real(path, data, mode)

    out = tmp_path / "killed"
    monkeypatch.setattr(sd_runner, "atomic_write", killed_at_the_second_checkpoint)
    with pytest.raises(SystemExit, match="stopped at once by a second Ctrl-C; go on with python lab/sd_runner.py --resume"):
        sd_runner.main(run_args(tiny, out, "--epochs", "2"))
    monkeypatch.undo()
    assert sd_runner.read_checkpoint(out)["epoch"] == 1  # epoch 2's weights were written, its checkpoint not
    ckpt_weights = sd_runner.read_checkpoint(out)["weights"]
    assert any(not torch.equal(v, ckpt_weights[k]) for k, v in load_file(out / "lora.safetensors").items())
    sd_runner.main(["--resume", str(out)])
    a, b = load_file(tmp_path / "straight" / "lora.safetensors"), load_file(out / "lora.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # a kill after the last checkpoint: the run is finished but has no summary.json
    monkeypatch.setattr(sd_runner, "write_json", lambda path, obj: (_ for _ in ()).throw(KeyboardInterrupt)
                        if path.endswith("summary.json") else run_folder.write_json(path, obj))
    fin = tmp_path / "finished"
    with pytest.raises(SystemExit, match="second Ctrl-C"):
        sd_runner.main(run_args(tiny, fin, "--epochs", "1"))
    monkeypatch.undo()
    assert not (fin / "summary.json").exists() and sd_runner.read_checkpoint(fin)["epoch"] == 1
    (fin / "lora.safetensors").write_bytes(b"an older file")  # what a kill could leave
    rows = sd_runner.main(["--resume", str(fin)])
    assert [r["epoch"] for r in rows] == [0, 1] and json.load(open(fin / "summary.json"))["epochs"] == 1
    saved = sd_runner.read_checkpoint(fin)["weights"]
    assert all(torch.equal(v, saved[k]) for k, v in load_file(fin / "lora.safetensors").items())


HUP_AT = []  # the call at which hup_at_a_call sends SIGHUP; empty: never


def hup_at_a_call(images, prompts, calls=[]):
    """darkness, and a SIGHUP to this process at call HUP_AT[0] of this reward."""
    import signal

    calls.append(1)
    if HUP_AT and len(calls) == HUP_AT[0]:
        os.kill(os.getpid(), signal.SIGHUP)
    return [sd_runner.darkness(im) for im in images]


@slow
def test_a_signal_mid_epoch_stops_at_the_next_optimizer_step_and_resume_equals_a_whole_run(tiny, tmp_path):
    """SIGHUP during epoch 2 (of 2 optimizer steps): the run stops after its first step, without a
    checkpoint of that epoch, and says so; --resume redoes epoch 2, and the weights are those of a
    run never stopped."""
    from safetensors.torch import load_file

    args = ("--epochs", "2", "--reward", "test_sd_runner:hup_at_a_call")
    sd_runner.main(run_args(tiny, tmp_path / "straight", *args))
    hup_at_a_call.__defaults__[0].clear()
    HUP_AT.append(4)  # epoch 2's rollouts: epoch 0's evaluation, epoch 1's rollouts and evaluation come first
    out = tmp_path / "stopped"
    try:
        with pytest.raises(SystemExit) as e:
            sd_runner.main(run_args(tiny, out, *args))
    finally:
        HUP_AT.clear()
    assert str(e.value.code) == (f"error: stopped by SIGHUP in epoch 2, after 1 of its 2 optimizer steps; the checkpoint "
                                 f"of epoch 1 stands: go on with python lab/sd_runner.py --resume {out}")
    assert sd_runner.read_checkpoint(out)["epoch"] == 1
    sd_runner.main(["--resume", str(out)])
    a, b = load_file(tmp_path / "straight" / "lora.safetensors"), load_file(out / "lora.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


@slow
def test_torchrun_stops_every_rank_inside_the_launchers_grace(tiny, tmp_path):
    """SIGTERM to torchrun (a cluster's preemption) with long epochs: every rank stops at its next
    optimizer step or rollout chunk, well inside torchrun's 30 s before it kills them, and the run
    names the checkpoint that stands."""
    import signal

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "lab/sd_runner.py",
           *run_args(tiny, out, "--epochs", "50", "--eval-every", "50", "--prompts-per-epoch", "8")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("epoch 1/"):
            break
    time.sleep(2)  # inside epoch 2
    sent = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert time.perf_counter() - sent < 25, err[-2000:]
    # The signal lands inside an epoch, in its rollouts or between its optimizer steps (the checkpoint
    # is the epoch before), or, on a fast machine, between two epochs (the one just written).
    inside = re.search(r"error: stopped by SIGTERM in epoch (\d+)[,'][^;]*; the checkpoint of epoch (\d+) stands", err)
    between = re.search(r"error: stopped by SIGTERM after epoch (\d+); the checkpoint of epoch (\d+) stands", err)
    assert inside or between, err[-3000:]
    if inside:
        assert int(inside[2]) == int(inside[1]) - 1 >= 1, err[-3000:]
    else:
        assert int(between[2]) == int(between[1]) >= 1, err[-3000:]
    stands = inside or between
    assert "forcefully" not in err and sd_runner.read_checkpoint(out)["epoch"] == int(stands[2])
