"""velocity_fn recipes for the diffusers transformers people train with GRPO: what jagg.py needs
from SD3 / SD3.5, Flux and Qwen-Image. tests/test_recipes.py builds each at a tiny random size,
checks it with jagg_options.check_velocity_fn, trains it exact and with JAGG, and checks one window's
JAGG gradient against explicit Jacobians.

jagg.py's contract: velocity_fn(z [S, B, *D], t [S, B]) -> v [S, B, *D], t = sigma (1 = noise),
v = noise - data. All three families are rectified flows with that sign (their pipelines step
z += (sigma_next - sigma) * v with FlowMatchEulerDiscreteScheduler); they differ in these:

| family | transformer | time input | latents, *D | conditioning, repeated over S as a block | sigmas |
|---|---|---|---|---|---|
| SD3 / SD3.5 | SD3Transformer2DModel | sigma * 1000 | [C, H, W] | prompt_embeds [B, L, E], pooled [B, P] | static shift (3.0): scheduler_sigmas |
| Flux | FluxTransformer2DModel | sigma (x 1000 inside) | packed [H/2 * W/2, 4C] | prompt_embeds, pooled; txt_ids [L, 3] and img_ids [seq, 3], not repeated; guidance [B] if distilled (dev) | shifted by the image's token count: scheduler_sigmas(..., seq) |
| Qwen-Image | QwenImageTransformer2DModel | sigma (x 1000 inside) | packed [H/2 * W/2, 4C] | prompt_embeds [B, L, E] and its mask [B, L]; img_shapes, one per row | shifted by the image's token count |

SD3's recipe is train_sd.make_velocity_fn (with classifier-free guidance and bf16 autocast).
Flux-dev is guidance-distilled: it takes the guidance scale as an input, one forward, no CFG.
Qwen-Image uses true CFG (a second, unconditional forward); give it as train_sd.py's SD3 recipe
does (the unconditional branch without graph), or train without CFG as here.
"""

import numpy as np
import torch


def scheduler_sigmas(scheduler, num_steps, image_seq_len=None):
    """The sigmas your pipeline samples at, [T + 1] from 1 to 0, from its own scheduler (pass the
    pipeline's pipe.scheduler). With dynamic shifting (Flux, Qwen-Image) the shift depends on the
    image's token count image_seq_len, as their pipelines compute it; SD3's shift is static."""
    config = scheduler.config
    if config.get("use_dynamic_shifting"):
        # The pipelines' calculate_shift: mu linear in the token count between two anchors.
        slope = (config.get("max_shift", 1.15) - config.get("base_shift", 0.5)) / (
            config.get("max_image_seq_len", 4096) - config.get("base_image_seq_len", 256))
        mu = config.get("base_shift", 0.5) + slope * (image_seq_len - config.get("base_image_seq_len", 256))
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    else:
        scheduler.set_timesteps(num_steps)
    return scheduler.sigmas.float()  # [T+1], the last 0


def pack_latents(latents):
    """Flux / Qwen-Image: [B, C, H, W] latents -> [B, H/2 * W/2, 4C] tokens of 2x2 patches."""
    B, C, H, W = latents.shape
    x = latents.view(B, C, H // 2, 2, W // 2, 2).permute(0, 2, 4, 1, 3, 5)  # [B, H/2, W/2, C, 2, 2]
    return x.reshape(B, (H // 2) * (W // 2), C * 4)  # [B, seq, 4C]


def flux_image_ids(height, width):
    """Flux's img_ids [H/2 * W/2, 3] for latents of height x width: (0, row, column) per token."""
    ids = torch.zeros(height // 2, width // 2, 3)
    ids[..., 1] += torch.arange(height // 2)[:, None]
    ids[..., 2] += torch.arange(width // 2)[None, :]
    return ids.reshape(-1, 3)  # [seq, 3]


def flux_velocity_fn(transformer, prompt_embeds, pooled, img_ids, guidance=None):
    """Flux: z [S, B, seq, 4C] packed latents; prompt_embeds [B, L, E] and pooled [B, P] of the B
    samples; img_ids [seq, 3] (flux_image_ids); guidance: the distilled guidance scale
    (Flux-dev: 3.5) or None for a transformer without guidance_embeds (schnell)."""
    txt_ids = torch.zeros(prompt_embeds.shape[1], 3, device=prompt_embeds.device)  # [L, 3]: text has no position

    def velocity_fn(z, t):
        S, B = t.shape
        x = z.reshape(S * B, *z.shape[2:])  # [S*B, seq, 4C], step-major: row s * B + b
        g = None if guidance is None else torch.full((S * B,), float(guidance), device=x.device, dtype=x.dtype)
        v = transformer(hidden_states=x, timestep=t.reshape(S * B).to(x.dtype),  # sigma: Flux multiplies by 1000
                        encoder_hidden_states=prompt_embeds.repeat(S, 1, 1), pooled_projections=pooled.repeat(S, 1),
                        txt_ids=txt_ids, img_ids=img_ids.to(x.device), guidance=g, return_dict=False)[0]
        return v.reshape(z.shape)  # [S, B, seq, 4C]

    return velocity_fn


def qwen_image_velocity_fn(transformer, prompt_embeds, prompt_mask, height, width):
    """Qwen-Image: z [S, B, seq, 4C] packed latents of height x width latent pixels;
    prompt_embeds [B, L, E] and prompt_mask [B, L] (1 for a token, 0 for padding) of the B samples."""
    img_shapes = [[(1, height // 2, width // 2)]]  # one image per row

    def velocity_fn(z, t):
        S, B = t.shape
        x = z.reshape(S * B, *z.shape[2:])  # [S*B, seq, 4C], step-major: row s * B + b
        v = transformer(hidden_states=x, timestep=t.reshape(S * B).to(x.dtype),  # sigma: Qwen-Image multiplies by 1000
                        encoder_hidden_states=prompt_embeds.repeat(S, 1, 1),
                        encoder_hidden_states_mask=prompt_mask.repeat(S, 1), img_shapes=img_shapes * (S * B),
                        return_dict=False)[0]
        return v.reshape(z.shape)  # [S, B, seq, 4C]

    return velocity_fn
