"""JAGG: GRPO for flow-matching diffusion transformers with one backward per window of W steps.

A single-file, model-agnostic reference implementation of JAGG (Jacobian-Aggregated Group
Gradient), from "JAGG: Jacobian-Aggregated Group Gradient for Efficient GRPO Training of
Diffusion Models" (arXiv 2607.17572, 2026), on top of Flow-GRPO's SDE sampler and loss
(Liu et al., "Flow-GRPO: Training Flow Matching Models via Online RL", arXiv 2505.05470).

Exact GRPO on a diffusion model back-propagates through the transformer at every sampling step,
because every step's loss depends on that step's velocity. JAGG splits the T steps into windows
of W steps, assumes the parameter-Jacobian of the velocity moves linearly in t across a window,
and so collapses the W per-step backward passes into ONE backward over the window's two
endpoints, run as a double batch [z_a; z_b]: per window, W backward passes over one step's B
samples each become ONE backward pass over 2B (two steps' rows).

Part I (sections 1-8) is the paper and all a reader needs: Flow-GRPO's SDE step, rollout,
advantages and loss, the exact backward, the paper's JAGG on one window in one short function
(backward_jagg_window, section 6), routing and the training step; `python jagg.py` runs it.
Part II (9-12) is ours, options that default to the paper, each with its equation and when it
is exact: shared anchors, rollout interiors and their drift guard, index weights, a bound on the
rows in a graph, the probe. Part III (13) is train_step for real runs: many ranks, NaN steps.
We follow the paper's abstract; where it is silent, our choices are marked OURS.

Notation (code name -> symbol)
    T          number of sampling steps of a rollout
    W          window length (steps); a window runs from step a to step b = a + W - 1
    B          batch size (number of samples, all prompts and groups together)
    z[k]       z_k, the latent state before step k;  z_next[k] = z_{k+1}
    t[k]       t_k, the flow time of step k; we use t = sigma (noise level, 1 = pure noise)
    v_k        v_theta(z_k, t_k), the velocity the network predicts at step k (v = noise - data)
    g_k        dL_k / dv_k, the upstream gradient of step k's loss (cheap, no network)
    J_k        d v_k / d theta, the Jacobian of the network at step k (expensive)
    alpha_k    (t_a - t_k) / (t_a - t_b): 0 at the window's start a, 1 at its end b
    G_a, G_b   sum_k (1 - alpha_k) g_k  and  sum_k alpha_k g_k: the composite upstream signals
    J_a, J_b   the Jacobians at the window's endpoints, the only two JAGG back-propagates
  Part II:
    anchors    a_0 = 0 < a_1 < ... < a_m = S - 1, the steps whose Jacobians are back-propagated
               (the paper: the window's a and b)
    H[k, j]    the hat weight of anchor j at step k (the paper: 1 - alpha_k and alpha_k)
    G[j]       G_j = sum_k H[k, j] g_k (the paper: G_a and G_b)
    v_old      v_k(theta_old), the rollout's velocities (Trajectory.v)

Letters in shape comments: T steps, W window steps, S any number of steps, B samples,
M anchors, *D the shape of one sample (channels, height, width for images; 2 for the toy), P parameters.
A "row" is one step's B samples through the network: exact runs T rows with grad, JAGG 2 a window.

The whole contract with a model is one function:
    velocity_fn(z, t) -> v    z: [S, B, *D], t: [S, B], v: [S, B, *D]
with t = sigma in [0, 1] (1 = pure noise) and v = d z / d sigma = noise - data, the rectified-flow
convention of SD3 and Flow-GRPO. The caller's function owns any conditioning (prompts,
classifier-free guidance); examples/your_model.py shows one with minibatches, CFG and a reference.

Run it:
    python jagg.py               # Part I checks itself on tiny models in seconds
    python train_toy.py          # the CPU demo: exact GRPO vs JAGG on a toy 2-D DiT
    python -m pytest -q          # the checks: JAGG vs exact vs explicit Jacobians
"""

import contextlib
import copy
import math
import time
import warnings
from dataclasses import dataclass

import torch


def _check(ok, message):
    """Raise a ValueError that tells the user what is wrong and how to fix it."""
    if not ok:
        raise ValueError(message)


# #####################################################################################
#  PART I: THE PAPER
# #####################################################################################

# === 1. SDE step: the Gaussian policy of one sampling step (Flow-GRPO) ===
# The deterministic flow ODE has no log-probability, so Flow-GRPO samples with an SDE whose
# marginals match the ODE's. Each step is then a Gaussian policy z_{k+1} ~ N(mu_k, std_k^2)
# and GRPO can use the ratio of its densities.


def sigma_schedule(num_steps, shift=3.0):
    """Noise levels sigma_0 = 1 > sigma_1 > ... > sigma_T = 0, shifted like SD3's scheduler.

    shift > 1 spends more steps at high noise: sigma' = shift * s / (1 + (shift - 1) * s).
    Returns a float32 tensor of shape [T + 1].
    """
    _check(num_steps >= 1, f"num_steps must be >= 1, got {num_steps}")
    _check(shift > 0, f"shift must be > 0, got {shift}")
    s = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)  # [T+1]
    return (shift * s / (1 + (shift - 1) * s)).float()  # [T+1]


def sde_step(v, z, sigma, sigma_next, noise_level, prev_sample=None, generator=None):
    """One SDE step from z at sigma to sigma_next, and the log-probability of the result.

    v, z: [B, *D]; sigma, sigma_next: [B]. If prev_sample (z_{k+1}, [B, *D]) is given it is
    scored instead of sampled. Returns (prev_sample, log_prob [B], mean [B, *D], std [B, 1..]):
    the next state, its Gaussian log-density averaged over the non-batch dimensions (Flow-GRPO's
    convention), and the mean and standard deviation of the Gaussian it was drawn from. All four
    are fp32 (fp64 if given fp64), whatever v's dtype: the state is stored exactly as it was
    scored, so a bf16 network on fp32 latents still gives a first ratio of exactly 1.
    """
    # Why fp32: log-probabilities of near-identical policies are subtracted and exponentiated
    # in the GRPO ratio; bf16 rounding alone would move the ratio by more than the clip range.
    dtype = torch.promote_types(torch.promote_types(v.dtype, z.dtype), torch.float32)  # fp32, or fp64 if given fp64
    v, z = v.to(dtype), z.to(dtype)
    shape = (-1,) + (1,) * (z.ndim - 1)
    sigma = sigma.to(dtype).reshape(shape)  # [B, 1, ...]
    sigma_next = sigma_next.to(dtype).reshape(shape)  # [B, 1, ...]
    # dt < 0: sigma decreases from noise to data.
    dt = sigma_next - sigma  # [B, 1, ...]
    # std_t = noise_level * sqrt(sigma / (1 - sigma)). At sigma = 1 (the first step) this is
    # infinite; like Flow-GRPO we use the next sigma in the denominator there instead.
    denom = 1 - torch.where(sigma >= 1, sigma_next, sigma)  # [B, 1, ...]
    std_t = noise_level * torch.sqrt(sigma / denom)  # [B, 1, ...]
    # mu = z (1 + std_t^2 / (2 sigma) dt) + v (1 + std_t^2 (1 - sigma) / (2 sigma)) dt
    mean = z * (1 + std_t**2 / (2 * sigma) * dt) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
    # The Gaussian's standard deviation: std_t * sqrt(-dt).
    std = std_t * torch.sqrt(-dt)  # [B, 1, ...]
    if prev_sample is None:
        eps = torch.randn(z.shape, generator=generator, device=z.device, dtype=z.dtype)
        prev_sample = mean + std * eps  # [B, *D]
    prev_sample = prev_sample.to(dtype)
    # log N(x; mu, std^2) = -(x - mu)^2 / (2 std^2) - log std - log sqrt(2 pi), per element.
    log_prob = (
        -((prev_sample.detach() - mean) ** 2) / (2 * std**2)
        - torch.log(std)
        - 0.5 * math.log(2 * math.pi)
    )  # [B, *D]
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
    noise_level: float = None  # the SDE's noise level that drew it (the training step checks the loss uses the same)

    TENSORS = ("z", "z_next", "t", "t_next", "log_prob", "v")

    @property
    def sample(self):
        """The final clean samples z_T: [B, *D]."""
        return self.z_next[-1]

    def first_steps(self, n):
        """The trajectories' first n steps (Flow-GRPO trains int(T * timestep_fraction) = 9 of
        T = 10: the last step, to sigma 0 from SD3's smallest sigma, barely changes the image).
        Every tensor is sliced on dim 0 (T), so the result's .sample is z_n: reward the full one."""
        _check(1 <= n <= self.z.shape[0], f"a trajectory of {self.z.shape[0]} steps has no first {n} steps to train")
        return Trajectory(**{name: getattr(self, name)[:n] for name in self.TENSORS}, noise_level=self.noise_level)

    def subset(self, idx):
        """The trajectories of the samples idx (a minibatch): every tensor is indexed on dim 1 (B)."""
        return Trajectory(**{name: getattr(self, name)[:, idx] for name in self.TENSORS}, noise_level=self.noise_level)

    @staticmethod
    def cat(trajs):
        """One batch from several (rollout chunks, or ranks): every tensor concatenated on dim 1 (B)."""
        levels = {traj.noise_level for traj in trajs}
        _check(len(levels) == 1, f"trajectories drawn at different noise levels cannot form one batch: {levels}")
        return Trajectory(**{name: torch.cat([getattr(traj, name) for traj in trajs], dim=1) for name in Trajectory.TENSORS},
                          noise_level=levels.pop())


