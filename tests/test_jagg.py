"""jagg.py against trusted references: autograd of the summed loss, explicit Jacobians built with
torch.func, torch.distributions' Gaussian density, and hand-checked statistics."""

import dataclasses
import copy
import math
import os

import numpy as np
import pytest
import torch
from torch.func import functional_call, jacrev

import jagg
import jagg_options
import jagg_probe
import grpo_step
import train_sd

pytestmark = pytest.mark.usefixtures("float64")  # conftest's: exactness shows as ~1e-16, not fp32's ~1e-7


# ------------------------------------------------------------------ small models


class LinearFlow(torch.nn.Module):
    """v = (A1 A2) z + b t + c: linear in (z, t), nonlinear in theta, so J(z, t) is affine."""

    def __init__(self, d=3):
        super().__init__()
        self.A1 = torch.nn.Parameter(torch.randn(d, d))
        self.A2 = torch.nn.Parameter(torch.randn(d, d))
        self.b = torch.nn.Parameter(torch.randn(d))
        self.c = torch.nn.Parameter(torch.randn(d))

    def forward(self, z, t):  # z [N, d], t [N]
        return z @ (self.A1 @ self.A2).T + t[:, None] * self.b + self.c


class MLPFlow(torch.nn.Module):
    """A small nonlinear velocity network: its Jacobian is not affine in (z, t)."""

    def __init__(self, d=3, h=16):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(d + 1, h), torch.nn.Tanh(), torch.nn.Linear(h, h),
                                       torch.nn.Tanh(), torch.nn.Linear(h, d))

    def forward(self, z, t):
        return self.net(torch.cat([z, t[:, None]], dim=-1))


def as_velocity_fn(model, calls=None):
    """velocity_fn(z [S, B, d], t [S, B]); records (steps, grad_enabled) of each call in calls."""

    def velocity_fn(z, t):
        if calls is not None:
            calls.append((z.shape[0], torch.is_grad_enabled()))
        S, B = t.shape
        return model(z.reshape(S * B, -1), t.reshape(S * B)).reshape(z.shape)

    return velocity_fn


def make_loss(W, B, d, seed=0):
    """A nonlinear per-step loss of v_k with different weights per step."""
    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(W, B, d, generator=g), torch.randn(W, B, d, generator=g)

    def step_loss(k, v_k):
        return (w1[k] * v_k).sum() + 0.5 * (w2[k] * torch.tanh(v_k) ** 2).sum()

    return step_loss


def window(W, B, d, straight, seed=0):
    """A window's states z [W, B, d] and decreasing times t [W, B]; straight puts z on a segment."""
    g = torch.Generator().manual_seed(seed)
    t = torch.sort(torch.rand(W, generator=g), descending=True).values[:, None].expand(W, B).clone()  # [W, B]
    if straight:
        alpha = jagg.interpolation_weights(t)[..., None]  # [W, B, 1]
        z_a, z_b = torch.randn(B, d, generator=g), torch.randn(B, d, generator=g)
        z = (1 - alpha) * z_a + alpha * z_b  # [W, B, d]
    else:
        z = torch.randn(W, B, d, generator=g)
    return z, t


def grads_of(model, backward, z, t, step_loss, calls=None, **kwargs):
    """(summed loss, flat gradient) of backward(velocity_fn, z, t, step_loss, **kwargs) from zero grads."""
    model.zero_grad(set_to_none=True)
    loss = backward(as_velocity_fn(model, calls), z, t, step_loss, **kwargs)
    return loss, torch.cat([p.grad.flatten() for p in model.parameters()])


def reference_gradient(model, z, t, step_loss):
    """The trusted exact gradient: autograd of the summed loss in one graph."""
    model.zero_grad(set_to_none=True)
    fn = as_velocity_fn(model)
    total = sum(step_loss(k, fn(z[k : k + 1], t[k : k + 1])[0]) for k in range(z.shape[0]))
    total.backward()
    return total.item(), torch.cat([p.grad.flatten() for p in model.parameters()])


def cosine(a, b):
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()


# ------------------------------------------------------------------ exactness


def test_exact_backward_matches_autograd_of_summed_loss():
    torch.manual_seed(0)
    model, (W, B, d) = MLPFlow(), (5, 4, 3)
    z, t = window(W, B, d, straight=False)
    loss, grad = grads_of(model, jagg.backward_exact, z, t, make_loss(W, B, d))
    ref_loss, ref_grad = reference_gradient(model, z, t, make_loss(W, B, d))
    assert loss == pytest.approx(ref_loss, rel=1e-10)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("jagg_fn", [jagg.backward_jagg_window, jagg_options.backward_jagg], ids=["paper", "general"])
@pytest.mark.parametrize("W", [3, 4, 8])
def test_jagg_is_exact_for_linear_model_on_straight_path(W, jagg_fn):
    torch.manual_seed(1)
    model, (B, d) = LinearFlow(), (4, 3)
    z, t = window(W, B, d, straight=True, seed=W)
    loss_j, g_jagg = grads_of(model, jagg_fn, z, t, make_loss(W, B, d))
    loss_e, g_exact = grads_of(model, jagg.backward_exact, z, t, make_loss(W, B, d))
    assert loss_j == pytest.approx(loss_e, rel=1e-10)
    torch.testing.assert_close(g_jagg, g_exact, rtol=1e-9, atol=1e-10)


def test_jagg_is_not_exact_for_linear_model_off_the_straight_path():
    """The straight-path condition matters: the same linear model, states off the segment."""
    torch.manual_seed(1)
    model, (W, B, d) = LinearFlow(), (4, 4, 3)
    z, t = window(W, B, d, straight=False)
    _, g_jagg = grads_of(model, jagg_options.backward_jagg, z, t, make_loss(W, B, d))
    _, g_exact = grads_of(model, jagg.backward_exact, z, t, make_loss(W, B, d))
    assert (g_jagg - g_exact).norm() > 1e-3 * g_exact.norm()


@pytest.mark.parametrize("jagg_fn", [jagg.backward_jagg_window, jagg_options.backward_jagg], ids=["paper", "general"])
def test_window_of_two_is_exact_on_a_nonlinear_model(jagg_fn):
    torch.manual_seed(2)
    model, (W, B, d) = MLPFlow(), (2, 5, 3)
    z, t = window(W, B, d, straight=False)
    _, g_jagg = grads_of(model, jagg_fn, z, t, make_loss(W, B, d))
    _, g_exact = grads_of(model, jagg.backward_exact, z, t, make_loss(W, B, d))
    torch.testing.assert_close(g_jagg, g_exact, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("jagg_fn", [jagg.backward_jagg_window, jagg_options.backward_jagg], ids=["paper", "general"])
def test_jagg_equals_explicit_jacobian_interpolation_and_differs_from_exact(jagg_fn):
    """On a nonlinear model, JAGG's gradient is exactly sum_k g_k^T ((1-alpha_k) J_a + alpha_k J_b)
    with J_a, J_b built explicitly by torch.func, and it is not the exact gradient."""
    torch.manual_seed(3)
    model, (W, B, d) = MLPFlow(), (5, 3, 3)
    z, t = window(W, B, d, straight=False)
    step_loss = make_loss(W, B, d)
    params = {name: p.detach() for name, p in model.named_parameters()}

    def f(p, z_k, t_k):  # [B, d]
        return functional_call(model, p, (z_k, t_k))

    J_a = jacrev(f)(params, z[0], t[0])  # {name: [B, d, *p.shape]}
    J_b = jacrev(f)(params, z[-1], t[-1])
    alpha = jagg.interpolation_weights(t)  # [W, B]
    expected = {name: torch.zeros_like(p) for name, p in params.items()}
    for k in range(W):
        v_k = f(params, z[k], t[k]).requires_grad_(True)  # [B, d]
        (g_k,) = torch.autograd.grad(step_loss(k, v_k), v_k)  # [B, d]
        for name in params:
            J_k = (1 - alpha[k]).reshape(B, 1, *[1] * params[name].ndim) * J_a[name] + \
                alpha[k].reshape(B, 1, *[1] * params[name].ndim) * J_b[name]  # [B, d, *p.shape]
            expected[name] += torch.einsum("bi,bi...->...", g_k, J_k)
    expected = torch.cat([expected[name].flatten() for name, _ in model.named_parameters()])

    _, g_jagg = grads_of(model, jagg_fn, z, t, step_loss)
    _, g_exact = grads_of(model, jagg.backward_exact, z, t, step_loss)
    torch.testing.assert_close(g_jagg, expected, rtol=1e-9, atol=1e-10)
    assert (g_jagg - g_exact).norm() > 1e-3 * g_exact.norm()
    assert cosine(g_jagg, g_exact) < 0.999999


@pytest.mark.parametrize("jagg_fn", [jagg.backward_jagg_window, jagg_options.backward_jagg], ids=["paper", "general"])
def test_jagg_runs_the_network_with_grad_on_two_steps_only(jagg_fn):
    torch.manual_seed(4)
    model, (W, B, d) = MLPFlow(), (6, 2, 3)
    z, t = window(W, B, d, straight=False)
    calls = []
    grads_of(model, jagg_fn, z, t, make_loss(W, B, d), calls)
    assert calls == [(W - 2, False), (2, True)]
    calls.clear()
    grads_of(model, jagg.backward_exact, z, t, make_loss(W, B, d), calls)
    assert calls == [(1, True)] * W


def test_the_papers_function_equals_the_general_one_and_training_uses_it(monkeypatch):
    """jagg.py's backward_jagg_window and jagg_options' backward_jagg with the paper's anchors compute
    the same loss and gradient on a nonlinear model; training in the paper's mode runs jagg.py's."""
    torch.manual_seed(5)
    model, (W, B, d) = MLPFlow(), (5, 3, 3)
    z, t = window(W, B, d, straight=False)
    loss_p, g_paper = grads_of(model, jagg.backward_jagg_window, z, t, make_loss(W, B, d))
    loss_g, g_general = grads_of(model, jagg_options.backward_jagg, z, t, make_loss(W, B, d), anchors=[0, W - 1])
    assert loss_p == pytest.approx(loss_g, rel=1e-12)
    torch.testing.assert_close(g_paper, g_general, rtol=1e-12, atol=1e-14)
    used = []
    for module, name in ((jagg, "backward_jagg_window"), (jagg_options, "backward_jagg"), (jagg, "backward_exact")):
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _fn=fn, _name=name, **k: used.append(_name) or _fn(*a, **k))
    jagg_calls = lambda: [name for name in used if name != "backward_exact"]  # noqa: E731
    traj, adv = _toy_batch(model, T=8, B=4)
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2)
    jagg_options.window_gradients(as_velocity_fn(model), traj, adv, cfg, jagg_options.JaggOptions(4, 1.0))
    assert jagg_calls() == ["backward_jagg_window"] * 2
    used.clear()
    jagg_options.window_gradients(as_velocity_fn(model), traj, adv, cfg, jagg_options.JaggOptions(4, 1.0, anchors="shared"))
    assert jagg_calls() == ["backward_jagg"]
    # What the trainers call, train_step with the default options, trains every window through jagg.py's own two
    # functions, in routing's order (T = 10: windows of 4, 4 and 2 steps; the 2-step one is always exact).
    traj, adv = _toy_batch(model, T=10, B=4)
    for frac, expected in ((1.0, ["backward_jagg_window", "backward_jagg_window", "backward_exact"]),
                           (0.0, ["backward_exact"] * 3)):
        used.clear()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        grpo_step.train_step(as_velocity_fn(model), opt, traj, adv, cfg, jagg_options.JaggOptions(jagg_frac=frac))
        assert used == expected, (frac, used)
    used.clear()
    _, routed = grpo_step.train_step(as_velocity_fn(model), opt, traj, adv, cfg, jagg_options.JaggOptions(jagg_frac=0.5))
    assert used == ["backward_jagg_window" if r else "backward_exact" for r in routed] and sum(routed) == 1


