"""JAGG: GRPO for flow-matching diffusion transformers with one backward per window of W steps.

The paper's algorithm alone, in one file to read top to bottom: JAGG (Jacobian-Aggregated Group
Gradient), from "JAGG: Jacobian-Aggregated Group Gradient for Efficient GRPO Training of
Diffusion Models" (arXiv 2607.17572, 2026), on top of Flow-GRPO's SDE sampler and loss
(Liu et al., "Flow-GRPO: Training Flow Matching Models via Online RL", arXiv 2505.05470).
We follow the paper as its abstract states it; where it is silent, our choices are marked OURS.
The name: GRPO's group-relative gradient, aggregated over a window through its Jacobians.

JAGG in brief: a window's gradient sum_k g_k^T J_k needs a transformer backward per step for its
Jacobians J_k; interpolating them linearly in t between the window's two end steps collapses the
sum into ONE backward over the double batch [z_a; z_b]. Section 6 derives it, says what it costs
and when it is exact.

Notation (code name -> symbol)
    T          the number of steps of the trajectories at hand: a rollout's, or its trained first ones
    W          window length (a trajectory's last window may be shorter); a window runs from its first
               step a to its last b = a + W - 1, both included (code ranges are start:stop, stop = b + 1)
    k          a step. JAGG's sums run over a window's steps, k = a..b. Code that handles one
               window holds only its steps and counts them from 0: there z[k] is z_{a+k}
    B          batch size (number of samples, all prompts and groups together)
    z[k]       z_k, the latent state before step k;  z_next[k] = z_{k+1}
    t[k]       t_k = sigma_k, the flow time of step k (1 = pure noise, 0 = data)
    v_k        v_theta(z_k, t_k), the velocity the network predicts at step k (v = noise - data)
    g_k        dL_k / dv_k, the upstream gradient of step k's loss (cheap, no network)
    J_k        d v_k / d theta, the Jacobian of the network at step k (expensive)
    alpha_k    (t_a - t_k) / (t_a - t_b): 0 at the window's first step a, 1 at its last b
    G_a, G_b   sum_k (1 - alpha_k) g_k  and  sum_k alpha_k g_k (k = a..b): the composite signals
    J_a, J_b   the Jacobians at the window's end steps, the only two JAGG back-propagates
    noise_level  eta, the SDE's stochasticity (Flow-GRPO: 0.7); not a sigma

Shapes: T steps, W window steps, S any number, B samples, *D one sample's shape (channels, height,
width of an image; [seq, C] packed; 3 in the self-check), P parameters; [B, 1..]: B, then ones. A
"row" is one step's B samples through the network, the unit of cost: exact runs T with grad, JAGG 2
per window with grad (+ W - 2 without graph).

The whole contract with a model is one function:
    velocity_fn(z, t) -> v    z: [S, B, *D], t: [S, B], v: [S, B, *D], the same shape as z
with t = sigma and v = d z / d sigma = noise - data (the rectified flow of SD3, Flux and
Flow-GRPO; convert to your transformer's own time inside it). It owns any conditioning (prompts,
CFG), and JAGG calls it on several steps at once: check_velocity_fn (section 9) catches the
silent mistakes this allows; call it once before training.
Options beyond the paper and the training step for real runs (many ranks) are in jagg_options.py.

Run it:
    python jagg.py               # the self-check, a few seconds: what each part computes and costs
    python train_toy.py          # the CPU demo: exact GRPO vs JAGG on a toy 2-D DiT
    python -m pytest -q          # the checks: JAGG vs exact vs explicit Jacobians
"""

import copy
import math
from dataclasses import dataclass

import torch


def _check(ok, message):  # a ValueError naming the mistake and its fix
    if not ok:
        raise ValueError(message)


# === 1. SDE step: the Gaussian policy of one sampling step (Flow-GRPO) ===
# The flow ODE has no log-probability; an SDE with its marginals makes each step a Gaussian
# policy z_{k+1} ~ N(mu_k, std_k^2), whose densities' ratio GRPO uses.


def sigma_schedule(num_steps, shift=3.0):
    """The sigmas sigma_0 = 1 > ... > sigma_T = 0 [T + 1], float32: an even grid s bent by SD3's
    shift, sigma = shift * s / (1 + (shift - 1) * s), more steps at high noise for shift > 1."""
    _check(num_steps >= 1 and shift > 0, f"num_steps must be >= 1 and shift > 0, got {num_steps} and {shift}")
    s = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)  # [T+1]
    return (shift * s / (1 + (shift - 1) * s)).float()  # [T+1]


