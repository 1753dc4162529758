"""The velocity_fn recipes of examples/diffusers_models.py (and train_sd.py's SD3 one) on tiny
random diffusers transformers of each family: checks.check_velocity_fn passes them and catches the
two silent mistakes (a velocity not reshaped to z's shape, conditioning repeated in the wrong
order); exact and JAGG both train; one window's JAGG gradient equals the explicit interpolation
of Jacobians built row by row with autograd. Then what no check of velocity_fn alone can see:
every family's scheduler gives a first SDE step of sane size, and each recipe reproduces its
diffusers pipeline's own denoising loop (time convention, shift, packing, CFG, experts)."""

import os
import sys

import pytest
import torch

pytest.importorskip("diffusers", reason="the optional extra: pip install -e '.[sd]'")
from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel, QwenImageTransformer2DModel  # noqa: E402
from diffusers import LTXVideoTransformer3DModel, SD3Transformer2DModel, UniPCMultistepScheduler  # noqa: E402
from diffusers import WanTransformer3DModel  # noqa: E402

import jagg  # noqa: E402
from beyond_paper import checks, options, ranks  # noqa: E402
import train_sd  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import diffusers_models as recipes  # noqa: E402

B, L, E = 3, 5, 16  # samples, text tokens, text width
DYNAMIC = dict(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
# Qwen-Image's scheduler_config.json: its own dynamic shift, and the last sigma stretched to 0.02.
QWEN = dict(DYNAMIC, max_shift=0.9, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
# Wan 2.1 / 2.2's scheduler: UniPC on flow sigmas, flow_shift 3 (480p) or 5 (720p); its first sigma is 1 - 1e-6.
WAN_UNIPC = dict(use_flow_sigmas=True, prediction_type="flow_prediction")


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
    model = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=1,
                                  attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
                                  caption_projection_dim=16, pooled_projection_dim=32, pos_embed_max_size=8,
                                  dual_attention_layers=(0,), qk_norm="rms_norm").to(dtype).eval()  # SD3.5's MMDiT-X, tiny
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


def tiny_wan(seed, dtype=torch.float32):
    torch.manual_seed(seed)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                                 out_channels=4, text_dim=E, freq_dim=32, ffn_dim=32, num_layers=1,
                                 rope_max_seq_len=32).to(dtype).eval()


def wan(dtype=torch.float64, interleave=False):
    """Wan 2.2's two experts (switching at timestep 875) with CFG, on UniPC's flow sigmas: both
    experts in one ModuleList, so that model.parameters() holds both, as the optimizer must."""
    model = torch.nn.ModuleList([tiny_wan(3, dtype), tiny_wan(4, dtype)])
    embeds, negative = torch.randn(B, L, E, dtype=dtype), torch.randn(B, L, E, dtype=dtype)
    if interleave:
        embeds, negative = _interleaved(embeds), _interleaved(negative)
    fn = recipes.wan_velocity_fn(model[0], embeds, negative, 4.0, transformer_2=model[1], boundary_ratio=0.875,
                                 guidance_scale_2=3.0)
    z = torch.randn(B, 4, 1, 2, 4, dtype=dtype)  # [B, C, F, H, W]: one frame of 2 tokens keeps the Jacobians small
    sigmas = recipes.scheduler_sigmas(UniPCMultistepScheduler(**WAN_UNIPC, flow_shift=3.0), 6)
    return fn, model, z, sigmas  # timesteps 1000 (1 - 1e-6), 937.5 | 857, 750, 600, 375: both experts run


# LTX-Video's scheduler_config.json: a dynamic shift by the video's latent tokens, the last sigma 0.1.
LTX = dict(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
           max_image_seq_len=4096, shift_terminal=0.1)


def tiny_ltx(seed, dtype=torch.float32):
    torch.manual_seed(seed)
    return LTXVideoTransformer3DModel(in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2,
                                      attention_head_dim=8, cross_attention_dim=16, num_layers=1,
                                      caption_channels=E).to(dtype).eval()