@torch.no_grad()
def rollout(velocity_fn, noise, sigmas, noise_level, generator=None):
    """Sample B trajectories of T = len(sigmas) - 1 SDE steps from the noise z_0: [B, *D].

    The velocities are stored because JAGG's routing score (section 7) reads them for free (and
    an option beyond the paper uses them in place of the interior steps' forward passes).
    """
    B = noise.shape[0]
    T = len(sigmas) - 1
    z = noise
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
    return Trajectory(
        z=torch.stack(zs),  # [T, B, *D]
        z_next=torch.stack(z_nexts),  # [T, B, *D]
        t=t.contiguous(),
        t_next=t_next.contiguous(),
        log_prob=torch.stack(log_probs),  # [T, B]
        v=torch.stack(vs),  # [T, B, *D]
        noise_level=noise_level,
    )


# === 3. Group-relative advantages (GRPO) ===


def group_advantages(rewards, group_ids, eps=1e-4, global_std=False, clip=5.0):
    """A_i = (r_i - mean_group(i)) / (std + eps), clipped to [-clip, clip].

    rewards, group_ids: [B]; samples with the same group id were drawn for the same prompt.
    std is the group's own (per-prompt statistics, as in GRPO) or, with global_std, the std of
    all rewards (Flow-GRPO's option, steadier when a group's rewards are nearly equal).
    """
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
    clip_range: float  # PPO/GRPO ratio clip epsilon
    beta: float = 0.0  # weight of the KL to the reference model; 0 = no reference needed


def grpo_step_loss(log_prob, log_prob_old, advantages, clip_range, mean=None, mean_ref=None, std_t=None, beta=0.0):
    """Clipped GRPO surrogate of one step, plus beta * KL to the reference policy.

    All per-sample inputs are [B] (mean, mean_ref: [B, *D]; std_t: [B, 1..]).
    ratio = exp(logp - logp_old);  L = mean_B max(-A ratio, -A clip(ratio, 1 -/+ eps))
    KL term = mean_B mean_D ||mu - mu_ref||^2 / (2 std_t^2)   (Flow-GRPO's train_sd3.py)
    with std_t the SDE's noise scale of section 1, not the transition's std_t sqrt(|dt|): the KL
    of the two Gaussian transitions times |dt|, so beta means what it means in Flow-GRPO's configs.
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
    with torch.no_grad():
        stats = {
            "clipfrac": (torch.abs(ratio - 1.0) > clip_range).float().mean().item(),
            # approx_kl = E[(logp - logp_old)^2] / 2, the k2 estimator (Schulman, "Approximating
            # KL divergence", 2020), as Flow-GRPO logs it (CleanRL's ppo.py logs k1 and k3).
            "approx_kl": 0.5 * ((log_prob - log_prob_old) ** 2).mean().item(),
            "kl": kl.item(),
        }
    return loss, stats


def make_step_loss(traj, advantages, a, b, cfg, v_ref=None, log=None):
    """step_loss(k, v_k) for the steps a..b-1 of traj (b exclusive, as window_bounds gives it;
    k = 0 is step a), each step weighted 1/T so that a whole
    trajectory's loss is the mean over its steps. v_ref: [b - a, B, *D] reference velocities
    (needed when cfg.beta > 0). Each call appends its stats dict to the list log."""
    T = traj.z.shape[0]

    def step_loss(k, v_k):
        _check(0 <= k < b - a, f"step {k} is outside the window's {b - a} steps")
        i = a + k
        _, log_prob, mean, std = sde_step(v_k, traj.z[i], traj.t[i], traj.t_next[i], cfg.noise_level,
                                          prev_sample=traj.z_next[i])
        mean_ref = std_t = None
        if cfg.beta > 0:
            _, _, mean_ref, _ = sde_step(v_ref[k], traj.z[i], traj.t[i], traj.t_next[i], cfg.noise_level,
                                         prev_sample=traj.z_next[i])
            std_t = std / (traj.t[i] - traj.t_next[i]).sqrt().reshape(std.shape)  # the transition's std / sqrt(|dt|)
        loss, stats = grpo_step_loss(log_prob, traj.log_prob[i], advantages, cfg.clip_range,
                                     mean=mean, mean_ref=mean_ref, std_t=std_t, beta=cfg.beta)
        if log is not None:
            log.append(stats)
        return loss / T

    return step_loss


# === 5. Exact per-step backward: the baseline (what Flow-GRPO does) ===
# The backward functions (here, section 6, and Part II's general one) take S consecutive steps
# (the paper: a window of W): z [S, B, *D],
# t [S, B], and step_loss(k, v_k) -> scalar, the loss of the k-th of those steps given its
# velocity [B, *D]. They accumulate parameter gradients like loss.backward() and return the
# summed loss. timings, if given, is a dict that receives seconds under "fwd_graph",
# "fwd_nograd" and "backward" (and the training step's "fwd_ref" for the KL reference),
# synchronised on CUDA so that the numbers mean something ("fwd_graph" also counts the per-step
# losses and their g_k, which run with the graph alive).


@contextlib.contextmanager
def _timed(timings, key, device):
    if timings is None:
        yield
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    timings[key] = timings.get(key, 0.0) + time.perf_counter() - start


def check_batch(traj, advantages, cfg):
    """A batch's trajectories, advantages and loss agree (before any work)."""
    _check(traj.noise_level is None or traj.noise_level == cfg.noise_level,
           f"the trajectories were drawn at noise_level {traj.noise_level} but the loss scores them at "
           f"{cfg.noise_level}: pass the same noise level to rollout and LossConfig")
    _check(advantages.shape == traj.log_prob.shape[1:],
           f"advantages must be [B] = {tuple(traj.log_prob.shape[1:])}, got {tuple(advantages.shape)}")


