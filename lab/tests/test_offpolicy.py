"""lab/offpolicy_error.py on a small task: its statistics mean what its docstring says."""

import argparse
import json
import os
import sys

import pytest
import torch

import jagg
from beyond_paper import options, probe
import sd_runner

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import offpolicy_error  # noqa: E402
import probe_check  # noqa: E402


class TinyTask:
    """A small MLP flow policy on 3-D samples, groups of 4, clip 0.2 (the tool's task interface)."""

    def __init__(self):
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3)).double()
        self.params = list(self.model.parameters())
        self.loss_cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2)
        self.lr, self.window, self.setting = 3e-2, 4, "tiny MLP"

    def velocity_fn(self, z, t):
        return self.model(torch.cat([z, t[..., None]], dim=-1))

    def draw(self, n, generator, window_start=None):
        noise, sigmas = torch.randn(n, 3, generator=generator, dtype=torch.float64), jagg.sigma_schedule(10).double()
        if window_start is None:
            traj = jagg.rollout(self.velocity_fn, noise, sigmas, 0.7, generator=generator)
            sample = traj.sample
        else:  # an SDE window of self.window steps
            traj, sample = sd_runner.window_rollout(self.velocity_fn, noise, sigmas, 0.7, window_start, self.window,
                                                       generator=generator)
        adv = jagg.group_advantages(-sample.norm(dim=-1), torch.arange(n) // 4)
        return offpolicy_error.Batch(traj, adv, lambda idx: (self.velocity_fn, None))


def test_measure_on_policy_modes_agree_and_the_rule_drifts_off_policy(tmp_path):
    task = TinyTask()
    args = argparse.Namespace(batches=2, batch=16, inner_steps=4, modes=list(offpolicy_error.MODES))
    result = offpolicy_error.measure(task, args, torch.Generator().manual_seed(1), torch.optim.AdamW(task.params))
    table = offpolicy_error.summary(result)
    assert result["noise"] > 0 and len(result["records"]) == 2 * 4 * len(offpolicy_error.MODES)
    first = {m: table[1, m] for m in offpolicy_error.MODES}
    for forward, rollout in (("paper", "rollout"), ("paper", "rollout_unguarded"), ("shared", "shared_rollout")):
        assert abs(first[forward]["rel_error"] - first[rollout]["rel_error"]) < 1e-9  # on-policy: the same gradient
    assert first["rollout_unguarded"]["ratio_error"] < 1e-9 and table[4, "rollout_unguarded"]["ratio_error"] > 0
    for m in offpolicy_error.MODES:  # error / noise is |j - g|^2 over the noise, from the same records
        for rec in (r for r in result["records"] if r["mode"] == m):
            assert rec["error_to_noise"] >= 0 and -1 <= rec["cosine"] <= 1
    # The guarded modes never err more than forward interiors here (they fall back once ratios move).
    for step in range(2, 5):
        assert table[step, "shared_rollout"]["rel_error"] <= table[step, "shared"]["rel_error"] * 1.05
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"args": {**vars(args)}, "setting": task.setting, "checkpoints": {"0": result}}))
    lines = offpolicy_error.report(str(path))
    assert len([line for line in lines if line.startswith("| 0 | ")]) == 5  # 4 steps and the agreement row


def test_probe_check_pools_probes_and_measures_independent_batches():
    """lab/probe_check.py's figures on a tiny task: the independent-batch figure is |j - g|^2 over
    the noise of pairs of batches, computed here again; an SDE window gives one segment."""
    task = TinyTask()
    opts = options.JaggOptions(task.window, 1.0)
    rows = probe_check.check(task, opts, 3, 8, torch.Generator().manual_seed(2))
    assert [r["steps"] for r in rows] == [(0, 4), (4, 8), (8, 10)]
    for r in rows[:2]:
        assert len(r["probes"]) == 3 and r["probes"] == sorted(r["probes"]) and r["pooled"] > 0 and r["independent"] > 0
    assert abs(rows[2]["pooled"]) < 1e-12 and rows[2]["independent"] < 1e-20  # a 2-step window: exact, to round-off
    g = torch.Generator().manual_seed(2)
    batches = [task.draw(8, g) for _ in range(3)]
    pairs = [list(probe.segment_gradients(task.velocity_fn, task.params, b.traj, b.adv, task.loss_cfg, opts))[0]
             for b in batches]
    noise = sum((pairs[i][0] - pairs[j][0]).square().sum() for i, j in ((0, 1), (0, 2), (1, 2))) / 2 / 3
    error = sum((j - e).square().sum() for e, j in pairs) / 3
    assert rows[0]["independent"] == pytest.approx((error / noise).item(), rel=1e-9)
    windowed = probe_check.check(task, opts, 2, 8, torch.Generator().manual_seed(3), window_start=3)
    assert [r["steps"] for r in windowed] == [(0, 4)]


def test_probe_check_takes_steps_and_probes_at_random_as_training_does():
    """--step-batch and --probe-batch: each batch of 16 gives a step of 8 random samples (the
    independent figure's) and a probe of 4 others, asked for the error of an 8-sample step;
    recomputed here from the same draws."""
    task = TinyTask()
    opts = options.JaggOptions(task.window, 1.0)
    rows = probe_check.check(task, opts, 3, 16, torch.Generator().manual_seed(4), step_batch=8, probe_batch=4)
    g = torch.Generator().manual_seed(4)
    pairs, probes, own = [], [], []
    for _ in range(3):
        b = task.draw(16, g)
        step, probed = torch.randperm(16, generator=g)[:8], torch.randperm(16, generator=g)[:4]
        pairs.append(list(probe.segment_gradients(task.velocity_fn, task.params, b.traj.subset(step),
                                                          b.adv[step], task.loss_cfg, opts))[0])
        probes.append(probe.probe_segments(lambda idx: (task.velocity_fn, None), task.params,
                                                  b.traj.subset(probed), b.adv[probed], task.loss_cfg, opts, train_batch=8))
        own.append(probe.probe_segments(lambda idx: (task.velocity_fn, None), task.params,
                                               b.traj.subset(probed), b.adv[probed], task.loss_cfg, opts, train_batch=4))
    noise = sum((pairs[i][0] - pairs[j][0]).square().sum() for i, j in ((0, 1), (0, 2), (1, 2))) / 2 / 3
    error = sum((j - e).square().sum() for e, j in pairs) / 3
    assert rows[0]["independent"] == pytest.approx((error / noise).item(), rel=1e-9)
    pooled = sum(p["error"][0] for p in probes) / sum(p["noise"][0] for p in probes)
    assert rows[0]["pooled"] == pytest.approx(pooled, rel=1e-9) and rows[0]["pooled_stderr"] > 0
    # before the fix the probe read |j - g|^2 on its own 4 samples: that error at B = 4, over the step's noise
    assert rows[0]["old_way"] == pytest.approx(sum(p["error"][0] for p in own) / sum(p["noise"][0] for p in probes))
    assert rows[0]["probes"] == sorted(p["error_to_noise"][0] for p in probes)
    whole = probe_check.check(task, opts, 3, 16, torch.Generator().manual_seed(4))  # the default: the whole batch
    assert whole[0]["independent"] != pytest.approx(rows[0]["independent"], rel=1e-3)
