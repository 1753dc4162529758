"""Check your velocity_fn once, before training: the contract jagg.py states, and the time convention.

jagg.py never sees a network, only velocity_fn(z [S, B, *D], t [S, B]) -> v [S, B, *D] (its
section 10). A velocity_fn that breaks the contract rarely crashes: it trains the wrong thing.
Each check here names the mistake and its fix in a ValueError:
    check_velocity_fn       v of z's shape and finite, two equal calls equal (no dropout), one call
                            on S steps equal to S one-step calls (step-major rows)
    check_against_pipeline  velocity_fn rolled out without noise ends where your own pipeline does
                            from the same noise, or the likely cause is named (time scaled by 1000
                            or not, time reversed, another shift of the sigmas)
    checked                 velocity_fn wrapped to refuse a v not of z's shape at every call
"""

import torch

from jagg import _check


def checked(velocity_fn):
    """velocity_fn that refuses a v not of z's shape: it would broadcast and train wrongly."""
    def velocity(z, t):
        v = velocity_fn(z, t)
        _check(v.shape == z.shape,
               f"velocity_fn(z {z.shape}) returned {v.shape}: end it with .reshape(z.shape)")
        return v
    return velocity


# === 1. The velocity_fn contract ===
@torch.no_grad()
def check_velocity_fn(velocity_fn, z, sigmas, rtol=None):
    """Check velocity_fn once before training, on noise z: [B, *D] of samples with different
    conditioning and the schedule sigmas: [T + 1]: v of z's shape and finite, two equal calls
    equal, one call on S steps equal to S one-step calls (jagg.py section 10: step-major). A
    ValueError names the mistake and its fix. rtol, relative to |v|; None: 1e-4 in fp32, 2e-2 in
    bf16 / fp16 or under autocast (pass 2e-2 if velocity_fn autocasts inside). Returns the largest
    relative difference."""
    S = min(3, len(sigmas) - 1)  # steps spread over the schedule: its first, middle and last
    steps = torch.linspace(0, len(sigmas) - 2, S).round().long()  # [S]
    t = sigmas[steps].to(z.device)[:, None].expand(S, z.shape[0])  # [S, B]
    zs = torch.stack([z * (1 - 0.1 * s) for s in range(S)])  # [S, B, *D]: a state per step
    velocity_fn = checked(velocity_fn)
    v = velocity_fn(zs, t)  # [S, B, *D]
    _check(v.dtype.is_floating_point and bool(torch.isfinite(v).all()),
           "velocity_fn returned non-finite values")
    low = v.dtype in (torch.bfloat16, torch.float16) or torch.is_autocast_enabled(z.device.type)
    if rtol is None:
        rtol = 2e-2 if low else 1e-4
    size = v.float().norm().item()
    again = (velocity_fn(zs, t).float() - v.float()).norm().item() / size
    _check(again <= rtol,
           f"two equal calls of velocity_fn differ by {again:.1e} of |v|: put the model in eval "
           "mode (no dropout) for rollouts and training alike, or the first ratio is not 1")
    one = torch.stack([velocity_fn(zs[s : s + 1], t[s : s + 1])[0] for s in range(S)])  # [S, B, *D]
    error = (v.float() - one.float()).norm().item() / size
    _check(error <= rtol,
           f"velocity_fn on {S} steps at once differs from {S} one-step calls by {error:.1e} of "
           f"|v| (rtol {rtol:.0e}): it is step-major (entry s * B + i is sample i at step s), so "
           "repeat the conditioning as a block, c.repeat(S) or .repeat(S, 1, 1), never "
           "repeat_interleave; choose a network (an expert, e.g. Wan 2.2's two) per row from t, "
           "not once per call from t[0]; and make no row depend on the others (batch statistics)")
    return max(error, again)


