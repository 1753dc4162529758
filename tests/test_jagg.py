"""jagg.py against trusted references: autograd of the summed loss, explicit Jacobians built with
torch.func, torch.distributions' Gaussian density, and hand-checked statistics."""

import math

import pytest
import torch
from torch.func import functional_call, jacrev

import jagg



@pytest.fixture(autouse=True)
def float64():
    """Exactness checks compare to ~1e-10, not to fp32 rounding."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


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


def grads_of(model, backward, z, t, step_loss, calls=None):
    model.zero_grad(set_to_none=True)
    loss = backward(as_velocity_fn(model, calls), z, t, step_loss)
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


@pytest.mark.parametrize("W", [3, 4, 8])
def test_jagg_is_exact_for_linear_model_on_straight_path(W):
    torch.manual_seed(1)
    model, (B, d) = LinearFlow(), (4, 3)
    z, t = window(W, B, d, straight=True, seed=W)
    loss_j, g_jagg = grads_of(model, jagg.backward_jagg, z, t, make_loss(W, B, d))
    loss_e, g_exact = grads_of(model, jagg.backward_exact, z, t, make_loss(W, B, d))
    assert loss_j == pytest.approx(loss_e, rel=1e-10)
    torch.testing.assert_close(g_jagg, g_exact, rtol=1e-9, atol=1e-10)


def test_jagg_is_not_exact_for_linear_model_off_the_straight_path():
    """The straight-path condition matters: the same linear model, states off the segment."""
    torch.manual_seed(1)
    model, (W, B, d) = LinearFlow(), (4, 4, 3)
    z, t = window(W, B, d, straight=False)
    _, g_jagg = grads_of(model, jagg.backward_jagg, z, t, make_loss(W, B, d))
    _, g_exact = grads_of(model, jagg.backward_exact, z, t, make_loss(W, B, d))
    assert (g_jagg - g_exact).norm() > 1e-3 * g_exact.norm()


def test_window_of_two_is_exact_on_a_nonlinear_model():
    torch.manual_seed(2)
    model, (W, B, d) = MLPFlow(), (2, 5, 3)
    z, t = window(W, B, d, straight=False)
    _, g_jagg = grads_of(model, jagg.backward_jagg, z, t, make_loss(W, B, d))
    _, g_exact = grads_of(model, jagg.backward_exact, z, t, make_loss(W, B, d))
    torch.testing.assert_close(g_jagg, g_exact, rtol=1e-9, atol=1e-10)


def test_jagg_equals_explicit_jacobian_interpolation_and_differs_from_exact():
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

    _, g_jagg = grads_of(model, jagg.backward_jagg, z, t, step_loss)
    _, g_exact = grads_of(model, jagg.backward_exact, z, t, step_loss)
    torch.testing.assert_close(g_jagg, expected, rtol=1e-9, atol=1e-10)
    assert (g_jagg - g_exact).norm() > 1e-3 * g_exact.norm()
    assert cosine(g_jagg, g_exact) < 0.999999


def test_jagg_runs_the_network_with_grad_on_two_steps_only():
    torch.manual_seed(4)
    model, (W, B, d) = MLPFlow(), (6, 2, 3)
    z, t = window(W, B, d, straight=False)
    calls = []
    grads_of(model, jagg.backward_jagg, z, t, make_loss(W, B, d), calls)
    assert calls == [(W - 2, False), (2, True)]
    calls.clear()
    grads_of(model, jagg.backward_exact, z, t, make_loss(W, B, d), calls)
    assert calls == [(1, True)] * W


# ------------------------------------------------------------------ SDE, advantages, loss


def test_sde_log_prob_is_the_gaussian_density():
    torch.manual_seed(5)
    B, D = 4, (2, 3)
    v, z = torch.randn(B, *D), torch.randn(B, *D)
    sigma, sigma_next = torch.tensor([0.9, 0.5, 0.3, 0.1]), torch.tensor([0.8, 0.4, 0.2, 0.0])
    x, log_prob, mean, std = jagg.sde_step(v, z, sigma, sigma_next, noise_level=0.7)
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


def test_sde_first_step_at_sigma_one_is_finite():
    sigmas = jagg.sigma_schedule(8, shift=3.0)
    assert sigmas[0] == 1 and sigmas[-1] == 0 and (sigmas[1:] < sigmas[:-1]).all()
    x, log_prob, _, std = jagg.sde_step(torch.randn(3, 2), torch.randn(3, 2), sigmas[:1].expand(3),
                                        sigmas[1:2].expand(3), 0.7)
    assert torch.isfinite(log_prob).all() and torch.isfinite(std).all() and torch.isfinite(x).all()


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
    loss_kl, stats = jagg.grpo_step_loss(old, old, adv, 0.2, mean=mean, mean_ref=ref, std=std, beta=0.1)
    assert stats["kl"] == pytest.approx(1 / (2 * 0.25))
    assert loss_kl.item() == pytest.approx(0.1 * 2.0)


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
        stats, routed = jagg.train_step(as_velocity_fn(model), model.parameters(), opt, traj, adv, cfg, W, frac,
                                        ref_velocity_fn=as_velocity_fn(ref))
        results.append((torch.cat([p.detach().flatten() for p in model.parameters()]), stats, routed))
    (p0, s0, r0), (p1, _, _), (p2, s2, r2) = results
    torch.testing.assert_close(p0, p1, rtol=1e-10, atol=1e-12)
    assert not any(r0) and all(r2) and s0["routed_frac"] == 0 and s2["routed_frac"] == 1
    assert s0["grad_steps"] == 8 and s2["grad_steps"] == 4
    assert (p2 - p0).norm() > 1e-8  # JAGG on a nonlinear model is a (slightly) different step
    assert (p0 - torch.cat([p.detach().flatten() for p in base.parameters()])).norm() > 1e-6
    assert s0["loss"] == pytest.approx(s2["loss"], rel=1e-10)  # same loss value, different gradient


def test_gradient_cosines_are_one_for_linear_flow_and_below_one_otherwise():
    torch.manual_seed(8)
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2)
    model = MLPFlow()
    traj, adv = _toy_batch(model)
    cos = jagg.gradient_cosines(as_velocity_fn(model), model.parameters(), traj, adv, cfg, window=4)
    assert len(cos) == 2 and all(0.0 < c < 1.0 - 1e-9 for c in cos)
    assert all(p.grad is None for p in model.parameters())
    cos2 = jagg.gradient_cosines(as_velocity_fn(model), model.parameters(), traj, adv, cfg, window=2)
    assert all(c == pytest.approx(1.0, abs=1e-9) for c in cos2)


def test_benchmark_window_reports_each_part():
    torch.manual_seed(9)
    model, (W, B, d) = MLPFlow(), (4, 8, 3)
    z, t = window(W, B, d, straight=False)
    out = jagg.benchmark_window(as_velocity_fn(model), model.parameters(), z, t, make_loss(W, B, d), repeats=2)
    assert set(out) == {"exact", "jagg"}
    assert out["exact"]["fwd_nograd"] == 0.0 and out["jagg"]["fwd_nograd"] > 0.0
    for m in out.values():
        assert m["backward"] > 0 and m["total"] == pytest.approx(m["fwd_graph"] + m["fwd_nograd"] + m["backward"])


# ------------------------------------------------------------------ bad input


def test_bad_input_raises_clear_errors():
    model = MLPFlow()
    fn = as_velocity_fn(model)
    z, t = window(4, 2, 3, straight=False)
    loss = make_loss(4, 2, 3)
    with pytest.raises(ValueError, match="at least 2 steps"):
        jagg.backward_jagg(fn, z[:1], t[:1], loss)
    with pytest.raises(ValueError, match=r"z: \[W, B, \*D\] and t: \[W, B\]"):
        jagg.backward_jagg(fn, z, t[:3], loss)
    with pytest.raises(ValueError, match=r"z: \[W, B, \*D\] and t: \[W, B\]"):
        jagg.backward_exact(fn, z, t[:, :1], loss)
    with pytest.raises(ValueError, match="different times"):
        jagg.backward_jagg(fn, z, torch.ones(4, 2), loss)
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
        jagg.train_step(fn, model.parameters(), opt, traj, adv[:-1], cfg, 4, 1.0)
    with pytest.raises(ValueError, match="longer than the trajectory"):
        jagg.train_step(fn, model.parameters(), opt, traj, adv, cfg, 16, 1.0)
    # Nothing was changed by the failed calls.
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
