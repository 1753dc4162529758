"""train_toy.py as a user meets it: bad flags refused before any work, a tiny run's files (fast); seeded GRPO
runs that raise the reward, probe routing, torchrun, exact repeats, resume after a kill and a non-editable
install (slow, end to end)."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import toy_dit
import train_toy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
slow = pytest.mark.slow


@pytest.fixture(scope="session")
def base_ckpt(tmp_path_factory):
    """A quickly pretrained toy DiT (the demo pretrains longer; this is enough to learn the modes)."""
    path = str(tmp_path_factory.mktemp("base") / "toy_base.pt")
    toy_dit.pretrain(path, steps=400, seed=0, batch=256)
    return path


def quick(base_ckpt, out, *extra):
    return ["--base-ckpt", base_ckpt, "--out", str(out), "--eval-samples", "128", "--eval-every", "5", *extra]


def rows_of(folder):
    return [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]


# --- fast: the command line's contract

@pytest.mark.parametrize("args, message", [
    (["--window", "1"], "--window must be >= 2, got 1"),
    (["--window", "17"], "--window 17 is longer than --num-steps 16"),
    (["--jagg-frac", "1.5"], r"--jagg-frac must be in \[0, 1\], got 1.5"),
    (["--lr", "nan"], "--lr must be > 0, got nan"),
    (["--max-drift", "-0.5"], "--max-drift must be >= 0 or -1"),
    (["--base-ckpt", "/nonexistent/base.pt"], "does not exist"),
    (["--route", "probe", "--probe-every", "0"], "--route probe routes by the probe"),
    (["--interior", "rollout", "--max-graph-rows", "1"], "--max-graph-rows 1 is below the 2"),
    (["--minibatches", "5"], "--minibatches 5 must divide the batch of 64"),
    (["--min-cosine", "2"], r"--min-cosine must be in \[-1, 1\]"),
    (["--resume"], "holds no run"),
])
def test_bad_input_fails_before_touching_files(tmp_path, args, message):
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=message):
        train_toy.main(["--out", str(out), *args])
    assert not out.exists()


def test_every_numeric_flag_is_range_checked(tmp_path):
    """Each numeric flag declares its range, its default lies in it, and a value outside it is refused in one
    line that names the flag and the value, before the output folder is made."""
    numeric = [f for f in train_toy.fields(train_toy.Config) if f.type in (int, float)]
    assert len(numeric) >= 20
    for f in numeric:
        assert f.metadata["valid"], f"--{f.name} declares no range"
        ok, text = f.metadata["valid"]
        assert ok(f.default), f"--{f.name}'s default {f.default} is out of its range {text}"
        bad = next(v for v in (-10**6, -2, -1, 0, 0.5, 1, 1.5, 10**6, math.inf) if not ok(v) or not math.isfinite(v))
        flag, out = "--" + f.name.replace("_", "-"), tmp_path / f.name
        with pytest.raises(SystemExit) as e:
            train_toy.main(["--out", str(out), flag, str(f.type(bad) if math.isfinite(bad) else bad)])
        message = str(e.value.code)
        assert message.startswith(f"error: {flag} must be {text}, got ") and "\n" not in message, message
        assert not out.exists()


def test_unwritable_out_fails_before_any_work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("")
    for out in ("/proc/x", str(tmp_path / "a_file" / "out")):
        with pytest.raises(SystemExit, match="cannot be created or written to"):
            train_toy.main(["--out", out, "--pretrain-steps", "1"])
    assert not (tmp_path / "runs").exists()  # no pretraining started


def test_an_output_folder_belongs_to_one_run(tmp_path):
    """A folder that holds a run is refused without --resume or --overwrite, one in use (its lock held) is
    refused, --resume with --overwrite is refused, a checkpoint that is not whole is one line; each before any
    work, with nothing of the old run touched."""
    import fcntl

    out = tmp_path / "out"
    (out / "jagg").mkdir(parents=True)
    (out / "jagg" / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(SystemExit) as e:
        train_toy.main(["--out", str(out), "--pretrain-steps", "1"])
    assert str(e.value.code) == (f"error: --out '{out}' holds a run (jagg/metrics.jsonl): continue it with --resume, "
                                 "start afresh with --overwrite, or pick another folder")
    with pytest.raises(SystemExit, match="--resume continues a run, --overwrite deletes it: give one"):
        train_toy.main(["--out", str(out), "--resume", "--overwrite"])
    with open(out / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another run holds the folder
        with pytest.raises(SystemExit, match=f"--out '{out}' is in use by another run"):
            train_toy.main(["--out", str(out), "--pretrain-steps", "1", "--overwrite"])
    args = ["--out", str(out), "--method", "jagg", "--base-ckpt", make_base(tmp_path), "--eval-samples", "8"]
    (out / "config.json").write_text(json.dumps(train_toy.asdict(train_toy.parse(args))))
    (out / "checkpoint.pt").write_bytes(b"cut")
    with pytest.raises(SystemExit, match=f"error: cannot resume: {out}/checkpoint.pt is not a whole train_toy.py checkpoint"):
        train_toy.main([*args, "--resume"])
    assert (out / "jagg" / "metrics.jsonl").read_text() == "{}\n" and not (tmp_path / "runs").exists()


def make_base(tmp_path):  # a toy DiT pretrained for one step: enough to load
    path = str(tmp_path / "base.pt")
    toy_dit.pretrain(path, steps=1, seed=0, batch=8)
    return path


def test_a_corrupt_base_checkpoint_is_one_line(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"this is not a checkpoint")
    with pytest.raises(SystemExit, match="is not a toy DiT checkpoint"):
        train_toy.main(["--base-ckpt", str(bad), "--out", str(tmp_path / "out")])


def test_a_tiny_run_writes_what_it_says(tmp_path, monkeypatch, capsys):
    """Two epochs from a base pretrained for one step (cached under runs/cache of the working folder)."""
    monkeypatch.chdir(tmp_path)
    train_toy.main(["--out", "out", "--pretrain-steps", "1", "--epochs", "2", "--group-size", "4", "--eval-samples", "8",
                    "--eval-every", "1", "--probe-every", "1", "--probe-batch", "4"])
    printed = capsys.readouterr().out
    assert "[exact] epoch   2/2  reward" in printed and "approx_kl" in printed and "JAGG (jagg) kept" in printed
    assert json.load(open("out/config.json")) == train_toy.asdict(train_toy.parse(["--out", "out", "--pretrain-steps", "1",
        "--epochs", "2", "--group-size", "4", "--eval-samples", "8", "--eval-every", "1", "--probe-every", "1",
        "--probe-batch", "4"]))
    for method in ("exact", "jagg"):
        rows = rows_of(f"out/{method}")
        assert [r["epoch"] for r in rows] == [1, 2]
        assert {key.split("/")[0] for r in rows for key in r} == {"epoch", "method", "rollout", "train", "routing", "probe",
                                                                    "time", "eval"}
        s = json.load(open(f"out/{method}/summary.json"))
        assert s["method"] == method and len(s["probe"]["cosine"]) == 4 and s["config"]["epochs"] == 2
    assert json.load(open("out/summary.json"))["backward_speedup"] > 0
    for picture in ("samples.png", "reward.png"):
        assert os.path.getsize(f"out/{picture}") > 1000
    assert not [p for _, _, files in os.walk("out") for p in files if p.startswith(".tmp-")]


# --- slow: end to end

@slow
def test_short_grpo_run_raises_reward_for_both_methods(base_ckpt, tmp_path):
    train_toy.main(quick(base_ckpt, tmp_path, "--epochs", "15", "--probe-every", "5"))
    top = json.load(open(tmp_path / "summary.json"))
    assert top["method"] == "compare"
    ex, jg = top["exact"], top["jagg"]
    for method, s in (("exact", ex), ("jagg", jg)):
        assert s == {k: v for k, v in json.load(open(tmp_path / method / "summary.json")).items() if k != "config"}
        assert s["method"] == method
        assert s["final_reward"] > s["initial_reward"] + 0.05, s
        rows = rows_of(tmp_path / method)
        assert len(rows) == 15 and all("train/clipfrac" in r and "time/backward_seconds" in r for r in rows)
    assert top["train_speedup"] == pytest.approx(ex["train_seconds"] / jg["train_seconds"])
    assert top["backward_speedup"] == pytest.approx(ex["backward_seconds"] / jg["backward_seconds"])
    assert (top["mode"], jg["mode"], ex["mode"]) == ("jagg", "jagg", "exact")  # the paper's mode by default
    # Same seed and checkpoint: the same starting point; JAGG ran 2 of every 4 steps with grad.
    assert ex["initial_reward"] == jg["initial_reward"]
    assert ex["grad_rows"] == 2 * jg["grad_rows"]
    assert jg["skipped_steps"] == 0 and 0 < jg["probe_seconds"] < jg["train_seconds"]
    for s in (ex, jg):  # the probe is a diagnostic in both runs: JAGG vs exact per window
        cos = s["probe"]["cosine"]
        assert len(cos) == 4 and all(0.3 < c < 1.0 for c in cos)
        err = s["probe"]["error_to_noise"]  # JAGG's error in units of the step's own noise
        assert len(err) == 4 and all(-math.inf < e < math.inf for e in err)  # pooled; below 0 where lost in the scatter
        assert all(se > 0 for se in s["probe"]["stderr"])  # 3 probes: their scatter
    assert jg["routed_frac_by_position"] == [1.0] * 4 and ex["routed_frac_by_position"] == [0.0] * 4
    for picture in ("samples.png", "reward.png"):
        assert (tmp_path / picture).stat().st_size > 1000


@slow
def test_shared_anchors_with_rollout_interiors_raise_reward(base_ckpt, tmp_path):
    train_toy.main(quick(base_ckpt, tmp_path, "--method", "jagg", "--anchors", "shared", "--interior", "rollout",
                         "--epochs", "15", "--max-graph-rows", "2"))
    s = json.load(open(tmp_path / "summary.json"))
    assert (s["mode"], s["config"]["anchors"], s["config"]["interior"]) == ("jagg_shared_rollout", "shared", "rollout")
    assert s["final_reward"] > s["initial_reward"] + 0.05, s
    # T = 16, W = 4: anchors 0, 3, 6, 9, 12, 15 -> 6 rows with grad per optimizer step (the paper's windows: 8).
    assert s["grad_rows"] == 6 * 4 * 15 and s["probe"] is None


@slow
def test_probe_routing_follows_the_averaged_cosines(base_ckpt, tmp_path):
    train_toy.main(quick(base_ckpt, tmp_path, "--method", "jagg", "--jagg-frac", "0.5", "--route", "probe",
                         "--probe-every", "2", "--probe-decay", "0.5", "--epochs", "5"))
    s, rows = json.load(open(tmp_path / "summary.json")), rows_of(tmp_path)
    assert s["config"]["route"] == "probe" and [r["epoch"] for r in rows if "probe/cosine" in r] == [1, 2, 4]
    average = None
    for r in rows:
        if "probe/cosine" in r:
            average = r["probe/cosine"] if average is None else [0.5 * a + 0.5 * c for a, c in zip(average, r["probe/cosine"])]
        top_two = sorted(range(4), key=lambda i: -average[i])[:2]
        assert r["routing/routed"] == [i in top_two for i in range(4)], (r["epoch"], average)  # every step of the epoch
    assert sum(s["routed_frac_by_position"]) == pytest.approx(2.0)
    assert len(s["probe"]["cosine"]) == 4 and s["probe_seconds"] > 0


@slow
def test_index_weights_reach_the_probe_and_training(base_ckpt, tmp_path):
    """--weights index (the authors' early code) runs end to end; on the same first batch the probe measures
    another gradient than with the t-weighting (T = 16 steps on a shift-3 schedule)."""
    first = {}
    for weights in ("time", "index"):
        out = tmp_path / weights
        train_toy.main(quick(base_ckpt, out, "--method", "jagg", "--weights", weights, "--epochs", "1", "--probe-every", "1"))
        assert json.load(open(out / "summary.json"))["config"]["weights"] == weights
        first[weights] = rows_of(out)[0]["probe/cosine"]
    assert all(0.0 < c <= 1.0 for c in first["index"]) and first["index"] != pytest.approx(first["time"], abs=1e-6)


@slow
def test_torchrun_ranks_stay_in_sync(base_ckpt, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train_toy.py",
           "--method", "compare", "--jagg-frac", "0.5", "--epochs", "3", *quick(base_ckpt, tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    base = torch.load(base_ckpt, weights_only=True)["model"]
    for method in ("exact", "jagg"):  # exact ends each batch on an exact step, jagg (0.5) on a JAGG window
        s = json.load(open(tmp_path / method / "summary.json"))
        assert s["world_size"] == 2
        # Each rank trained on its own rollouts; the gradients were averaged, so the weights agree...
        a, b = s["param_checksums"]
        assert a == b  # bit for bit
        # ...and they did move away from the base model.
        assert abs(a - sum(v.double().sum().item() for v in base.values())) > 1e-6


def run_script(args, threads="1", timeout=300, **kwargs):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train_toy.py"), *args], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": threads}, timeout=timeout, **kwargs)


@slow
@pytest.mark.parametrize("threads", ["1", "2"])
def test_a_run_repeats_exactly_on_one_machine(base_ckpt, tmp_path, threads):
    """The same short run twice, in fresh processes with the same thread count, gives identical rewards to the
    last bit. (Across processors CPU kernels differ and 80 epochs amplify last-bit differences into a different
    run, as another seed would.)"""
    curves = []
    for i in range(2):
        out = tmp_path / f"run{i}"
        proc = run_script(quick(base_ckpt, out, "--method", "jagg", "--epochs", "4", "--eval-every", "2"), threads)
        assert proc.returncode == 0, proc.stderr[-2000:]
        curves.append([(r["rollout/reward_mean"], r.get("eval/reward"), r["train/loss"]) for r in rows_of(out)])
    assert curves[0] == curves[1]
    assert len({c[0] for c in curves[0]}) > 1  # the runs did train: the rollouts' reward moved


@slow
def test_resume_of_a_killed_run_equals_an_uninterrupted_run(base_ckpt, tmp_path):
    """A compare run killed (SIGKILL), or stopped by Ctrl-C (SIGINT: one line, no traceback, the epoch's
    checkpoint written), partway, then resumed with --resume, ends with the weights, metrics and summary
    rewards of a run that was never stopped, bit for bit; a changed flag is refused."""
    args = ["--epochs", "12", "--probe-every", "3", "--route", "probe", "--jagg-frac", "0.5"]
    whole = run_script(quick(base_ckpt, tmp_path / "whole", *args))
    assert whole.returncode == 0, whole.stderr[-2000:]
    for stop in (signal.SIGKILL, signal.SIGINT):
        cut = tmp_path / stop.name
        killed = subprocess.Popen([sys.executable, os.path.join(ROOT, "train_toy.py"), *quick(base_ckpt, cut, *args)],
                                  cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True)
        checkpoint = cut / "jagg" / "checkpoint.pt"  # stopped inside the second method's run
        deadline = time.time() + 300
        while not (checkpoint.exists() and len(torch.load(checkpoint, weights_only=True)["rows"]) >= 3) and time.time() < deadline:
            time.sleep(0.05)
        killed.send_signal(stop)
        stderr = killed.communicate()[1]
        done = len(torch.load(checkpoint, weights_only=True)["rows"])
        assert 3 <= done < 12, done  # it was stopped partway
        if stop == signal.SIGINT:
            assert killed.returncode == 1 and stderr.strip().splitlines()[-1] == (
                f"error: stopped by SIGINT after epoch {done} of jagg, checkpointed: go on with the same command and "
                "--resume") and "Traceback" not in stderr, stderr[-2000:]
        changed = run_script(quick(base_ckpt, cut, *args, "--lr", "0.002", "--resume"))
        assert changed.returncode != 0 and "--resume: --lr 0.002 differs from the run's 0.001" in changed.stderr
        resumed = run_script(quick(base_ckpt, cut, *args, "--resume"))
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        for method in ("exact", "jagg"):
            a, b = (torch.load(run / method / "checkpoint.pt", weights_only=True) for run in (tmp_path / "whole", cut))
            assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
            untimed = [[{k: v for k, v in r.items() if not k.startswith("time/")} for r in c["rows"]] for c in (a, b)]
            assert untimed[0] == untimed[1] and len(untimed[0]) == 12
        s_whole, s_cut = (json.load(open(run / "summary.json")) for run in (tmp_path / "whole", cut))
        assert s_whole["reward_gain_ratio"] == s_cut["reward_gain_ratio"]


@slow
def test_a_non_editable_install_runs_the_scripts(tmp_path):
    """pip install . (not editable) ships every top-level module the scripts import: run from outside the checkout."""
    target, source = tmp_path / "site", tmp_path / "source"  # built from a copy: setuptools leaves build/ behind
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", "runs", "build", "*.egg-info", "__pycache__"))
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), str(source)],
                         capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": str(target)}
    # Every module of the repository's top level that the scripts load must come from the install: an editable
    # install of the checkout elsewhere on the path would otherwise hide a module the wheel leaves out.
    ours = sorted(name[:-3] for name in os.listdir(ROOT) if name.endswith(".py"))
    imports = subprocess.run([sys.executable, "-c", "import json, sys, train_toy, train_sd, jagg_options; print(json.dumps("
                              f"{{m: sys.modules[m].__file__ for m in {ours!r} if m in sys.modules}}))"],
                             cwd=tmp_path, env=env, capture_output=True, text=True)
    assert imports.returncode == 0, imports.stderr[-3000:]
    loaded = json.loads(imports.stdout.strip().splitlines()[-1])
    assert {"jagg", "jagg_options", "toy_dit", "train_toy", "train_sd"} <= set(loaded), loaded
    assert all(path.startswith(str(target)) for path in loaded.values()), loaded
    usage = subprocess.run([sys.executable, str(target / "train_toy.py"), "--help"], cwd=tmp_path, env=env,
                           capture_output=True, text=True)
    assert usage.returncode == 0 and "--epochs" in usage.stdout, usage.stderr[-3000:]