def sde_step(v, z, sigma, sigma_next, noise_level, prev_sample=None, generator=None):
    """One SDE step from z at sigma to sigma_next (v, z: [B, *D]; sigma, sigma_next: [B]);
    prev_sample (z_{k+1}, [B, *D], diffusers' name), if given, is scored instead of sampled. Returns (prev_sample,
    log_prob [B], mean [B, *D], std [B, 1..]): the next state, its Gaussian log-density averaged
    over the non-batch dimensions (Flow-GRPO's), the Gaussian's mean and its standard deviation
    std = std_t sqrt(-dt), std_t = eta sqrt(sigma / (1 - sigma)) (the KL recovers std_t, section 4), in fp32."""
    # Why fp32: the GRPO ratio exponentiates the difference of near-equal log-probabilities; bf16
    # rounding alone would move it by more than Flow-GRPO's clip range of 1e-4.
    dtype = torch.promote_types(torch.promote_types(v.dtype, z.dtype), torch.float32)  # fp32, or fp64 if given fp64
    v, z = v.to(dtype), z.to(dtype)
    shape = (-1,) + (1,) * (z.ndim - 1)
    sigma = sigma.to(dtype).reshape(shape)  # [B, 1, ...]
    sigma_next = sigma_next.to(dtype).reshape(shape)  # [B, 1, ...]
    dt = sigma_next - sigma  # [B, 1, ...], < 0: sigma decreases from noise to data
    # std_t = noise_level * sqrt(sigma / (1 - sigma)). At sigma = 1 (the first step) this is
    # infinite; like Flow-GRPO we use the next sigma in the denominator there instead. "1" within
    # 1e-4: some schedulers start just below it (Wan's UniPC flow sigmas at 1 - 1e-6, std_t ~700 eta).
    denom = 1 - torch.where(sigma > 1 - 1e-4, sigma_next, sigma)  # [B, 1, ...]
    std_t = noise_level * torch.sqrt(sigma / denom)  # [B, 1, ...]
    # Euler on dz = [v + std_t^2 / (2 sigma) (z + (1 - sigma) v)] dsigma + std_t dw (the ODE's marginals):
    # mu = z (1 + std_t^2 / (2 sigma) dt) + v (1 + std_t^2 (1 - sigma) / (2 sigma)) dt
    mean = z * (1 + std_t**2 / (2 * sigma) * dt) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
    std = std_t * torch.sqrt(-dt)  # [B, 1, ...], the Gaussian's standard deviation
    if prev_sample is None:
        noise = torch.randn(z.shape, generator=generator, device=z.device, dtype=z.dtype)
        prev_sample = mean + std * noise  # [B, *D]
    prev_sample = prev_sample.to(dtype)
    # log N(x; mu, std^2) = -(x - mu)^2 / (2 std^2) - log std - log sqrt(2 pi), per element.
    log_prob = -((prev_sample.detach() - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)  # [B, *D]
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))  # [B]
    return prev_sample, log_prob, mean, std


# === 2. Rollout: sample trajectories and keep what training needs ===


@dataclass
class Trajectory:
    """A batch of sampled trajectories: everything GRPO needs, no graph attached."""

    z: torch.Tensor  # z_k, the state before each step          [T, B, *D]
    z_next: torch.Tensor  # z_{k+1}, the state after each step   [T, B, *D]
    t: torch.Tensor  # t_k = sigma_k of each step                [T, B]
    t_next: torch.Tensor  # sigma_{k+1} of each step            [T, B]
    log_prob: torch.Tensor  # log p_old(z_{k+1} | z_k)           [T, B]
    v: torch.Tensor  # v_k under the sampling policy             [T, B, *D]
    noise_level: float | None = None  # the SDE's noise level that drew it (the loss must score at the same)

    TENSORS = ("z", "z_next", "t", "t_next", "log_prob", "v")

    @property
    def sample(self):  # the final clean samples z_T: [B, *D]
        return self.z_next[-1]

    def first_steps(self, n):
        """The first n steps, the ones Flow-GRPO trains (its timestep_fraction: 9 of T = 10; with SD3's
        own scheduler the last step barely changes the image). Reward the full trajectory's .sample."""
        _check(1 <= n <= self.z.shape[0], f"a trajectory of {self.z.shape[0]} steps has no first {n} steps to train")
        return Trajectory(**{name: getattr(self, name)[:n] for name in self.TENSORS}, noise_level=self.noise_level)

    def subset(self, idx):
        """The samples idx, a minibatch (slice their conditioning with the same idx)."""
        return Trajectory(**{name: getattr(self, name)[:, idx] for name in self.TENSORS}, noise_level=self.noise_level)

    @staticmethod
    def cat(trajs):
        """One batch from several, joined on B (a rollout drawn in chunks, or gathered from ranks)."""
        levels = {traj.noise_level for traj in trajs}
        _check(len(levels) == 1, f"trajectories drawn at different noise levels cannot form one batch: {levels}")
        return Trajectory(**{name: torch.cat([getattr(traj, name) for traj in trajs], dim=1) for name in Trajectory.TENSORS},
                          noise_level=levels.pop())


@torch.no_grad()
def rollout(velocity_fn, noise, sigmas, noise_level, generator=None):
    """Sample B trajectories of T = len(sigmas) - 1 SDE steps from the noise z_0: [B, *D]. The
    velocities are kept: JAGG's routing score (section 7) reads them for free."""
    velocity_fn = checked(velocity_fn)  # refuses a v not of z's shape (section 9)
    B, T, z = noise.shape[0], len(sigmas) - 1, noise
    zs, z_nexts, log_probs, vs = [], [], [], []
    for k in range(T):
        t_k = sigmas[k].expand(1, B).to(z.device)  # [1, B]
        v = velocity_fn(z[None], t_k)[0]  # [B, *D]
        z_next, log_prob, _, _ = sde_step(v, z, t_k[0], sigmas[k + 1].expand(B).to(z.device),
                                          noise_level, generator=generator)
        zs.append(z), z_nexts.append(z_next), log_probs.append(log_prob), vs.append(v)
        z = z_next
    t = sigmas[:-1, None].expand(T, B).to(noise.device)  # [T, B]
    t_next = sigmas[1:, None].expand(T, B).to(noise.device)  # [T, B]
    return Trajectory(z=torch.stack(zs), z_next=torch.stack(z_nexts),  # [T, B, *D] each
                      t=t.contiguous(), t_next=t_next.contiguous(), log_prob=torch.stack(log_probs),  # [T, B] each
                      v=torch.stack(vs), noise_level=noise_level)  # [T, B, *D]