# ------------------------------------------------------------------ beyond the paper: anchors, rollout interiors


def hat_matrix(t_col, anchors):
    """H [S, M] computed independently of jagg.py: anchor j's hat function (1 at its own time, 0 at
    the other anchors', linear in between) evaluated at each step's time, by numpy's interp."""
    t_col, eye = t_col.numpy(), np.eye(len(anchors))
    # np.interp wants increasing abscissae; t decreases along a trajectory, -t increases.
    return torch.tensor(np.stack([np.interp(-t_col, -t_col[list(anchors)], eye[j]) for j in range(len(anchors))], 1))


def explicit_anchor_gradient(model, z, t, step_loss, anchors, v_old=None):
    """sum_j (sum_k H[k, j] g_k)^T J_{a_j}, the J's built by torch.func, the g_k at the velocities
    JAGG uses: the model's own (forward interiors) or v_old_k + sum_j H[k, j] (v_{a_j} - v_old_{a_j})."""
    params = {name: p.detach() for name, p in model.named_parameters()}

    def f(p, z_k, t_k):  # [B, d]
        return functional_call(model, p, (z_k, t_k))

    H = hat_matrix(t[:, 0], anchors)  # [S, M]
    J = [jacrev(f)(params, z[a], t[a]) for a in anchors]  # each {name: [B, d, *p.shape]}
    v_anc = [f(params, z[a], t[a]) for a in anchors]  # each [B, d]
    expected = {name: torch.zeros_like(p) for name, p in params.items()}
    for k in range(z.shape[0]):
        if v_old is None:
            v_k = f(params, z[k], t[k])
        else:
            v_k = v_old[k] + sum(H[k, j] * (v_anc[j] - v_old[a]) for j, a in enumerate(anchors))
        v_k = v_k.detach().requires_grad_(True)
        (g_k,) = torch.autograd.grad(step_loss(k, v_k), v_k)  # [B, d]
        for j in range(len(anchors)):
            for name in params:
                expected[name] += H[k, j] * torch.einsum("bi,bi...->...", g_k, J[j][name])
    return torch.cat([expected[name].flatten() for name, _ in model.named_parameters()])


def test_hat_weights_match_numpy_interp():
    t = jagg.sigma_schedule(9, shift=3.0).double()[:-1, None].expand(9, 2)  # [S, B]
    for anchors in ((0, 8), (0, 3, 6, 8), (0, 1, 2, 5, 8), tuple(range(9))):
        H = jagg_options.hat_weights(t, list(anchors))  # [S, M, B]
        torch.testing.assert_close(H[..., 0], hat_matrix(t[:, 0], anchors), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(H.sum(1), torch.ones(9, 2))
    # The paper's window: 1 - alpha and alpha.
    alpha = jagg.interpolation_weights(t)
    torch.testing.assert_close(jagg_options.hat_weights(t, [0, 8]), torch.stack([1 - alpha, alpha], 1))


@pytest.mark.parametrize("anchors", [(0, 6), (0, 2, 6), (0, 1, 4, 6), (0, 3, 4, 5, 6)])
@pytest.mark.parametrize("rollout", [False, True])
def test_jagg_with_anchors_equals_explicit_jacobians(anchors, rollout):
    """Any anchors, forward or rollout interiors (the rollout by other, older parameters): JAGG's
    one backward equals the explicit sum_j G_j^T J_{a_j} with hat weights H."""
    torch.manual_seed(10)
    model, old, (S, B, d) = MLPFlow(), MLPFlow(), (7, 3, 3)
    z, t = window(S, B, d, straight=False, seed=11)
    step_loss = make_loss(S, B, d, seed=12)
    with torch.no_grad():
        v_old = as_velocity_fn(old)(z, t) if rollout else None  # [S, B, d]
    _, g_jagg = grads_of(model, jagg_options.backward_jagg, z, t, step_loss, anchors=list(anchors), v_rollout=v_old)
    expected = explicit_anchor_gradient(model, z, t, step_loss, anchors, v_old)
    torch.testing.assert_close(g_jagg, expected, rtol=1e-9, atol=1e-10)


def test_default_anchors_are_the_papers_window():
    torch.manual_seed(11)
    model, (S, B, d) = MLPFlow(), (5, 3, 3)
    z, t = window(S, B, d, straight=False)
    _, g_default = grads_of(model, jagg_options.backward_jagg, z, t, make_loss(S, B, d))
    _, g_paper = grads_of(model, jagg_options.backward_jagg, z, t, make_loss(S, B, d), anchors=(0, S - 1))
    torch.testing.assert_close(g_paper, g_default, rtol=0, atol=0)
    # Every step an anchor: the exact gradient.
    _, g_all = grads_of(model, jagg_options.backward_jagg, z, t, make_loss(S, B, d), anchors=range(S))
    _, g_exact = grads_of(model, jagg.backward_exact, z, t, make_loss(S, B, d))
    torch.testing.assert_close(g_all, g_exact, rtol=1e-10, atol=1e-12)


def test_rollout_interiors_equal_forward_interiors_on_policy_then_follow_the_formula():
    """v_rollout from a rollout with the current parameters: the same gradient as forward interiors.
    After an optimizer step they differ, and the rollout one matches the first-order formula."""
    torch.manual_seed(12)
    model = MLPFlow()
    traj, adv = _toy_batch(model, T=8, B=6)
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2)
    a, b = 2, 7

    def both():
        return [grads_of(model, jagg_options.backward_jagg, traj.z[a:b], traj.t[a:b], jagg.make_step_loss(traj, adv, a, b, cfg),
                         v_rollout=v_rollout)[1] for v_rollout in (None, traj.v[a:b])]

    g_forward, g_rollout = both()
    torch.testing.assert_close(g_rollout, g_forward, rtol=1e-10, atol=1e-12)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt.step()  # the gradient left by both(): theta moves away from the rollout's theta_old
    g_forward, g_rollout = both()
    assert (g_rollout - g_forward).norm() > 1e-6 * g_forward.norm()
    expected = explicit_anchor_gradient(model, traj.z[a:b], traj.t[a:b], jagg.make_step_loss(traj, adv, a, b, cfg),
                                        (0, b - a - 1), traj.v[a:b])
    torch.testing.assert_close(g_rollout, expected, rtol=1e-9, atol=1e-10)



@pytest.mark.parametrize("anchors", ["window", "shared"])
def test_rollout_interiors_are_exact_at_the_rollouts_parameters_but_the_reference_stays_interpolated(anchors):
    """On-policy (the first optimizer step after a rollout) rollout interiors train what forward
    interiors train when beta = 0, and with the KL term when the reference's velocities differ from
    the rollout's affinely (here: the reference is the rollout's own model). With another
    reference the reference's interiors stay interpolated, so the two differ, by that alone."""
    torch.manual_seed(17)
    model, other = MLPFlow(), MLPFlow()
    same = MLPFlow()
    same.load_state_dict(model.state_dict())
    traj, adv = _toy_batch(model, T=10, B=6)

    def grads(interior, beta, ref):
        model.zero_grad(set_to_none=True)
        cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2, beta=beta)
        jagg_options.window_gradients(as_velocity_fn(model), traj, adv, cfg,
                                      jagg_options.JaggOptions(4, 1.0, anchors=anchors, interior=interior),
                                      as_velocity_fn(ref))
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    for beta, ref in ((0.0, other), (0.1, same)):
        torch.testing.assert_close(grads("rollout", beta, ref), grads("forward", beta, ref), rtol=1e-10, atol=1e-12)
    forward, rollout = grads("forward", 0.1, other), grads("rollout", 0.1, other)
    assert (rollout - forward).norm() > 1e-6 * forward.norm()


def _off_policy_run(seed, lr, steps):
    """A rollout, then `steps` exact AdamW steps on it (clip 0.2, the policy drifting from the
    rollout's): yields (model, traj, adv, cfg, clipfrac) before each step, the first on-policy."""
    torch.manual_seed(seed)
    model = MLPFlow(h=32)
    traj, adv = _toy_batch(model, T=10, B=32, seed=seed)
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        stats, _ = jagg_options.window_gradients(as_velocity_fn(model), traj, adv, cfg, jagg_options.JaggOptions(4, 0.0))
        yield model, traj, adv, cfg, stats["clipfrac"]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()


def test_rollout_interiors_stay_within_forward_interiors_error_off_policy():
    """Several optimizer steps on one rollout, ratios past the clip: the rollout rule alone
    (max_drift None, the code before the guard) errs up to several times more than forward
    interiors; with the default guard the rollout mode stays within 5 % of forward's error."""
    worst_guarded, worst_unguarded, clipped = 0.0, 0.0, 0.0
    for seed in (0, 3):
        for model, traj, adv, cfg, clipfrac in _off_policy_run(seed, lr=1e-2, steps=6):
            clipped = max(clipped, clipfrac)
            exact, _, _ = window_grad(model, traj, adv, cfg, 4, 0.0)
            for anchors in ("window", "shared"):
                err = {}
                for name, options in (("forward", {}), ("guarded", {"interior": "rollout"}),
                                      ("unguarded", {"interior": "rollout", "max_drift": None})):
                    got, _, _ = window_grad(model, traj, adv, cfg, 4, 1.0, anchors=anchors, **options)
                    err[name] = ((got - exact).norm() / exact.norm()).item()
                worst_guarded = max(worst_guarded, err["guarded"] / err["forward"])
                worst_unguarded = max(worst_unguarded, err["unguarded"] / err["forward"])
    assert clipped > 0.1  # off-policy enough that the clip acts
    assert worst_unguarded > 1.5  # the setting tells the two apart
    assert worst_guarded < 1.05


