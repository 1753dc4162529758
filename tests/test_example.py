"""examples/your_model.py runs, learns, and uses what it says it uses (so the template cannot go stale)."""

import importlib.util
import os

import pytest
import torch

import jagg
from beyond_paper import options, probe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_example():
    spec = importlib.util.spec_from_file_location("your_model", os.path.join(ROOT, "examples", "your_model.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_raises_its_reward_with_the_papers_jagg_and_probes_that_mode(monkeypatch):
    example = load_example()
    calls = {"probe": [], "paper_gradients": []}
    probe_segments, paper_gradients = probe.probe_segments, jagg.paper_gradients

    def counting_probe(*args, **kwargs):
        calls["probe"].append(args[5])
        return probe_segments(*args, **kwargs)

    def recording_paper_gradients(*args, **kwargs):
        calls["paper_gradients"].append((args[4:], kwargs))
        return paper_gradients(*args, **kwargs)

    monkeypatch.setattr(probe, "probe_segments", counting_probe)
    monkeypatch.setattr(jagg, "paper_gradients", recording_paper_gradients)
    history = example.main(epochs=12)
    first, last = sum(history[:3]) / 3, sum(history[-3:]) / 3
    assert last > first + 0.1, history  # the template trains, not merely runs
    # the probe at epochs 0, 5, 10 measures the mode that trains: the paper's JAGG at the same W
    assert calls["probe"] == [options.JaggOptions(window=example.WINDOW)] * 3
    assert len(calls["paper_gradients"]) == 12 * 2  # 32 samples in minibatches of 16
    # every step the paper's JAGG on every window (jagg_frac 1), with the KL reference
    assert all(args == (example.WINDOW,) and kwargs["ref_fn"] is not None for args, kwargs in calls["paper_gradients"])


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
