"""beyond_paper/probe.py: the probe's cosine and its error in units of a step's noise against gradients
computed here, pooling over probes against numpy, and the timing of exact against JAGG. The
velocity_fn contract check is tested on every diffusers family in test_recipes.py."""

import math

import pytest
import torch

import jagg
from beyond_paper import checks, options, probe
from flows import MLPFlow, as_velocity_fn, cosine, toy_batch

pytestmark = pytest.mark.usefixtures("float64")  # conftest's: exactness shows as ~1e-16, not fp32's ~1e-7


def test_probe_average():
    avg = probe.probe_average(None, [0.5, 1.0], decay=0.75)
    assert avg == [0.5, 1.0]
    assert probe.probe_average(avg, [1.0, 0.0], decay=0.75) == pytest.approx([0.625, 0.75])


def test_gradient_cosines_are_one_for_linear_flow_and_below_one_otherwise():
    torch.manual_seed(8)
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2)
    model = MLPFlow()
    traj, adv = toy_batch(model)
    cos = probe.gradient_cosines(as_velocity_fn(model), model.parameters(), traj, adv, cfg, options.JaggOptions(window=4))
    assert len(cos) == 2 and all(0.0 < c < 1.0 - 1e-9 for c in cos)
    assert all(p.grad is None for p in model.parameters())
    cos2 = probe.gradient_cosines(as_velocity_fn(model), model.parameters(), traj, adv, cfg, options.JaggOptions(window=2))
    assert all(c == pytest.approx(1.0, abs=1e-9) for c in cos2)