def test_the_drift_guard_is_free_on_policy_and_is_forward_interiors_where_it_acts():
    """On-policy every anchor's drift is 0: no interior forward at all. Where every segment is
    stale, the guarded gradient is the forward-interior one (an independent path through
    backward_jagg), with the same rows; the bounded path agrees with the guard on."""
    for i, (model, traj, adv, cfg, _) in enumerate(_off_policy_run(1, lr=1e-2, steps=4)):
        if i == 0:  # on-policy
            calls = []
            jagg_options.window_gradients(as_velocity_fn(model, calls), traj, adv, cfg,
                                  jagg_options.JaggOptions(4, 1.0, anchors="shared", interior="rollout"))
            assert rows_by_grad(calls)[:2] == (4, 0)
    # four steps off the rollout now (the generator took its last step)
    forward, s_f, _ = window_grad(model, traj, adv, cfg, 4, 1.0, anchors="shared")
    calls.clear()
    model.zero_grad(set_to_none=True)
    stats, _ = jagg_options.window_gradients(as_velocity_fn(model, calls), traj, adv, cfg,
                                     jagg_options.JaggOptions(4, 1.0, anchors="shared", interior="rollout", max_drift=0.0))
    guarded = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(guarded, forward, rtol=1e-10, atol=1e-12)
    assert stats["rollout_refreshed"] == 3 and stats["anchor_drift"] > 0.5
    assert rows_by_grad(calls)[:2] == (4, 6)  # the anchors with grad, the 6 interiors without
    bounded, _, _ = window_grad(model, traj, adv, cfg, 4, 1.0, anchors="shared", interior="rollout", max_drift=0.0,
                                max_graph_rows=2)
    torch.testing.assert_close(bounded, forward, rtol=1e-10, atol=1e-12)


def test_trained_steps_only_flow_grpos_timestep_fraction():
    """Training traj.first_steps(9) of T = 10 (Flow-GRPO's timestep_fraction 0.99): exact equals
    autograd of the mean of the 9 steps' clipped losses written out here; no mode ever runs the
    network at the untrained last step; rows: exact 9, the paper's windows 5, shared anchors 4."""
    torch.manual_seed(23)
    model = MLPFlow()
    traj, adv = _toy_batch(model, T=10, B=6)
    sub, cfg = traj.first_steps(9), jagg.LossConfig(noise_level=0.7, clip_range=0.2)
    assert sub.z.shape[0] == 9 and torch.equal(sub.z_next[-1], traj.z[9])
    model.zero_grad(set_to_none=True)
    total = 0.0
    for k in range(9):  # the trusted reference: one graph, the loss by hand
        v = as_velocity_fn(model)(traj.z[k : k + 1], traj.t[k : k + 1])[0]
        _, log_prob, _, _ = jagg.sde_step(v, traj.z[k], traj.t[k], traj.t_next[k], 0.7, prev_sample=traj.z_next[k])
        ratio = torch.exp(log_prob - traj.log_prob[k])
        total = total + torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean() / 9
    total.backward()
    expected = torch.cat([p.grad.flatten() for p in model.parameters()])
    got, stats, _ = window_grad(model, sub, adv, cfg, 4, 0.0)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    for options, rows in (({}, 5), ({"anchors": "shared"}, 4), ({"anchors": "shared", "interior": "rollout"}, 4)):
        seen = []

        def recording(z, t):
            seen.append(t)
            return as_velocity_fn(model)(z, t)

        model.zero_grad(set_to_none=True)
        stats, _ = jagg_options.window_gradients(recording, sub, adv, cfg, jagg_options.JaggOptions(4, 1.0, **options))
        assert stats["grad_rows"] == rows
        assert not any((t_seen == traj.t[9, 0]).any() for t_seen in seen)  # sigma_9 -> 0: no network call
    with pytest.raises(ValueError, match="no first 11 steps"):
        traj.first_steps(11)


# ------------------------------------------------------------------ the authors' early code: index weights


def authors_window_gradient(model, traj, adv, cfg, a, b):
    """The authors' early scheme (SchumiDing/eff_grpo, grpo_group_backward), written here from its
    description, not from jagg.py: W forwards without graph (the endpoints too), each step's
    upstream gradient, weights by index alpha_j = j / (W - 1), then TWO separate forward-with-graph
    + backward passes, one per endpoint. Returns the flat gradient it accumulates."""
    W, fn = b - a, as_velocity_fn(model)
    G_a, G_b = torch.zeros_like(traj.z[a]), torch.zeros_like(traj.z[a])  # [B, d]
    for j in range(W):
        k = a + j
        with torch.no_grad():
            v = fn(traj.z[k : k + 1], traj.t[k : k + 1])[0]
        v.requires_grad_(True)
        _, log_prob, _, _ = jagg.sde_step(v, traj.z[k], traj.t[k], traj.t_next[k], cfg.noise_level,
                                          prev_sample=traj.z_next[k])
        # Flow-GRPO's clipped surrogate, averaged over the batch and the T steps
        ratio = torch.exp(log_prob - traj.log_prob[k])
        loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - cfg.clip_range, 1 + cfg.clip_range)).mean()
        (g,) = torch.autograd.grad(loss / traj.z.shape[0], v)  # [B, d]
        alpha = j / (W - 1)
        G_a += (1 - alpha) * g
        G_b += alpha * g
    model.zero_grad(set_to_none=True)
    for k, G in ((a, G_a), (b - 1, G_b)):  # one backward per endpoint
        (fn(traj.z[k : k + 1], traj.t[k : k + 1])[0] * G).sum().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_index_weights_reproduce_the_authors_two_pass_scheme():
    """weights="index" equals the authors' scheme to float64 round-off, on a nonlinear model and
    SD3's shifted schedule (where t is not linear in the step index); weights="time" differs."""
    torch.manual_seed(13)
    model = MLPFlow()
    g = torch.Generator().manual_seed(14)
    traj = jagg.rollout(as_velocity_fn(model), torch.randn(6, 3, generator=g), jagg.sigma_schedule(10, shift=3.0).double(),
                        0.7, generator=g)
    adv = jagg.group_advantages(-traj.sample.norm(dim=-1), torch.arange(6) // 3)
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2)
    a, b = 1, 6  # W = 5, as the authors' run_jagg.sh
    expected = authors_window_gradient(model, traj, adv, cfg, a, b)
    z, t = traj.z[a:b], traj.t[a:b]
    _, g_index = grads_of(model, jagg_options.backward_jagg, z, t, jagg.make_step_loss(traj, adv, a, b, cfg), weights="index")
    torch.testing.assert_close(g_index, expected, rtol=1e-10, atol=1e-13)
    # jagg.backward_jagg_window takes its weights as an argument (self-check B): by index, it is the same scheme.
    by_index = torch.linspace(0, 1, b - a)[:, None].expand(b - a, 6)  # [W, B]
    _, g_alpha = grads_of(model, jagg.backward_jagg_window, z, t, jagg.make_step_loss(traj, adv, a, b, cfg), alpha=by_index)
    torch.testing.assert_close(g_alpha, expected, rtol=1e-10, atol=1e-13)
    _, g_time = grads_of(model, jagg_options.backward_jagg, z, t, jagg.make_step_loss(traj, adv, a, b, cfg))
    assert (g_time - expected).norm() > 1e-3 * expected.norm()
    # With times linear in the index (no shift) the two weightings are the same.
    t_lin = torch.linspace(0.9, 0.5, 5)[:, None].expand(5, 6)  # [W, B]
    torch.testing.assert_close(jagg_options.segment_weights(t_lin, "index"), jagg.interpolation_weights(t_lin))

    # Through window_gradients (so train_step) and the probe: every window by the authors' scheme.
    T, W = 10, 5
    model.zero_grad(set_to_none=True)
    stats, routed = jagg_options.window_gradients(as_velocity_fn(model), traj, adv, cfg, jagg_options.JaggOptions(W, 1.0, weights="index"))
    assert all(routed)
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    windows = [authors_window_gradient(model, traj, adv, cfg, a, a + W) for a in range(0, T, W)]
    torch.testing.assert_close(got, sum(windows), rtol=1e-10, atol=1e-13)
    cos = jagg_probe.gradient_cosines(as_velocity_fn(model), model.parameters(), traj, adv, cfg, jagg_options.JaggOptions(W, weights="index"))
    for (a, b), c, gw in zip(jagg.window_bounds(T, W), cos, windows):
        _, exact = grads_of(model, jagg.backward_exact, traj.z[a:b], traj.t[a:b], jagg.make_step_loss(traj, adv, a, b, cfg))
        assert c == pytest.approx(cosine(gw, exact), abs=1e-10)
    assert cos != pytest.approx(jagg_probe.gradient_cosines(as_velocity_fn(model), model.parameters(), traj, adv, cfg, jagg_options.JaggOptions(W)),
                                abs=1e-6)


def test_index_hat_weights_interpolate_over_step_numbers():
    t = jagg.sigma_schedule(9, shift=3.0).double()[:-1, None].expand(9, 2)  # [S, B]
    steps = torch.arange(9.0).double()
    for anchors in ((0, 8), (0, 3, 6, 8), (0, 1, 2, 5, 8)):
        H = jagg_options.hat_weights(t, list(anchors), weights="index")  # [S, M, B]
        # The same hat functions over -k instead of t (hat_matrix interpolates over -t).
        torch.testing.assert_close(H[..., 0], hat_matrix(-steps, anchors), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="weights must be one of"):
        jagg_options.hat_weights(t, [0, 8], weights="steps")


def straight_trajectory(model, T=10, B=4, d=3, seed=0):
    """A trajectory whose states lie on one straight line per sample, at alpha = the fraction of t
    travelled, with the model's own velocities and log-probabilities (as a rollout would store)."""
    g = torch.Generator().manual_seed(seed)
    sigmas = jagg.sigma_schedule(T, shift=2.0).double()  # [T+1], float64 like everything here
    t = sigmas[:-1, None].expand(T, B).contiguous()  # [T, B]
    alpha = jagg.interpolation_weights(t)[..., None]  # [T, B, 1]
    z = (1 - alpha) * torch.randn(B, d, generator=g) + alpha * torch.randn(B, d, generator=g)  # [T, B, d]
    z_next = torch.cat([z[1:], torch.randn(1, B, d, generator=g)])  # [T, B, d]
    t_next = sigmas[1:, None].expand(T, B).contiguous()
    with torch.no_grad():
        v = as_velocity_fn(model)(z, t)  # [T, B, d]
        log_prob = torch.stack([jagg.sde_step(v[k], z[k], t[k], t_next[k], 0.7, prev_sample=z_next[k])[1]
                                for k in range(T)])  # [T, B]
    return jagg.Trajectory(z=z, z_next=z_next, t=t, t_next=t_next, log_prob=log_prob, v=v)


def window_grad(model, traj, adv, cfg, W, frac, ref=None, probe_cosines=None, **options):
    model.zero_grad(set_to_none=True)
    stats, routed = jagg_options.window_gradients(as_velocity_fn(model), traj, adv, cfg, jagg_options.JaggOptions(W, frac, **options),
                                          None if ref is None else as_velocity_fn(ref), probe_cosines=probe_cosines)
    return torch.cat([p.grad.flatten() for p in model.parameters()]), stats, routed


