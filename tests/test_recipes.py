"""The velocity_fn recipes of examples/diffusers_models.py (and train_sd.py's SD3 one) on tiny
random diffusers transformers of each family: jagg_options.check_velocity_fn passes them and catches the
two silent mistakes (a velocity not reshaped to z's shape, conditioning repeated in the wrong
order); exact and JAGG both train; one window's JAGG gradient equals the explicit interpolation
of Jacobians built row by row with autograd."""

import os
import sys

import pytest
import torch

pytest.importorskip("diffusers", reason="the optional extra: pip install -e '.[sd]'")
from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel, QwenImageTransformer2DModel  # noqa: E402

import jagg  # noqa: E402
import jagg_options  # noqa: E402
import mini_sd3  # noqa: E402
import train_sd  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import diffusers_models as recipes  # noqa: E402

B, L, E = 3, 5, 16  # samples, text tokens, text width
DYNAMIC = dict(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)


def flux(dtype=torch.float64, interleave=False):
    """(velocity_fn, transformer, noise z [B, seq, 4C], sigmas) of a tiny Flux-dev (guidance-distilled)."""
    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8,
                                   num_attention_heads=2, joint_attention_dim=E, pooled_projection_dim=8,
                                   guidance_embeds=True, axes_dims_rope=(2, 2, 4)).to(dtype).eval()
    embeds, pooled = torch.randn(B, L, E, dtype=dtype), torch.randn(B, 8, dtype=dtype)
    if interleave:  # the mistake: each block of S rows takes one sample's prompt S times
        embeds, pooled = _interleaved(embeds), _interleaved(pooled)
    z = recipes.pack_latents(torch.randn(B, 4, 8, 8, dtype=dtype))  # [B, 16, 16]
    fn = recipes.flux_velocity_fn(model, embeds, pooled, recipes.flux_image_ids(8, 8).to(dtype), guidance=3.5)
    return fn, model, z, recipes.scheduler_sigmas(FlowMatchEulerDiscreteScheduler(**DYNAMIC), 6, z.shape[1])


def qwen_image(dtype=torch.float64, interleave=False):
    torch.manual_seed(1)
    model = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=8,
                                        num_attention_heads=2, joint_attention_dim=E, axes_dims_rope=(2, 2, 4))
    model = model.to(dtype).eval()
    embeds, mask = torch.randn(B, L, E, dtype=dtype), torch.ones(B, L, dtype=dtype)
    mask[0, 3:] = 0  # a shorter prompt, padded
    if interleave:
        embeds, mask = _interleaved(embeds), _interleaved(mask)
    z = recipes.pack_latents(torch.randn(B, 4, 8, 8, dtype=dtype))  # [B, 16, 16]
    fn = recipes.qwen_image_velocity_fn(model, embeds, mask, 8, 8)
    return fn, model, z, recipes.scheduler_sigmas(FlowMatchEulerDiscreteScheduler(**DYNAMIC), 6, z.shape[1])


def sd3(dtype=torch.float64, interleave=False):
    torch.manual_seed(2)
    pipe = mini_sd3.build_pipeline("tiny")
    model = pipe.transformer.to(dtype).eval()
    embeds = torch.randn(B, L, model.config.joint_attention_dim, dtype=dtype)
    pooled = torch.randn(B, model.config.pooled_projection_dim, dtype=dtype)
    if interleave:
        embeds, pooled = _interleaved(embeds), _interleaved(pooled)
    cond, uncond = (embeds, pooled), (torch.zeros_like(embeds), torch.zeros_like(pooled))
    fn = train_sd.make_velocity_fn(model, cond, uncond, guidance_scale=2.0, use_bf16=False)
    z = torch.randn(B, model.config.in_channels, 4, 4, dtype=dtype)  # [B, C, h, w]
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    return fn, model, z, recipes.scheduler_sigmas(scheduler, 6)


class _interleaved(torch.Tensor):
    """A conditioning tensor whose .repeat(S, ...) acts as repeat_interleave(S, dim=0): the mistake
    check_velocity_fn must catch, planted in each recipe without editing it."""

    @staticmethod
    def __new__(cls, x):
        return torch.Tensor._make_subclass(cls, x)

    def repeat(self, S, *rest):
        return torch.Tensor(self).repeat_interleave(S, dim=0)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out.as_subclass(torch.Tensor) if isinstance(out, torch.Tensor) else out


FAMILIES = {"flux": flux, "qwen_image": qwen_image, "sd3": sd3}


@pytest.mark.parametrize("family", FAMILIES)
def test_check_velocity_fn_passes_the_recipe_and_catches_both_mistakes(family):
    fn, _, z, sigmas = FAMILIES[family]()
    assert sigmas[0] == 1 and sigmas[-1] == 0 and len(sigmas) == 7
    assert jagg_options.check_velocity_fn(fn, z, sigmas) < 1e-10
    wrong_order, _, _, _ = FAMILIES[family](interleave=True)
    with pytest.raises(ValueError, match=r"repeat the conditioning as a block, c.repeat\(S\)"):
        jagg_options.check_velocity_fn(wrong_order, z, sigmas)
    flat = lambda z_, t_: fn(z_, t_).flatten(0, 1)  # noqa: E731  [S*B, ...]: forgot .reshape(z.shape)
    with pytest.raises(ValueError, match=r"velocity_fn\(z .* returned .*end it with .reshape\(z.shape\)"):
        jagg_options.check_velocity_fn(flat, z, sigmas)
    with pytest.raises(ValueError, match="velocity_fn.*reshape"):  # rollout refuses it by name too
        jagg.rollout(flat, z, sigmas, 0.7)