def ltx(dtype=torch.float64, interleave=False):
    """LTX-Video: 2 latent frames of 2 x 2, packed to 8 tokens of 8 channels; T5 embeds with a mask; CFG."""
    model = tiny_ltx(12, dtype)
    embeds, mask = torch.randn(B, L, E, dtype=dtype), torch.ones(B, L, dtype=dtype)
    mask[1, 2:] = 0  # a shorter prompt, padded
    negative = (torch.randn(B, L, E, dtype=dtype), torch.ones(B, L, dtype=dtype))
    if interleave:
        embeds, mask = _interleaved(embeds), _interleaved(mask)
    fn = recipes.ltx_velocity_fn(model, embeds, mask, 2, 2, 2, negative=negative, guidance_scale=3.0)
    z = torch.randn(B, 8, 8, dtype=dtype)  # [B, F*H*W, C]
    return fn, model, z, recipes.scheduler_sigmas(FlowMatchEulerDiscreteScheduler(**LTX), 6, 8)


FAMILIES = {"flux": flux, "qwen_image": qwen_image, "sd3": sd3, "wan": wan, "ltx": ltx}


@pytest.mark.parametrize("family", FAMILIES)
def test_check_velocity_fn_passes_the_recipe_and_catches_both_mistakes(family):
    fn, _, z, sigmas = FAMILIES[family]()
    assert 1 - 1e-4 < sigmas[0] <= 1 and sigmas[-1] == 0 and len(sigmas) == 7
    assert checks.check_velocity_fn(fn, z, sigmas) < 1e-10
    wrong_order, _, _, _ = FAMILIES[family](interleave=True)
    with pytest.raises(ValueError, match=r"repeat the conditioning as a block, c.repeat\(S\)"):
        checks.check_velocity_fn(wrong_order, z, sigmas)
    flat = lambda z_, t_: fn(z_, t_).flatten(0, 1)  # noqa: E731  [S*B, ...]: forgot .reshape(z.shape)
    with pytest.raises(ValueError, match=r"velocity_fn\(z .* returned .*end it with .reshape\(z.shape\)"):
        checks.check_velocity_fn(flat, z, sigmas)
    with pytest.raises(ValueError, match="velocity_fn gave .*, not z's shape"):  # rollout refuses it too
        jagg.rollout(flat, z, sigmas, 0.7)


def test_check_velocity_fn_passes_a_bf16_model_and_catches_dropout():
    fn, _, z, sigmas = flux(dtype=torch.bfloat16)
    assert checks.check_velocity_fn(fn, z, sigmas) < 2e-2  # bf16's tolerance: batched and single rows may round apart
    wrong_order, _, _, _ = flux(dtype=torch.bfloat16, interleave=True)
    with pytest.raises(ValueError, match=r"rtol 2e-02\): it is step-major"):
        checks.check_velocity_fn(wrong_order, z, sigmas)
    fn, _, z, sigmas = flux()
    torch.manual_seed(3)
    drop = torch.nn.Dropout(0.1).train()  # a model left in train mode
    with pytest.raises(ValueError, match="eval mode"):
        checks.check_velocity_fn(lambda z_, t_: drop(fn(z_, t_)), z, sigmas)


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
    if family == "wan":  # and Wan's FP32LayerNorms run in fp32 inside an fp64 model: sums over rows round at ~1e-7
        tol = 5e-7 * expected.abs().max().item()  # measured 6.3e-8 of the largest entry
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=tol)
    model.zero_grad(set_to_none=True)
    jagg.backward_exact(fn, traj.z[1:5], traj.t[1:5], step_loss)  # the window's exact gradient is another one
    exact = torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros_like(p).flatten()
                       for p in model.parameters() if p.requires_grad])
    assert (exact - expected).abs().max() > 1000 * tol

    # A few optimizer steps in each mode: finite, and the parameters move.
    start = [p.detach().clone() for p in model.parameters()]
    for opts in (options.JaggOptions(3, 0.0), options.JaggOptions(3, 1.0),
                 options.JaggOptions(3, 1.0, anchors="shared", interior="rollout")):
        for p, p0 in zip(model.parameters(), start):
            p.data.copy_(p0)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        for _ in range(2):
            stats, routed = options.backward_batch(fn, traj, adv, cfg, opts)
            done = ranks.optimizer_step(model.parameters(), optimizer, [stats["loss"]])
            assert not done["skipped"] and done["grad_norm"] > 0
        assert any(routed) == (opts.jagg_frac > 0)
        assert any(not torch.equal(p, p0) for p, p0 in zip(model.parameters(), start))


