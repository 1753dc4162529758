"""beyond_paper/ranks.py's optimizer step on one process: a step skipped when anything is not finite, exact
training reproduced at jagg_frac 0, a mismatched batch refused before any work, a forgotten zero_grad
leaking nothing. Many ranks: test_ddp.py and test_fsdp.py."""

import copy
import math

import pytest
import torch

import jagg
from beyond_paper import options, ranks
from flows import MLPFlow, as_velocity_fn, toy_batch

pytestmark = pytest.mark.usefixtures("float64")  # conftest's: exactness shows as ~1e-16, not fp32's ~1e-7


def train_step(velocity_fn, optimizer, traj, adv, cfg, opts, ref_velocity_fn=None, step=None):
    """One optimizer step as a trainer runs it: the batch's gradient, then ranks.optimizer_step."""
    stats, routed = options.backward_batch(velocity_fn, traj, adv, cfg, opts, ref_velocity_fn)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    stats.update(ranks.optimizer_step(params, optimizer, [stats["loss"]], step=step))
    return stats, routed


def test_non_finite_step_is_skipped_and_leaves_everything_untouched():
    torch.manual_seed(17)
    model = MLPFlow()
    traj, adv = toy_batch(model, T=8, B=6)
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stats, _ = train_step(as_velocity_fn(model), opt, traj, adv, cfg, options.JaggOptions(4, 1.0), step=6)
    assert stats["skipped"] is False  # a normal step first, so the optimizer has state to keep

    def nan_at_one_step(z, t):  # a velocity that is NaN at one sampling time, as a bf16 overflow would be
        v = as_velocity_fn(model)(z, t)
        return torch.where((t == traj.t[5, 0])[..., None], torch.nan, v)

    params = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    with pytest.warns(RuntimeWarning, match="optimizer step 7 skipped: non-finite"):
        stats, _ = train_step(nan_at_one_step, opt, traj, adv, cfg, options.JaggOptions(4, 1.0), step=7)
    assert stats["skipped"] is True and not math.isfinite(stats["loss"])
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    for p, saved in zip(model.parameters(), state):
        assert opt.state[p].keys() == saved.keys() and all(torch.equal(opt.state[p][k], v) for k, v in saved.items())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_jagg_frac_zero_reproduces_exact_training(beta):
    torch.manual_seed(7)
    base = MLPFlow()
    ref = MLPFlow()
    ref.load_state_dict(base.state_dict())
    traj, adv = toy_batch(base)
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2, beta=beta)
    results = []
    for frac, W in ((0.0, 4), (0.0, 3), (1.0, 4)):
        model = MLPFlow()
        model.load_state_dict(base.state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        # W changes nothing for exact training: windows only group the steps.
        stats, routed = train_step(as_velocity_fn(model), opt, traj, adv, cfg, options.JaggOptions(W, frac),
                                        ref_velocity_fn=as_velocity_fn(ref))
        results.append((torch.cat([p.detach().flatten() for p in model.parameters()]), stats, routed))
    (p0, s0, r0), (p1, _, _), (p2, s2, r2) = results
    torch.testing.assert_close(p0, p1, rtol=1e-10, atol=1e-12)
    assert not any(r0) and all(r2) and s0["routed_frac"] == 0 and s2["routed_frac"] == 1
    assert s0["grad_rows"] == 8 and s2["grad_rows"] == 4
    assert (p2 - p0).norm() > 1e-8  # JAGG on a nonlinear model is a (slightly) different step
    assert (p0 - torch.cat([p.detach().flatten() for p in base.parameters()])).norm() > 1e-6
    assert s0["loss"] == pytest.approx(s2["loss"], rel=1e-10)  # same loss value, different gradient


def test_a_loss_at_another_noise_level_than_the_rollouts_is_refused():
    torch.manual_seed(21)
    model = MLPFlow()
    traj, adv = toy_batch(model, T=4, B=4)
    assert traj.noise_level == 0.7 and traj.subset([0, 1]).noise_level == 0.7
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="drawn at noise_level 0.7 but the loss scores them at 1.0"):
        train_step(as_velocity_fn(model), opt, traj, adv,
                        jagg.LossConfig(noise_level=1.0, clip_range=0.2), options.JaggOptions(2, 1.0))
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("calls_zero_grad", [True, False])
def test_a_forgotten_zero_grad_leaks_nothing_into_the_next_step(calls_zero_grad):
    """Two optimizer steps of two micro-batches each through options.backward_batch and ranks.optimizer_step,
    with and without the caller's zero_grad, end at the same parameters as steps written out with
    zero_grad; and each step's gradient is the mean of its own micro-batches, not the sum with the
    step before (which a leak would make: cosine 0.95 and 1.18x the norm, silently)."""
    torch.manual_seed(11)
    model = MLPFlow()
    reference = copy.deepcopy(model)
    batches = [toy_batch(model, T=4, B=4, seed=s) for s in range(4)]
    cfg, opts = jagg.LossConfig(0.7, 0.2), options.JaggOptions(2, 1.0)

    def run(net, step_api):
        opt = torch.optim.SGD(net.parameters(), lr=0.5)
        for step in range(2):
            if not step_api:
                opt.zero_grad(set_to_none=True)
            elif calls_zero_grad:
                opt.zero_grad(set_to_none=True)
            losses = []
            for traj, adv in batches[2 * step : 2 * step + 2]:
                if step_api:
                    stats, _ = options.backward_batch(as_velocity_fn(net), traj, adv, cfg, opts)
                    losses.append(stats["loss"])
                else:
                    options.backward_batch(as_velocity_fn(net), traj, adv, cfg, opts)
            if step_api:
                ranks.optimizer_step(net.parameters(), opt, losses, micro_batches=2, max_grad_norm=1e9)
                assert all(p.grad is None for p in net.parameters())
            else:
                for p in net.parameters():
                    p.grad /= 2
                opt.step()
        return torch.cat([p.detach().flatten() for p in net.parameters()])

    torch.testing.assert_close(run(model, True), run(reference, False), rtol=1e-12, atol=1e-14)