@pytest.mark.parametrize("interior", ["forward", "rollout"])
def test_shared_anchors_are_exact_for_a_linear_model_on_a_straight_path(interior):
    """Even after an optimizer step (the rollout's velocities are stale): the change of a linear
    model's velocity is affine in (z, t), so rollout interiors interpolate it exactly too."""
    torch.manual_seed(13)
    old, model = LinearFlow(), LinearFlow()
    traj = straight_trajectory(old)
    adv = torch.tensor([1.0, -0.5, 0.3, -0.8])
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2, beta=0.1)
    g_exact, s_exact, _ = window_grad(model, traj, adv, cfg, 4, 0.0, ref=old)
    g_shared, s_shared, routed = window_grad(model, traj, adv, cfg, 4, 1.0, ref=old, anchors="shared", interior=interior)
    assert routed == [True] * 3 and s_exact["grad_rows"] == 10 and s_shared["grad_rows"] == 4
    torch.testing.assert_close(g_shared, g_exact, rtol=1e-9, atol=1e-10)
    assert s_shared["loss"] == pytest.approx(s_exact["loss"], rel=1e-10)
    # On a nonlinear model the same call is an approximation.
    mlp = MLPFlow()
    traj = straight_trajectory(mlp)
    g_exact, _, _ = window_grad(mlp, traj, adv, cfg, 4, 0.0, ref=mlp)
    g_shared, _, _ = window_grad(mlp, traj, adv, cfg, 4, 1.0, ref=mlp, anchors="shared", interior=interior)
    assert (g_shared - g_exact).norm() > 1e-4 * g_exact.norm()


def test_shared_anchors_route_segments_and_keep_the_others_exact():
    """T = 10, W = 4: segments 0-3, 3-6, 6-9. With the middle one kept exact, the gradient is JAGG's
    with anchors 0, 3, 4, 5, 6, 9 over the whole trajectory: interior steps of an exact segment are anchors."""
    torch.manual_seed(14)
    model = MLPFlow()
    traj, adv = _toy_batch(model, T=10, B=6)
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2)
    assert jagg_options.segment_bounds(10, 4, "shared") == [(0, 4), (3, 7), (6, 10)]
    assert jagg_options.segment_bounds(10, 8, "shared") == [(0, 8), (7, 10)]
    assert jagg_options.segment_bounds(16, 4, "shared")[-1] == (12, 16)
    for interior in ("forward", "rollout"):
        g, stats, routed = window_grad(model, traj, adv, cfg, 4, 2 / 3, anchors="shared", interior=interior,
                                       route="probe", probe_cosines=[0.9, 0.1, 0.8])
        assert routed == [True, False, True] and stats["grad_rows"] == 6
        _, expected = grads_of(model, jagg_options.backward_jagg, traj.z, traj.t, jagg.make_step_loss(traj, adv, 0, 10, cfg),
                               anchors=[0, 3, 4, 5, 6, 9], v_rollout=traj.v if interior == "rollout" else None)
        torch.testing.assert_close(g, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("anchors, interior, policy_calls, ref_calls", [
    # The last window, of 2 steps, trains exactly: JAGG would save nothing on it (jagg.route_windows).
    ("window", "forward", [(2, False), (2, True)] * 2 + [(1, True)] * 2, [(4, False)] * 2 + [(2, False)]),
    ("window", "rollout", [(2, True)] * 2 + [(1, True)] * 2, [(2, False)] * 3),
    ("shared", "forward", [(6, False), (4, True)], [(10, False)]),
    ("shared", "rollout", [(4, True)], [(4, False)]),
])
def test_the_network_sees_only_the_anchor_rows(anchors, interior, policy_calls, ref_calls):
    """T = 10, W = 4. With rollout interiors the policy runs once per JAGG call, with grad, on the
    anchors alone, and the reference model (beta > 0) on the anchors alone too."""
    torch.manual_seed(15)
    model, ref = MLPFlow(), MLPFlow()
    traj, adv = _toy_batch(model, T=10, B=6)
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2, beta=0.1)
    calls, calls_ref = [], []
    jagg_options.window_gradients(as_velocity_fn(model, calls), traj, adv, cfg, jagg_options.JaggOptions(4, 1.0, anchors=anchors, interior=interior),
                          as_velocity_fn(ref, calls_ref))
    assert calls == policy_calls and calls_ref == ref_calls


def test_rows_with_grad_per_trajectory():
    """Backward rows for T = 10: exact 10, the paper's windows 6 (W = 4) and 4 (W = 8), shared anchors 4 and 3."""
    torch.manual_seed(16)
    model = MLPFlow()
    traj, adv = _toy_batch(model, T=10, B=4)
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2)
    rows = {(W, anchors): window_grad(model, traj, adv, cfg, W, 1.0, anchors=anchors)[1]["grad_rows"]
            for W in (4, 8) for anchors in ("window", "shared")}
    assert rows == {(4, "window"): 6, (4, "shared"): 4, (8, "window"): 4, (8, "shared"): 3}
    assert window_grad(model, traj, adv, cfg, 4, 0.0, anchors="shared")[1]["grad_rows"] == 10


def test_non_finite_step_is_skipped_and_leaves_everything_untouched():
    torch.manual_seed(17)
    model = MLPFlow()
    traj, adv = _toy_batch(model, T=8, B=6)
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stats, _ = grpo_step.train_step(as_velocity_fn(model), opt, traj, adv, cfg, jagg_options.JaggOptions(4, 1.0), step=6)
    assert stats["skipped"] is False  # a normal step first, so the optimizer has state to keep

    def nan_at_one_step(z, t):  # a velocity that is NaN at one sampling time, as a bf16 overflow would be
        v = as_velocity_fn(model)(z, t)
        return torch.where((t == traj.t[5, 0])[..., None], torch.nan, v)

    params = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    with pytest.warns(RuntimeWarning, match="optimizer step 7 skipped: non-finite"):
        stats, _ = grpo_step.train_step(nan_at_one_step, opt, traj, adv, cfg, jagg_options.JaggOptions(4, 1.0), step=7)
    assert stats["skipped"] is True and not math.isfinite(stats["loss"])
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    for p, saved in zip(model.parameters(), state):
        assert opt.state[p].keys() == saved.keys() and all(torch.equal(opt.state[p][k], v) for k, v in saved.items())
    assert all(p.grad is None for p in model.parameters())


class BandFlow(torch.nn.Module):
    """Linear in (z, t) but for two things. A parameter w whose Jacobian dv/dw = s(t) u is a bump
    inside one time band (zero at its ends, so JAGG there misses it all) and zero elsewhere; w
    starts at 0, so it leaves the velocity unchanged. And a fixed wiggle e(t) outside the band,
    with no parameter in it: it bends the velocities there, but not the Jacobian."""

    def __init__(self, t_hi, t_lo, d=3):
        super().__init__()
        self.linear, self.t_hi, self.t_lo = LinearFlow(d), t_hi, t_lo
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.u = 5.0 * torch.ones(d)

    def forward(self, z, t):  # z [N, d], t [N]
        inside = (t <= self.t_hi) & (t >= self.t_lo)  # [N]
        s = torch.where(inside, torch.sin(math.pi * (self.t_hi - t) / (self.t_hi - self.t_lo)), torch.zeros_like(t))
        e = torch.where(inside, torch.zeros_like(t), 0.5 * torch.sin(25 * t))  # [N]
        return self.linear(z, t) + (self.w * s + e)[:, None] * self.u


@pytest.mark.parametrize("anchors, T, band", [("window", 12, 1), ("shared", 10, 1)])
def test_probe_routing_keeps_the_nonlinear_segment_exact(anchors, T, band):
    """One segment (the band) has a nonlinear Jacobian and linear velocities; the others the reverse.
    The free velocity score prefers the band; the probe measures it and routes around it."""
    torch.manual_seed(18)
    bounds = jagg_options.segment_bounds(T, 4, anchors)  # three segments of 4 steps
    t = jagg.sigma_schedule(T, shift=2.0).double()
    a, b = bounds[band]
    model = BandFlow(t_hi=t[a].item(), t_lo=t[b - 1].item())
    traj = straight_trajectory(model, T=T, B=4)
    adv = torch.tensor([1.0, -0.5, 0.3, -0.8])
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2)
    cos = jagg_probe.gradient_cosines(as_velocity_fn(model), model.parameters(), traj, adv, cfg, jagg_options.JaggOptions(4, anchors=anchors))
    assert cos[band] < 0.99 and all(c == pytest.approx(1.0, abs=1e-9) for i, c in enumerate(cos) if i != band)

    _, stats, by_velocity = window_grad(model, traj, adv, cfg, 4, 1 / 3, anchors=anchors, route="velocity")
    assert max(stats["window_scores"]) == stats["window_scores"][band] and by_velocity[band]  # the wrong choice
    _, _, by_probe = window_grad(model, traj, adv, cfg, 4, 2 / 3, anchors=anchors, route="probe", probe_cosines=cos)
    assert not by_probe[band] and sum(by_probe) == 2
    # Before the first probe (no cosines yet) "probe" routes by velocity.
    assert window_grad(model, traj, adv, cfg, 4, 1 / 3, anchors=anchors, route="probe")[2] == by_velocity
    # The floor: even at jagg_frac = 1 a segment measured below min_cosine stays exact...
    _, _, floored = window_grad(model, traj, adv, cfg, 4, 1.0, anchors=anchors, route="probe", probe_cosines=cos,
                                min_cosine=0.99)
    assert floored == [i != band for i in range(3)]
    # ...and the gradient is then exact, since the segments left to JAGG are linear.
    g, _, _ = window_grad(model, traj, adv, cfg, 4, 1.0, anchors=anchors, route="probe", probe_cosines=cos,
                          min_cosine=0.99)
    g_exact, _, _ = window_grad(model, traj, adv, cfg, 4, 0.0)
    torch.testing.assert_close(g, g_exact, rtol=1e-9, atol=1e-10)


def test_probe_average():
    avg = jagg_probe.probe_average(None, [0.5, 1.0], decay=0.75)
    assert avg == [0.5, 1.0]
    assert jagg_probe.probe_average(avg, [1.0, 0.0], decay=0.75) == pytest.approx([0.625, 0.75])


# ------------------------------------------------------------------ SDE, advantages, loss