def test_an_expert_chosen_once_per_call_is_caught():
    """Wan 2.2's expert must be chosen per row: one call holds rows of several steps. Chosen once
    from t[0], the batched call runs the high-noise expert on low-noise rows and the check sees it."""
    fn, model, z, sigmas = wan()
    high = recipes.wan_velocity_fn(model[0], torch.randn(B, L, E, dtype=z.dtype), None, 1.0)
    low = recipes.wan_velocity_fn(model[1], torch.randn(B, L, E, dtype=z.dtype), None, 1.0)
    per_call = lambda z_, t_: (high if t_[0, 0] * 1000 >= 875 else low)(z_, t_)  # noqa: E731  the mistake
    with pytest.raises(ValueError, match=r"differs from 3 one-step calls"):
        checks.check_velocity_fn(per_call, z, sigmas)


# === Every flow scheduler's sigmas give a first SDE step of SD3's size ===

SCHEDULERS = {  # (scheduler, image_seq_len): each family's own scheduler at a typical size
    "sd3": lambda: (FlowMatchEulerDiscreteScheduler(shift=3.0), None),
    "flux_1024px": lambda: (FlowMatchEulerDiscreteScheduler(shift=3.0, **DYNAMIC), 64 * 64),
    "qwen_image_1328px": lambda: (FlowMatchEulerDiscreteScheduler(**QWEN), 83 * 83),
    "wan_480p": lambda: (UniPCMultistepScheduler(**WAN_UNIPC, flow_shift=3.0), None),
    "wan_720p": lambda: (UniPCMultistepScheduler(**WAN_UNIPC, flow_shift=5.0), None),
}


@pytest.mark.parametrize("name", SCHEDULERS)
def test_every_flow_schedulers_sigmas_give_a_first_sde_step_of_sd3s_size(name):
    scheduler, seq = SCHEDULERS[name]()
    sigmas = recipes.scheduler_sigmas(scheduler, 10, seq)  # [11]
    assert 1 - 1e-4 < sigmas[0] <= 1 and sigmas[-1] == 0 and bool((sigmas.diff() < 0).all())
    noise = torch.randn(16, 4, 8, 8, generator=torch.Generator().manual_seed(0))  # [B, C, H, W]
    zero = lambda z, t: torch.zeros_like(z)  # noqa: E731  v = 0: the step is the SDE's own

    def first_std(s):  # std of the 16 states after step 0 at Flow-GRPO's noise level
        traj = jagg.rollout(zero, noise, s, 0.7, generator=torch.Generator().manual_seed(1))
        assert bool(torch.isfinite(traj.z_next).all() and torch.isfinite(traj.log_prob).all())
        return traj.z_next[0].std().item()

    # The first step maps z to z (1 - eta^2 / 2) + eta eps whatever the sigmas: std
    # sqrt(0.755^2 + 0.7^2) = 1.03. Were only sigma >= 1 the first step, UniPC's 1 - 1e-6 would
    # give std_t = 0.7 sqrt(1e6) = 700: std 8,626 (flow_shift 3), 5,250 (5).
    sd3 = first_std(recipes.scheduler_sigmas(FlowMatchEulerDiscreteScheduler(shift=3.0), 10))
    assert first_std(sigmas) == pytest.approx(sd3, rel=1e-3)
    assert sd3 == pytest.approx(1.03, abs=0.03)


# === Each recipe reproduces its own pipeline's denoising loop ===
# rollout at noise level 0 is the Euler ODE z += (sigma_next - sigma) v, FlowMatchEulerDiscreteScheduler's
# step. Given the same latents and prompt embeddings (no text encoder, no VAE: output_type="latent"),
# the recipe with scheduler_sigmas must give the pipeline's final latents. fp32 throughout; tolerance
# 2e-5 (absolute, latents of size ~4): the same operations up to batching (SD3's pipeline runs both
# CFG branches as one batch of 2B, the recipe as two) and the order of float32 sums, over 3-4 steps.
# Measured: 0 (Flux, Qwen-Image, Wan) to 1.7e-6 (SD3). A wrong time convention moves them by 0.07-0.75,
# more than 1000x the tolerance (checked in each test).

T_PIPE, ATOL = 3, 2e-5


def rollout_ode(fn, latents, sigmas):
    with torch.no_grad():
        return jagg.rollout(fn, latents, sigmas, 0.0).sample  # noise level 0: the deterministic ODE


def assert_reproduces(pipeline_latents, fn, wrong_time_fn, latents, sigmas, cause):
    """The recipe ends where the pipeline does; a wrong time convention does not, and
    checks.check_against_pipeline passes the one and names the cause of the other."""
    torch.testing.assert_close(rollout_ode(fn, latents, sigmas), pipeline_latents, rtol=0, atol=ATOL)
    assert (rollout_ode(wrong_time_fn, latents, sigmas) - pipeline_latents).abs().max() > 1000 * ATOL
    assert checks.check_against_pipeline(fn, latents, sigmas, pipeline_latents, rtol=1e-5) < 1e-5
    with pytest.raises(ValueError, match=cause):
        checks.check_against_pipeline(wrong_time_fn, latents, sigmas, pipeline_latents, rtol=1e-5)