def _check_window(z, t):
    _check(z.ndim >= 2 and t.ndim == 2 and tuple(t.shape) == tuple(z.shape[:2]),
           f"a window needs z: [W, B, *D] and t: [W, B] with matching W and B, got z {tuple(z.shape)}, t {tuple(t.shape)}")


def backward_exact(velocity_fn, z, t, step_loss, timings=None):
    """Exact gradient of S steps: one forward with graph and one backward per step (S of each)."""
    _check_window(z, t)
    total = 0.0
    for k in range(z.shape[0]):
        with _timed(timings, "fwd_graph", z.device):
            v_k = velocity_fn(z[k : k + 1], t[k : k + 1])[0]  # [B, *D]
            loss = step_loss(k, v_k)
        with _timed(timings, "backward", z.device):
            loss.backward()
        total += loss.item()
    return total


# === 6. JAGG: interpolate the Jacobians, back-propagate once ===
# The gradient of a window a..b is a sum of vector-Jacobian products:
#     grad = sum_k g_k^T J_k,      g_k = dL_k/dv_k,   J_k = dv_theta(z_k, t_k)/dtheta.
# g_k is cheap (the loss is a few elementwise ops on v_k); each J_k costs a full backward.
# Training-free DiT accelerators (Delta-DiT, ScalingCache) exploit that a DiT's features and
# velocities change smoothly, nearly linearly, along a trajectory. JAGG bets the Jacobians do
# too, and interpolates them between the window's endpoints, weighted by t:
#     J_k ~= (1 - alpha_k) J_a + alpha_k J_b,        alpha_k = (t_a - t_k) / (t_a - t_b).
# The sum then collapses by linearity into two vector-Jacobian products,
#     grad ~= G_a^T J_a + G_b^T J_b,   G_a = sum_k (1 - alpha_k) g_k,  G_b = sum_k alpha_k g_k,
# which one backward of  sum(v_a * G_a) + sum(v_b * G_b)  through ONE forward on the double
# batch [z_a; z_b] computes. Per window: W backward passes of one row each -> ONE of 2 rows.
#
# When it is exact: if J(z, t) is affine in (z, t) along the window (e.g. v_theta linear in
# (z, t), whatever its dependence on theta) and the states lie on the straight segment
# z_k = (1 - alpha_k) z_a + alpha_k z_b, then J_k = (1 - alpha_k) J_a + alpha_k J_b exactly and
# so is JAGG's gradient. With W = 2 there is no interior step, so it is always exact.


def interpolation_weights(t):
    """alpha_k = (t_a - t_k) / (t_a - t_b) for a window's times t: [W, B] (the paper's abstract:
    weighted by t). Returns [W, B]: 0 at a, 1 at b."""
    span = t[0] - t[-1]  # [B]
    _check(bool((span != 0).all()), "a window's endpoints must have different times (t_a != t_b)")
    return (t[0] - t) / span  # [W, B]


def backward_jagg_window(velocity_fn, z, t, step_loss, timings=None):
    """The paper's JAGG gradient of one window of W steps a = 0 .. b = W - 1: ONE forward with
    graph on the double batch [z_a; z_b] and ONE backward of G_a^T J_a + G_b^T J_b."""
    _check_window(z, t)
    W = z.shape[0]
    _check(W >= 2, f"JAGG needs a window of at least 2 steps, got W = {W}")
    acc_dtype = torch.promote_types(z.dtype, torch.float32)  # G_a, G_b in fp32 at least, whatever the network's precision
    alpha = interpolation_weights(t.to(acc_dtype))  # [W, B]: 0 at a, 1 at b
    alpha = alpha.reshape(alpha.shape + (1,) * (z.ndim - 2))  # [W, B, 1..]

    # The interior velocities are needed only for g_k = dL_k/dv_k, never back-propagated through
    # the network, so they need no graph: all W - 2 of them in one forward that stores no activations.
    with _timed(timings, "fwd_nograd", z.device), torch.no_grad():
        v_mid = velocity_fn(z[1:-1], t[1:-1]) if W > 2 else z[:0]  # [W-2, B, *D]; W = 2: none, an empty [0, B, *D]

    with _timed(timings, "fwd_graph", z.device):
        # The endpoints: one forward with graph on the double batch [z_a; z_b].
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
    with _timed(timings, "backward", z.device):
        (v_ab[0] * G_a.to(v_ab.dtype) + v_ab[1] * G_b.to(v_ab.dtype)).sum().backward()
    return total


# === 7. Routing: which windows are linear enough for JAGG ===
# OURS (the abstract names the knob jagg_frac but not the score): score a window by the cosine
# similarity between its interior velocities and their endpoint interpolation. The velocities
# come from the rollout, so the score costs no network call. If v itself moves linearly in t,
# the features (and, JAGG bets, the Jacobians) likely do too. The score is a guess; the probe
# beyond the paper (section 12) measures, and route="probe" routes by what it measured.

ROUTES = ("velocity", "probe")  # OURS both: velocity linearity (free), or the probe's cosines


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
    cos = torch.nn.functional.cosine_similarity(
        v[1:-1].flatten(2), v_lin[1:-1].flatten(2), dim=-1)  # [W-2, B]
    return cos.mean().item()


def window_bounds(num_steps, window):
    """Split T steps into windows of W steps: [(a, b_exclusive), ...]; the last may be shorter."""
    _check(window >= 2, f"window must be >= 2 steps (JAGG interpolates between two endpoints), got {window}")
    _check(window <= num_steps,
           f"window ({window}) is longer than the trajectory ({num_steps} steps): use a window <= {num_steps}")
    return [(a, min(a + window, num_steps)) for a in range(0, num_steps, window)]


def route_windows(scores, lengths, jagg_frac, floor=None):
    """Send the jagg_frac fraction of segments with the highest scores to JAGG, but none whose
    score is below floor (None: no floor).

    scores, lengths: one per segment. A segment of 1 step has no two endpoints and is always
    exact (its exact gradient costs one backward anyway). Returns a list of bools.
    """
    _check(0.0 <= jagg_frac <= 1.0, f"jagg_frac must be in [0, 1], got {jagg_frac}")
    eligible = [i for i, n in enumerate(lengths) if n >= 2]
    n_jagg = round(jagg_frac * len(eligible))
    # sorted() is stable: among equal scores the earlier segment wins, so routing is reproducible.
    chosen = {i for i in sorted(eligible, key=lambda i: -scores[i])[:n_jagg] if floor is None or scores[i] >= floor}
    return [i in chosen for i in range(len(scores))]


# === 8. One training step over a batch of trajectories ===
# A batch's gradient, window by window: the windows routing gives to JAGG run
# backward_jagg_window (section 6), the others backward_exact (section 5). With the KL term, the
# frozen reference model's velocities are needed at every step too; they need no graph. One
# optimizer step is then what it is in any PyTorch loop (the self-check at the end runs it):
#     optimizer.zero_grad(); paper_gradients(...); clip_grad_norm_(params, 1.0); optimizer.step()
# on each minibatch of the rollout (traj.subset(idx), the same idx for the conditioning), the
# first step on-policy (ratio 1), the next ones off-policy, their ratio clipped. Part III's
# train_step does the same with every option, many ranks and non-finite steps.