def test_sde_log_prob_is_the_gaussian_density():
    torch.manual_seed(5)
    B, D = 4, (2, 3)
    v, z = torch.randn(B, *D), torch.randn(B, *D)
    sigma, sigma_next = torch.tensor([0.9, 0.5, 0.3, 0.1]), torch.tensor([0.8, 0.4, 0.2, 0.0])
    x, log_prob, mean, std_t = jagg.sde_step(v, z, sigma, sigma_next, noise_level=0.7)
    # sde_step returns Flow-GRPO's std_dev_t, noise_level * sqrt(sigma / (1 - sigma)); the Gaussian's std
    # is std_t * sqrt(sigma - sigma_next).
    torch.testing.assert_close(std_t.flatten().double(), (0.7 * torch.sqrt(sigma / (1 - sigma))).double(), rtol=1e-6, atol=1e-7)
    std = std_t * torch.sqrt(sigma - sigma_next).reshape(std_t.shape)  # [B, 1, 1]
    ref = torch.distributions.Normal(mean, std.expand_as(mean)).log_prob(x).mean(dim=(1, 2))  # [B]
    torch.testing.assert_close(log_prob.double(), ref.double(), rtol=1e-5, atol=1e-5)
    # The std is noise_level * sqrt(sigma / (1 - sigma)) * sqrt(sigma - sigma_next).
    expected_std = 0.7 * torch.sqrt(sigma / (1 - sigma)) * torch.sqrt(sigma - sigma_next)
    torch.testing.assert_close(std.flatten().double(), expected_std.double(), rtol=1e-6, atol=1e-7)
    # Scoring the sample it drew gives the same log-prob; a far-away sample scores lower.
    _, again, _, _ = jagg.sde_step(v, z, sigma, sigma_next, 0.7, prev_sample=x)
    torch.testing.assert_close(again, log_prob)
    _, far, _, _ = jagg.sde_step(v, z, sigma, sigma_next, 0.7, prev_sample=x + 10 * std)
    assert (far < log_prob).all()


def test_a_bf16_network_on_fp32_latents_stores_what_it_scored():
    """The state is stored as it was scored: with a bf16 velocity_fn on fp32 latents, every stored
    z_next is fp32 and scoring it again with the same velocities gives the stored log-probability
    exactly (a first ratio of 1), as Flow-GRPO stores fp32 latents."""
    torch.manual_seed(11)
    model = MLPFlow().to(torch.bfloat16)

    def bf16_velocity_fn(z, t):  # a bf16 network on fp32 latents, returning bf16 as autocast would
        S, B = t.shape
        return model(z.reshape(S * B, -1).bfloat16(), t.reshape(S * B).bfloat16()).reshape(z.shape)

    sigmas = jagg.sigma_schedule(6).float()
    traj = jagg.rollout(bf16_velocity_fn, torch.randn(5, 3, dtype=torch.float32), sigmas, 0.7)
    assert traj.z.dtype == traj.z_next.dtype == torch.float32
    for k in range(6):
        _, lp, _, _ = jagg.sde_step(traj.v[k], traj.z[k], traj.t[k], traj.t_next[k], 0.7, prev_sample=traj.z_next[k])
        assert torch.equal(lp, traj.log_prob[k]), k


def test_sde_first_step_at_sigma_one_is_finite():
    sigmas = jagg.sigma_schedule(8, shift=3.0)
    assert sigmas[0] == 1 and sigmas[-1] == 0 and (sigmas[1:] < sigmas[:-1]).all()
    x, log_prob, _, std_t = jagg.sde_step(torch.randn(3, 2), torch.randn(3, 2), sigmas[:1].expand(3),
                                          sigmas[1:2].expand(3), 0.7)
    assert torch.isfinite(log_prob).all() and torch.isfinite(std_t).all() and torch.isfinite(x).all()


def test_sde_without_noise_is_the_euler_step():
    z, v = torch.randn(3, 2), torch.randn(3, 2)
    sigma, sigma_next = torch.full((3,), 0.6), torch.full((3,), 0.4)
    _, _, mean, _ = jagg.sde_step(v, z, sigma, sigma_next, noise_level=1e-8)
    torch.testing.assert_close(mean.double(), (z + v * (sigma_next - sigma)[:, None]).double(), rtol=1e-6, atol=1e-6)


def test_group_advantages():
    rewards = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 40.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = jagg.group_advantages(rewards, groups, eps=0.0)
    for g in (0, 1):
        a = adv[groups == g]
        assert a.mean().abs() < 1e-6 and (a.std(unbiased=False) - 1).abs() < 1e-6
    expected = (torch.tensor([1.0, 2.0, 3.0]) - 2.0) / torch.tensor([1.0, 2.0, 3.0]).std(unbiased=False)
    torch.testing.assert_close(adv[:3].double(), expected.double(), rtol=1e-6, atol=1e-6)
    glob = jagg.group_advantages(rewards, groups, eps=0.0, global_std=True)
    torch.testing.assert_close(glob[:3].double(), ((torch.tensor([1.0, 2.0, 3.0]) - 2) / rewards.std(unbiased=False)).double())
    clipped = jagg.group_advantages(torch.tensor([0.0] * 9 + [1.0]), torch.zeros(10, dtype=torch.long), clip=2.0)
    assert clipped.max() == 2.0
    # A group whose rewards are all equal gets zero advantage, not NaN.
    assert (jagg.group_advantages(torch.ones(4), torch.zeros(4, dtype=torch.long)) == 0).all()


def test_grpo_loss_clips_and_kl():
    adv = torch.tensor([1.0, -1.0])
    old = torch.zeros(2)
    # Ratio 2 with positive advantage is clipped at 1 + eps; with negative, the unclipped -A r wins.
    loss, stats = jagg.grpo_step_loss(torch.log(torch.tensor([2.0, 2.0])), old, adv, clip_range=0.2)
    assert loss.item() == pytest.approx((-1.2 + 2.0) / 2)
    assert stats["clipfrac"] == 1.0
    assert stats["approx_kl"] == pytest.approx(0.5 * math.log(2) ** 2)
    mean, ref, std = torch.ones(2, 3), torch.zeros(2, 3), torch.full((2, 1), 0.5)
    loss_kl, stats = jagg.grpo_step_loss(old, old, adv, 0.2, mean=mean, mean_ref=ref, std_t=std, beta=0.1)
    assert stats["kl"] == pytest.approx(1 / (2 * 0.25))
    assert loss_kl.item() == pytest.approx(0.1 * 2.0)


def test_kl_term_is_flow_grpos_not_the_transitions():
    """The KL term of a step is Flow-GRPO's, ||mu - mu_ref||^2 / (2 std_t^2) with std_t = noise_level
    sqrt(sigma / (1 - sigma)) (sigma_next in the denominator at sigma = 1), computed here from the
    velocities alone: mu - mu_ref = (v - v_ref) (1 + std_t^2 (1 - sigma) / (2 sigma)) dt. The
    transitions' own KL is 1 / |dt| times larger: with it, beta = 0.04 held the mini SD3 still."""
    torch.manual_seed(0)
    T, B, D, noise_level = 4, 3, 5, 0.7
    sigmas = jagg.sigma_schedule(T, shift=3.0).double()
    traj = jagg.rollout(lambda z, t: 0.5 * z, torch.randn(B, D, dtype=torch.float64), sigmas, noise_level)
    cfg = jagg.LossConfig(noise_level=noise_level, clip_range=0.2, beta=1.0)
    for i in range(T):
        v, v_ref = torch.randn(B, D, dtype=torch.float64), torch.randn(B, D, dtype=torch.float64)
        log = []
        jagg.make_step_loss(traj, torch.zeros(B, dtype=torch.float64), i, i + 1, cfg, v_ref=v_ref[None], log=log)(0, v)
        sigma, sigma_next = sigmas[i].item(), sigmas[i + 1].item()
        std_t = noise_level * math.sqrt(sigma / (1 - (sigma_next if sigma >= 1 else sigma)))
        dt = sigma_next - sigma
        gap = (v - v_ref) * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
        expected = (gap**2).mean().item() / (2 * std_t**2)
        assert log[0]["kl"] == pytest.approx(expected, rel=1e-9), i
        assert abs(expected / abs(dt) - log[0]["kl"]) > 0.5 * log[0]["kl"]  # the transitions' KL: far off


# ------------------------------------------------------------------ routing and training


def test_routing_picks_the_most_linear_windows():
    T, B, d, W = 12, 3, 2, 4
    t = jagg.sigma_schedule(T, shift=1.0)[:-1, None].expand(T, B)  # [T, B]
    v = torch.randn(B, d).expand(T, B, d).clone()  # constant: perfectly linear everywhere
    v[5] = -v[5]  # window 1 (steps 4..7) bends hard
    v[9] += 0.3 * torch.randn(B, d)  # window 2 (steps 8..11) bends a little
    bounds = jagg.window_bounds(T, W)
    scores = [jagg.linearity_score(v[a:b], t[a:b]) for a, b in bounds]
    assert scores[0] == pytest.approx(1.0) and scores[0] > scores[2] > scores[1]
    lengths = [b - a for a, b in bounds]
    assert jagg.route_windows(scores, lengths, 1 / 3) == [True, False, False]
    assert jagg.route_windows(scores, lengths, 2 / 3) == [True, False, True]
    assert jagg.route_windows(scores, lengths, 0.0) == [False] * 3
    assert jagg.route_windows(scores, lengths, 1.0) == [True] * 3
    # A leftover one-step window is always exact.
    assert jagg.window_bounds(9, 4) == [(0, 4), (4, 8), (8, 9)]
    assert jagg.route_windows([1.0, 1.0, 1.0], [4, 4, 1], 1.0) == [True, True, False]


def test_a_window_of_two_steps_never_takes_a_jagg_slot():
    """A 2-step window has no interior: JAGG saves nothing on it, so routing leaves it exact and
    jagg_frac counts the windows of 3 steps or more. T = 10, W = 4 (windows of 4, 4, 2): a share
    of 0.34 goes to one 4-step window, 8 rows with grad, where it used to take the 2-step one (10)."""
    assert jagg.route_windows([1.0, 1.0, 1.0], [4, 4, 2], 1.0) == [True, True, False]
    assert jagg.route_windows([0.9, 0.95, 1.0], [4, 4, 2], 0.34) == [False, True, False]
    torch.manual_seed(3)
    model = MLPFlow()
    traj, adv = _toy_batch(model, T=10, B=4)
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2)
    for frac, rows in ((0.34, 8), (1.0, 6), (0.0, 10)):
        stats, routed = jagg.paper_gradients(as_velocity_fn(model), traj, adv, cfg, 4, frac)
        assert stats["grad_rows"] == rows and not routed[2] and sum(routed) == round(2 * frac)
    assert jagg_options.route_segments([0.9, 0.5, 1.0], [4, 4, 3], 1.0, floor=0.6) == [True, False, True]