SIGMA_FOR_1000 = r"passes the model sigma where the model takes sigma \* 1000"  # SD3, Wan, LTX
X1000_INSIDE = r"passes the model sigma \* 1000 where the model takes sigma"  # Flux, Qwen-Image


def test_sd3_recipe_reproduces_stable_diffusion_3_pipeline():
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(5)
    model = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=1,
                                  attention_head_dim=8, num_attention_heads=2, joint_attention_dim=E,
                                  caption_projection_dim=16, pooled_projection_dim=8, pos_embed_max_size=8).eval()
    pipe = StableDiffusion3Pipeline(transformer=model, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=None,
                                    text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
                                    text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    embeds, pooled, neg_embeds, neg_pooled = torch.randn(B, L, E), torch.randn(B, 8), torch.randn(B, L, E), torch.randn(B, 8)
    latents = torch.randn(B, 4, 8, 8)  # [B, C, H, W]; no VAE: the pipeline's 64 pixels are 8 latent pixels
    with torch.no_grad():
        out = pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, negative_prompt_embeds=neg_embeds,
                   negative_pooled_prompt_embeds=neg_pooled, latents=latents, height=64, width=64,
                   num_inference_steps=T_PIPE, guidance_scale=4.5, output_type="latent").images
    fn = train_sd.make_velocity_fn(model, (embeds, pooled), (neg_embeds, neg_pooled), 4.5, use_bf16=False)
    sigmas = recipes.scheduler_sigmas(FlowMatchEulerDiscreteScheduler(shift=3.0), T_PIPE)
    assert_reproduces(out, fn, lambda z, t: fn(z, t / 1000), latents, sigmas, SIGMA_FOR_1000)


def test_flux_recipe_reproduces_flux_pipeline():
    from diffusers import FluxPipeline

    fn_, model, _, _ = flux(dtype=torch.float32)  # Flux-dev: guidance-distilled, guidance 3.5 is an input, no CFG
    pipe = FluxPipeline(transformer=model, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, **DYNAMIC), vae=None,
                        text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None)
    pipe.set_progress_bar_config(disable=True)
    torch.manual_seed(6)
    embeds, pooled = torch.randn(B, L, E), torch.randn(B, 8)
    latents = recipes.pack_latents(torch.randn(B, 4, 8, 8))  # [B, 16, 16]: the pipeline takes packed latents
    with torch.no_grad():
        out = pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, latents=latents, height=64, width=64,
                   num_inference_steps=T_PIPE, guidance_scale=3.5, output_type="latent").images
    fn = recipes.flux_velocity_fn(model, embeds, pooled, recipes.flux_image_ids(8, 8), guidance=3.5)
    sigmas = recipes.scheduler_sigmas(FlowMatchEulerDiscreteScheduler(shift=3.0, **DYNAMIC), T_PIPE, latents.shape[1])
    assert_reproduces(out, fn, lambda z, t: fn(z, t * 1000), latents, sigmas, X1000_INSIDE)


def test_qwen_image_recipe_reproduces_qwen_image_pipeline_with_true_cfg():
    from diffusers import QwenImagePipeline

    _, model, _, _ = qwen_image(dtype=torch.float32)
    pipe = QwenImagePipeline(transformer=model, scheduler=FlowMatchEulerDiscreteScheduler(**QWEN), vae=None,
                             text_encoder=None, tokenizer=None)
    pipe.set_progress_bar_config(disable=True)
    torch.manual_seed(7)
    embeds, neg_embeds = torch.randn(B, L, E), torch.randn(B, L, E)
    mask, neg_mask = torch.ones(B, L, dtype=torch.long), torch.ones(B, L, dtype=torch.long)
    mask[0, 3:], neg_mask[1, 2:] = 0, 0  # padded prompts, so that the masks matter
    latents = recipes.pack_latents(torch.randn(B, 4, 8, 8))  # [B, 16, 16]
    with torch.no_grad():
        out = pipe(prompt_embeds=embeds, prompt_embeds_mask=mask, negative_prompt_embeds=neg_embeds,
                   negative_prompt_embeds_mask=neg_mask, true_cfg_scale=4.0, latents=latents, height=64, width=64,
                   num_inference_steps=T_PIPE, output_type="latent").images
    fn = recipes.qwen_image_velocity_fn(model, embeds, mask, 8, 8, negative=(neg_embeds, neg_mask), true_cfg_scale=4.0)
    sigmas = recipes.scheduler_sigmas(FlowMatchEulerDiscreteScheduler(**QWEN), T_PIPE, latents.shape[1])
    assert_reproduces(out, fn, lambda z, t: fn(z, t * 1000), latents, sigmas, X1000_INSIDE)


