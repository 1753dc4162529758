"""Models with two experts (Wan 2.2 A14B: one transformer at high noise, another below a switch):
JaggOptions.boundaries keeps every window and shared-anchor segment within one network.

Two small networks make one velocity_fn that picks the network row by row from t. T = 10 steps of
SD3's schedule (shift 3), W = 4; the switch falls between steps 5 and 6, inside the paper's window
4-7. With boundaries (6,) the windows are 0-3 | 4-5 | 6-9 and the shared segments 0-3 | 3-5 | 6-9."""

import os
import sys

import pytest
import torch

import jagg
from beyond_paper import options, probe

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import diffusers_models  # noqa: E402  (Wan's recipe computes the boundaries)

T, W, B, D = 10, 4, 6, 3
SWITCH = 0.7  # sigma; steps 0-5 (sigma >= 0.75) run expert 1, steps 6-9 (sigma <= 0.667) expert 2
CFG = jagg.LossConfig(noise_level=0.7, clip_range=0.2)


pytestmark = pytest.mark.usefixtures("float64")  # conftest's: exactness shows as ~1e-16, not fp32's ~1e-7


class Affine(torch.nn.Module):
    """v = (A1 A2) z + b t + c: affine in (z, t), nonlinear in theta, so J(z, t) is affine (jagg.py's
    self-check, part A): the paper's condition for one network."""

    def __init__(self):
        super().__init__()
        self.A1, self.A2 = torch.nn.Parameter(torch.randn(D, D)), torch.nn.Parameter(torch.randn(D, D))
        self.b, self.c = torch.nn.Parameter(torch.randn(D)), torch.nn.Parameter(torch.randn(D))

    def forward(self, x):  # x: [N, D + 1] = (z, t)
        return x[:, :D] @ (self.A1 @ self.A2).T + x[:, D:] * self.b + self.c


def tanh_mlp():
    return torch.nn.Sequential(torch.nn.Linear(D + 1, 16), torch.nn.Tanh(), torch.nn.Linear(16, D))


class TwoExperts(torch.nn.Module):
    """Expert 1 where t >= SWITCH, expert 2 elsewhere, chosen per row (as WanPipeline chooses by
    timestep, but row by row: JAGG runs several steps in one call)."""

    def __init__(self, first, second):
        super().__init__()
        self.first, self.second = first, second

    def velocity_fn(self, calls=None):
        def velocity_fn(z, t):  # z: [S, B, D], t: [S, B]
            high = (t >= SWITCH).reshape(-1, 1)  # [S * B, 1]: the rows expert 1 runs
            if calls is not None and torch.is_grad_enabled():  # which experts a forward with graph holds
                calls.append(sorted({1 if h else 2 for h in high.flatten().tolist()}))
            x = torch.cat([z, t[..., None]], dim=-1).reshape(-1, D + 1)  # [S * B, D + 1]
            return torch.where(high, self.first(x), self.second(x)).reshape(z.shape)
        return velocity_fn


def flat(module):  # the module's .grad as one vector [P]
    return torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros_like(p).flatten()
                      for p in module.parameters()])


def gradient(model, traj, adv, cfg=CFG, **fields):
    """(flat gradient [P] of both experts, per expert [P_1], [P_2], stats) of backward_batch."""
    model.zero_grad(set_to_none=True)
    stats, _ = options.backward_batch(model.velocity_fn(), traj, adv, cfg, options.JaggOptions(W, **fields))
    return flat(model), flat(model.first), flat(model.second), stats


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def cosine(a, b):
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()