def test_the_routing_score_ranks_window_positions_more_than_trajectories():
    """What the routing score (jagg.py section 7: it sees v, not J) can and cannot tell, measured in the
    self-check's setting (a tanh network 4-32-3 on its own rollouts, T = 10, W = 4, B = 16, groups of 4,
    beta 0.04 to a reference 0.05 away) over 40 seeds. Spearman's rank correlation of each 4-step
    window's score with its JAGG gradient's cosine to exact: 0.57 over all 80 windows, 0.23 and 0.40
    within the first and the second window; the high-noise window scores lower in 39 of 40 seeds and has
    the lower cosine in 34."""
    def spearman(a, b):  # no ties among these floats
        ra, rb = (torch.tensor(x).argsort().argsort().double() for x in (a, b))
        return torch.corrcoef(torch.stack([ra, rb]))[0, 1].item()

    T, W, B, D = 10, 4, 16, 3
    rows = []  # (window position, score, cosine)
    for seed in range(40):
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Linear(D + 1, 32), torch.nn.Tanh(), torch.nn.Linear(32, D))
        frozen = copy.deepcopy(net).requires_grad_(False)
        frozen[0].bias.data += 0.05
        fn = lambda n: (lambda z, t: n(torch.cat([z, t[..., None]], -1)))  # noqa: E731
        traj = jagg.rollout(fn(net), torch.randn(B, D), jagg.sigma_schedule(T), 0.7)
        adv = jagg.group_advantages(-traj.sample.norm(dim=-1), torch.arange(B) // 4).double()
        cfg = jagg.LossConfig(0.7, 0.2, 0.04)
        for pos, (a, b) in enumerate(jagg.window_bounds(T, W)[:2]):
            z, t = traj.z[a:b], traj.t[a:b]
            grads = []
            for backward in (jagg.backward_exact, jagg.backward_jagg_window):
                net.zero_grad(set_to_none=True)
                backward(fn(net), z, t, jagg.make_step_loss(traj, adv, a, b, cfg, fn(frozen)(z, t)))
                grads.append(torch.cat([p.grad.flatten() for p in net.parameters()]))
            rows.append((pos, jagg.linearity_score(traj.v[a:b], traj.t[a:b]), cosine(*grads)))
    overall = spearman([r[1] for r in rows], [r[2] for r in rows])
    within = [spearman([r[1] for r in rows if r[0] == p], [r[2] for r in rows if r[0] == p]) for p in (0, 1)]
    first, second = rows[0::2], rows[1::2]
    lower_score = sum(f[1] < s[1] for f, s in zip(first, second))
    lower_cosine = sum(f[2] < s[2] for f, s in zip(first, second))
    # The figures measured (float64; a margin for another machine's rounding of the same seeds).
    assert overall == pytest.approx(0.57, abs=0.03) and within == pytest.approx([0.23, 0.40], abs=0.03), (overall, within)
    assert abs(lower_score - 39) <= 1 and abs(lower_cosine - 34) <= 2, (lower_score, lower_cosine)
    assert max(within) < overall - 0.15  # the claim itself: it ranks positions far better than trajectories


@pytest.mark.parametrize("beta, frac", [(0.0, 1.0), (0.05, 0.5)])
def test_default_options_train_bit_for_bit_what_the_paper_function_does(beta, frac):
    """jagg_options.window_gradients with JaggOptions() (as the trainers run it) and
    jagg.paper_gradients: the same stats and the same gradient, to the last bit."""
    torch.manual_seed(9)
    model, ref = MLPFlow(), MLPFlow()
    traj, adv = _toy_batch(model, T=10, B=6)
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2, beta=beta)
    model.zero_grad(set_to_none=True)
    paper, routed_p = jagg.paper_gradients(as_velocity_fn(model), traj, adv, cfg, 4, frac, as_velocity_fn(ref))
    g_paper = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    ours, routed_o = jagg_options.window_gradients(as_velocity_fn(model), traj, adv, cfg, jagg_options.JaggOptions(4, frac),
                                                   as_velocity_fn(ref))
    assert routed_p == routed_o and paper == ours
    assert all(torch.equal(a, p.grad) for a, p in zip(g_paper, model.parameters()))


@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_on_policy_interiors_from_the_rollout_equal_a_fresh_forward(beta):
    """paper_gradients(on_policy=True) right after a rollout, whose JAGG windows take their interior
    velocities from traj.v, against on_policy=False, which runs them forward at the same weights: the
    same gradient and stats to rounding (the rollout's one-step calls and the window's batched call of an
    MLP agree to ~1e-7), with no interior row forwarded. After an optimizer step the two differ."""
    torch.manual_seed(11)
    model, ref = MLPFlow(), MLPFlow()
    traj, adv = _toy_batch(model, T=10, B=6)
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2, beta=beta)

    def run(on_policy):
        calls = []
        fn = as_velocity_fn(model)
        def counted(z, t):
            calls.append((z.shape[0], torch.is_grad_enabled()))
            return fn(z, t)
        model.zero_grad(set_to_none=True)
        stats, routed = jagg.paper_gradients(counted, traj, adv, cfg, 4, 1.0, as_velocity_fn(ref), on_policy=on_policy)
        return [p.grad.clone() for p in model.parameters()], stats, routed, calls

    g_on, s_on, r_on, calls_on = run(True)
    g_off, s_off, r_off, calls_off = run(False)
    assert r_on == r_off == [True, True, False]
    assert sum(n for n, grad in calls_off if not grad) == 4 and not any(not grad for _, grad in calls_on)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(g_on, g_off))
    assert s_on["loss"] == pytest.approx(s_off["loss"], rel=1e-5, abs=1e-8)
    with torch.no_grad():  # the weights move: traj.v is no longer the policy's velocity
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    g_on, g_off = run(True)[0], run(False)[0]
    assert not all(torch.allclose(a, b, rtol=1e-3, atol=1e-6) for a, b in zip(g_on, g_off))


def _toy_batch(model, T=8, B=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    sigmas = jagg.sigma_schedule(T, shift=2.0)
    traj = jagg.rollout(as_velocity_fn(model), torch.randn(B, 3, generator=g), sigmas, 0.7, generator=g)
    rewards = -traj.sample.norm(dim=-1)  # [B]
    return traj, jagg.group_advantages(rewards, torch.arange(B) // 3)


def test_rollout_shapes_and_log_probs():
    torch.manual_seed(6)
    model = MLPFlow()
    traj, adv = _toy_batch(model, T=5, B=4)
    assert traj.z.shape == (5, 4, 3) and traj.v.shape == (5, 4, 3) and traj.log_prob.shape == (5, 4)
    torch.testing.assert_close(traj.z[1:], traj.z_next[:-1])
    # The stored log-probs are what the policy gives its own samples: the first ratio is 1.
    with torch.no_grad():
        v = as_velocity_fn(model)(traj.z[2:3], traj.t[2:3])[0]
        _, lp, _, _ = jagg.sde_step(v, traj.z[2], traj.t[2], traj.t_next[2], 0.7, prev_sample=traj.z_next[2])
    torch.testing.assert_close(lp.double(), traj.log_prob[2].double(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_jagg_frac_zero_reproduces_exact_training(beta):
    torch.manual_seed(7)
    base = MLPFlow()
    ref = MLPFlow()
    ref.load_state_dict(base.state_dict())
    traj, adv = _toy_batch(base)
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2, beta=beta)
    results = []
    for frac, W in ((0.0, 4), (0.0, 3), (1.0, 4)):
        model = MLPFlow()
        model.load_state_dict(base.state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        # W changes nothing for exact training: windows only group the steps.
        stats, routed = grpo_step.train_step(as_velocity_fn(model), opt, traj, adv, cfg, jagg_options.JaggOptions(W, frac),
                                        ref_velocity_fn=as_velocity_fn(ref))
        results.append((torch.cat([p.detach().flatten() for p in model.parameters()]), stats, routed))
    (p0, s0, r0), (p1, _, _), (p2, s2, r2) = results
    torch.testing.assert_close(p0, p1, rtol=1e-10, atol=1e-12)
    assert not any(r0) and all(r2) and s0["routed_frac"] == 0 and s2["routed_frac"] == 1
    assert s0["grad_rows"] == 8 and s2["grad_rows"] == 4
    assert (p2 - p0).norm() > 1e-8  # JAGG on a nonlinear model is a (slightly) different step
    assert (p0 - torch.cat([p.detach().flatten() for p in base.parameters()])).norm() > 1e-6
    assert s0["loss"] == pytest.approx(s2["loss"], rel=1e-10)  # same loss value, different gradient


def test_gradient_cosines_are_one_for_linear_flow_and_below_one_otherwise():
    torch.manual_seed(8)
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2)
    model = MLPFlow()
    traj, adv = _toy_batch(model)
    cos = jagg_probe.gradient_cosines(as_velocity_fn(model), model.parameters(), traj, adv, cfg, jagg_options.JaggOptions(window=4))
    assert len(cos) == 2 and all(0.0 < c < 1.0 - 1e-9 for c in cos)
    assert all(p.grad is None for p in model.parameters())
    cos2 = jagg_probe.gradient_cosines(as_velocity_fn(model), model.parameters(), traj, adv, cfg, jagg_options.JaggOptions(window=2))
    assert all(c == pytest.approx(1.0, abs=1e-9) for c in cos2)


# ------------------------------------------------------------------ bad input


def test_a_loss_at_another_noise_level_than_the_rollouts_is_refused():
    torch.manual_seed(21)
    model = MLPFlow()
    traj, adv = _toy_batch(model, T=4, B=4)
    assert traj.noise_level == 0.7 and traj.subset([0, 1]).noise_level == 0.7
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="drawn at noise_level 0.7 but the loss scores them at 1.0"):
        grpo_step.train_step(as_velocity_fn(model), opt, traj, adv,
                        jagg.LossConfig(noise_level=1.0, clip_range=0.2), jagg_options.JaggOptions(2, 1.0))
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    other = jagg.Trajectory(**{f: getattr(traj, f) for f in jagg.Trajectory.TENSORS}, noise_level=1.0)
    with pytest.raises(ValueError, match="different noise levels"):
        train_sd.cat_trajectories([traj, other])


def test_bad_input_raises_clear_errors():
    model = MLPFlow()
    fn = as_velocity_fn(model)
    z, t = window(4, 2, 3, straight=False)
    loss = make_loss(4, 2, 3)
    with pytest.raises(ValueError, match="at least 2 steps"):
        jagg_options.backward_jagg(fn, z[:1], t[:1], loss)
    with pytest.raises(ValueError, match=r"z: \[W, B, \*D\] and t: \[W, B\]"):
        jagg_options.backward_jagg(fn, z, t[:3], loss)
    with pytest.raises(ValueError, match="different times"):
        jagg_options.backward_jagg(fn, z, torch.ones(4, 2), loss)
    for anchors in ((1, 3), (0, 2), (0, 2, 1, 3), (0, 1.5, 3), (0,)):
        with pytest.raises(ValueError, match=r"anchors must be increasing step indices from 0 to S - 1 = 3"):
            jagg_options.backward_jagg(fn, z, t, loss, anchors=anchors)
    with pytest.raises(ValueError, match=r"v_rollout must be \[S, B, \*D\] like z"):
        jagg_options.backward_jagg(fn, z, t, loss, v_rollout=z[:3])
    with pytest.raises(ValueError, match="window must be >= 2"):
        jagg.window_bounds(8, 1)
    with pytest.raises(ValueError, match="longer than the trajectory"):
        jagg.window_bounds(8, 9)
    for frac in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"jagg_frac must be in \[0, 1\], got"):
            jagg.route_windows([1.0], [4], frac)
    with pytest.raises(ValueError, match="rewards and group_ids"):
        jagg.group_advantages(torch.ones(4), torch.zeros(3, dtype=torch.long))
    traj, adv = _toy_batch(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="advantages must be"):
        grpo_step.train_step(fn, opt, traj, adv[:-1], cfg, jagg_options.JaggOptions(4, 1.0))
    with pytest.raises(ValueError, match="longer than the trajectory"):
        grpo_step.train_step(fn, opt, traj, adv, cfg, jagg_options.JaggOptions(16, 1.0))
    for kwargs, message in (({"anchors": "overlap"}, "anchors must be one of"),
                            ({"interior": "cache"}, "interior must be one of"),
                            ({"route": "random"}, "route must be one of"),
                            ({"max_drift": -0.1}, "max_drift must be >= 0"),
                            ({"route": "probe", "probe_cosines": [0.9]}, "one value per segment")):
        probe = {"probe_cosines": kwargs.pop("probe_cosines")} if "probe_cosines" in kwargs else {}
        with pytest.raises(ValueError, match=message):
            grpo_step.train_step(fn, opt, traj, adv, cfg, jagg_options.JaggOptions(4, 1.0, **kwargs), **probe)
    # Nothing was changed by the failed calls.
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))