def wan_pipeline(scheduler, two_experts):
    from diffusers import WanPipeline

    experts = dict(transformer_2=tiny_wan(9), boundary_ratio=0.875) if two_experts else {}  # Wan 2.2 A14B's boundary
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=scheduler, transformer=tiny_wan(8), **experts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_wan(pipe, embeds, neg_embeds, latents):  # the pipeline's loop: CFG 4.0, and 3.0 for Wan 2.2's low-noise expert
    with torch.no_grad():
        return pipe(prompt_embeds=embeds, negative_prompt_embeds=neg_embeds, latents=latents, height=64, width=64,
                    num_frames=5, num_inference_steps=4, guidance_scale=4.0,
                    guidance_scale_2=3.0 if pipe.transformer_2 is not None else None, output_type="latent").frames


@pytest.mark.parametrize("two_experts", [False, True], ids=["wan2.1", "wan2.2_two_experts"])
def test_wan_recipe_reproduces_wan_pipeline(two_experts):
    """On FlowMatchEuler sigmas (shift 3), timesteps 1000, 857.7, 602.2, 8.9: Wan 2.2's pipeline runs
    its high-noise expert at step 0 only (t >= 875), and the recipe must too, row by row."""
    pipe = wan_pipeline(FlowMatchEulerDiscreteScheduler(shift=3.0), two_experts)
    torch.manual_seed(10)
    embeds, neg_embeds = torch.randn(B, L, E), torch.randn(B, L, E)  # UMT5's: no mask, no pooled
    latents = torch.randn(B, 4, 2, 8, 8)  # [B, C, F, H, W]: 2 latent frames are the pipeline's 5 frames
    out = run_wan(pipe, embeds, neg_embeds, latents)
    experts = dict(transformer_2=pipe.transformer_2, boundary_ratio=0.875, guidance_scale_2=3.0) if two_experts else {}
    fn = recipes.wan_velocity_fn(pipe.transformer, embeds, neg_embeds, 4.0, **experts)
    sigmas = recipes.scheduler_sigmas(FlowMatchEulerDiscreteScheduler(shift=3.0), 4)
    assert_reproduces(out, fn, lambda z, t: fn(z, t / 1000), latents, sigmas, SIGMA_FOR_1000)
    if two_experts:  # one expert throughout is wrong too
        one = recipes.wan_velocity_fn(pipe.transformer, embeds, neg_embeds, 4.0)
        assert (rollout_ode(one, latents, sigmas) - out).abs().max() > 1000 * ATOL


def test_wan_recipe_on_unipc_sigmas_differs_from_wan_pipeline_only_by_its_solver_and_integer_timesteps():
    """Wan ships UniPCMultistepScheduler (a 2nd-order multistep solver with a corrector); rollout
    steps Euler(-Maruyama) on the same sigmas, as Flow-GRPO does. With UniPC at order 1 and no
    corrector (which is Euler for a flow), the pipeline equals rollout with the recipe once the
    recipe's time is truncated as UniPC's int64 timesteps are (999.999 -> 999, 900.12 -> 900, ...):
    the two differences, and nothing else (no shift, packing or CFG error). Measured on this tiny
    model: the recipe's exact sigma * 1000 moves the latents by 0.051 (of ~4), UniPC's own order 2
    and corrector by 0.44."""
    unipc = UniPCMultistepScheduler(**WAN_UNIPC, flow_shift=3.0, solver_order=1, disable_corrector=[0, 1, 2, 3])
    pipe = wan_pipeline(unipc, two_experts=True)  # timesteps 999, 900, 750, 500: two steps per expert
    torch.manual_seed(11)
    embeds, neg_embeds = torch.randn(B, L, E), torch.randn(B, L, E)
    latents = torch.randn(B, 4, 2, 8, 8)  # [B, C, F, H, W]
    out = run_wan(pipe, embeds, neg_embeds, latents)
    fn = recipes.wan_velocity_fn(pipe.transformer, embeds, neg_embeds, 4.0, transformer_2=pipe.transformer_2,
                                 boundary_ratio=0.875, guidance_scale_2=3.0)
    sigmas = recipes.scheduler_sigmas(UniPCMultistepScheduler(**WAN_UNIPC, flow_shift=3.0), 4)
    truncated = lambda z, t: fn(z, torch.floor(t * 1000) / 1000)  # noqa: E731  UniPC's int64 timesteps
    assert_reproduces(out, truncated, lambda z, t: truncated(z, t / 1000), latents, sigmas, SIGMA_FOR_1000)


