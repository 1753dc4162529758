"""tools/offpolicy_error.py on a small task: its statistics mean what its docstring says."""

import argparse
import json
import os
import sys

import torch

import jagg

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import offpolicy_error  # noqa: E402


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

    def draw(self, n, generator):
        traj = jagg.rollout(self.velocity_fn, torch.randn(n, 3, generator=generator, dtype=torch.float64),
                            jagg.sigma_schedule(10).double(), 0.7, generator=generator)
        adv = jagg.group_advantages(-traj.sample.norm(dim=-1), torch.arange(n) // 4)
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