# ------------------------------------------------------------------ beyond the paper: a bound on the rows in a graph


def rows_by_grad(calls):
    """(rows with grad, rows without, largest single call with grad) from as_velocity_fn's record."""
    return (sum(s for s, grad in calls if grad), sum(s for s, grad in calls if not grad),
            max([s for s, grad in calls if grad], default=0))


@pytest.mark.parametrize("anchors", [(0, 6), (0, 2, 6), (0, 1, 4, 6), (0, 2, 3, 4, 6)])
@pytest.mark.parametrize("rollout", [False, True])
def test_bounded_graph_rows_give_the_same_gradient_with_the_same_rows(anchors, rollout):
    """max_graph_rows: the unbounded call's gradient and loss to float64 round-off, the explicit
    Jacobians' too, the same network rows with and without graph, and never more rows in one
    forward with graph than the bound."""
    torch.manual_seed(20)
    model, old, (S, B, d) = MLPFlow(), MLPFlow(), (7, 3, 3)
    z, t = window(S, B, d, straight=False, seed=21)
    with torch.no_grad():
        v_old = as_velocity_fn(old)(z, t) if rollout else None  # [S, B, d]
    free_calls = []
    loss, g_free = grads_of(model, jagg_options.backward_jagg, z, t, make_loss(S, B, d, seed=22), free_calls,
                            anchors=list(anchors), v_rollout=v_old)
    expected = explicit_anchor_gradient(model, z, t, make_loss(S, B, d, seed=22), anchors, v_old)
    for bound in range(2 if rollout else 1, len(anchors)):
        calls = []
        loss_b, g_bound = grads_of(model, jagg_options.backward_jagg, z, t, make_loss(S, B, d, seed=22), calls,
                                   anchors=list(anchors), v_rollout=v_old, max_graph_rows=bound)
        torch.testing.assert_close(g_bound, g_free, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(g_bound, expected, rtol=1e-9, atol=1e-10)
        assert loss_b == pytest.approx(loss, rel=1e-12)
        assert rows_by_grad(calls)[:2] == rows_by_grad(free_calls)[:2]
        assert rows_by_grad(calls)[2] <= bound < rows_by_grad(free_calls)[2]
    if rollout:
        with pytest.raises(ValueError, match="max_graph_rows must be an integer >= 2 with rollout interiors"):
            grads_of(model, jagg_options.backward_jagg, z, t, make_loss(S, B, d), anchors=list(anchors), v_rollout=v_old,
                     max_graph_rows=1)


@pytest.mark.parametrize("anchors, interior, bound", [("window", "forward", 1), ("shared", "forward", 1),
                                                      ("shared", "rollout", 2), ("shared", "rollout", 3)])
def test_bounded_training_step_matches_and_calls_the_same_rows(anchors, interior, bound):
    """Through window_gradients with the KL reference (beta > 0): the same gradient and the same
    policy and reference rows as without a bound (T = 10, W = 4: shared anchors 0, 3, 6, 9)."""
    torch.manual_seed(23)
    model, ref = MLPFlow(), MLPFlow()
    traj, adv = _toy_batch(model, T=10, B=6)
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2, beta=0.1)
    results = []
    for max_rows in (None, bound):
        policy, reference = [], []
        model.zero_grad(set_to_none=True)
        opts = jagg_options.JaggOptions(4, 1.0, anchors=anchors, interior=interior, max_graph_rows=max_rows)
        stats, routed = jagg_options.window_gradients(as_velocity_fn(model, policy), traj, adv, cfg, opts,
                                              ref_velocity_fn=as_velocity_fn(ref, reference))
        results.append((torch.cat([p.grad.flatten() for p in model.parameters()]), stats, policy, reference))
    (g0, s0, p0, r0), (g1, s1, p1, r1) = results
    torch.testing.assert_close(g1, g0, rtol=1e-10, atol=1e-12)
    assert s1["loss"] == pytest.approx(s0["loss"], rel=1e-12) and s1["grad_rows"] == s0["grad_rows"]
    assert rows_by_grad(p1)[:2] == rows_by_grad(p0)[:2] and r1 == r0
    assert rows_by_grad(p1)[2] <= bound
    with pytest.raises(ValueError, match="max_graph_rows must be an integer >= [12].* or None \\(no bound\\), got 0"):
        jagg_options.window_gradients(as_velocity_fn(model), traj, adv, cfg, jagg_options.JaggOptions(4, 1.0, anchors=anchors, interior=interior,
                              max_graph_rows=0), ref_velocity_fn=as_velocity_fn(ref))


def test_python_jagg_py_runs_its_self_check():
    """`python jagg.py` prints what a learner should see: exact on a linear velocity with states where t
    puts them, and not when they sit evenly by step, bend, or the network is a tanh; on real rollouts, the
    gradient error of JAGG below that of 2 random steps x W/2, a routing score that mostly picks the
    low-noise window, as a fixed rule would; routing at jagg_frac 0, 1 and 0.5 (the short last window
    never takes JAGG's share) with its cost in rows with grad (10 -> 6, and 9 -> 5 on Flow-GRPO's 9
    trained steps) and in forwards (30 -> 22); GRPO runs with JAGG and exact over 3 seeds whose rewards
    rise, the clip at work in the off-policy step (the script also asserts that on-policy ratios are 1)."""
    import re
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "jagg.py"], capture_output=True, text=True, check=True, timeout=120,
                         cwd=os.path.dirname(os.path.abspath(jagg.__file__))).stdout
    rel, evenly, bent, curved = (float(x) for x in re.search(
        r"A\. \|JAGG - exact\| / \|exact\|: (\S+) with v affine in \(z, t\), states on the segment;\s+"
        r"(\S+) spaced by step; (\S+) off it; (\S+) for a tanh net", out).groups())
    assert rel < 1e-12 and min(evenly, bent, curved) > 1e-3, out  # either condition broken: JAGG is no longer exact
    rows = [tuple(map(float, r)) for r in re.findall(r"^ +(?:0-3|4-7) \| +(\S+) \| +(\S+)$", out, re.M)]
    (jagg_0, alt_0), (jagg_1, alt_1) = rows
    assert 0.01 < min(jagg_0, jagg_1) and jagg_0 < alt_0 and jagg_1 < alt_1, out
    late, rollouts = (int(x) for x in re.search(r"the score picks steps 4-7 in (\d+) of (\d+) rollouts", out).groups())
    assert rollouts / 2 < late <= rollouts, out  # the score mostly picks the low-noise window, as the fixed rule does
    rows = re.findall(r"^ +(\d+) \| +(\S+) \| (\w+) +\| (\[.*?\]) +\| +(\d+) \| +(\d+) \| +(\d+) \| +(\d+)$",
                      out, re.M)
    assert rows == [("10", "0.0", "False", "[False, False, False]", "10", "10", "0", "30"),  # a backward: 2 forwards
                    ("10", "1.0", "False", "[True, True, False]", "6", "4", "4", "22"),
                    ("10", "0.5", "False", rows[2][3], "8", "7", "2", "26"),
                    ("9", "1.0", "False", "[True, True, False]", "5", "3", "4", "19"),
                    ("9", "1.0", "True", "[True, True, False]", "5", "3", "0", "15")], out  # traj.v: no interior forward
    assert rows[2][3] in ("[True, False, False]", "[False, True, False]"), out  # one 4-step window, never the 2-step
    runs = re.findall(r"seed \d: (\S+) -> (\S+) JAGG, (\S+) exact; clipped (\d+)% in the last step$", out, re.M)
    assert len(runs) == 3, out
    for first, jagg_last, exact_last, clipped in (map(float, r) for r in runs):
        assert jagg_last > first + 0.5 and exact_last > first + 0.5 and clipped > 0, out
    assert out.strip().endswith("ok"), out


@pytest.mark.parametrize("beta, options", [(0.0, {}), (0.05, {"anchors": "shared", "interior": "rollout"})])
def test_probe_reports_the_error_in_units_of_the_batchs_own_noise(beta, options):
    """probe_segments against a direct computation in float64: the whole probe batch's exact and
    JAGG gradients g, j per segment, the halves' g_h, j_h (samples 0, 2, .. and 1, 3, ..),
    Sigma = |g_1 - g_2|^2 / (1/n_1 + 1/n_2), Sigma_e the same of the halves' errors j_h - g_h,
    error = |j - g|^2 + Sigma_e (1/N - 1/B) (the error a step of N samples carries), error_to_noise
    = error / (Sigma / N); at N = B the error is |j - g|^2 itself."""
    torch.manual_seed(21)
    model, ref = MLPFlow(), MLPFlow()
    traj, adv = _toy_batch(model, T=7, B=7)  # 7 samples: halves of 4 and 3
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2, beta=beta)
    opts = jagg_options.JaggOptions(3, 1.0, **options)
    fns = lambda idx: (as_velocity_fn(model), as_velocity_fn(ref))  # noqa: E731  no conditioning to slice
    out = jagg_probe.probe_segments(fns, model.parameters(), traj, adv, cfg, opts, train_batch=32)
    at_b = jagg_probe.probe_segments(fns, model.parameters(), traj, adv, cfg, opts, train_batch=7)
    bounds = jagg_options.segment_bounds(7, 3, opts.anchors)
    assert len(out["cosine"]) == len(out["error_to_noise"]) == len(bounds)

    def grad(backward, idx, start, stop, **kwargs):
        model.zero_grad(set_to_none=True)
        sub, v_ref = traj.subset(idx), None
        if beta > 0:  # the reference's interiors as the mode trains them: interpolated with rollout interiors
            v_rollout = sub.v[start:stop] if "v_rollout" in kwargs else None
            v_ref = jagg_options.reference_velocities(as_velocity_fn(ref), sub.z[start:stop], sub.t[start:stop],
                                                      v_rollout=v_rollout)
        backward(as_velocity_fn(model), sub.z[start:stop], sub.t[start:stop],
                 jagg.make_step_loss(sub, adv[idx], start, stop, cfg, v_ref), **kwargs)
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    every, halves = torch.arange(7), (torch.arange(0, 7, 2), torch.arange(1, 7, 2))
    for (start, stop), cos, ratio in zip(bounds, out["cosine"], out["error_to_noise"]):
        if stop - start < 2:
            assert (cos, ratio) == (1.0, 0.0)
            continue
        rollout = {"v_rollout": traj.v[start:stop]} if opts.interior == "rollout" else {}
        g = grad(jagg.backward_exact, every, start, stop)
        j = grad(jagg_options.backward_jagg, every, start, stop, max_drift=opts.max_drift, **rollout,
                 drift_fn=lambda k, v_k, s=start: jagg_options.ratio_drift(traj, cfg, s + k, v_k))
        g_1, g_2 = (grad(jagg.backward_exact, idx, start, stop) for idx in halves)
        j_1, j_2 = (grad(jagg_options.backward_jagg, idx, start, stop, max_drift=opts.max_drift,
                         **({"v_rollout": traj.v[start:stop][:, idx]} if rollout else {}),
                         drift_fn=lambda k, v_k, s=start, idx=idx: jagg_options.ratio_drift(traj.subset(idx), cfg, s + k, v_k))
                    for idx in halves)
        sigma = (g_1 - g_2).square().sum() / (1 / 4 + 1 / 3)
        sigma_e = ((j_1 - g_1) - (j_2 - g_2)).square().sum() / (1 / 4 + 1 / 3)
        error = (j - g).square().sum() + sigma_e * (1 / 32 - 1 / 7)
        assert cos == pytest.approx(cosine(j, g), abs=1e-6)
        assert ratio == pytest.approx(error.item() / (sigma / 32).item(), rel=1e-4, abs=1e-9)
        assert ratio < math.inf
        i = bounds.index((start, stop))  # the ratio's two parts, for pooling probes (jagg_probe.pool_probes)
        assert out["error"][i] == pytest.approx(error.item(), rel=1e-4, abs=1e-12)
        assert out["noise"][i] == pytest.approx((sigma / 32).item(), rel=1e-4)
        assert out["error"][i] < (j - g).square().sum().item()  # a step of 32 averages more of the error away than 7 do
        assert at_b["error"][i] == pytest.approx((j - g).square().sum().item(), rel=1e-4)
    assert at_b["noise"] == pytest.approx([n * 32 / 7 for n in out["noise"]], rel=1e-9)


