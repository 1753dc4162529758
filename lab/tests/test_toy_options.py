"""lab/toy_options.py, the options of beyond_paper/options.py on the toy: its flags refused in one line
before any work, its defaults the demo's run bit for bit, the probe and its routing (fast); every
option raising the reward (slow)."""

import json
import os

import pytest

import toy_dit
import train_toy
import toy_options  # lab/ is on the path (lab/tests/conftest.py)
slow = pytest.mark.slow


@pytest.fixture(scope="module")
def base_ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("base") / "toy_base.pt")
    train_toy.save_base_model(toy_dit.pretrain(steps=400, seed=0, batch=256), path)
    return path


def quick(base_ckpt, out, *extra):
    return ["--base-ckpt", base_ckpt, "--out", str(out), "--eval-samples", "64", "--eval-every", "5",
            *extra]


def rows_of(folder):
    return [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]


@pytest.mark.parametrize("args, message", [
    (["--route", "probe"], "--probe-every must be >= 1 with --route probe"),
    (["--interior", "rollout", "--max-graph-rows", "1"],
     "--max-graph-rows must be an integer >= 2 with rollout interiors"),
    (["--max-drift", "-0.5"], r"--max-drift must be >= 0, or -1 \(never\), got -0.5"),
    (["--min-cosine", "2"], r"--min-cosine must be in \[-1, 1\]"),
    (["--anchors", "both"], "--anchors must be one of"),
    (["--probe-batch", "1"], "--probe-batch must be >= 2"),
    (["--window", "1"], r"--window must be in \[2, --num-steps 16\]"),  # train_toy.py's own rules
])
def test_bad_option_fails_before_touching_files(tmp_path, args, message):
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=message):
        toy_options.main(["--out", str(out), *args])
    assert not out.exists()


def test_the_default_options_train_the_demos_run_bit_for_bit(base_ckpt, tmp_path):
    """--method jagg with every option at its default is train_toy.py's JAGG run; and --anchors
    shared with rollout interiors is another run."""
    args = quick(base_ckpt, tmp_path / "demo", "--method", "jagg", "--epochs", "2", "--group-size", "4")
    train_toy.main(args)
    toy_options.main(quick(base_ckpt, tmp_path / "options", *args[4:]))
    toy_options.main(quick(base_ckpt, tmp_path / "shared", *args[4:], "--anchors", "shared",
                           "--interior", "rollout"))
    demo, options, shared = (rows_of(tmp_path / name) for name in ("demo", "options", "shared"))

    def trained(rows):
        return [(r["rollout/reward_mean"], r["train/loss"], r["train/grad_rows"]) for r in rows]
    assert trained(demo) == trained(options)
    assert trained(shared) != trained(demo)
    summary = json.load(open(tmp_path / "shared" / "summary.json"))
    # T = 16, W = 4 shared: anchors 0, 3, 6, 9, 12, 15, 6 rows a step (the paper's windows: 8)
    assert summary["mode"] == "jagg_shared_rollout" and summary["grad_rows"] == 6 * 4 * 2


def test_probe_routing_follows_the_averaged_cosines(base_ckpt, tmp_path):
    """--route probe at --jagg-frac 0.5: each epoch's steps route the two windows of the highest
    running average of the probe's cosines (decay 0.5), which every probed epoch updates first."""
    toy_options.main(quick(base_ckpt, tmp_path, "--method", "jagg", "--jagg-frac", "0.5", "--route",
                           "probe", "--probe-every", "2", "--probe-batch", "4", "--epochs", "4",
                           "--group-size", "4"))
    s, rows = json.load(open(tmp_path / "summary.json")), rows_of(tmp_path)
    assert [r["epoch"] for r in rows if "probe/cosine" in r] == [1, 2, 4]
    average = None
    for r in rows:
        if "probe/cosine" in r:
            cosines = r["probe/cosine"]
            average = cosines if average is None else [0.5 * a + 0.5 * c for a, c in zip(average, cosines)]
        top_two = sorted(range(4), key=lambda i: -average[i])[:2]
        assert r["routing/routed"] == [i in top_two for i in range(4)], (r["epoch"], average)
    assert sum(s["routed_frac_by_position"]) == pytest.approx(2.0)
    assert len(s["probe"]["cosine"]) == 4 and s["probe_seconds"] > 0


@slow
@pytest.mark.parametrize("flags", [("--anchors", "shared", "--interior", "rollout", "--max-graph-rows", "2"),
                                   ("--weights", "index"), ("--interior", "rollout", "--max-drift", "-1")])
def test_every_option_raises_the_reward(base_ckpt, tmp_path, flags):
    toy_options.main(quick(base_ckpt, tmp_path, "--method", "jagg", "--epochs", "15", *flags))
    s = json.load(open(tmp_path / "summary.json"))
    assert s["final_reward"] > s["initial_reward"] + 0.05, s


@slow
def test_index_weights_reach_the_probe(base_ckpt, tmp_path):
    """--weights index (the authors' early code): on the same first batch the probe measures
    another gradient than with the t-weighting (T = 16 steps on a shift-3 schedule)."""
    first = {}
    for weights in ("time", "index"):
        out = tmp_path / weights
        toy_options.main(quick(base_ckpt, out, "--method", "jagg", "--weights", weights, "--epochs", "1",
                               "--probe-every", "1"))
        first[weights] = rows_of(out)[0]["probe/cosine"]
    assert all(0.0 < c <= 1.0 for c in first["index"])
    assert first["index"] != pytest.approx(first["time"], abs=1e-6)
