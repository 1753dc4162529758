"""Small flow models and helpers the tests of jagg.py and beyond_paper/ share: a linear flow (its Jacobian
affine in (z, t)) and a nonlinear one, velocity_fn wrappers that record their calls, and trusted references
(autograd of a summed loss, Jacobians interpolated explicitly with torch.func)."""

import numpy as np
import pytest
import torch
from torch.func import functional_call, jacrev

import jagg


@pytest.fixture
def float64():
    """Torch's default dtype float64 for one test (test_jagg and test_experts take it for every test): exactness
    then shows as ~1e-16, not fp32's ~1e-7. The conftests of tests/ and lab/tests/ import it."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


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


def toy_batch(model, T=8, B=6, seed=0):
    """A rollout of B trajectories of T steps of model from seeded noise, and group advantages."""
    g = torch.Generator().manual_seed(seed)
    sigmas = jagg.sigma_schedule(T, shift=2.0)
    traj = jagg.rollout(as_velocity_fn(model), torch.randn(B, 3, generator=g), sigmas, 0.7, generator=g)
    rewards = -traj.sample.norm(dim=-1)  # [B]
    return traj, jagg.group_advantages(rewards, torch.arange(B) // 3)


def cat_trajectories(trajs):
    """One jagg.Trajectory of several batches, joined on B: what one process sees of all ranks' samples."""
    tensors = {name: torch.cat([getattr(traj, name) for traj in trajs], dim=1) for name in jagg.Trajectory.TENSORS}
    return jagg.Trajectory(**tensors, noise_level=trajs[0].noise_level)


def routes_by_the_velocity_score(monkeypatch):
    """Wraps jagg.backward_batch: each call's JAGG windows against the cosine rule worked out here from the
    trajectory it was given (linearity_score per window, the highest jagg_frac of them); the calls' routes."""
    seen, paper = [], jagg.backward_batch

    def check(fn, traj, adv, cfg, window=4, jagg_frac=1.0, ref_fn=None, route="early"):
        stats, routed = paper(fn, traj, adv, cfg, window, jagg_frac, ref_fn, route)
        bounds = jagg.window_bounds(traj.z.shape[0], window)
        scores = [jagg.linearity_score(traj.v[a:b], traj.t[a:b]) for a, b in bounds]
        best = sorted((w for w, (a, b) in enumerate(bounds) if b - a >= 3), key=lambda w: -scores[w])
        assert routed == [w in best[: int(jagg_frac * len(best) + 0.5)] for w in range(len(bounds))]
        seen.append(route)
        return stats, routed
    monkeypatch.setattr(jagg, "backward_batch", check)
    return seen