@dataclass
class JaggOptions:
    """How a batch's gradient is computed. The paper's knobs come first; every other field is an
    option beyond the paper (Part II) whose default is the paper's behaviour."""

    window: int = 4  # W, sampling steps per window
    jagg_frac: float = 1.0  # the share of windows of >= 2 steps (the most linear, rounded) JAGG takes; the rest exact
    # --- beyond the paper (Part II, OURS)
    anchors: str = "window"  # "window": the paper's disjoint windows; "shared": windows share end steps (section 9)
    interior: str = "forward"  # "forward": the paper's no-graph forwards; "rollout": the rollout's velocities (10)
    weights: str = "time"  # "time": the paper's alpha_k by t; "index": alpha_k = k / (W - 1) (section 11)
    max_graph_rows: int = None  # at most this many anchor rows in a graph at once, same gradient (11); None: no bound
    max_drift: float = 0.5  # rollout interiors only while the anchors' ratios stay within this share of the clip (10)
    route: str = "velocity"  # "velocity": by linearity_score; "probe": by the probe's cosines (gradient_cosines, 12)
    min_cosine: float = None  # route="probe" never lets JAGG take a window whose cosine is below this

    def is_paper(self):
        """True when nothing beyond the paper is asked for: Part I's functions compute it all."""
        return (self.anchors == "window" and self.interior == "forward" and self.weights == "time"
                and self.route == "velocity" and (self.max_graph_rows is None or self.max_graph_rows >= 2))


def paper_gradients(velocity_fn, traj, advantages, cfg, opts, ref_velocity_fn=None, timings=None):
    """Accumulate the gradient of the batch's GRPO loss (the mean over its T steps and B samples)
    into the parameters' .grad, window by window, routed between exact and the paper's JAGG.
    traj: T steps of B samples; advantages: [B]; cfg: LossConfig; opts: JaggOptions (the paper's
    fields). Returns (stats, routed): routed[i] is True when window i went to JAGG."""
    _check(opts.is_paper(), f"paper_gradients computes the paper's JAGG only (anchors 'window', interior 'forward', "
                            f"weights 'time', route 'velocity'); {opts} asks for more: window_gradients and "
                            f"train_step take every option")
    check_batch(traj, advantages, cfg)
    _check(cfg.beta == 0 or ref_velocity_fn is not None, "beta > 0 needs a ref_velocity_fn (the frozen reference model)")
    T = traj.z.shape[0]
    bounds = window_bounds(T, opts.window)  # [(a, b_exclusive), ...]
    # Route: the jagg_frac most linear windows, judged on the rollout's own velocities (free).
    scores = [linearity_score(traj.v[a:b], traj.t[a:b]) for a, b in bounds]
    routed = route_windows(scores, [b - a for a, b in bounds], opts.jagg_frac)

    log, loss = [], 0.0  # log: every step's stats from grpo_step_loss
    for (a, b), use_jagg in zip(bounds, routed):
        z, t = traj.z[a:b], traj.t[a:b]  # [W, B, *D], [W, B]
        v_ref = None
        if cfg.beta > 0:
            with _timed(timings, "fwd_ref", traj.z.device), torch.no_grad():
                v_ref = ref_velocity_fn(z, t)  # [W, B, *D]
        step_loss = make_step_loss(traj, advantages, a, b, cfg, v_ref, log)
        backward = backward_jagg_window if use_jagg else backward_exact
        loss += backward(velocity_fn, z, t, step_loss, timings)

    # grad_rows: network rows run with grad, the cost JAGG cuts (exact: T; JAGG: 2 per window).
    grad_rows = sum(2 if use_jagg else b - a for (a, b), use_jagg in zip(bounds, routed))
    stats = {key: sum(s[key] for s in log) / len(log) for key in log[0]}  # means over steps
    stats.update(loss=loss, routed_frac=sum(routed) / len(routed), grad_rows=grad_rows, window_scores=scores)
    return stats, routed


# #####################################################################################
#  PART II: BEYOND THE PAPER (OURS; every option defaults to the paper's behaviour)
# #####################################################################################

# === 9. Anchors: windows that share their endpoints ===
# The paper's two endpoints generalise to sorted anchor steps a_0 = 0 < ... < a_m = S - 1. A step
# between consecutive anchors a_j, a_{j+1} interpolates between those two ("hat" weights H in
# t; an anchor keeps weight 1 on itself):
#     J_k ~= sum_j H[k, j] J_{a_j},    grad ~= sum_j G_j^T J_{a_j},    G_j = sum_k H[k, j] g_k,
# still ONE forward with graph (on the anchor rows) and ONE backward. The paper's window is
# anchors (0, S - 1): H[k, 0] = 1 - alpha_k, H[k, 1] = alpha_k. Every step an anchor is exact
# training. Exact under the paper's conditions, segment by segment between anchors.
# anchors="shared": adjacent windows share their end step, so anchors fall every W - 1 steps
# (T = 10, W = 4: anchors 0, 3, 6, 9; 4 rows with grad instead of the paper's 6).

ANCHOR_MODES = ("window", "shared")  # the paper's disjoint windows; OURS: windows sharing end steps
WEIGHTS = ("time", "index")  # the paper's alpha_k by t; the authors' early code's by step index (section 11)


def segment_weights(t, weights="time"):
    """alpha_k over one segment's times t: [S, B] -> [S, B], 0 at its first step, 1 at its last:
    by time (the paper's interpolation_weights) or by index, alpha_k = k / (S - 1)."""
    _check(weights in WEIGHTS, f"weights must be one of {WEIGHTS}, got {weights!r}")
    if weights == "time":
        return interpolation_weights(t)
    k = torch.arange(t.shape[0], dtype=t.dtype, device=t.device)  # [S]
    return (k / (t.shape[0] - 1))[:, None].expand(t.shape)  # [S, B]


def hat_weights(t, anchors, weights="time"):
    """H[k, j], the weight of anchor j in step k's interpolated Jacobian, for times t: [S, B] and
    anchor steps 0 = a_0 < ... < a_m = S - 1. Returns [S, M, B], M = len(anchors); rows sum to 1.
    The paper's anchors (0, S - 1) give H[:, 0] = 1 - alpha and H[:, 1] = alpha. weights:
    "time" or "index" (segment_weights), between each pair of consecutive anchors."""
    H = t.new_zeros(t.shape[0], len(anchors), t.shape[1])  # [S, M, B]
    for j, (a, b) in enumerate(zip(anchors, anchors[1:])):
        alpha = segment_weights(t[a : b + 1], weights)  # [b - a + 1, B]: 0 at a_j, 1 at a_{j+1}
        H[a : b + 1, j] = 1 - alpha
        H[a : b + 1, j + 1] = alpha
    return H


def _anchor_steps(anchors, S):
    steps = list(anchors)
    _check(len(steps) >= 2 and steps[0] == 0 and steps[-1] == S - 1
           and all(int(a) == a for a in steps) and all(a < b for a, b in zip(steps, steps[1:])),
           f"anchors must be increasing step indices from 0 to S - 1 = {S - 1}, got {steps}")
    return [int(a) for a in steps]


def segment_bounds(num_steps, window, anchors="window"):
    """The segments routing chooses between, [(a, b_exclusive), ...]. "window": the paper's
    disjoint windows (window_bounds). "shared": anchors every W - 1 steps and at T - 1, each
    segment running from one anchor to the next inclusive: W steps (the last may be shorter),
    and consecutive segments share their end step (T = 10, W = 4: anchors 0, 3, 6, 9)."""
    _check(anchors in ANCHOR_MODES, f"anchors must be one of {ANCHOR_MODES}, got {anchors!r}")
    bounds = window_bounds(num_steps, window)
    if anchors == "window":
        return bounds
    ends = list(range(0, num_steps - 1, window - 1)) + [num_steps - 1]  # the anchor steps
    return [(a, b + 1) for a, b in zip(ends, ends[1:])]