@pytest.mark.parametrize("beta, fields", [(0.0, {}), (0.05, {"anchors": "shared", "interior": "rollout"})])
def test_probe_reports_the_error_in_units_of_the_batchs_own_noise(beta, fields):
    """probe_segments against a direct computation in float64: the whole probe batch's exact and
    JAGG gradients g, j per segment, the halves' g_h, j_h (samples 0, 2, .. and 1, 3, ..),
    Sigma = |g_1 - g_2|^2 / (1/n_1 + 1/n_2), Sigma_e the same of the halves' errors j_h - g_h,
    error = |j - g|^2 + Sigma_e (1/N - 1/B) (the error a step of N samples carries), error_to_noise
    = error / (Sigma / N); at N = B the error is |j - g|^2 itself."""
    torch.manual_seed(21)
    model, ref = MLPFlow(), MLPFlow()
    traj, adv = toy_batch(model, T=7, B=7)  # 7 samples: halves of 4 and 3
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2, beta=beta)
    opts = options.JaggOptions(3, 1.0, **fields)
    fns = lambda idx: (as_velocity_fn(model), as_velocity_fn(ref))  # noqa: E731  no conditioning to slice
    out = probe.probe_segments(fns, model.parameters(), traj, adv, cfg, opts, train_batch=32)
    at_b = probe.probe_segments(fns, model.parameters(), traj, adv, cfg, opts, train_batch=7)
    bounds = options.segment_bounds(7, 3, opts.anchors)
    assert len(out["cosine"]) == len(out["error_to_noise"]) == len(bounds)

    def grad(backward, idx, start, stop, **kwargs):
        model.zero_grad(set_to_none=True)
        sub, v_ref = traj.subset(idx), None
        if beta > 0:  # the reference's interiors as the mode trains them: interpolated with rollout interiors
            v_rollout = sub.v[start:stop] if "v_rollout" in kwargs else None
            v_ref = options.reference_velocities(as_velocity_fn(ref), sub.z[start:stop], sub.t[start:stop],
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
        j = grad(options.backward_jagg, every, start, stop, max_drift=opts.max_drift, **rollout,
                 drift_fn=lambda k, v_k, s=start: options.ratio_drift(traj, cfg, s + k, v_k))
        g_1, g_2 = (grad(jagg.backward_exact, idx, start, stop) for idx in halves)
        j_1, j_2 = (grad(options.backward_jagg, idx, start, stop, max_drift=opts.max_drift,
                         **({"v_rollout": traj.v[start:stop][:, idx]} if rollout else {}),
                         drift_fn=lambda k, v_k, s=start, idx=idx: options.ratio_drift(traj.subset(idx), cfg, s + k, v_k))
                    for idx in halves)
        sigma = (g_1 - g_2).square().sum() / (1 / 4 + 1 / 3)
        sigma_e = ((j_1 - g_1) - (j_2 - g_2)).square().sum() / (1 / 4 + 1 / 3)
        error = (j - g).square().sum() + sigma_e * (1 / 32 - 1 / 7)
        assert cos == pytest.approx(cosine(j, g), abs=1e-6)
        assert ratio == pytest.approx(error.item() / (sigma / 32).item(), rel=1e-4, abs=1e-9)
        assert ratio < math.inf
        i = bounds.index((start, stop))  # the ratio's two parts, for pooling probes (probe.pool_probes)
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
        _, _, error, noise = probe.probe_figures(*(gs[h].mean(0) for h in halves), *(js[h].mean(0) for h in halves),
                                                        2, 2, N)
        errors.append(error), noises.append(noise)
    mean_error, mean_noise = sum(errors) / draws, sum(noises) / draws
    assert mean_error == pytest.approx(0.25 + P * scale_e ** 2 / N, rel=0.05)  # 0.875; a probe's own |j - g|^2: 2.75
    assert mean_noise == pytest.approx(P * scale_g ** 2 / N, rel=0.05)
    assert min(errors) < 0  # one probe's estimate can fall below 0: it is unbiased, so pooling keeps it


def test_pool_probes_sums_errors_over_noises():
    """Summed errors over summed noises, per segment position: not the mean of the ratios, which one
    small noise estimate would blow up; an unbiased part below 0 counts and is not clipped."""
    probes = [{"cosine": [0.8, 1.0], "error": [1.0, 0.0], "noise": [10.0, 0.0]},
              {"cosine": [0.6, 1.0], "error": [3.0, 0.0], "noise": [0.1, 0.0]}]
    pooled = probe.pool_probes(probes)
    assert pooled["error_to_noise"] == pytest.approx([4.0 / 10.1, 0.0])
    assert pooled["cosine"] == pytest.approx([0.7, 1.0])
    assert probe.pool_probes([]) is None
    below = [{"cosine": [1.0], "error": [-0.5], "noise": [1.0]}, {"cosine": [1.0], "error": [2.0], "noise": [1.0]}]
    assert probe.pool_probes(below)["error_to_noise"] == pytest.approx([0.75])
    assert probe.pool_probes(below[:1])["error_to_noise"] == [-0.5]


def test_pool_probes_gives_the_standard_error_of_the_pooled_figure():
    """The ratio of sums' standard error from the probes' scatter about it, computed here again; probes
    that all agree have none, and one probe gives no estimate."""
    e, v = [1.0, 3.0, -0.5, 2.0], [2.0, 1.0, 1.5, 2.5]
    probes = [{"cosine": [1.0, 1.0], "error": [a, 0.0], "noise": [b, 0.0]} for a, b in zip(e, v)]
    ratio = sum(e) / sum(v)
    expected = math.sqrt(4 / 3 * sum((a - ratio * b) ** 2 for a, b in zip(e, v))) / sum(v)
    assert probe.pool_probes(probes)["stderr"] == pytest.approx([expected, 0.0])
    same = [{"cosine": [1.0], "error": [0.5 * b], "noise": [b]} for b in v]  # every probe reads 0.5
    assert probe.pool_probes(same)["stderr"] == pytest.approx([0.0], abs=1e-15)
    assert probe.pool_probes(probes[:1])["stderr"] == [None, None]


class TimedFlow(torch.nn.Module):
    """A model whose time input is sigma * 1000, as SD3's: v = net(z, m / 1000), m the time input."""

    def __init__(self):
        super().__init__()
        self.net = MLPFlow()

    def forward(self, z, m):
        return self.net(z, m / 1000)


@pytest.mark.parametrize("wrong, cause", [
    (lambda t: t, "passes the model sigma where the model takes sigma \\* 1000"),
    (lambda t: t * 1e6, "passes the model sigma \\* 1000 where the model takes sigma"),
    (lambda t: (1 - t) * 1000, r"its time runs backwards \(1 - sigma"),
    (lambda t: 1 - t, "its time runs backwards and is not scaled by 1000"),
])
def test_the_pipeline_check_names_a_wrong_time_convention(wrong, cause):
    """Latents of a 'pipeline' that runs the model at sigma * 1000; velocity_fns that pass it other
    times are each refused with their cause, the right one passes."""
    torch.manual_seed(31)
    model, noise, sigmas = TimedFlow(), torch.randn(4, 3), jagg.sigma_schedule(6)

    def fn_of(time):
        def velocity_fn(z, t):
            S, B = t.shape
            return model(z.reshape(S * B, -1), time(t).reshape(S * B)).reshape(z.shape)
        return velocity_fn
    pipeline = checks.ode_rollout(fn_of(lambda t: t * 1000), noise, sigmas)
    assert checks.check_against_pipeline(fn_of(lambda t: t * 1000), noise, sigmas, pipeline) < 1e-12
    with pytest.raises(ValueError, match=cause):
        checks.check_against_pipeline(fn_of(wrong), noise, sigmas, pipeline)


def test_the_pipeline_check_names_another_shift_and_unexplained_differences():
    torch.manual_seed(32)
    model, noise = MLPFlow(), torch.randn(4, 3)
    fn = as_velocity_fn(model)
    pipeline = checks.ode_rollout(fn, noise, jagg.sigma_schedule(6, shift=3.0))
    with pytest.raises(ValueError, match="the sigmas are not the pipeline's, which are these shifted by 3"):
        checks.check_against_pipeline(fn, noise, jagg.sigma_schedule(6, shift=1.0), pipeline)
    with pytest.raises(ValueError, match="no change of the time input or of the shift explains it"):
        checks.check_against_pipeline(fn, noise, jagg.sigma_schedule(6, shift=3.0), pipeline + 0.1)
    with pytest.raises(ValueError, match="sigmas must fall from noise to data"):
        checks.check_against_pipeline(fn, noise, jagg.sigma_schedule(6).flip(0), pipeline)
    # the ODE rollout is jagg.rollout at noise level 0, the pipelines' Euler step
    with torch.no_grad():
        rolled = jagg.rollout(fn, noise, jagg.sigma_schedule(6, shift=3.0), 0.0).sample
    torch.testing.assert_close(rolled, pipeline, rtol=1e-12, atol=1e-12)