# === 3. Group-relative advantages (GRPO) ===


def group_advantages(rewards, group_ids, eps=1e-4, global_std=False, clip=5.0):
    """A_i = (r_i - mean_group(i)) / (std + eps), clipped to [-clip, clip]; rewards, group_ids: [B]
    (a group: the samples drawn for one prompt). std is the group's own, as in GRPO, or with
    global_std all rewards' (Flow-GRPO's option, steadier when a group's rewards are nearly equal)."""
    _check(rewards.shape == group_ids.shape and rewards.ndim == 1,
           f"rewards and group_ids must both be [B], got {tuple(rewards.shape)} and {tuple(group_ids.shape)}")
    rewards = rewards.float()
    adv = torch.empty_like(rewards)  # [B]
    all_std = rewards.std(unbiased=False)
    for g in group_ids.unique():
        m = group_ids == g  # [B] bool
        std = all_std if global_std else rewards[m].std(unbiased=False)
        adv[m] = (rewards[m] - rewards[m].mean()) / (std + eps)
    return adv.clamp(-clip, clip)


# === 4. The per-step GRPO loss ===


@dataclass
class LossConfig:
    """The knobs of the per-step loss (section 4) and of the SDE (section 1)."""

    noise_level: float  # the SDE's noise level (Flow-GRPO: 0.7)
    clip_range: float  # PPO/GRPO ratio clip epsilon (Flow-GRPO: 1e-4; the self-check's 0.2 lets clipping show)
    beta: float = 0.0  # weight of the KL to the reference model; 0 = no reference needed


def grpo_step_loss(log_prob, log_prob_old, advantages, clip_range, mean=None, mean_ref=None, std_t=None, beta=0.0):
    """Clipped GRPO surrogate of one step, plus beta * KL to the reference policy.

    All per-sample inputs are [B] (mean, mean_ref: [B, *D]; std_t: [B, 1..]).
    ratio = exp(logp - logp_old);  L = mean_B max(-A ratio, -A clip(ratio, 1 - clip_range, 1 + clip_range))
    KL term = mean_B mean_D (mu - mu_ref)^2 / (2 std_t^2)   (Flow-GRPO's train_sd3.py)
    with std_t the SDE's noise scale of section 1 (the transition's std is std_t sqrt(|dt|)): the
    KL of the two Gaussian transitions times |dt|, so beta means what it means in Flow-GRPO's configs.
    Returns (loss, stats) where stats holds detached per-step diagnostics.
    """
    ratio = torch.exp(log_prob - log_prob_old)  # [B]
    unclipped = -advantages * ratio  # [B]
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)  # [B]
    loss = torch.maximum(unclipped, clipped).mean()
    kl = torch.zeros((), device=loss.device)
    if beta > 0:
        kl = ((mean - mean_ref) ** 2 / (2 * std_t**2)).mean(dim=tuple(range(1, mean.ndim))).mean()
        loss = loss + beta * kl
    # approx_kl = E[(logp - logp_old)^2] / 2, the k2 estimator (Schulman, "Approximating KL
    # divergence", 2020), as Flow-GRPO logs it (CleanRL's ppo.py logs k1 and k3).
    stats = {"clipfrac": (torch.abs(ratio - 1.0) > clip_range).float().mean().item(),
             "approx_kl": 0.5 * ((log_prob - log_prob_old) ** 2).mean().item(), "kl": kl.item()}
    return loss, stats


def make_step_loss(traj, advantages, start, stop, cfg, v_ref=None, log=None):
    """step_loss(k, v_k) for the steps start..stop-1 of traj, a window (window_bounds, section 7): k
    counts from its first step, k = 0 is step start. Each is weighted 1/T, so that a trajectory's
    loss is the mean over its steps (as Flow-GRPO averages them). v_ref: [stop - start, B, *D] the
    reference's velocities (when cfg.beta > 0). Each call appends its stats dict to the list log."""
    T = traj.z.shape[0]

    def step_loss(k, v_k):
        _check(0 <= k < stop - start, f"step {k} is outside the window's {stop - start} steps")
        i = start + k  # the step in the trajectory
        _, log_prob, mean, std = sde_step(v_k, traj.z[i], traj.t[i], traj.t_next[i], cfg.noise_level,
                                          prev_sample=traj.z_next[i])
        mean_ref = std_t = None
        if cfg.beta > 0:
            _, _, mean_ref, _ = sde_step(v_ref[k], traj.z[i], traj.t[i], traj.t_next[i], cfg.noise_level,
                                         prev_sample=traj.z_next[i])
            # The KL's std_t is the SDE's noise scale of section 1: the transition's std over sqrt(|dt|).
            std_t = std / (traj.t[i] - traj.t_next[i]).sqrt().reshape(std.shape)  # [B, 1..]
        loss, stats = grpo_step_loss(log_prob, traj.log_prob[i], advantages, cfg.clip_range,
                                     mean=mean, mean_ref=mean_ref, std_t=std_t, beta=cfg.beta)
        if log is not None:
            log.append(stats)
        return loss / T

    return step_loss


