"""velocity_fn recipes for the diffusers transformers people train with GRPO: what jagg.py needs
from SD3 / SD3.5, Flux, Qwen-Image, Wan 2.1 / 2.2 and LTX-Video. tests/test_recipes.py builds each
at a tiny random size, checks it with checks.check_velocity_fn, trains it exact and with JAGG,
checks one window's JAGG gradient against explicit Jacobians, and checks with
checks.check_against_pipeline that the recipe with scheduler_sigmas, rolled out at noise
level 0, gives the final latents of the family's own diffusers pipeline (same latents, same
embeddings, same guidance).

jagg.py's contract: velocity_fn(z [S, B, *D], t [S, B]) -> v [S, B, *D], t = sigma (1 = noise),
v = noise - data. All five families are rectified flows with that sign (their pipelines step
z += (sigma_next - sigma) * v with FlowMatchEulerDiscreteScheduler); they differ in these:

- SD3 / SD3.5: time input sigma * 1000; latents [C, H, W], not packed; no mask; pooled [B, P]
  and CFG; sigmas of a static shift (3.0).
- Flux: time input sigma (x 1000 inside); latents packed in 2x2 patches, [H/2 * W/2, 4C]; no
  mask; pooled, txt_ids [L, 3] and img_ids [seq, 3] (not repeated), guidance [B] if distilled
  (dev), no CFG; sigmas shifted by the H/2 * W/2 tokens.
- Qwen-Image: time input sigma (x 1000 inside); latents packed in 2x2 patches, [H/2 * W/2, 4C];
  a prompt mask [B, L]; img_shapes, one per row, and true CFG rescaled to the conditional
  velocity's norm per token; sigmas shifted by the H/2 * W/2 tokens.
- Wan 2.1 / 2.2: time input sigma * 1000; latents [C, F, H, W], not packed; no mask; UMT5
  embeddings only, CFG; 2.2 A14B has two experts, chosen per row at t >= boundary_ratio * 1000;
  UniPC's flow sigmas (flow_shift 3 or 5), the first 1 - 1e-6.
- LTX-Video: time input sigma * 1000; latents [F * H * W, C] (patch size 1: one token a latent
  voxel); a prompt mask [B, L]; F, H, W, and frame_rate in the rotary scale, CFG; sigmas shifted
  by the F * H * W tokens.

In every recipe the conditioning (embeddings, masks, pooled) repeats over S as a block.
SD3's recipe is train_sd.make_velocity_fn (with classifier-free guidance and bf16 autocast).
Flux-dev is guidance-distilled: it takes the guidance scale as an input, one forward, no CFG.
Qwen-Image and Wan run their unconditional branch without graph, as train_sd.py's SD3 recipe
does.
Wan's pipeline samples with UniPC, a multistep solver; rollout steps Euler(-Maruyama) on UniPC's
sigmas, as Flow-GRPO does, and passes sigma * 1000 where UniPC passes it truncated to an integer.
"""

import numpy as np
import torch


def scheduler_sigmas(scheduler, num_steps, image_seq_len=None):
    """The sigmas your pipeline samples at, [T + 1] from 1 to 0, from its own scheduler (pass the
    pipeline's pipe.scheduler). With dynamic shifting (Flux, Qwen-Image, LTX-Video) the shift
    depends on image_seq_len, the token count the pipeline shifts by: an image's packed tokens
    (H/2 * W/2 latent pixels: Flux, Qwen-Image), a video's latent frames x height x width
    (LTX-Video's F * H * W); SD3's and Wan's shifts are static. Wan's
    UniPCMultistepScheduler(use_flow_sigmas=True) starts at 1 - 1e-6, which jagg.sde_step takes as
    the first step, as it takes 1."""
    config = scheduler.config
    if config.get("use_dynamic_shifting") and image_seq_len is None:
        raise ValueError("this scheduler shifts its sigmas by the token count: pass "
                         "image_seq_len, an image's packed tokens (H/2 * W/2) or a video's "
                         "latent F * H * W")
    if config.get("use_dynamic_shifting"):
        # The pipelines' calculate_shift: mu linear in the token count between two anchors.
        slope = (config.get("max_shift", 1.15) - config.get("base_shift", 0.5)) / (
            config.get("max_image_seq_len", 4096) - config.get("base_image_seq_len", 256))
        base_len = config.get("base_image_seq_len", 256)
        mu = config.get("base_shift", 0.5) + slope * (image_seq_len - base_len)
        # FluxPipeline and QwenImagePipeline pass these sigmas, to be shifted; UniPC's flow
        # sigmas make their own.
        sigmas = None
        if not config.get("use_flow_sigmas"):
            sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        scheduler.set_timesteps(num_steps, sigmas=sigmas, mu=mu)
    else:
        scheduler.set_timesteps(num_steps)
    # [T+1], the last 0 (UniPC's with final_sigmas_type="sigma_min": its sigma_min)
    return scheduler.sigmas.float()