def backward_calls(bounds, routed, anchors="window"):
    """The batch's backward calls [(kind, a, b_exclusive, anchor steps)], kind "jagg" or "exact",
    in step order. The paper's windows: one call each. Shared anchors: routed segments that touch
    (one ends on the step where the next starts) merge into one JAGG call with all their anchors;
    an exact call takes each segment's steps that no JAGG call or earlier segment has taken."""
    if anchors == "window":
        return [("jagg" if r else "exact", a, b, [a, b - 1]) for (a, b), r in zip(bounds, routed)]
    runs = []  # [a, b, anchor steps] of each JAGG call
    for (a, b), use_jagg in zip(bounds, routed):
        if not use_jagg:
            continue
        if runs and runs[-1][1] == a + 1:  # starts on the previous call's last anchor: extend that call
            runs[-1] = (runs[-1][0], b, runs[-1][2] + [b - 1])
        else:
            runs.append((a, b, [a, b - 1]))
    done = {k for a, b, _ in runs for k in range(a, b)}
    calls = [("jagg", a, b, steps) for a, b, steps in runs]
    for a, b in bounds:
        steps = [k for k in range(a, b) if k not in done]
        done.update(steps)
        if steps:
            calls.append(("exact", steps[0], steps[-1] + 1, None))
    return sorted(calls, key=lambda call: call[1])


# === 10. Rollout interiors: no interior step calls the network ===
# The rollout stored v_k(theta_old). To first order, with JAGG's own interpolated Jacobian,
#     v_k(theta) ~= v_k(theta_old) + sum_j H[k, j] (v_{a_j}(theta) - v_{a_j}(theta_old)),
# so the interior steps call no network at all: the anchors' current velocities come from the
# one forward with graph, and the KL reference takes the same rule with its own anchor
# velocities. Exact while theta = theta_old (the first optimizer step after a rollout), and
# whenever v_theta changes affinely in (z, t) between anchors on a straight path.

INTERIOR_MODES = ("forward", "rollout")  # the paper's no-graph forwards; OURS: rollout velocities


def interpolate_from_anchors(v_anchor, v_old, H, anchors):
    """Rollout interiors: v_k ~= v_old_k + sum_j H[k, j] (v_anchor_j - v_old_{a_j}), and exactly
    v_anchor at the anchors. v_anchor: [M, B, *D] the anchors' velocities now; v_old: [S, B, *D]
    the rollout's; H: [S, M, B] (hat_weights). Returns [S, B, *D] in H's dtype."""
    H = H.reshape(H.shape + (1,) * (v_old.ndim - 2))  # [S, M, B, 1..]
    v_old = v_old.to(H.dtype)  # [S, B, *D]
    delta = v_anchor.to(H.dtype) - v_old[anchors]  # [M, B, *D]: how far each anchor moved since the rollout
    v = v_old + (H * delta).sum(dim=1)  # [S, B, *D]
    v[anchors] = v_anchor.to(H.dtype)  # known there, not interpolated (no rounding either)
    return v


# Once the policy has moved. From the second optimizer step on a rollout, theta != theta_old and
# the rule above errs by the part of each interior's change that is not affine between its
# anchors. That error moves the interiors' ratios, and GRPO's clip turns a small ratio error into
# a wrong gradient wherever it carries a sample across the clip boundary: measured, rollout
# interiors stay as close to exact as forward interiors until ratios near the boundary, then fall
# far behind (docs/offpolicy.md). The anchors show how far their ratios have moved, for free:
#     drift_j = max_b |ratio_{a_j, b} - 1| / clip_range      (0 on-policy; 1: at the clip boundary)
# A segment with an anchor drifted past max_drift takes its interior velocities from a no-graph
# forward instead, as forward interiors do: their accuracy, at their cost, there only.


def ratio_drift(traj, cfg, k, v_k):
    """drift at step k of traj with velocity v_k [B, *D]: max_b |ratio - 1| / cfg.clip_range."""
    _, log_prob, _, _ = sde_step(v_k, traj.z[k], traj.t[k], traj.t_next[k], cfg.noise_level, prev_sample=traj.z_next[k])
    return ((log_prob - traj.log_prob[k]).exp() - 1).abs().max().item() / cfg.clip_range


def stale_segments(drifts, max_drift, record=None):
    """The segments j (between anchors j and j + 1) whose rollout interiors must not be trusted:
    an anchor's drift above max_drift (None: trust them at any drift). drifts: one per anchor
    (the training step passes one segment's two). record (a dict), if given, adds the segments
    seen and refreshed under "rollout_segments" and "rollout_refreshed" and keeps the largest
    drift under "anchor_drift"."""
    stale = [j for j in range(len(drifts) - 1) if max_drift is not None and max(drifts[j], drifts[j + 1]) > max_drift]
    if record is not None:
        record["rollout_segments"] = record.get("rollout_segments", 0) + len(drifts) - 1
        record["rollout_refreshed"] = record.get("rollout_refreshed", 0) + len(stale)
        record["anchor_drift"] = max(record.get("anchor_drift", 0.0), *drifts)
    return stale


# === 11. The general JAGG backward: anchors, rollout interiors, index weights, bounded rows ===
# Index weights: the authors' early code (SchumiDing/eff_grpo, fastvideo/
# train_grpo_qwenimage_jagg.py) weights steps by index, alpha_k = k / (W - 1) (weights="index"),
# which equals the t-weighting only when t is linear in k (segment_weights, section 9). With
# SD3's shifted schedule it is not: the steps bunch up at high noise, and the two differ inside
# every window.
#
# A bound on the rows in a graph (max_graph_rows). All M anchors in one forward with graph hold
# M rows of activations at once (shared anchors at T = 10, W = 4: 4 rows of B samples, against
# exact's 1). The joint backward is linear in the anchors, sum_j G_j^T J_{a_j}, so it can run
# chunk by chunk, each chunk's graph freed by its own backward once its G_j = sum_k H[k, j] g_k
# are known. G_j needs the g_k of the steps on both sides of a_j:
# - forward interiors: their velocities come from the no-graph forward, so G_j needs only v at
#   a_j itself: chunks of max_graph_rows anchors, one at a time (1 row is exact's footprint);
# - rollout interiors: v_k between a_j and a_{j+1} needs both anchors' current velocities, so a
#   chunk is back-propagated once the next chunk has run its forward: chunks of max_graph_rows // 2,
#   at most two alive at once (a bound of at least 2). Earlier anchors' velocities are kept detached.
# Every step's g_k is computed once and no network row runs twice: without a bound, one chunk.


def min_graph_rows(interior):
    """The smallest max_graph_rows a mode allows: 1, or 2 with rollout interiors (an interior step
    needs both its anchors' current velocities at once)."""
    return 2 if interior == "rollout" else 1


def check_max_graph_rows(max_graph_rows, interior):
    _check(max_graph_rows is None or (isinstance(max_graph_rows, int) and max_graph_rows >= min_graph_rows(interior)),
           f"max_graph_rows must be an integer >= {min_graph_rows(interior)}"
           f"{' with rollout interiors (an interior step needs both its anchors at once)' if interior == 'rollout' else ''}"
           f" or None (no bound), got {max_graph_rows!r}")