# === 5. Exact per-step backward: the baseline (what Flow-GRPO does) ===
# The backward functions (here and in section 6) take one window's W steps, z [W, B, *D] and
# t [W, B], and step_loss(k, v_k) -> scalar, the loss of its k-th step given the velocity
# [B, *D]; they accumulate gradients like loss.backward() and return the window's summed loss.


def _check_window(z, t):  # z: [W, B, *D], t: [W, B]
    _check(z.ndim >= 2 and t.shape == z.shape[:2], f"a window needs z: [W, B, *D] and t: [W, B] with matching W and "
                                                  f"B, got z {tuple(z.shape)}, t {tuple(t.shape)}")


def backward_exact(velocity_fn, z, t, step_loss):
    """Exact gradient of W steps: one forward with graph and one backward per step (W of each)."""
    _check_window(z, t)
    total = 0.0
    for k in range(z.shape[0]):
        v_k = velocity_fn(z[k : k + 1], t[k : k + 1])[0]  # [B, *D]
        loss = step_loss(k, v_k)
        loss.backward()  # frees step k's graph before step k + 1 builds its own: one row alive at a time
        total += loss.item()
    return total


# === 6. JAGG: interpolate the Jacobians, back-propagate once ===
# The gradient of a window a..b is a sum of vector-Jacobian products:
#     grad = sum_k g_k^T J_k,      g_k = dL_k/dv_k,   J_k = dv_theta(z_k, t_k)/dtheta.
# (A step's loss L_k depends on the weights only through its velocity v_k: the states and the
# reference are fixed.) g_k is cheap, a few elementwise ops on v_k; each J_k costs a backward.
# Training-free DiT accelerators (Delta-DiT, ScalingCache) exploit that a DiT's features and
# velocities change smoothly, nearly linearly, along a trajectory. JAGG bets the Jacobians do
# too, and interpolates them between the window's end steps, weighted by t:
#     J_k ~= (1 - alpha_k) J_a + alpha_k J_b,        alpha_k = (t_a - t_k) / (t_a - t_b).
# The sum then collapses by linearity into two vector-Jacobian products,
#     grad ~= G_a^T J_a + G_b^T J_b,   G_a = sum_k (1 - alpha_k) g_k,  G_b = sum_k alpha_k g_k,
# which one backward of  sum(v_a * G_a) + sum(v_b * G_b)  through ONE forward on the double
# batch [z_a; z_b] computes. Only the Jacobians are approximated: every g_k, and so every step's
# loss, ratio and clip, comes from the step's true velocity at the current weights. As we read
# the paper, it removes backward passes only: the interior steps still run forward, without a
# graph (the rollout's stored velocities would be stale after the first update).
#
# What it costs, per window of W steps: exact runs W rows with grad (W forwards with graph, W
# backward passes of one row); JAGG runs 2 (one forward with graph over the double batch, one
# backward over it) plus W - 2 interior rows forward without graph, which store no activations.
# With a backward costing about two forwards, exact's 3W forward-units become JAGG's 2 x 3 +
# (W - 2) = W + 4: 1.5x at W = 4, under 3x however long the window (and long ones interpolate
# worse); the rollout's and the KL reference's forwards, which it does not touch, dilute that.
# Memory: the double batch keeps 2 rows of activations alive at once, twice exact's one.
# OURS: windows tile the trained steps from the first, the last one shorter (T = 10 at W = 4:
# windows of 4, 4 and 2 steps, 6 rows with grad, not 10; Flow-GRPO's 9 trained steps: 4, 4 and
# 1, 5 rows); W = 4 is our default. A 1-step window is exact; a 2-step one costs 2 rows either way.
#
# Its error is sum_k g_k^T (J_k - (1 - alpha_k) J_a - alpha_k J_b). It is exact when J(z, t) is
# affine in (z, t) along the window (e.g. v_theta affine in (z, t), whatever its dependence on
# theta) and the states lie on the straight segment z_k = (1 - alpha_k) z_a + alpha_k z_b (t_k is
# on it by alpha's definition); with W = 2, no interior step, always. Real DiTs are not affine in
# (z, t) and the SDE's noise bends the states, so there JAGG approximates: routing guards it (7).


def interpolation_weights(t):
    """alpha_k = (t_a - t_k) / (t_a - t_b) for a window's times t: [W, B] (the paper's abstract:
    weighted by t). Returns [W, B]: 0 at a, 1 at b."""
    span = t[0] - t[-1]  # [B]
    _check(bool((span != 0).all()), "a window's end steps must have different times (t_a != t_b)")
    return (t[0] - t) / span  # [W, B]


