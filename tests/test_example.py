"""examples/your_model.py runs the checks and measures what it says it measures (so the template cannot go stale)."""

import importlib.util
import os

import pytest
import torch

import jagg
from beyond_paper import checks, options, probe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_example():
    spec = importlib.util.spec_from_file_location("your_model", os.path.join(ROOT, "examples", "your_model.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_checks_the_model_and_measures_the_gradient_it_names(monkeypatch):
    """The template runs the contract check once, computes the batch's gradient by jagg.backward_batch at
    jagg_frac 0 and 1, and the cosine it prints is that of two gradients computed here another way: autograd
    of the summed per-step loss (exact), and options.backward_jagg window by window (JAGG); the probe
    measures the paper's JAGG at the same W."""
    example = load_example()
    calls = {"check": 0, "backward_batch": [], "probe": []}
    check, backward_batch, probe_segments = checks.check_velocity_fn, jagg.backward_batch, probe.probe_segments

    def counting_check(*args, **kwargs):
        calls["check"] += 1
        return check(*args, **kwargs)

    def recording_backward_batch(*args, **kwargs):
        calls["backward_batch"].append(args[4:])
        return backward_batch(*args, **kwargs)

    def recording_probe(*args, **kwargs):
        calls["probe"].append(args[5])
        return probe_segments(*args, **kwargs)

    monkeypatch.setattr(checks, "check_velocity_fn", counting_check)
    monkeypatch.setattr(jagg, "backward_batch", recording_backward_batch)
    monkeypatch.setattr(probe, "probe_segments", recording_probe)
    cosine, measured = example.main(seed=3)
    assert calls == {"check": 1, "backward_batch": [(example.WINDOW, 0.0), (example.WINDOW, 1.0)],
                     "probe": [options.JaggOptions(window=example.WINDOW)]}
    assert len(measured["cosine"]) == len(jagg.window_bounds(example.T, example.WINDOW))

    # The same batch again (the same seed), its two gradients computed another way
    torch.manual_seed(3)
    model = example.Net().eval()
    sigmas = jagg.sigma_schedule(example.T, shift=3.0)
    torch.randn(example.PROMPTS, 2)  # the contract check's noise
    c = torch.arange(example.PROMPTS).repeat_interleave(example.GROUP)
    traj = jagg.rollout(example.make_velocity_fn(model, c), torch.randn(len(c), 2), sigmas, example.NOISE_LEVEL)
    adv = jagg.group_advantages(example.reward(traj.sample, c), c)
    cfg, fn = jagg.LossConfig(noise_level=example.NOISE_LEVEL, clip_range=0.2), example.make_velocity_fn(model, c)
    step_loss = jagg.make_step_loss(traj, adv, 0, example.T, cfg)
    model.zero_grad(set_to_none=True)
    sum(step_loss(k, fn(traj.z[k : k + 1], traj.t[k : k + 1])[0]) for k in range(example.T)).backward()
    exact = example.flat_grad(model)
    model.zero_grad(set_to_none=True)
    for a, b in jagg.window_bounds(example.T, example.WINDOW):
        window_loss = jagg.make_step_loss(traj, adv, a, b, cfg)
        if b - a >= 3:
            options.backward_jagg(fn, traj.z[a:b], traj.t[a:b], window_loss)
        else:  # a window of 2 steps trains exactly: JAGG would save nothing there
            jagg.backward_exact(fn, traj.z[a:b], traj.t[a:b], window_loss)
    by_jagg = example.flat_grad(model)
    assert cosine == pytest.approx(torch.nn.functional.cosine_similarity(exact, by_jagg, dim=0).item(), abs=1e-6)
    assert cosine < 1 - 1e-6  # a nonlinear net: JAGG approximates


def test_example_velocity_follows_the_convention():
    """t is sigma, with sigma = 1 pure noise; the velocity_fn keeps [S, B, d] and repeats the prompts over S."""
    example = load_example()
    torch.manual_seed(0)
    model = example.Net()
    c = torch.tensor([0, 1, 2])
    z, t = torch.randn(2, 3, 2), torch.rand(2, 3)
    v = example.make_velocity_fn(model, c)(z, t)
    assert v.shape == z.shape
    one = example.make_velocity_fn(model, c[1:2])(z[1:, 1:2], t[1:, 1:2])  # one sample, one step: the same prompt
    torch.testing.assert_close(v[1:, 1:2], one)


def test_example_velocity_keeps_an_image_shaped_sample():
    """A model on image latents [N, C, H, W] gets them in that shape, rows step-major: the velocity
    of sample b at step s is the model's on z[s, b] with sample b's prompt."""
    example = load_example()
    torch.manual_seed(1)
    seen = []

    class ImageNet(torch.nn.Module):  # a conv net: a flattened [N, C*H*W] input would fail here
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(2, 2, 3, padding=1)
            self.embed = torch.nn.Embedding(example.PROMPTS + 1, 2)

        def forward(self, x, sigma, c):  # x [N, C, H, W]
            seen.append(tuple(x.shape))
            return self.conv(x) * sigma[:, None, None, None] + self.embed(c)[:, :, None, None]

    model, c = ImageNet(), torch.tensor([0, 3, 1])
    z, t = torch.randn(2, 3, 2, 5, 5), torch.rand(2, 3)  # [S, B, C, H, W]
    v = example.make_velocity_fn(model, c)(z, t)
    assert v.shape == z.shape and seen[0] == (6, 2, 5, 5)
    one = example.make_velocity_fn(model, c[2:3])(z[1:, 2:3], t[1:, 2:3])  # step 1, sample 2 alone
    torch.testing.assert_close(v[1:, 2:3], one)


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