def backward_jagg(velocity_fn, z, t, step_loss, timings=None, anchors=None, v_rollout=None, weights="time",
                  max_graph_rows=None, drift_fn=None, max_drift=None):
    """backward_jagg_window generalised: forwards with graph on the anchor steps only and one
    backward of their composite signals G_j (sections 9-11).

    anchors: sorted step indices containing 0 and S - 1; None is (0, S - 1), the paper's window.
    v_rollout: [S, B, *D] the rollout's velocities (rollout interiors, section 10), or None for
    the paper's no-graph forward of the interior steps. weights: "time" or "index" (hat_weights).
    max_graph_rows: at most this many anchor rows in a graph at once (None: all M in one), the
    same gradient up to the order of floating-point sums. drift_fn(k, v_k) -> float, max_drift:
    with v_rollout, a segment with an anchor whose drift (section 10's ratio_drift, as the
    training step passes it) is above max_drift takes forward interiors (stale_segments, whose
    counts timings receives); None: the rollout rule at any drift. Exact under section 9's
    conditions; with v_rollout, also while theta = theta_old.
    """
    _check_window(z, t)
    S = z.shape[0]
    _check(S >= 2, f"JAGG needs a window of at least 2 steps, got W = {S}")
    anchors = _anchor_steps((0, S - 1) if anchors is None else anchors, S)
    _check(v_rollout is None or tuple(v_rollout.shape) == tuple(z.shape),
           f"v_rollout must be [S, B, *D] like z {tuple(z.shape)}, got {None if v_rollout is None else tuple(v_rollout.shape)}")
    rollout = v_rollout is not None
    check_max_graph_rows(max_graph_rows, "rollout" if rollout else "forward")
    acc_dtype = torch.promote_types(z.dtype, torch.float32)  # G_j in fp32 at least, whatever the network's precision
    H = hat_weights(t.to(acc_dtype), anchors, weights)  # [S, M, B]
    H = H.reshape(H.shape + (1,) * (z.ndim - 2))  # [S, M, B, 1..]
    M, index = len(anchors), {a: j for j, a in enumerate(anchors)}
    interior = [k for k in range(S) if k not in index]

    # Forward interiors, as in backward_jagg_window: one batched forward without graph, first.
    v_mid = {}  # k -> v_k [B, *D] of the interiors known without the rollout rule
    if not rollout and interior:
        with _timed(timings, "fwd_nograd", z.device), torch.no_grad():
            v_mid = dict(zip(interior, velocity_fn(z[interior], t[interior])))  # [S-M] x [B, *D]
    v_old = v_rollout.to(acc_dtype) if rollout else None  # [S, B, *D]
    v_anchor, checked = {}, set()  # j -> v_{a_j} [B, *D] detached, once its chunk has run; segments checked
    g, total = {}, 0.0  # k -> g_k [B, *D]

    def check_drift(j):
        """Rollout interiors of segment j (between a_j and a_{j+1}): from a no-graph forward if an
        anchor drifted past max_drift (section 10), once."""
        checked.add(j)
        steps = list(range(anchors[j] + 1, anchors[j + 1]))
        drifts = [drift_fn(anchors[i], v_anchor[i]) if drift_fn is not None else 0.0 for i in (j, j + 1)]
        if steps and stale_segments(drifts, max_drift, timings):
            with _timed(timings, "fwd_nograd", z.device), torch.no_grad():
                v_mid.update(zip(steps, velocity_fn(z[steps], t[steps])))  # [R] x [B, *D]

    def velocity(k):
        """Step k's velocity without graph: an anchor's own, a forward interior's, or the rollout
        interior v_old_k + sum_j H[k, j] (v_{a_j} - v_old_{a_j}) from its two anchors."""
        if k in index:
            return v_anchor[index[k]]
        j = max(i for i, a in enumerate(anchors) if a < k)  # k lies between a_j and a_{j+1}
        if rollout and j not in checked:
            check_drift(j)
        if k in v_mid:
            return v_mid[k].to(v_anchor[j].dtype)
        return (v_old[k] + sum(H[k, i] * (v_anchor[i].to(acc_dtype) - v_old[anchors[i]]) for i in (j, j + 1))).to(
            v_anchor[j].dtype)

    def upstream(k):
        """g_k = dL_k/dv_k from the loss alone, once per step: detach v_k, make it a leaf, differentiate."""
        nonlocal total
        if k not in g:
            v_k = velocity(k).detach().requires_grad_(True)  # [B, *D]
            loss = step_loss(k, v_k)
            (g[k],) = torch.autograd.grad(loss, v_k)  # [B, *D]
            total += loss.item()
        return g[k].to(acc_dtype)

    def forward(chunk):
        """The chunk's anchors: one forward with graph on their stacked rows (the paper: [z_a; z_b])."""
        with _timed(timings, "fwd_graph", z.device):
            steps = [anchors[j] for j in chunk]
            v = velocity_fn(z[steps], t[steps])  # [len(chunk), B, *D]
        v_anchor.update({j: v[i].detach() for i, j in enumerate(chunk)})
        return v

    def backward(chunk, v):
        G = torch.zeros(v.shape, dtype=acc_dtype, device=z.device)  # [len(chunk), B, *D]
        for i, j in enumerate(chunk):
            first = anchors[j - 1] + 1 if j > 0 else 0
            last = anchors[j + 1] - 1 if j + 1 < M else S - 1
            for k in range(first, last + 1):  # the steps where H[k, j] can be nonzero
                G[i] += H[k, j] * upstream(k)  # G_j = sum_k H[k, j] g_k (the paper: G_a, G_b)
        # d/dtheta sum_j sum(v_{a_j} * G_j) = sum_j G_j^T J_{a_j}  (the paper: G_a^T J_a + G_b^T J_b)
        with _timed(timings, "backward", z.device):
            (v * G.to(v.dtype)).sum().backward()  # frees this chunk's graph

    size = M if max_graph_rows is None else max_graph_rows // 2 if rollout else max_graph_rows
    chunks = [list(range(i, min(i + size, M))) for i in range(0, M, size)]
    alive = forward(chunks[0])
    for n, chunk in enumerate(chunks):
        # Rollout interiors: the next chunk's first anchor closes this chunk's last segment.
        following = forward(chunks[n + 1]) if rollout and n + 1 < len(chunks) else None
        backward(chunk, alive)
        alive = following if rollout or n + 1 == len(chunks) else forward(chunks[n + 1])
    return total


# === 12. The training step with every option, and the probe ===
# Part I's paper_gradients, generalised: segments between anchors instead of windows, routing by
# the probe's cosines, the reference model's velocities at the anchors only with rollout
# interiors. Asked for nothing beyond the paper, it is paper_gradients itself.

def check_options(opts, num_segments=None, probe_cosines=None):
    """Every JaggOptions field in range, before any work (a ValueError that names the field)."""
    _check(opts.anchors in ANCHOR_MODES, f"anchors must be one of {ANCHOR_MODES}, got {opts.anchors!r}")
    _check(opts.interior in INTERIOR_MODES, f"interior must be one of {INTERIOR_MODES}, got {opts.interior!r}")
    _check(opts.route in ROUTES, f"route must be one of {ROUTES}, got {opts.route!r}")
    _check(opts.weights in WEIGHTS, f"weights must be one of {WEIGHTS}, got {opts.weights!r}")
    _check(opts.max_drift is None or opts.max_drift >= 0, f"max_drift must be >= 0 or None, got {opts.max_drift!r}")
    check_max_graph_rows(opts.max_graph_rows, opts.interior)
    _check(probe_cosines is None or len(probe_cosines) == num_segments,
           f"probe_cosines needs one value per segment ({num_segments}), got {probe_cosines}")


def reference_velocities(ref_velocity_fn, z, t, anchors=None, v_rollout=None, weights="time"):
    """The frozen reference model's velocities of S steps, for the KL term (no graph): a forward
    at every step, or, with v_rollout (rollout interiors), at the anchors only, the interiors
    interpolated from the reference's difference to the rollout's velocities there."""
    with torch.no_grad():
        if v_rollout is None:
            return ref_velocity_fn(z, t)  # [S, B, *D]
        anchors = _anchor_steps((0, z.shape[0] - 1) if anchors is None else anchors, z.shape[0])
        v_anc = ref_velocity_fn(z[anchors], t[anchors])  # [M, B, *D]
        H = hat_weights(t.to(torch.promote_types(z.dtype, torch.float32)), anchors, weights)  # [S, M, B]
        return interpolate_from_anchors(v_anc, v_rollout, H, anchors).to(v_anc.dtype)  # [S, B, *D]