def pack_latents(latents):
    """Flux / Qwen-Image: [B, C, H, W] latents -> [B, H/2 * W/2, 4C] tokens of 2x2 patches."""
    B, C, H, W = latents.shape
    x = latents.view(B, C, H // 2, 2, W // 2, 2)
    x = x.permute(0, 2, 4, 1, 3, 5)  # [B, H/2, W/2, C, 2, 2]
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
    # [L, 3]: text has no position
    txt_ids = torch.zeros(prompt_embeds.shape[1], 3, device=prompt_embeds.device)

    def velocity_fn(z, t):
        S, B = t.shape
        x = z.reshape(S * B, *z.shape[2:])  # [S*B, seq, 4C], step-major: row s * B + b
        g = None
        if guidance is not None:
            g = torch.full((S * B,), float(guidance), device=x.device, dtype=x.dtype)
        v = transformer(hidden_states=x,
                        timestep=t.reshape(S * B).to(x.dtype),  # sigma: Flux multiplies by 1000
                        encoder_hidden_states=prompt_embeds.repeat(S, 1, 1),
                        pooled_projections=pooled.repeat(S, 1), txt_ids=txt_ids,
                        img_ids=img_ids.to(x.device), guidance=g, return_dict=False)[0]
        return v.reshape(z.shape)  # [S, B, seq, 4C]

    return velocity_fn


def qwen_image_velocity_fn(transformer, prompt_embeds, prompt_mask, height, width, negative=None,
                           true_cfg_scale=1.0):
    """Qwen-Image: z [S, B, seq, 4C] packed latents of height x width latent pixels;
    prompt_embeds [B, L, E] and prompt_mask [B, L] (1 for a token, 0 for padding) of the B samples.
    negative: (embeds, mask) of the negative prompt for true CFG at true_cfg_scale > 1, which
    QwenImagePipeline rescales token by token to the conditional velocity's norm (below)."""
    img_shapes = [[(1, height // 2, width // 2)]]  # one image per row

    def velocity_fn(z, t):
        S, B = t.shape
        x = z.reshape(S * B, *z.shape[2:])  # [S*B, seq, 4C], step-major: row s * B + b

        def forward(embeds, mask):  # sigma: Qwen-Image multiplies by 1000
            return transformer(hidden_states=x, timestep=t.reshape(S * B).to(x.dtype),
                               encoder_hidden_states=embeds.repeat(S, 1, 1),
                               encoder_hidden_states_mask=mask.repeat(S, 1),
                               img_shapes=img_shapes * (S * B),
                               return_dict=False)[0]  # [S*B, seq, 4C]

        v = forward(prompt_embeds, prompt_mask)
        if negative is not None and true_cfg_scale > 1:
            with torch.no_grad():  # the unconditional branch: no graph, as in train_sd.py's SD3
                v_u = forward(*negative)
            guided = v_u + true_cfg_scale * (v - v_u)  # [S*B, seq, 4C]
            # QwenImagePipeline's rescale: each token's guided velocity takes the conditional
            # one's norm.
            v = guided * (v.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True))
        return v.reshape(z.shape)  # [S, B, seq, 4C]

    return velocity_fn


def ltx_velocity_fn(transformer, prompt_embeds, prompt_mask, num_frames, height, width,
                    negative=None, guidance_scale=3.0, frame_rate=25, temporal_compression=8,
                    spatial_compression=32):
    """LTX-Video (LTXVideoTransformer3DModel): z [S, B, F*H*W, C] packed latents (patch size 1: one
    token per latent voxel) of num_frames x height x width latent voxels; prompt_embeds [B, L, E]
    and prompt_mask [B, L] (T5's, 1 for a token) of the B samples, both repeated over S as a block;
    negative: (embeds, mask) of the negative prompt, for CFG at guidance_scale > 1. The time input
    is sigma * 1000. frame_rate enters the rotary position scale, (temporal_compression /
    frame_rate, spatial_compression, spatial_compression): pass LTXPipeline's frame_rate and its
    pipe.vae_temporal_compression_ratio and pipe.vae_spatial_compression_ratio. The sigmas shift
    by the video's F * H * W latent tokens (scheduler_sigmas). Not reproduced: LTXPipeline's
    guidance_rescale (0 by default), which breaks the exactness of even a bias-only model."""
    rope_scale = (temporal_compression / frame_rate, spatial_compression, spatial_compression)

    def velocity_fn(z, t):
        S, B = t.shape
        x = z.reshape(S * B, *z.shape[2:])  # [S*B, F*H*W, C], step-major: row s * B + b
        timestep = (t.reshape(S * B) * 1000).to(x.dtype)  # [S*B]: LTX takes sigma * 1000

        def forward(embeds, mask):
            return transformer(hidden_states=x, encoder_hidden_states=embeds.repeat(S, 1, 1),
                               timestep=timestep, encoder_attention_mask=mask.repeat(S, 1),
                               num_frames=num_frames, height=height, width=width,
                               rope_interpolation_scale=rope_scale, return_dict=False)[0]

        v = forward(prompt_embeds, prompt_mask)  # [S*B, F*H*W, C]
        if negative is not None and guidance_scale > 1:
            with torch.no_grad():  # the unconditional branch: no graph, as in train_sd.py's SD3
                v_u = forward(*negative)
            v = v_u + guidance_scale * (v - v_u)
        return v.to(z.dtype).reshape(z.shape)  # [S, B, F*H*W, C]

    return velocity_fn


def wan_velocity_fn(transformer, prompt_embeds, negative_embeds=None, guidance_scale=5.0,
                    transformer_2=None, boundary_ratio=None, guidance_scale_2=None):
    """Wan 2.1 / 2.2 text-to-video (WanTransformer3DModel): z [S, B, C, F, H, W] video latents;
    prompt_embeds and negative_embeds [B, L, E] of the B samples (UMT5's, no mask, no pooled);
    CFG v = v_u + s (v_c - v_u) when negative_embeds is given and s > 1.
    Wan 2.2 A14B has two experts: transformer for high noise, transformer_2 for low noise,
    switching where WanPipeline does: at timestep boundary_ratio * 1000 (pipe.config.boundary_ratio,
    e.g. 0.875, times the scheduler's num_train_timesteps), with guidance_scale_2 (default
    guidance_scale) for transformer_2. The expert is chosen row by row: one call holds rows of
    many steps. Put both experts' trainable parameters in the optimizer, and end JAGG's windows
    at the switch.
    Not covered: Wan 2.2 TI2V-5B's per-token timesteps (WanPipeline's expand_timesteps)."""
    # WanPipeline's boundary_timestep
    boundary = None if boundary_ratio is None else boundary_ratio * 1000
    scale_2 = guidance_scale if guidance_scale_2 is None else guidance_scale_2

    def guided(model, scale, x, timestep, cond, uncond):  # one network's rows x [R, C, F, H, W]
        v = model(hidden_states=x, timestep=timestep, encoder_hidden_states=cond,
                  return_dict=False)[0]
        if negative_embeds is not None and scale > 1:
            with torch.no_grad():  # the unconditional branch: no graph, as in train_sd.py's SD3
                v_u = model(hidden_states=x, timestep=timestep, encoder_hidden_states=uncond,
                            return_dict=False)[0]
            v = v_u + scale * (v - v_u)
        return v  # [R, C, F, H, W]

    def velocity_fn(z, t):
        S, B = t.shape
        x = z.reshape(S * B, *z.shape[2:])  # [S*B, C, F, H, W], step-major: row s * B + b
        timestep = (t.reshape(S * B) * 1000).to(x.dtype)  # [S*B]: sigma * 1000, as SD3's
        cond = prompt_embeds.repeat(S, 1, 1)  # [S*B, L, E]
        uncond = cond if negative_embeds is None else negative_embeds.repeat(S, 1, 1)
        if boundary is None:  # one network (Wan 2.1)
            v = guided(transformer, guidance_scale, x, timestep, cond, uncond)
            return v.to(z.dtype).reshape(z.shape)
        # [S*B]: WanPipeline runs transformer at t >= boundary, else transformer_2 (t compared in
        # its own precision, not bf16's)
        high = t.reshape(S * B) * 1000 >= boundary
        v = torch.zeros_like(x)  # [S*B, C, F, H, W]
        experts = ((transformer, guidance_scale, high), (transformer_2, scale_2, ~high))
        for model, scale, rows in experts:
            if rows.any():
                v_rows = guided(model, scale, x[rows], timestep[rows], cond[rows], uncond[rows])
                v[rows] = v_rows.to(v.dtype)
        return v.reshape(z.shape)  # [S, B, C, F, H, W]

    return velocity_fn


# Wan 2.2 A14B's two experts in JAGG's windows. A window across the switch would interpolate
# between two networks' Jacobians, exact under no condition: beyond_paper.options tiles each
# network's steps on their own when given the steps where the second takes over,
#     JaggOptions(window=4, boundaries=expert_boundaries(sigmas, pipe.config.boundary_ratio)).
def expert_boundaries(sigmas, switch_sigma):
    """JaggOptions.boundaries for a model with two experts: the first network runs the steps
    whose sigma is >= switch_sigma, the second the others, as diffusers' WanPipeline does (its
    transformer at timesteps >= boundary_ratio x 1000, so switch_sigma = boundary_ratio: Wan 2.2
    A14B's 0.875 text-to-video, 0.9 image-to-video; a switch at timestep t_b of a model whose time
    is sigma x 1000 is switch_sigma = t_b / 1000). sigmas: [T + 1], decreasing, the schedule
    given to jagg.rollout (step k runs at sigmas[k]; the last entry runs no step). Returns (k,),
    the second network's first step, or () when all T steps run one network. Training only a
    trajectory's first n steps (first_steps), keep the boundaries below n."""
    s = torch.as_tensor(sigmas, dtype=torch.float64).flatten()[:-1]  # the steps' sigmas [T]
    if not (len(s) >= 1 and bool((s[1:] <= s[:-1]).all())):
        raise ValueError("sigmas must be a decreasing schedule [T + 1] as given to rollout, "
                         f"got {torch.as_tensor(sigmas).tolist()}")
    k = int((s >= switch_sigma).sum())  # the steps of the first network: they come first
    return (k,) if 0 < k < len(s) else ()
