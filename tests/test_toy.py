"""train_toy.py as a user meets it: bad flags refused before any work, a tiny run's files (fast);
seeded GRPO runs that raise the reward, exact repeats, and a non-editable install (slow)."""

import copy
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

import flows
import jagg
import toy_dit
import train_toy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
slow = pytest.mark.slow


@pytest.fixture(scope="session")
def base_ckpt(tmp_path_factory):
    """A quickly pretrained toy DiT (the demo pretrains longer; this is enough to learn the modes)."""
    path = str(tmp_path_factory.mktemp("base") / "toy_base.pt")
    train_toy.save_base_model(toy_dit.pretrain(steps=400, seed=0, batch=256), path)
    return path


def quick(base_ckpt, out, *extra):
    return ["--base-ckpt", base_ckpt, "--out", str(out), "--eval-samples", "128", "--eval-every", "5",
            *extra]


def rows_of(folder):
    return [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]


# --- fast: the command line's contract

@pytest.mark.parametrize("args, message", [
    (["--window", "1"], r"--window must be in \[2, --num-steps 16\], got 1"),
    (["--window", "17"], r"--window must be in \[2, --num-steps 16\], got 17"),
    (["--jagg-frac", "1.5"], r"--jagg-frac must be in \[0, 1\], got 1.5"),
    (["--lr", "nan"], "every number must be finite"),
    (["--lr", "0"], "--lr must be > 0, got 0.0"),
    (["--method", "fast"], "--method must be exact, jagg or compare, got 'fast'"),
    (["--base-ckpt", "/nonexistent/base.pt"], "--base-ckpt must be an existing file"),
    (["--minibatches", "5"], "--minibatches must be a divisor of the batch of 64"),
    (["--group-size", "1"], "--group-size must be >= 2"),
    (["--noise-level", "0"], r"--noise-level must be in \(0, 1\]"),
])
def test_bad_input_fails_before_touching_files(tmp_path, args, message):
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=message):
        train_toy.main(["--out", str(out), *args])
    assert not out.exists()