def window_gradients(velocity_fn, traj, advantages, cfg, opts, ref_velocity_fn=None, timings=None,
                     probe_cosines=None):
    """paper_gradients with JaggOptions' every field: accumulate the batch's gradient, segment by
    segment (segment_bounds), routed between exact and JAGG. Returns (stats, routed).
    route="probe" ranks the segments by probe_cosines (probe_average's) once there are any,
    never routing one below opts.min_cosine; before the first probe, by velocity."""
    T = traj.z.shape[0]
    bounds = segment_bounds(T, opts.window, opts.anchors)
    check_options(opts, len(bounds), probe_cosines)
    if opts.is_paper():
        return paper_gradients(velocity_fn, traj, advantages, cfg, opts, ref_velocity_fn, timings)
    _check(cfg.beta == 0 or ref_velocity_fn is not None, "beta > 0 needs a ref_velocity_fn (the frozen reference model)")
    scores = [linearity_score(traj.v[a:b], traj.t[a:b]) for a, b in bounds]
    by_probe = opts.route == "probe" and probe_cosines is not None
    routed = route_windows(probe_cosines if by_probe else scores, [b - a for a, b in bounds], opts.jagg_frac,
                           floor=opts.min_cosine if by_probe else None)

    calls = backward_calls(bounds, routed, opts.anchors)  # [(kind, a, b_exclusive, anchor steps)]
    v_old = traj.v if opts.interior == "rollout" else None
    log, loss, record = [], 0.0, {} if timings is None else timings
    for kind, a, b, steps in calls:
        z, t = traj.z[a:b], traj.t[a:b]  # [S, B, *D], [S, B]
        options = {}  # a JAGG call's: its anchors, rollout interiors, weights
        if kind == "jagg":
            options = {"anchors": [s - a for s in steps], "v_rollout": None if v_old is None else v_old[a:b],
                       "weights": opts.weights}
        v_ref = None
        if cfg.beta > 0:
            with _timed(timings, "fwd_ref", traj.z.device):
                v_ref = reference_velocities(ref_velocity_fn, z, t, **options)  # [S, B, *D]
        step_loss = make_step_loss(traj, advantages, a, b, cfg, v_ref, log)
        if kind == "exact":
            loss += backward_exact(velocity_fn, z, t, step_loss, timings)
        else:
            drift_fn = lambda k, v_k, a=a: ratio_drift(traj, cfg, a + k, v_k)  # noqa: E731 (section 10)
            loss += backward_jagg(velocity_fn, z, t, step_loss, record, **options, max_graph_rows=opts.max_graph_rows,
                                  drift_fn=drift_fn, max_drift=opts.max_drift)
    grad_rows = sum(b - a if kind == "exact" else len(steps) for kind, a, b, steps in calls)  # network rows with grad
    stats = {key: sum(s[key] for s in log) / len(log) for key in log[0]}
    stats.update(loss=loss, routed_frac=sum(routed) / len(routed), grad_rows=grad_rows, window_scores=scores)
    if opts.interior == "rollout":  # how often the drift guard (section 10) sent a segment to forward interiors
        stats.update(rollout_refreshed=record.get("rollout_refreshed", 0), anchor_drift=record.get("anchor_drift", 0.0))
    return stats, routed


# The fidelity probe: is the approximation good on YOUR model? JAGG's error depends on how linear
# the network's Jacobian is along a trajectory, which differs between models. The probe computes
# both gradients of the same segments and reports their cosine, so a user adapting JAGG sees at
# once whether it holds; route="probe" keeps an exponential average of the cosines per segment
# position (probe_average) and routes by it.


def flat_grad(params):
    """Every parameter's .grad in one float64 vector [P] (a missing .grad counts as zeros)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().double() for p in params])


def gradient_cosines(velocity_fn, params, traj, advantages, cfg, opts, ref_velocity_fn=None):
    """For each segment of traj (segment_bounds; the paper's windows by default), the cosine of its
    gradient by JAGG between its two end steps, as opts trains it (interior, weights, max_drift),
    to its exact gradient; 1.0 for a segment of one step. Leaves the parameters' .grad None."""
    check_options(opts)
    params, cosines = list(params), []
    for a, b in segment_bounds(traj.z.shape[0], opts.window, opts.anchors):
        if b - a < 2:  # one step: always exact
            cosines.append(1.0)
            continue
        z, t = traj.z[a:b], traj.t[a:b]  # [S, B, *D], [S, B]
        options = {"v_rollout": traj.v[a:b] if opts.interior == "rollout" else None, "weights": opts.weights}
        jagg_kwargs = dict(options, drift_fn=lambda k, v_k, a=a: ratio_drift(traj, cfg, a + k, v_k),
                           max_drift=opts.max_drift)
        grads = []
        for backward, kwargs, ref_options in ((backward_exact, {}, {}), (backward_jagg, jagg_kwargs, options)):
            for p in params:
                p.grad = None
            v_ref = reference_velocities(ref_velocity_fn, z, t, **ref_options) if cfg.beta > 0 else None
            backward(velocity_fn, z, t, make_step_loss(traj, advantages, a, b, cfg, v_ref), **kwargs)
            grads.append(flat_grad(params))  # [P]
        cosines.append(torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0).item())
    for p in params:
        p.grad = None
    return cosines


def probe_average(average, cosines, decay):
    """The running average route="probe" ranks by: average <- decay * average + (1 - decay) *
    cosines per segment position; the first probe (average None) starts it."""
    if average is None:
        return list(cosines)
    return [decay * m + (1 - decay) * c for m, c in zip(average, cosines)]


# #####################################################################################
#  PART III: A TRAINING STEP FOR REAL RUNS: many GPUs, and steps that must be skipped
# #####################################################################################

# === 13. train_step: the gradient, averaged over ranks, clipped, and a step if it is finite ===
# Why DDP must not all-reduce by itself: its reducer pairs each forward with graph with the
# next backward, and the bounded path with rollout interiors runs the next chunk's forward
# before this chunk's backward: the ranks would drift apart silently. So every backward runs
# inside no_sync, then per optimizer step ONE all-reduce of the gradients (and one of the
# finite flag), whatever the mode, anchors or bound.
# Why skip: a non-finite loss or gradient (bf16 rollouts of real models do give NaN
# log-probabilities) would poison the weights and the optimizer's moments for good; every rank
# skips the step alike, leaving both untouched, and says so.
# Gradient accumulation (Flow-GRPO's 2 optimizer steps per epoch over several micro-batches):
# accumulate_gradients per micro-batch, then one optimizer_step, which averages over both the
# micro-batches and the ranks; train_step is the two for a single batch.


def _distributed():
    return torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def _average_gradients_over_ranks(params):
    """Every rank's .grad becomes the mean over ranks, in ONE all-reduce per dtype (the gradients
    flattened into one buffer). A parameter without a gradient counts as 0."""
    if not _distributed():
        return
    world = torch.distributed.get_world_size()
    for dtype in {p.dtype for p in params}:
        group = [p for p in params if p.dtype == dtype]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in group])  # [P]
        torch.distributed.all_reduce(flat)
        flat /= world
        for p, g in zip(group, flat.split([p.numel() for p in group])):
            p.grad = g.view_as(p).clone()