def test_probe_figures_read_the_error_a_larger_step_carries():
    """A probe of B = 4 samples asked about a step of N = 16: per-sample exact gradients g_i =
    mu_g + noise and errors e_i = mu_e + noise (j_i = g_i + e_i) drawn many times. Averaged over the
    draws, the error is |mu_e|^2 + tr(Sigma_e) / 16 (not the / 4 a probe's own |j - g|^2 has) and
    the noise tr(Sigma_g) / 16."""
    g = torch.Generator().manual_seed(5)
    P, draws, B, N = 40, 4000, 4, 16
    mu_g = torch.randn(P, generator=g, dtype=torch.float64)
    mu_e = torch.randn(P, generator=g, dtype=torch.float64)
    mu_e *= 0.5 / mu_e.norm()  # |mu_e|^2 = 0.25
    scale_g, scale_e = 1.0, 0.5  # tr Sigma_g = P, tr Sigma_e = P / 4 = 10
    errors, noises = [], []
    for _ in range(draws):
        gs = mu_g + scale_g * torch.randn(B, P, generator=g, dtype=torch.float64)
        js = gs + mu_e + scale_e * torch.randn(B, P, generator=g, dtype=torch.float64)
        halves = (slice(0, 2), slice(2, 4))
        _, _, error, noise = jagg_probe.probe_figures(*(gs[h].mean(0) for h in halves), *(js[h].mean(0) for h in halves),
                                                        2, 2, N)
        errors.append(error), noises.append(noise)
    mean_error, mean_noise = sum(errors) / draws, sum(noises) / draws
    assert mean_error == pytest.approx(0.25 + P * scale_e ** 2 / N, rel=0.05)  # 0.875; a probe's own |j - g|^2: 2.75
    assert mean_noise == pytest.approx(P * scale_g ** 2 / N, rel=0.05)
    assert min(errors) < 0  # one probe's estimate can fall below 0: it is unbiased, so pooling keeps it


# ------------------------------------------------------------------ an SDE window (Flow-GRPO-Fast, MixGRPO)


def test_window_rollout_is_the_sde_inside_and_the_ode_outside():
    torch.manual_seed(23)
    model = MLPFlow()
    fn, sigmas, noise = as_velocity_fn(model), jagg.sigma_schedule(8), torch.randn(5, 3)
    full = jagg.rollout(fn, noise, sigmas, 0.7, generator=torch.Generator().manual_seed(1))
    whole, sample = train_sd.window_rollout(fn, noise, sigmas, 0.7, 0, 8, generator=torch.Generator().manual_seed(1))
    assert all(torch.equal(getattr(full, n), getattr(whole, n)) for n in jagg.Trajectory.TENSORS)  # bit for bit
    assert torch.equal(sample, full.sample)
    traj, sample = train_sd.window_rollout(fn, noise, sigmas, 0.7, 2, 3, generator=torch.Generator().manual_seed(1))
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
        train_sd.window_rollout(fn, noise, sigmas, 0.7, 6, 3)


def test_window_placement_follows_flow_grpo_fast():
    """Flow-GRPO-Fast's placement: the first step uniform in [low, high - K], drawn anew each epoch
    and the same for the same epoch and seed (every rank draws alike)."""
    starts = [train_sd.window_start(e, 3, 1, 7) for e in range(1, 200)]
    assert set(starts) == {1, 2, 3, 4} and starts == [train_sd.window_start(e, 3, 1, 7) for e in range(1, 200)]
    assert starts != [train_sd.window_start(e, 3, 1, 7, seed=1) for e in range(1, 200)]
    with pytest.raises(ValueError, match="does not fit in steps 0 to 2"):
        train_sd.window_start(1, 4, 0, 3)


@pytest.mark.parametrize("options, anchors", [({}, (0, 3)), ({"anchors": "shared", "interior": "rollout"}, (0, 3))])
def test_exact_and_jagg_inside_a_window_against_autograd_and_explicit_jacobians(options, anchors):
    """A window of 4 SDE steps in 10: exact training on it is autograd of the window's summed loss,
    and JAGG on it (W = 4, one segment) is the explicit interpolation of Jacobians."""
    torch.manual_seed(24)
    model = MLPFlow()
    traj, sample = train_sd.window_rollout(as_velocity_fn(model), torch.randn(6, 3), jagg.sigma_schedule(10), 0.7,
                                               3, 4, generator=torch.Generator().manual_seed(2))
    adv = jagg.group_advantages(-sample.norm(dim=-1), torch.arange(6) // 3)
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2)

    def grad(frac):
        model.zero_grad(set_to_none=True)
        jagg_options.window_gradients(as_velocity_fn(model), traj, adv, cfg, jagg_options.JaggOptions(4, frac, **options))
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    step_loss = jagg.make_step_loss(traj, adv, 0, 4, cfg)
    _, expected_exact = reference_gradient(model, traj.z, traj.t, step_loss)
    torch.testing.assert_close(grad(0.0), expected_exact, rtol=1e-10, atol=1e-12)
    v_old = traj.v if options.get("interior") == "rollout" else None
    expected = explicit_anchor_gradient(model, traj.z, traj.t, step_loss, anchors, v_old)
    torch.testing.assert_close(grad(1.0), expected, rtol=1e-9, atol=1e-10)
    assert (expected - expected_exact).norm() > 1e-6 * expected_exact.norm()


def test_pool_probes_sums_errors_over_noises():
    """Summed errors over summed noises, per segment position: not the mean of the ratios, which one
    small noise estimate would blow up; an unbiased part below 0 counts and is not clipped."""
    probes = [{"cosine": [0.8, 1.0], "error": [1.0, 0.0], "noise": [10.0, 0.0]},
              {"cosine": [0.6, 1.0], "error": [3.0, 0.0], "noise": [0.1, 0.0]}]
    pooled = jagg_probe.pool_probes(probes)
    assert pooled["error_to_noise"] == pytest.approx([4.0 / 10.1, 0.0])
    assert pooled["cosine"] == pytest.approx([0.7, 1.0])
    assert jagg_probe.pool_probes([]) is None
    below = [{"cosine": [1.0], "error": [-0.5], "noise": [1.0]}, {"cosine": [1.0], "error": [2.0], "noise": [1.0]}]
    assert jagg_probe.pool_probes(below)["error_to_noise"] == pytest.approx([0.75])
    assert jagg_probe.pool_probes(below[:1])["error_to_noise"] == [-0.5]


def test_pool_probes_gives_the_standard_error_of_the_pooled_figure():
    """The ratio of sums' standard error from the probes' scatter about it, computed here again; probes
    that all agree have none, and one probe gives no estimate."""
    e, v = [1.0, 3.0, -0.5, 2.0], [2.0, 1.0, 1.5, 2.5]
    probes = [{"cosine": [1.0, 1.0], "error": [a, 0.0], "noise": [b, 0.0]} for a, b in zip(e, v)]
    ratio = sum(e) / sum(v)
    expected = math.sqrt(4 / 3 * sum((a - ratio * b) ** 2 for a, b in zip(e, v))) / sum(v)
    assert jagg_probe.pool_probes(probes)["stderr"] == pytest.approx([expected, 0.0])
    same = [{"cosine": [1.0], "error": [0.5 * b], "noise": [b]} for b in v]  # every probe reads 0.5
    assert jagg_probe.pool_probes(same)["stderr"] == pytest.approx([0.0], abs=1e-15)
    assert jagg_probe.pool_probes(probes[:1])["stderr"] == [None, None]


def test_time_gradients_times_exact_against_the_options_and_leaves_their_gradient():
    """jagg_probe.time_gradients: both gradients timed (medians of the repeats), the rows with grad each
    computes (T = 8, W = 4: exact 8 steps, JAGG 2 of each window's 4), and params left with the last call's
    gradient, which is window_gradients' of that method (so the timed work is the training work)."""
    torch.manual_seed(11)
    model = MLPFlow()
    traj, adv = _toy_batch(model, T=8, B=4)
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2, beta=0.0)
    opts, params = jagg_options.JaggOptions(4), list(model.parameters())
    times = jagg_probe.time_gradients(as_velocity_fn(model), params, traj, adv, cfg, opts, repeats=2)
    assert {m: t["grad_rows"] for m, t in times.items()} == {"exact": 8, "jagg": 2 * 2}
    assert all(0 < t["backward_s"] <= t["step_s"] for t in times.values())
    last = [p.grad.clone() for p in params]  # repeats = 2: the last round runs exact last (the order alternates)
    for p in params:
        p.grad = None
    jagg_options.window_gradients(as_velocity_fn(model), traj, adv, cfg, dataclasses.replace(opts, jagg_frac=0.0))
    assert all(torch.equal(a, p.grad) for a, p in zip(last, params))