def test_check_velocity_fn_passes_a_bf16_model_and_catches_dropout():
    fn, _, z, sigmas = flux(dtype=torch.bfloat16)
    assert jagg_options.check_velocity_fn(fn, z, sigmas) < 2e-2  # bf16's tolerance: batched and single rows may round apart
    wrong_order, _, _, _ = flux(dtype=torch.bfloat16, interleave=True)
    with pytest.raises(ValueError, match=r"rtol 2e-02\): it is step-major"):
        jagg_options.check_velocity_fn(wrong_order, z, sigmas)
    fn, _, z, sigmas = flux()
    torch.manual_seed(3)
    drop = torch.nn.Dropout(0.1).train()  # a model left in train mode
    with pytest.raises(ValueError, match="eval mode"):
        jagg_options.check_velocity_fn(lambda z_, t_: drop(fn(z_, t_)), z, sigmas)


def explicit_window_gradient(model, fn, z, t, step_loss):
    """sum_k g_k^T ((1 - alpha_k) J_a + alpha_k J_b), every Jacobian row built by its own autograd
    call, the alpha_k by numpy from the times, and g_k at the model's own velocities."""
    import numpy as np

    params = [p for p in model.parameters() if p.requires_grad]

    def jacobian(k):  # [numel(v_k), P]
        v = fn(z[k : k + 1], t[k : k + 1])[0].flatten()
        rows = [torch.autograd.grad(v[i], params, retain_graph=True, allow_unused=True) for i in range(v.numel())]
        return torch.stack([torch.cat([(g if g is not None else torch.zeros_like(p)).flatten()
                                       for g, p in zip(row, params)]) for row in rows])

    W = z.shape[0]
    alpha = torch.tensor(np.interp(-t[:, 0].numpy(), [-t[0, 0].item(), -t[-1, 0].item()], [0.0, 1.0]))  # [W]
    J_a, J_b = jacobian(0), jacobian(W - 1)
    total = torch.zeros(J_a.shape[1], dtype=J_a.dtype)
    for k in range(W):
        with torch.no_grad():
            v_k = fn(z[k : k + 1], t[k : k + 1])[0]
        v_k.requires_grad_(True)
        (g_k,) = torch.autograd.grad(step_loss(k, v_k), v_k)
        total += g_k.flatten() @ ((1 - alpha[k]) * J_a + alpha[k] * J_b)
    return total


@pytest.mark.parametrize("family", FAMILIES)
def test_recipe_trains_exact_and_jagg_and_one_window_matches_explicit_jacobians(family):
    fn, model, z, sigmas = FAMILIES[family]()
    traj = jagg.rollout(fn, z, sigmas, 0.7, generator=torch.Generator().manual_seed(4))  # T = 6 steps
    adv = jagg.group_advantages(-traj.sample.flatten(1).norm(dim=1), torch.tensor([0, 0, 0]))
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2)

    # One window of 4 steps: JAGG's one backward equals the explicit Jacobians' interpolation.
    step_loss = jagg.make_step_loss(traj, adv, 1, 5, cfg)
    model.zero_grad(set_to_none=True)
    jagg.backward_jagg_window(fn, traj.z[1:5], traj.t[1:5], step_loss)
    got = torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros_like(p).flatten()
                     for p in model.parameters() if p.requires_grad])
    expected = explicit_window_gradient(model, fn, traj.z[1:5], traj.t[1:5], step_loss)
    tol = 1e-8 * expected.abs().max().item()  # fp64, but diffusers computes its time embedding in fp32
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=tol)
    model.zero_grad(set_to_none=True)
    jagg.backward_exact(fn, traj.z[1:5], traj.t[1:5], step_loss)  # the window's exact gradient is another one
    exact = torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros_like(p).flatten()
                       for p in model.parameters() if p.requires_grad])
    assert (exact - expected).abs().max() > 1000 * tol

    # A few optimizer steps in each mode: finite, and the parameters move.
    start = [p.detach().clone() for p in model.parameters()]
    for opts in (jagg_options.JaggOptions(3, 0.0), jagg_options.JaggOptions(3, 1.0),
                 jagg_options.JaggOptions(3, 1.0, anchors="shared", interior="rollout")):
        for p, p0 in zip(model.parameters(), start):
            p.data.copy_(p0)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        for _ in range(2):
            stats, routed = jagg_options.train_step(fn, optimizer, traj, adv, cfg, opts)
            assert not stats["skipped"] and stats["grad_norm"] > 0
        assert any(routed) == (opts.jagg_frac > 0)
        assert any(not torch.equal(p, p0) for p, p0 in zip(model.parameters(), start))