def _agree_across_ranks(flag, device):
    """True only if flag is True on every rank (so that all ranks skip alike)."""
    if not _distributed():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return bool(t.item() > 0)


def accumulate_gradients(velocity_fn, traj, advantages, cfg, opts, *, ref_velocity_fn=None,
                         no_sync=contextlib.nullcontext, probe_cosines=None):
    """Add one batch's gradient (window_gradients') to the parameters' .grad, inside no_sync and
    timed: one micro-batch of an optimizer step. Returns (stats, routed)."""
    check_batch(traj, advantages, cfg)
    timings, start = {}, time.perf_counter()
    with no_sync():
        stats, routed = window_gradients(velocity_fn, traj, advantages, cfg, opts, ref_velocity_fn, timings,
                                         probe_cosines)
    stats.update(grad_seconds=time.perf_counter() - start, backward_seconds=timings.get("backward", 0.0))
    return stats, routed


def optimizer_step(params, optimizer, losses, *, micro_batches=1, max_grad_norm=1.0, step=None):
    """The optimizer step after accumulate_gradients on micro_batches batches (losses: theirs): the
    gradient becomes their mean (Flow-GRPO's accumulation) and the mean over ranks, is clipped,
    and the optimizer steps unless it or a loss is not finite; then the step is skipped on every
    rank and a warning names step, the caller's step number. Returns {"grad_norm", "skipped"}."""
    params = list(params)
    if micro_batches > 1:
        for p in params:
            if p.grad is not None:
                p.grad /= micro_batches
    _average_gradients_over_ranks(params)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
    finite = _agree_across_ranks(all(math.isfinite(x) for x in losses) and math.isfinite(grad_norm), params[0].device)
    if finite:
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
        warnings.warn(f"optimizer step {'?' if step is None else step} skipped: non-finite loss ({losses}) "
                      f"or gradient norm ({grad_norm}); parameters and optimizer state left as they were",
                      RuntimeWarning, stacklevel=2)
    return {"grad_norm": grad_norm, "skipped": not finite}


def train_step(velocity_fn, params, optimizer, traj, advantages, cfg, opts, *, ref_velocity_fn=None,
               max_grad_norm=1.0, no_sync=contextlib.nullcontext, probe_cosines=None, step=None):
    """One optimizer step of GRPO on a batch of trajectories (traj: T steps of B samples;
    advantages: [B]; cfg: LossConfig; opts: JaggOptions): accumulate_gradients, then
    optimizer_step (pass DDP's model.no_sync as no_sync). Returns (stats, routed)."""
    optimizer.zero_grad(set_to_none=True)
    stats, routed = accumulate_gradients(velocity_fn, traj, advantages, cfg, opts, ref_velocity_fn=ref_velocity_fn,
                                         no_sync=no_sync, probe_cosines=probe_cosines)
    stats.update(optimizer_step(params, optimizer, [stats["loss"]], max_grad_norm=max_grad_norm, step=step))
    return stats, routed


# #####################################################################################
#  RUN IT: python jagg.py checks Part I on tiny models in seconds (tests/test_jagg.py: the rest)
# #####################################################################################


def _self_check():
    """What a learner should see, each line checked (tests/test_jagg.py checks the rest against
    autograd of the summed loss and torch.func's Jacobians)."""
    torch.set_default_dtype(torch.float64)  # exactness shows as ~1e-16, not fp32's ~1e-7
    torch.manual_seed(0)
    T, W, B, D = 10, 4, 16, 3  # windows of 4, 4 and 2 steps
    calls = []  # (rows, grad enabled) of every network call

    def velocity_fn_of(net):  # velocity_fn(z [S, B, D], t [S, B]) -> [S, B, D], recording its calls
        def velocity_fn(z, t):
            calls.append((z.shape[0], torch.is_grad_enabled()))
            return net(torch.cat([z, t[..., None]], dim=-1))
        return velocity_fn

    def grad(net, backward, *args):  # the flat gradient [P] that backward(velocity_fn, *args) accumulates
        net.zero_grad(set_to_none=True)
        backward(velocity_fn_of(net), *args)
        return torch.cat([p.grad.flatten() for p in net.parameters()])

    # 1. v linear in (z, t), nonlinear in theta (two layers multiplied), on a straight window: J is
    #    affine along it, so JAGG's gradient is exact (section 6).
    linear = torch.nn.Sequential(torch.nn.Linear(D + 1, D + 1), torch.nn.Linear(D + 1, D))
    t = torch.tensor([0.9, 0.7, 0.5, 0.2])[:, None].expand(W, B)  # [W, B]
    alpha = interpolation_weights(t)[..., None]  # [W, B, 1]
    z = (1 - alpha) * torch.randn(B, D) + alpha * torch.randn(B, D)  # [W, B, D]
    w = torch.randn(W, B, D)
    step_loss = lambda k, v_k: (w[k] * v_k).sum() + (v_k**2).sum()  # noqa: E731
    exact, approx = (grad(linear, f, z, t, step_loss) for f in (backward_exact, backward_jagg_window))
    rel = ((approx - exact).norm() / exact.norm()).item()
    assert rel < 1e-12, rel
    print(f"1. v linear in (z, t), one straight window of W = {W}: |JAGG - exact| / |exact| = {rel:.1e}: equal")

    # 2. A small nonlinear network on its own rollouts, GRPO's loss with the KL to a frozen copy:
    #    one batch's gradient, exact and by JAGG, and what each ran.
    net = torch.nn.Sequential(torch.nn.Linear(D + 1, 32), torch.nn.Tanh(), torch.nn.Linear(32, D))
    ref = velocity_fn_of(copy.deepcopy(net).requires_grad_(False))
    traj = rollout(velocity_fn_of(net), torch.randn(B, D), sigma_schedule(T), noise_level=0.7)
    advantages = group_advantages(-traj.sample.norm(dim=-1), torch.arange(B) // 4)  # [B]: groups of 4
    cfg, grads = LossConfig(noise_level=0.7, clip_range=0.2, beta=0.04), {}
    for name, frac, passes in (("exact", 0.0, T), ("JAGG", 1.0, 3)):
        calls.clear()
        grads[name] = grad(net, paper_gradients, traj, advantages, cfg, JaggOptions(W, frac), ref)
        with_grad = [n for n, g in calls if g]
        assert len(with_grad) == passes  # one forward with graph (and so one backward pass) each
        print(f"2. {name:5s} (T = {T}, W = {W}): {len(with_grad)} backward passes over {sum(with_grad)} rows "
              f"(rows: one step's {B} samples), {sum(n for n, g in calls if not g)} rows forward without graph "
              f"(the KL reference's included)")
    cos = torch.nn.functional.cosine_similarity(grads["exact"], grads["JAGG"], dim=0).item()
    assert 0.9 < cos < 1 - 1e-9, cos
    print(f"   cosine of JAGG's gradient to the exact one on a small MLP: {cos:.4f} (1 only where J is affine)")

    # 3. The training step: the batch's gradient, clipped, and the optimizer's step (section 8).
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for step in range(1, 4):  # the first step on-policy (ratio 1, clipfrac 0), the next ones off it
        optimizer.zero_grad(set_to_none=True)
        stats, routed = paper_gradients(velocity_fn_of(net), traj, advantages, cfg, JaggOptions(W, 1.0), ref)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        print(f"3. optimizer step {step}: loss {stats['loss']:+.5f}, clipfrac {stats['clipfrac']:.3f}, "
              f"approx_kl {stats['approx_kl']:.2e}, kl {stats['kl']:.2e}, windows to JAGG {routed}")
    print("ok")


if __name__ == "__main__":
    _self_check()