def test_ltx_recipe_reproduces_ltx_pipeline_and_the_check_names_what_breaks_it():
    """LTXPipeline's loop (CFG 3.0, a padded prompt, frame_rate 25, its dynamic shift by the video's
    2 x 2 x 2 latent tokens); the check names a time passed as sigma, sigmas of another shift, and
    finds a frame rate other than the pipeline's unexplained by the time or the shift."""
    from diffusers import LTXPipeline

    model = tiny_ltx(13)
    pipe = LTXPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**LTX), vae=None, text_encoder=None, tokenizer=None,
                       transformer=model)
    pipe.set_progress_bar_config(disable=True)
    torch.manual_seed(14)
    embeds, neg_embeds = torch.randn(B, L, E), torch.randn(B, L, E)
    mask, neg_mask = torch.ones(B, L, dtype=torch.long), torch.ones(B, L, dtype=torch.long)
    mask[0, 3:], neg_mask[2, 1:] = 0, 0
    latents = torch.randn(B, 8, 8)  # [B, F*H*W, C]: 9 frames of 64 x 64 pixels are 2 x 2 x 2 latent voxels
    with torch.no_grad():
        out = pipe(prompt_embeds=embeds, prompt_attention_mask=mask, negative_prompt_embeds=neg_embeds,
                   negative_prompt_attention_mask=neg_mask, height=64, width=64, num_frames=9, frame_rate=25,
                   latents=latents, num_inference_steps=T_PIPE, guidance_scale=3.0, output_type="latent").frames
    assert pipe.vae_temporal_compression_ratio == 8 and pipe.vae_spatial_compression_ratio == 32

    def recipe(frame_rate=25):
        return recipes.ltx_velocity_fn(model, embeds, mask, 2, 2, 2, negative=(neg_embeds, neg_mask),
                                       guidance_scale=3.0, frame_rate=frame_rate)
    fn = recipe()
    sigmas = recipes.scheduler_sigmas(FlowMatchEulerDiscreteScheduler(**LTX), T_PIPE, 2 * 2 * 2)
    assert_reproduces(out, fn, lambda z, t: fn(z, t / 1000), latents, sigmas, SIGMA_FOR_1000)
    shifted = checks.shifted(sigmas, 1 / 3)  # a static shift a third of the pipeline's
    with pytest.raises(ValueError, match="the sigmas are not the pipeline's, which are these shifted by 3"):
        checks.check_against_pipeline(fn, latents, shifted, out, rtol=1e-5)
    with pytest.raises(ValueError, match="no change of the time input or of the shift explains it"):
        checks.check_against_pipeline(recipe(frame_rate=24), latents, sigmas, out, rtol=1e-5)
    with pytest.raises(ValueError, match="pass image_seq_len, an image's packed tokens"):
        recipes.scheduler_sigmas(FlowMatchEulerDiscreteScheduler(**LTX), T_PIPE)


def test_check_sd3_example_passes_the_sd3_recipe_and_names_a_wrong_time_input(tmp_path, capsys):
    """examples/check_sd3.py, the README's step 2 on a saved SD3 pipeline: train_sd.py's velocity_fn
    passes both checks; with sigma in place of sigma * 1000, or 1 - sigma, it ends in one line that
    names the cause."""
    import check_sd3
    import tiny_sd3

    model = str(tiny_sd3.build(tmp_path / "pipe"))
    check_sd3.main(["--model", model, "--num-steps", "4"])
    assert "check_against_pipeline: passed" in capsys.readouterr().out
    for time_input, cause in (("sigma", SIGMA_FOR_1000), ("1-sigma", "its time runs backwards")):
        with pytest.raises(SystemExit, match=f"^check_against_pipeline: .*{cause}"):
            check_sd3.main(["--model", model, "--num-steps", "4", "--time-input", time_input])