def test_every_flag_has_help_and_a_bad_value_is_one_line(tmp_path):
    """--help explains every flag; as a user meets a bad one: one line on stderr, no traceback."""
    usage = subprocess.run([sys.executable, os.path.join(ROOT, "train_toy.py"), "--help"], cwd=tmp_path,
                           capture_output=True, text=True)
    for field in train_toy.fields(train_toy.Args):
        assert "--" + field.name.replace("_", "-") in usage.stdout
        assert field.metadata["help"].split(",")[0][:20] in " ".join(usage.stdout.split())
    run = subprocess.run([sys.executable, os.path.join(ROOT, "train_toy.py"), "--out", "out",
                          "--epochs", "0"], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode != 0 and run.stderr.strip().splitlines() == [
        "error: --epochs must be >= 1, got 0"]
    assert os.listdir(tmp_path) == []


def test_a_corrupt_base_checkpoint_is_one_line(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"this is not a checkpoint")
    with pytest.raises(SystemExit, match="is not a toy DiT checkpoint"):
        train_toy.main(["--base-ckpt", str(bad), "--out", str(tmp_path / "out")])


def test_a_tiny_run_writes_what_it_says(tmp_path, monkeypatch, capsys):
    """Two epochs of both methods from a base pretrained for one step (cached under runs/cache of
    the working folder): the lines it prints, its files, and the rows with grad it counts."""
    monkeypatch.chdir(tmp_path)
    args = ["--out", "out", "--pretrain-steps", "1", "--epochs", "2", "--group-size", "4",
            "--eval-samples", "8", "--eval-every", "1"]
    train_toy.main(args)
    printed = capsys.readouterr().out
    assert "[exact] epoch   2/2  reward" in printed and "JAGG kept" in printed
    assert json.load(open("out/config.json")) == train_toy.asdict(train_toy.parse_args(args))
    assert os.path.isfile("runs/cache/toy_dit_h64_d3_s1_seed0.pt")
    for method in ("exact", "jagg"):
        rows = rows_of(f"out/{method}")
        assert [r["epoch"] for r in rows] == [1, 2]
        assert {key.split("/")[0] for r in rows for key in r} == {"epoch", "method", "rollout",
                                                                  "train", "time", "eval"}
        s = json.load(open(f"out/{method}/summary.json"))
        assert s["method"] == method and s["config"]["epochs"] == 2
        # T = 16 in windows of 4, 4 optimizer steps an epoch: exact 16 rows a step, JAGG 2 of 4
        assert s["grad_rows"] == 2 * 4 * (16 if method == "exact" else 8)
    top = json.load(open("out/summary.json"))
    assert top["exact"]["reward_gain"] == json.load(open("out/exact/summary.json"))["reward_gain"]
    for picture in ("samples.png", "reward.png"):
        assert os.path.getsize(f"out/{picture}") > 1000
    assert not [p for _, _, files in os.walk("out") for p in files if p.endswith(".tmp")]  # save's, replaced


def test_the_kl_is_to_the_frozen_base_and_zero_without_beta(tmp_path, monkeypatch):
    """--beta 0.04: the KL term is measured against the base model, which training does not move, so
    after the first optimizer step it is above 0; with --beta 0 no reference runs and it is 0."""
    monkeypatch.chdir(tmp_path)
    common = ["--pretrain-steps", "1", "--epochs", "1", "--group-size", "4", "--eval-samples", "8", "--lr", "1e-2"]
    for beta in ("0.04", "0"):
        train_toy.main([*common, "--beta", beta, "--out", f"b{beta}"])
        kl = [r["train/kl"] for m in ("exact", "jagg") for r in rows_of(f"b{beta}/{m}")]
        assert all(k > 1e-9 for k in kl) if beta != "0" else kl == [0.0, 0.0], (beta, kl)


def test_route_velocity_routes_by_the_cosine_rule(tmp_path, monkeypatch):
    """--route velocity reaches jagg.backward_batch, whose JAGG windows are the cosine rule's, worked out
    in tests/flows.py's wrapper from each call's trajectory."""
    seen = flows.routes_by_the_velocity_score(monkeypatch)
    monkeypatch.chdir(tmp_path)
    train_toy.main(["--pretrain-steps", "1", "--epochs", "1", "--group-size", "4", "--eval-samples", "8",
                    "--jagg-frac", "0.5", "--route", "velocity", "--out", "v"])
    assert seen and set(seen) == {"velocity"}


def test_an_epoch_is_the_papers_loop_written_out(float64):
    """One epoch of train(), its optimizer steps recomputed here with jagg.backward_batch, plain
    autograd of the summed clipped loss for exact: the same weights to float round-off."""
    torch.manual_seed(0)
    args = train_toy.Args(epochs=1, group_size=4, minibatches=2, num_steps=6, window=3,
                          eval_samples=4)
    base = toy_dit.ToyDiT(toy_dit.ToyDiTConfig(hidden=16, depth=1, heads=2))
    for p in base.parameters():  # adaLN-Zero starts at zero: give the gradient something to move
        torch.nn.init.normal_(p, std=0.1)
    for method in ("exact", "jagg"):
        _, model = train_toy.train(args, base, method)
        mine = copy.deepcopy(base)
        opt = torch.optim.AdamW(mine.parameters(), lr=args.lr)
        g = torch.Generator().manual_seed(0)
        labels = torch.arange(4).repeat_interleave(4)
        sigmas = jagg.sigma_schedule(6, 3.0)
        traj = jagg.rollout(train_toy.make_velocity_fn(mine, labels), torch.randn(16, 2, generator=g),
                            sigmas, 0.7, g)
        adv = jagg.group_advantages(train_toy.reward_fn(traj.sample, labels), labels)
        cfg = jagg.LossConfig(0.7, 0.2)
        for step, idx in enumerate(torch.randperm(16, generator=g).chunk(2)):
            for group in opt.param_groups:  # the demo's cosine to 0 over 2 steps: lr, lr / 2
                group["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * step / 2))
            opt.zero_grad()
            fn, sub = train_toy.make_velocity_fn(mine, labels[idx]), traj.subset(idx)
            if method == "exact":  # autograd of the mean over steps of Flow-GRPO's per-step loss
                step_loss = jagg.make_step_loss(sub, adv[idx], 0, 6, cfg)
                sum(step_loss(k, fn(sub.z[k : k + 1], sub.t[k : k + 1])[0]) for k in range(6)).backward()
            else:
                jagg.backward_batch(fn, sub, adv[idx], cfg, window=3, jagg_frac=1.0)
            torch.nn.utils.clip_grad_norm_(mine.parameters(), 1.0)
            opt.step()
        for a, b in zip(model.parameters(), mine.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


# --- slow: end to end

@slow
def test_short_grpo_run_raises_reward_for_both_methods(base_ckpt, tmp_path):
    argv = quick(base_ckpt, tmp_path, "--epochs", "15")
    train_toy.main(argv)
    top = json.load(open(tmp_path / "summary.json"))
    assert top["method"] == "compare"
    ex, jg = top["exact"], top["jagg"]
    for method, s in (("exact", ex), ("jagg", jg)):
        assert s == json.load(open(tmp_path / method / "summary.json"))
        assert s["final_reward"] > s["initial_reward"] + 0.05, s
        rows = rows_of(tmp_path / method)
        assert len(rows) == 15 and all("train/clipfrac" in r and "time/grad_seconds" in r for r in rows)
    # the printed speedups are the ratios of the times each epoch logged in metrics.jsonl
    seconds = {m: {k: sum(r[f"time/{k}_seconds"] for r in rows_of(tmp_path / m))
                   for k in ("train", "grad")} for m in ("exact", "jagg")}
    for k in ("train", "grad"):
        assert top[f"{k}_speedup"] == pytest.approx(seconds["exact"][k] / seconds["jagg"][k])
    # both start from the base checkpoint's own evaluation, recomputed here from the file
    base_reward = train_toy.evaluate(toy_dit.load(base_ckpt), train_toy.parse_args(argv))[0]
    assert ex["initial_reward"] == jg["initial_reward"] == pytest.approx(base_reward, abs=1e-6)
    assert ex["grad_rows"] == 2 * jg["grad_rows"]  # JAGG: 2 of every 4 steps with grad


def run_script(args, threads="1", timeout=300):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train_toy.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": threads})


@slow
@pytest.mark.parametrize("threads", ["1", "2"])
def test_a_run_repeats_exactly_on_one_machine(base_ckpt, tmp_path, threads):
    """The same short run twice, in fresh processes with the same thread count, gives identical
    rewards to the last bit. (Across processors CPU kernels differ, and 80 epochs amplify last-bit
    differences into a different run, as another seed would: the README says so.)"""
    curves = []
    for i in range(2):
        out = tmp_path / f"run{i}"
        proc = run_script(quick(base_ckpt, out, "--method", "jagg", "--epochs", "4",
                                "--eval-every", "2"), threads)
        assert proc.returncode == 0, proc.stderr[-2000:]
        curves.append([(r["rollout/reward_mean"], r.get("eval/reward"), r["train/loss"])
                       for r in rows_of(out)])
    assert curves[0] == curves[1]
    assert len({c[0] for c in curves[0]}) > 1  # the runs did train: the rollouts' reward moved


@slow
def test_a_non_editable_install_runs_the_scripts(tmp_path):
    """pip install . (not editable) ships every top-level module the scripts import: run from
    outside the checkout."""
    target, source = tmp_path / "site", tmp_path / "source"  # a copy: setuptools leaves build/
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", "runs", "build", "*.egg-info",
                                                                "__pycache__"))
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target),
                          str(source)], capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": str(target)}
    # Every module of the repository's top level must come from the install: an editable install
    # of the checkout elsewhere on the path would otherwise hide a module the wheel leaves out.
    ours = sorted(name[:-3] for name in os.listdir(ROOT) if name.endswith(".py"))
    code = (f"import json, sys; [__import__(m) for m in {ours!r}]; "
            f"print(json.dumps({{m: sys.modules[m].__file__ for m in {ours!r}}}))")
    imports = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                             capture_output=True, text=True)
    assert imports.returncode == 0, imports.stderr[-3000:]
    loaded = json.loads(imports.stdout.strip().splitlines()[-1])
    assert all(path.startswith(str(target)) for path in loaded.values()), loaded
    usage = subprocess.run([sys.executable, str(target / "train_toy.py"), "--help"], cwd=tmp_path,
                           env=env, capture_output=True, text=True)
    assert usage.returncode == 0 and "--epochs" in usage.stdout, usage.stderr[-3000:]