def backward_jagg_window(velocity_fn, z, t, step_loss):
    """The paper's JAGG gradient of one window of W steps (a is index 0, b is index W - 1): ONE
    forward with graph on the double batch [z_a; z_b] and ONE backward of G_a^T J_a + G_b^T J_b."""
    _check_window(z, t)
    W = z.shape[0]
    _check(W >= 2, f"JAGG needs a window of at least 2 steps, got W = {W}")
    acc_dtype = torch.promote_types(z.dtype, torch.float32)  # G_a, G_b in fp32 at least, whatever the network's precision
    alpha = interpolation_weights(t.to(acc_dtype))  # [W, B]: 0 at a, 1 at b
    alpha = alpha.reshape(alpha.shape + (1,) * (z.ndim - 2))  # [W, B, 1..]

    # The paper's interior velocities, at the current weights: needed only for g_k = dL_k/dv_k, never
    # back-propagated through the network, so no graph: all W - 2 in one forward that stores nothing.
    with torch.no_grad():
        v_mid = velocity_fn(z[1:-1], t[1:-1]) if W > 2 else z[:0]  # [W-2, B, *D]; W = 2: none, an empty [0, B, *D]

    # The end steps: one forward with graph on the double batch [z_a; z_b].
    v_ab = velocity_fn(z[[0, -1]], t[[0, -1]])  # [2, B, *D]
    v = torch.cat([v_ab[:1].detach(), v_mid.to(v_ab.dtype), v_ab[1:].detach()])  # [W, B, *D], no graph

    # G_a = sum_k (1 - alpha_k) g_k,  G_b = sum_k alpha_k g_k, with g_k from the loss alone.
    G_a = torch.zeros(v.shape[1:], dtype=acc_dtype, device=z.device)  # [B, *D]
    G_b = torch.zeros(v.shape[1:], dtype=acc_dtype, device=z.device)  # [B, *D]
    total = 0.0
    for k in range(W):
        v_k = v[k].detach().requires_grad_(True)  # [B, *D], a leaf: differentiate the loss, not the network
        loss = step_loss(k, v_k)
        (g_k,) = torch.autograd.grad(loss, v_k)  # [B, *D]
        G_a += (1 - alpha[k]) * g_k.to(acc_dtype)
        G_b += alpha[k] * g_k.to(acc_dtype)
        total += loss.item()

    # One backward: d/dtheta [sum(v_a * G_a) + sum(v_b * G_b)] = G_a^T J_a + G_b^T J_b.
    (v_ab[0] * G_a.to(v_ab.dtype) + v_ab[1] * G_b.to(v_ab.dtype)).sum().backward()
    return total


# === 7. Routing: which windows are linear enough for JAGG ===
# The abstract routes by a cosine-similarity rule and names the knob jagg_frac. OURS: which cosine,
# and what jagg_frac counts. A window's score is the cosine of its interior velocities with their
# interpolation between its end steps: free (the rollout's velocities), and if v moves linearly in
# t the Jacobians likely do too. It is blind to a velocity's scale and reads the rollout's (older)
# policy. Velocities point much the same way, so scores run high (low ones at high noise, as the
# self-check's first window shows): rank them, do not read them as absolute. jagg_frac is the
# share of windows, best first, that JAGG takes (Python's round, half to even); the rest train
# exactly. A window of 2 steps or fewer takes no share: with no interior step, JAGG saves nothing.


def linearity_score(v, t):
    """Cosine similarity of the interior velocities v_k with (1 - alpha_k) v_a + alpha_k v_b,
    averaged over interior steps and samples. v: [W, B, *D], t: [W, B]. 1.0 when W <= 2."""
    W = v.shape[0]
    if W <= 2:
        return 1.0
    alpha = interpolation_weights(t.float())  # [W, B]
    alpha = alpha.reshape(alpha.shape + (1,) * (v.ndim - 2))  # [W, B, 1..]
    v = v.float()
    v_lin = (1 - alpha) * v[:1] + alpha * v[-1:]  # [W, B, *D]
    cos = torch.nn.functional.cosine_similarity(v[1:-1].flatten(2), v_lin[1:-1].flatten(2), dim=-1)  # [W-2, B]
    return cos.mean().item()


def window_bounds(num_steps, window):
    """Split T steps into windows of W steps: [(start, stop), ...] with stop = b + 1; the last may be shorter."""
    _check(window >= 2, f"window must be >= 2 steps (JAGG interpolates between two end steps), got {window}")
    _check(window <= num_steps,
           f"window ({window}) is longer than the trajectory ({num_steps} steps): use a window <= {num_steps}")
    return [(start, min(start + window, num_steps)) for start in range(0, num_steps, window)]


def route_windows(scores, lengths, jagg_frac):
    """Send round(jagg_frac x the windows of 3 or more steps) of them, the highest scores first, to
    JAGG. scores, lengths: one per window. Returns a list of bools, True for JAGG."""
    _check(0.0 <= jagg_frac <= 1.0, f"jagg_frac must be in [0, 1], got {jagg_frac}")
    eligible = [i for i, n in enumerate(lengths) if n >= 3]
    n_jagg = round(jagg_frac * len(eligible))
    # sorted() is stable: among equal scores the earlier window wins, so routing is reproducible.
    chosen = set(sorted(eligible, key=lambda i: -scores[i])[:n_jagg])
    return [i in chosen for i in range(len(scores))]


# === 8. One training step over a batch of trajectories ===
# Window by window: those routing gives to JAGG run backward_jagg_window, the others
# backward_exact; the KL term's reference velocities need no graph. Then a plain optimizer step.
# The caller loops over the rollout's minibatches (traj.subset(idx)): the first optimizer step
# on-policy, the next off-policy.