# The time convention. check_velocity_fn cannot see a velocity_fn that is self-consistent but
# wrong: one that passes sigma where the model takes sigma * 1000 trains, and its cosines look
# normal, but every step runs the model at the wrong time. Only the model's own pipeline knows
# the convention: roll velocity_fn out by the ODE (noise level 0: z += v dsigma, the pipelines'
# FlowMatchEuler step) from the noise the pipeline started from, and compare the final latents.
TIME_FIXES = [  # (the t velocity_fn would have to be called with to match, as code; the cause)
    (lambda t: t * 1000, "t * 1000",
     "it passes the model sigma where the model takes sigma * 1000 (SD3, Wan, LTX-Video)"),
    (lambda t: t / 1000, "t / 1000",
     ("it passes the model sigma * 1000 where the model takes sigma (Flux, Qwen-Image scale "
      "inside)")),
    (lambda t: 1 - t, "1 - t", "its time runs backwards (1 - sigma where the model takes sigma)"),
    (lambda t: 1 - t * 1000, "1 - t * 1000",
     "its time runs backwards and is not scaled by 1000 where the model needs it"),
    (lambda t: 1 - t / 1000, "1 - t / 1000",
     "its time runs backwards and is scaled by 1000 where the model scales it inside"),
]


def shifted(sigmas, factor):
    """sigmas re-shifted by factor: s' = f s / (1 + (f - 1) s), SD3's shift; shifting by a and then
    by b is shifting by a b, so a schedule of the wrong static shift is this of the right one."""
    return factor * sigmas / (1 + (factor - 1) * sigmas)


@torch.no_grad()
def ode_rollout(velocity_fn, noise, sigmas):
    """The final latents of the deterministic sampler, z += v (sigma_next - sigma), step by step
    from noise [B, *D] over sigmas [T + 1]: the pipelines' FlowMatchEuler step, jagg.rollout at
    noise 0."""
    z = noise
    for k in range(len(sigmas) - 1):
        t = sigmas[k].expand(1, z.shape[0]).to(z.device)  # [1, B]
        v = velocity_fn(z[None], t)[0]  # [B, *D]
        dtype = torch.promote_types(torch.promote_types(v.dtype, z.dtype), torch.float32)
        z = z.to(dtype) + v.to(dtype) * (sigmas[k + 1] - sigmas[k]).to(z.device, dtype)
    return z


def check_against_pipeline(velocity_fn, noise, sigmas, pipeline_latents, rtol=1e-3):
    """Check once, before training, that velocity_fn is your pipeline's model at the right time:
    velocity_fn rolled out without noise (ode_rollout) over sigmas [T + 1] from noise [B, *D] must
    end at pipeline_latents [B, *D], what your pipeline returns for the same noise, conditioning
    and guidance at T steps (output_type="latent"). A ValueError names the likely cause when they
    differ by more than rtol of the latents' norm: the time scaled by 1000 where it must not be or
    not where it must, the time reversed, or sigmas of another shift than the pipeline's (each
    found by trying its fix), or none of these. Returns the relative difference."""
    _check(bool((sigmas[1:] < sigmas[:-1]).all()),
           f"sigmas must fall from noise to data (jagg.py's t = sigma, 1 = noise), got "
           f"{[round(s, 4) for s in sigmas.tolist()]}: pass the scheduler's own (scheduler_sigmas)")
    target = pipeline_latents.float()

    def distance(fn, s):
        return ((ode_rollout(fn, noise, s).float() - target).norm() / target.norm()).item()
    error = distance(velocity_fn, sigmas)
    if error <= rtol:
        return error
    where = (f"velocity_fn rolled out without noise ends {error:.2g} (relative) from the "
             "pipeline's latents")
    for fix, code, cause in TIME_FIXES:
        def fixed(z, t, fix=fix):
            return velocity_fn(z, fix(t))
        if distance(fixed, sigmas) <= rtol:
            raise ValueError(f"{where}: {cause}; called with {code} in place of t, it matches")
    for factor in (1 / 6, 1 / 5, 1 / 3, 1 / 2, 3 / 5, 2 / 3, 3 / 2, 5 / 3, 2, 3, 5, 6):
        if distance(velocity_fn, shifted(sigmas, factor)) <= rtol:
            raise ValueError(f"{where}: the sigmas are not the pipeline's, which are these "
                             f"shifted by {factor:.3g}; take its scheduler's own "
                             "(scheduler_sigmas, with the token count for a dynamic shift)")
    raise ValueError(f"{where}, and no change of the time input or of the shift explains it: check "
                     "that both ran on the same noise, conditioning, masks and guidance scale, the "
                     "model's extra inputs (frame rate, image ids, guidance), the latents' "
                     "packing, and the scheduler's sigmas (scheduler_sigmas)")