def straight_batch(model):
    """States affine in t along the whole trajectory, z_k = p + t_k u per sample, so every window
    of every tiling is straight; old log-probabilities from the model's own velocities (ratio 1)
    and group-relative advantages: the paper's condition holds for each expert on its own steps."""
    sigmas = jagg.sigma_schedule(T).double()  # [T + 1]
    p, u = torch.randn(B, D), torch.randn(B, D)
    zs = p + sigmas[:, None, None] * u  # [T + 1, B, D]
    t = sigmas[:-1, None].expand(T, B).contiguous()  # [T, B]
    t_next = sigmas[1:, None].expand(T, B).contiguous()  # [T, B]
    with torch.no_grad():
        v = model.velocity_fn()(zs[:-1], t)  # [T, B, D]
        log_prob = torch.stack([jagg.sde_step(v[k], zs[k], t[k], t_next[k], CFG.noise_level, prev_sample=zs[k + 1])[1]
                                for k in range(T)])  # [T, B]
    traj = jagg.Trajectory(z=zs[:-1], z_next=zs[1:], t=t, t_next=t_next, log_prob=log_prob, v=v,
                           noise_level=CFG.noise_level)
    adv = torch.randn(B)
    return traj, adv - adv.mean()


def rollout_batch(model, seed, cfg=CFG):
    """A real rollout of the two-expert model (its SDE bends the states) with advantages."""
    g = torch.Generator().manual_seed(seed)
    traj = jagg.rollout(model.velocity_fn(), torch.randn(B, D, generator=g), jagg.sigma_schedule(T).double(),
                        cfg.noise_level, generator=g)
    reward = -traj.sample.norm(dim=-1)  # [B]
    return traj, jagg.group_advantages(reward, torch.arange(B) // 3).double()


def test_expert_boundaries_follow_the_schedule_as_wans_pipeline_picks_its_transformer():
    sigmas = jagg.sigma_schedule(T)  # 1, .964, .923, .875, .818, .75, .667, ...
    assert diffusers_models.expert_boundaries(sigmas, SWITCH) == (6,)
    assert diffusers_models.expert_boundaries(sigmas, 0.875) == (4,)  # sigma 0.875 itself is the first expert's (>=)
    assert diffusers_models.expert_boundaries(sigmas, 1.5) == () == diffusers_models.expert_boundaries(sigmas, 0.1)
    # Wan's own scheduler: the transformer runs where timestep >= boundary_ratio x 1000 (diffusers' WanPipeline).
    diffusers = pytest.importorskip("diffusers")
    scheduler = diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    scheduler.set_timesteps(20)
    first = [k for k, timestep in enumerate(scheduler.timesteps.tolist()) if timestep >= 0.875 * 1000]
    assert diffusers_models.expert_boundaries(scheduler.sigmas, 0.875) == (len(first),) and first == list(range(len(first)))
    with pytest.raises(ValueError, match="decreasing schedule"):
        diffusers_models.expert_boundaries(sigmas.flip(0), SWITCH)


def test_segments_end_at_every_boundary():
    for anchors in ("window", "shared"):
        bounds = options.segment_bounds(T, W, anchors, (6,))
        assert all(stop <= 6 or start >= 6 for start, stop in bounds), (anchors, bounds)
        steps = sorted({k for start, stop in bounds for k in range(start, stop)})
        assert steps == list(range(T))  # every step still in a segment
    assert options.segment_bounds(T, W, "window", (6,)) == [(0, 4), (4, 6), (6, 10)]
    assert options.segment_bounds(T, W, "shared", (6,)) == [(0, 4), (3, 6), (6, 10)]
    assert options.segment_bounds(T, W, "shared", (3, 4)) == [(0, 3), (3, 4), (4, 8), (7, 10)]  # a 1-step network
    assert options.segment_bounds(T, W, "window", ()) == jagg.window_bounds(T, W)  # the paper's tiling


@pytest.mark.parametrize("bad", [(0,), (T,), (6, 6), (7, 3), (2.5,), "6", 6])
def test_a_bad_boundary_is_refused_in_one_line(bad):
    torch.manual_seed(0)
    model = TwoExperts(Affine(), Affine())
    traj, adv = straight_batch(model)
    with pytest.raises(ValueError, match=r"boundaries must be increasing step indices inside \(0, T = 10\)") as error:
        options.backward_batch(model.velocity_fn(), traj, adv, CFG, options.JaggOptions(W, boundaries=bad))
    assert "\n" not in str(error.value)
    assert all(p.grad is None for p in model.parameters())  # refused before any work


def test_exact_backward_is_autograd_of_the_summed_loss_for_two_experts():
    """jagg_frac 0 trains every step exactly, with the expert each step runs: the gradient of the
    trajectory's summed loss in one graph, expert by expert."""
    torch.manual_seed(1)
    model = TwoExperts(tanh_mlp(), tanh_mlp())
    traj, adv = rollout_batch(model, seed=1)
    g, g_1, g_2, stats = gradient(model, traj, adv, jagg_frac=0.0)
    model.zero_grad(set_to_none=True)
    step_loss, fn = jagg.make_step_loss(traj, adv, 0, T, CFG), model.velocity_fn()
    total = sum(step_loss(k, fn(traj.z[k : k + 1], traj.t[k : k + 1])[0]) for k in range(T))
    total.backward()
    assert stats["grad_rows"] == T and stats["loss"] == pytest.approx(total.item(), rel=1e-12)
    torch.testing.assert_close(g, flat(model), rtol=1e-10, atol=1e-13)
    assert g_1.norm() > 0 and g_2.norm() > 0  # both experts trained


def test_a_straddling_window_credits_the_other_expert_with_a_step_it_never_ran():
    """The paper's window 4-7 with a loss on step 5 alone (run by expert 1): exact gives expert 2
    nothing; JAGG interpolates step 5's Jacobian towards step 7's, expert 2's, and gives it alpha_5 of it."""
    torch.manual_seed(2)
    model = TwoExperts(Affine(), Affine())
    traj, _ = straight_batch(model)
    z, t, w = traj.z[4:8], traj.t[4:8], torch.randn(B, D)
    step_loss = lambda k, v_k: (w * v_k).sum() * (k == 1)  # noqa: E731  (k counts from the window's first step, 4)
    grads = {}
    for name, backward in (("exact", jagg.backward_exact), ("jagg", jagg.backward_jagg_window)):
        model.zero_grad(set_to_none=True)
        backward(model.velocity_fn(), z, t, step_loss)
        grads[name] = flat(model.first), flat(model.second)
    (exact_1, exact_2), (_, jagg_2) = grads["exact"], grads["jagg"]
    assert exact_2.norm() == 0 < exact_1.norm()
    alpha_5 = jagg.interpolation_weights(t)[1, 0].item()  # 0.31: step 5's weight on step 7's Jacobian
    assert jagg_2.norm() > 0.1 * exact_1.norm(), (jagg_2.norm(), exact_1.norm())
    print(f"\nstep 5 alone (expert 1's): expert 2 credited |g_2| = {jagg_2.norm():.3f} "
          f"(exact 0; |exact g_1| = {exact_1.norm():.3f}), alpha_5 = {alpha_5:.2f}")


@pytest.mark.parametrize("anchors,interior", [("window", "forward"), ("shared", "forward"), ("shared", "rollout")])
def test_with_boundaries_jagg_is_exact_where_each_expert_meets_the_papers_condition(anchors, interior):
    """Each expert affine in (z, t), the states straight: JAGG over segments within one expert equals
    exact to round-off; the same options without boundaries straddle the switch and miss, on both
    experts. Rollout interiors: on-policy (traj.v is the model's own), so PAPER, so exact here."""
    torch.manual_seed(3)
    model = TwoExperts(Affine(), Affine())
    traj, adv = straight_batch(model)
    boundaries = diffusers_models.expert_boundaries(jagg.sigma_schedule(T), SWITCH)  # (6,)
    g, g_1, g_2, _ = gradient(model, traj, adv, jagg_frac=0.0)  # exact
    with_b, with_1, with_2, stats = gradient(model, traj, adv, anchors=anchors, interior=interior, boundaries=boundaries)
    without, without_1, without_2, _ = gradient(model, traj, adv, anchors=anchors, interior=interior)
    assert rel(with_b, g) < 1e-12, rel(with_b, g)
    assert stats["grad_rows"] == (6 if anchors == "window" else 5)  # window: 2 + 2 (4-5) + 2; shared: 0, 3, 5 | 6, 9
    assert rel(without, g) > 1e-2 and min(rel(without_1, g_1), rel(without_2, g_2)) > 1e-2
    print(f"\n{anchors}/{interior}: |JAGG - exact| / |exact| {rel(with_b, g):.1e} with boundaries, {rel(without, g):.3f} "
          f"without; per expert without: error {rel(without_1, g_1):.3f} / {rel(without_2, g_2):.3f}, "
          f"cosine {cosine(without_1, g_1):.3f} / {cosine(without_2, g_2):.3f}, "
          f"norm x{(without_1.norm() / g_1.norm()).item():.2f} / x{(without_2.norm() / g_2.norm()).item():.2f}")


def test_each_forward_with_graph_holds_one_expert_with_boundaries():
    """Shared anchors with boundaries: the JAGG call of each network's segments runs its anchors
    (0, 3, 5 and 6, 9) in its own forward; without boundaries one forward holds anchors 0, 3, 6, 9 of both."""
    torch.manual_seed(4)
    model = TwoExperts(Affine(), Affine())
    traj, adv = straight_batch(model)
    for boundaries, expected in (((6,), [[1], [2]]), ((), [[1, 2]])):
        calls = []
        options.backward_batch(model.velocity_fn(calls), traj, adv, CFG,
                                      options.JaggOptions(W, anchors="shared", boundaries=boundaries))
        assert calls == expected, (boundaries, calls)


def test_the_probe_reads_segments_within_one_expert():
    """gradient_cosines takes the same segments: cosine 1 on each with boundaries; without, the
    straddling window 4-7 alone falls below 1."""
    torch.manual_seed(5)
    model = TwoExperts(Affine(), Affine())
    traj, adv = straight_batch(model)
    params = list(model.parameters())
    with_b = probe.gradient_cosines(model.velocity_fn(), params, traj, adv, CFG, options.JaggOptions(W, boundaries=(6,)))
    without = probe.gradient_cosines(model.velocity_fn(), params, traj, adv, CFG, options.JaggOptions(W))
    assert len(with_b) == 3 and all(abs(c - 1) < 1e-12 for c in with_b), with_b
    assert abs(without[0] - 1) < 1e-12 and abs(without[2] - 1) < 1e-12 and without[1] < 1 - 1e-3, without


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_with_boundaries_a_generic_two_expert_model_is_at_least_as_close(seed):
    """Two tanh networks on their own rollout (the states bend, the Jacobians are not affine): JAGG
    with boundaries is at least as close to exact as without, on the whole gradient and on each
    expert, where JAGG's own error is small (noise level 0.3: relative errors 0.02-0.09 with
    boundaries, 0.09-0.25 without, over 10 seeds). At 0.7 this toy's own error per window (~0.15)
    is as large as the straddle's, and the window 6-9 that boundaries add to expert 2 (the paper's
    tiling trains its 8-9 exactly) can cost it more than the straddle did (5 of 10 seeds)."""
    torch.manual_seed(seed)
    cfg = jagg.LossConfig(noise_level=0.3, clip_range=0.2)
    model = TwoExperts(tanh_mlp(), tanh_mlp())
    traj, adv = rollout_batch(model, seed, cfg)
    g, g_1, g_2, _ = gradient(model, traj, adv, cfg, jagg_frac=0.0)
    with_b, with_1, with_2, _ = gradient(model, traj, adv, cfg, boundaries=(6,))
    without, without_1, without_2, _ = gradient(model, traj, adv, cfg)
    print(f"\nseed {seed}: |JAGG - exact| / |exact| with boundaries {rel(with_b, g):.3f}, without {rel(without, g):.3f}; "
          f"cosine {cosine(with_b, g):.4f} vs {cosine(without, g):.4f}; per expert with / without: "
          f"{rel(with_1, g_1):.3f} / {rel(without_1, g_1):.3f}, {rel(with_2, g_2):.3f} / {rel(without_2, g_2):.3f}")
    assert rel(with_b, g) <= rel(without, g)
    assert rel(with_1, g_1) <= rel(without_1, g_1) and rel(with_2, g_2) <= rel(without_2, g_2)