def check_batch(traj, advantages, cfg):
    """A batch's trajectories, advantages and loss agree (before any work)."""
    _check(traj.noise_level is None or traj.noise_level == cfg.noise_level,
           f"the trajectories were drawn at noise_level {traj.noise_level} but the loss scores them at "
           f"{cfg.noise_level}: pass the same noise level to rollout and LossConfig")
    _check(advantages.shape == traj.log_prob.shape[1:],
           f"advantages must be [B] = {tuple(traj.log_prob.shape[1:])}, got {tuple(advantages.shape)}")


def paper_gradients(velocity_fn, traj, advantages, cfg, window=4, jagg_frac=1.0, ref_velocity_fn=None):
    """Accumulate the gradient of the batch's GRPO loss (the mean over traj's T steps and B
    samples; advantages: [B]) into .grad, window by window, routed between exact and the paper's
    JAGG. Returns (stats, routed): routed[i] is True when window i went to JAGG."""
    check_batch(traj, advantages, cfg)
    _check(cfg.beta == 0 or ref_velocity_fn is not None, "beta > 0 needs a ref_velocity_fn (the frozen reference model)")
    velocity_fn = checked(velocity_fn)
    bounds = window_bounds(traj.z.shape[0], window)  # [(start, stop), ...]
    # Route: the jagg_frac most linear windows, judged on the rollout's own velocities (free).
    scores = [linearity_score(traj.v[start:stop], traj.t[start:stop]) for start, stop in bounds]
    routed = route_windows(scores, [stop - start for start, stop in bounds], jagg_frac)

    log, loss = [], 0.0  # log: every step's stats from grpo_step_loss
    for (start, stop), use_jagg in zip(bounds, routed):
        z, t = traj.z[start:stop], traj.t[start:stop]  # [W, B, *D], [W, B]
        with torch.no_grad():  # the KL reference's velocities [W, B, *D], when there is a KL term
            v_ref = checked(ref_velocity_fn)(z, t) if cfg.beta > 0 else None
        step_loss = make_step_loss(traj, advantages, start, stop, cfg, v_ref, log)
        backward = backward_jagg_window if use_jagg else backward_exact
        loss += backward(velocity_fn, z, t, step_loss)

    # grad_rows: network rows run with grad, the cost JAGG cuts (exact: T; JAGG: 2 per window);
    # routed_frac: the share JAGG took of the windows jagg_frac counts (3 steps or more).
    grad_rows = sum(2 if use_jagg else stop - start for (start, stop), use_jagg in zip(bounds, routed))
    stats = {key: sum(s[key] for s in log) / len(log) for key in log[0]}  # means over steps
    eligible = sum(stop - start >= 3 for start, stop in bounds)
    stats.update(loss=loss, routed_frac=sum(routed) / max(eligible, 1), grad_rows=grad_rows, window_scores=scores)
    return stats, routed


def paper_train_step(velocity_fn, optimizer, traj, advantages, cfg, window=4, jagg_frac=1.0, ref_velocity_fn=None):
    """One optimizer step of GRPO with the paper's JAGG: the batch's gradient (paper_gradients),
    clipped to norm 1 (Flow-GRPO's max_grad_norm), and the optimizer's step. Returns (stats, routed)."""
    optimizer.zero_grad(set_to_none=True)
    stats, routed = paper_gradients(velocity_fn, traj, advantages, cfg, window, jagg_frac, ref_velocity_fn)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    stats["grad_norm"] = torch.nn.utils.clip_grad_norm_(params, 1.0).item()
    optimizer.step()
    return stats, routed


# === 9. Before training: check the model's velocity_fn ===
# Three silent mistakes: a v not of z's shape (checked refuses it); dropout; and conditioning in the
# wrong order. Entry s * B + i of z.reshape(S * B, *D) needs sample i's conditioning: repeat it,
# as a block, c.repeat(S), never repeat_interleave (only calls on several steps show it: JAGG's, the KL's).


def checked(velocity_fn):
    """velocity_fn, refusing a v not of z's shape (broadcast, it would train silently; section 9)."""
    def velocity(z, t):
        v = velocity_fn(z, t)
        _check(isinstance(v, torch.Tensor) and v.shape == z.shape,
               f"velocity_fn(z {tuple(z.shape)}, t {tuple(t.shape)}) returned {getattr(v, 'shape', type(v))}: it must "
               f"return v of z's shape [S, B, *D]; end it with .reshape(z.shape)")
        return v
    return velocity


@torch.no_grad()
def check_velocity_fn(velocity_fn, z, sigmas, rtol=None):
    """Check velocity_fn once before training, on noise z: [B, *D] of samples with different
    conditioning and the schedule sigmas: [T + 1]: v of z's shape and finite, two equal calls
    equal, one call on S steps equal to S one-step calls. A ValueError names the mistake and its
    fix. rtol, relative to |v|; None: 1e-4 in fp32, 2e-2 in bf16 / fp16 or under autocast (pass
    2e-2 if velocity_fn autocasts inside). Returns the largest relative difference."""
    S = min(3, len(sigmas) - 1)  # steps spread over the schedule: its first, middle and last: [S]
    t = sigmas[torch.linspace(0, len(sigmas) - 2, S).round().long()].to(z.device)[:, None].expand(S, z.shape[0])  # [S, B]
    zs = torch.stack([z * (1 - 0.1 * s) for s in range(S)])  # [S, B, *D]: a different state at each step
    v = checked(velocity_fn)(zs, t)  # [S, B, *D]
    _check(v.dtype.is_floating_point and bool(torch.isfinite(v).all()), "velocity_fn returned non-finite values")
    low = v.dtype in (torch.bfloat16, torch.float16) or torch.is_autocast_enabled(z.device.type)
    rtol = (2e-2 if low else 1e-4) if rtol is None else rtol
    again = (checked(velocity_fn)(zs, t).float() - v.float()).norm().item() / v.float().norm().item()
    _check(again <= rtol, f"two equal calls of velocity_fn differ by {again:.1e} of |v|: put the model in eval mode "
                          f"(no dropout) for rollouts and training alike, or the first ratio is not 1")
    one = torch.stack([checked(velocity_fn)(zs[s : s + 1], t[s : s + 1])[0] for s in range(S)])  # [S, B, *D]
    error = (v.float() - one.float()).norm().item() / v.float().norm().item()
    _check(error <= rtol, f"velocity_fn on {S} steps at once differs from {S} one-step calls by {error:.1e} of |v| "
                          f"(rtol {rtol:.0e}): it is step-major (entry s * B + i is sample i at step s), so repeat "
                          f"the conditioning as a block, c.repeat(S) or .repeat(S, 1, 1), never repeat_interleave; "
                          f"and make no row depend on the others (batch statistics)")
    return max(error, again)


# === Run it: python jagg.py (tests/test_jagg.py checks the rest against autograd and torch.func) ===


def _self_check():  # what a learner should see, each line checked
    torch.set_default_dtype(torch.float64)  # exactness shows as ~1e-16, not fp32's ~1e-7
    torch.manual_seed(0)
    T, W, B, D, calls = 10, 4, 16, 3, []  # windows of 4, 4 and 2 steps; calls: (model, rows, grad enabled)
    def velocity_fn_of(net, name="policy"):  # velocity_fn(z [S, B, D], t [S, B]) -> [S, B, D], recording its calls
        def velocity_fn(z, t):
            calls.append((name, z.shape[0], torch.is_grad_enabled()))
            return net(torch.cat([z, t[..., None]], dim=-1))
        return velocity_fn
    def grad(net, backward, *args):  # the flat gradient [P] that backward(velocity_fn, *args) accumulates
        net.zero_grad(set_to_none=True)
        out = backward(velocity_fn_of(net), *args)
        return torch.cat([p.grad.flatten() for p in net.parameters()]), out
    cosine = lambda a, b: torch.nn.functional.cosine_similarity(a, b, dim=0).item()  # noqa: E731

    # A. v affine in (z, t), nonlinear in theta, a straight window, a made-up loss: JAGG is exact (section 6).
    linear = torch.nn.Sequential(torch.nn.Linear(D + 1, D + 1), torch.nn.Linear(D + 1, D))
    t = torch.tensor([0.9, 0.7, 0.5, 0.2])[:, None].expand(W, B)  # [W, B], uneven: weights by index would fail
    alpha = interpolation_weights(t)[..., None]  # [W, B, 1]
    z = (1 - alpha) * torch.randn(B, D) + alpha * torch.randn(B, D)  # [W, B, D]
    w = torch.randn(W, B, D)
    step_loss = lambda k, v_k: (w[k] * v_k).sum() + (v_k**2).sum()  # noqa: E731

    def error(net, z):  # |JAGG - exact| / |exact| of net's gradient on the window z
        (exact, _), (approx, _) = (grad(net, f, z, t, step_loss) for f in (backward_exact, backward_jagg_window))
        return ((approx - exact).norm() / exact.norm()).item()
    mlp = torch.nn.Sequential(torch.nn.Linear(D + 1, 8), torch.nn.Tanh(), torch.nn.Linear(8, D))  # v, J not affine
    rel, bent, curved_j = error(linear, z), error(linear, z + 0.5 * alpha * (1 - alpha)), error(mlp, z)
    assert rel < 1e-12 and bent > 1e-3 and curved_j > 1e-3, (rel, bent, curved_j)
    print(f"A. |JAGG - exact| / |exact| on a window of W = {W}: {rel:.1e} with v affine in (z, t) and straight states; "
          f"{bent:.1e} when the states bend; {curved_j:.1e} with a tanh network on the straight states")

    # B. A small tanh network on its own rollouts, GRPO's loss with the KL to a reference a little away
    #    from it, groups of 4: each window's routing score (section 7) beside its gradient cosine.
    net = torch.nn.Sequential(torch.nn.Linear(D + 1, 32), torch.nn.Tanh(), torch.nn.Linear(32, D))
    frozen = copy.deepcopy(net).requires_grad_(False)  # the reference, a little away from the policy:
    frozen[0].bias.data += 0.05  # its KL term then has a gradient
    ref = velocity_fn_of(frozen, "reference")
    check_velocity_fn(velocity_fn_of(net), torch.randn(B, D), sigma_schedule(T))  # shape, batching, dropout
    traj = rollout(velocity_fn_of(net), torch.randn(B, D), sigma_schedule(T), noise_level=0.7)
    reward = -traj.sample.norm(dim=-1)  # [B], a made-up reward: closeness to the origin
    # Recentred in fp64 only so D's check is exact (group_advantages returns fp32; training uses it as is).
    advantages = group_advantages(reward, torch.arange(B) // 4).double().view(-1, 4)  # [B/4, 4]
    advantages = (advantages - advantages.mean(1, keepdim=True)).flatten()  # [B]
    cfg = LossConfig(noise_level=0.7, clip_range=0.2, beta=0.04)
    print(f"B. T = {T}, W = {W}: windows {window_bounds(T, W)} (start, stop); rows with grad: the cost JAGG cuts")
    ranked = []  # (routing score, gradient cosine) per window
    for start, stop in window_bounds(T, W):
        z, t = traj.z[start:stop], traj.t[start:stop]  # [W, B, D], [W, B]
        pair = [grad(net, f, z, t, make_step_loss(traj, advantages, start, stop, cfg, ref(z, t)))[0]
                for f in (backward_exact, backward_jagg_window)]
        score, cos = linearity_score(traj.v[start:stop], traj.t[start:stop]), cosine(*pair)
        assert cos > 0.9 if stop - start > 2 else abs(cos - 1) < 1e-12, (cos, score)
        print(f"   steps {start}-{stop - 1}: routing score {score:.5f}, JAGG's gradient cosine to exact {cos:.5f}; "
              f"rows with grad: exact {stop - start}, JAGG 2 (+ {stop - start - 2} rows without graph)")
        ranked.append((score, cos))
    (score_0, cos_0), (score_1, cos_1) = ranked[:2]
    assert (score_0 < score_1) == (cos_0 < cos_1)  # the two 4-step windows: the same order by score and cosine
    print("   the score orders the 4-step windows as their cosines do (one example); a 2-step one scores 1 by convention")

    grads = {}  # C. The batch's gradient at jagg_frac 0 (exact), 1 and 0.5: what each ran, how close it is
    for frac, rows, jagg_windows in ((0.0, T, [False] * 3), (1.0, 6, [True, True, False]), (0.5, 8, [False, True, False])):
        calls.clear()  # the 2-step window never takes JAGG's share; at 0.5, the higher-scoring 4-step one does
        grads[frac], (stats, routed) = grad(net, paper_gradients, traj, advantages, cfg, W, frac, ref)
        graph = [n for name, n, with_grad in calls if with_grad]  # the forwards with graph: a backward each
        assert sum(graph) == stats["grad_rows"] == rows and routed == jagg_windows, (graph, routed)
        assert cosine(grads[frac], grads[0.0]) > 0.99
        print(f"C. jagg_frac {frac}: windows to JAGG {routed}"
              + (" (half of the two 4-step windows: the higher-scoring, steps 4-7)" if frac == 0.5 else ""))
        interior = sum(n for name, n, with_grad in calls if name == 'policy' and not with_grad)
        print(f"   {len(graph)} backward passes over {sum(graph)} rows with grad; without graph, {interior} interior rows "
              f"and {sum(n for name, n, _ in calls if name == 'reference')} KL reference rows; {3 * sum(graph) + interior} "
              f"forward-units of the policy (a row with grad 3, without 1): {3 * T / (3 * sum(graph) + interior):.2f}x"
              + (" (the 2-step window saves nothing)" if frac else ""))
        print(f"   gradient cosine to exact {cosine(grads[frac], grads[0.0]):.5f}" + (" (exact itself)" if frac == 0 else ""))

    # D. Training as Flow-GRPO: its first 9 of T = 10 steps, on minibatches (here 2 groups each) of the rollout.
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)  # a large step: clipping shows by step 3
    print(f"D. training on the first 9 of {T} steps: windows {window_bounds(9, W)}, JAGG on the first two")
    lessons = ["on-policy: every ratio is 1 and the loss is beta x kl", "samples 8-15: the weights moved at step 1, "
               "off-policy", "samples 0-7 again: further off, some ratios clipped"]
    for step in range(1, 4):
        idx = torch.arange(B).split(B // 2)[(step - 1) % 2]  # [B / 2]: samples 0-7, 8-15, 0-7
        stats, routed = paper_train_step(velocity_fn_of(net), optimizer, traj.subset(idx).first_steps(9),
                                         advantages[idx], cfg, W, 1.0, ref)
        print(f"   step {step}: loss {stats['loss']:+.2e}, clipfrac {stats['clipfrac']:.3f}, "
              f"approx_kl {stats['approx_kl']:.2e}, kl {stats['kl']:.2e}: {lessons[step - 1]}")
        assert routed == [True, True, False]  # the 1-step window is exact
        if step == 1:  # on-policy: the surrogate is 0, the loss beta x kl alone
            assert abs(stats["loss"] - cfg.beta * stats["kl"]) < 1e-15 and 0 == stats["approx_kl"] < stats["kl"]
        else:
            assert stats["approx_kl"] > 0
    assert stats["clipfrac"] > 0
    print("   At step 1 every ratio is 1: the surrogate -mean(A ratio) is 0 (a group's advantages sum to 0), its gradient")
    print("   is not. Rollouts call one step at a time, JAGG several: ratio 1 needs both to give the same v (section 9).")
    print("ok")


if __name__ == "__main__":
    _self_check()
