"""JAGG: GRPO for flow-matching transformers that back-propagates 2 steps per window of W, not W.

A reference implementation of JAGG (Jacobian-Aggregated Group Gradient; the authors' code:
https://github.com/SchumiDing/JAGG), built on Flow-GRPO's SDE sampler and loss (arXiv 2505.05470),
to be read top to bottom. Exact GRPO back-propagates through the network at every sampling step.
JAGG assumes that, over a window of W steps, the network's Jacobian moves in a straight line in t
between the window's end steps; then one backward pass through those two steps gives the window's
whole gradient. A knob, jagg_frac, sets the share of windows that take JAGG (our reading of the
abstract's jagg_frac, OURS); the rest train exactly.
Where the abstract is silent, we made a choice and marked it OURS.

What JAGG saves: Flow-GRPO trains 9 steps per sample, each with its own backward pass; JAGG at
W = 4 back-propagates 5 of them, in 3 passes (self-check C counts the calls, D times a window).
What it costs: a bias wherever the straight-line assumption fails. Self-check A shows when JAGG is
exact; B measures its error beside an unbiased shortcut with as many rows with grad, and which
windows JAGG should take first (section 7); E trains a toy with it.

Notation (code name -> symbol)
    T, B      number of sampling steps; number of samples in the batch
    W         window length: steps a, a + 1, ..., b = a + W - 1; in code i = k - a
    z_k, t_k  the state before step k; its time t_k = sigma_k (1 = pure noise, 0 = clean sample)
    v_k       v_theta(z_k, t_k), the velocity the network predicts at step k
    g_k       dL_k/dv_k, how step k's loss moves with v_k: cheap, from the loss alone
    J_k       dv_k/dtheta, how v_k moves with the weights: a backward pass through the network
    alpha_k   (t_a - t_k) / (t_a - t_b): 0 at the first step a, 1 at the last step b
    G_a, G_b  sum_k (1 - alpha_k) g_k and sum_k alpha_k g_k: the window's loss signal at a and b
Shapes: S a number of steps, *D one sample's shape, P the number of weights; a row is one sample
at one step. The network enters only as velocity_fn(z [S, B, *D], t [S, B]) -> v [S, B, *D].
Run `python jagg.py [seed]`: it checks what the file claims, in seconds.
"""

import itertools
import math
import sys
import time
from dataclasses import dataclass, replace
import torch

def _check(ok, message):  # a one-line ValueError for a mistake a learner is likely to make
    if not ok:
        raise ValueError(message)

# === 1. SDE step: the Gaussian policy of one sampling step (Flow-GRPO) ===
# The flow ODE has no log-probability. An SDE with the same marginals makes each step a Gaussian
# policy, z_{k+1} ~ N(mu_k, std_t^2 |dt|), and GRPO needs the ratio of such densities.
def sigma_schedule(num_steps, shift=3.0):
    """The toy's sigmas [T+1], 1 down to 0: SD3's shift on an even grid (yours: the scheduler's)."""
    s = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)  # [T+1]
    return (shift * s / (1 + (shift - 1) * s)).float()  # [T+1]

def sde_step(v, z, sigma, sigma_next, noise_level, prev_sample=None, generator=None):
    """Flow-GRPO's sde_step_with_logprob from sigma to sigma_next [B]; v, z: [B, *D]. Returns
    z_{k+1} [B, *D] (sampled, or prev_sample), log_prob [B] (mean over *D), mu [B, *D], std_t."""
    # The SDE math runs in fp32 at least: in bf16, rounding alone moves a ratio past the 1e-4 clip.
    dtype = torch.promote_types(torch.result_type(v, z), torch.float32)
    v, z = v.to(dtype), z.to(dtype)
    shape = (-1,) + (1,) * (z.ndim - 1)  # [B, 1, ...]: one sigma per sample, broadcast over *D
    sigma, sigma_next = sigma.to(dtype).reshape(shape), sigma_next.to(dtype).reshape(shape)
    dt = sigma_next - sigma  # [B, 1, ...], negative: sigma falls from noise to data
    # std_t [B, 1, ...] = noise_level sqrt(sigma / (1 - sigma)) is infinite at sigma = 1: Flow-GRPO
    # divides by 1 - sigma_next there, and we do above 1 - 1e-4 (some schedulers start at 1 - 1e-6).
    std_t = noise_level * torch.sqrt(sigma / (1 - torch.where(sigma > 1 - 1e-4, sigma_next, sigma)))
    # Euler on dz = [v + std_t^2 / (2 sigma) (z + (1 - sigma) v)] dsigma + std_t dw gives the mean
    mean = (z * (1 + std_t**2 / (2 * sigma) * dt)  # mu [B, *D]
            + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt)
    std = std_t * torch.sqrt(-dt)  # [B, 1, ...], the Gaussian's standard deviation
    if prev_sample is None:
        noise = torch.randn(z.shape, generator=generator, device=z.device, dtype=dtype)  # [B, *D]
        prev_sample = mean + std * noise
    # log N(x; mu, std^2) = -(x - mu)^2 / (2 std^2) - log std - log sqrt(2 pi), per element
    log_prob = -(prev_sample.detach() - mean) ** 2 / (2 * std**2) - torch.log(std)  # [B, *D]
    # Flow-GRPO takes the MEAN over *D, not the sum: a log-ratio is the full Gaussian's divided by
    # the number of elements, presumably why its clip range is as small as 1e-4.
    log_prob = (log_prob - 0.5 * math.log(2 * math.pi)).mean(dim=tuple(range(1, z.ndim)))  # [B]
    return prev_sample.to(dtype), log_prob, mean, std_t

# === 2. Rollout: sample trajectories and keep what training needs ===
@dataclass
class Trajectory:  # a batch of sampled trajectories: everything GRPO needs, no graph attached
    z: torch.Tensor  # z_k, the state before each step          [T, B, *D]
    z_next: torch.Tensor  # z_{k+1}, the state after each step   [T, B, *D]
    t: torch.Tensor  # t_k = sigma_k of each step                [T, B]
    t_next: torch.Tensor  # sigma_{k+1} of each step            [T, B]
    log_prob: torch.Tensor  # log p_old(z_{k+1} | z_k)           [T, B]
    v: torch.Tensor | None = None  # v_k under the policy that sampled  [T, B, *D] (section 7)
    noise_level: float | None = None  # the SDE's noise level when sampled; the loss needs it
    TENSORS = ("z", "z_next", "t", "t_next", "log_prob", "v")  # the fields above that are tensors
    @property
    def sample(self):  # z_T, the clean samples [B, *D] the reward sees (take it before first_steps)
        return self.z_next[-1]
    def first_steps(self, n):  # the first n steps, the ones Flow-GRPO trains (9 of T = 10)
        _check(1 <= n <= len(self.z), f"a trajectory of {len(self.z)} steps has no first {n} steps")
        return self._indexed(slice(n))
    def subset(self, idx):  # the samples idx, a minibatch; slice advantages and conditions alike
        return self._indexed((slice(None), idx))
    def _indexed(self, index):  # every tensor field indexed alike (a missing v stays missing)
        tensors = {k: getattr(self, k) for k in self.TENSORS if getattr(self, k) is not None}
        return replace(self, **{k: x[index] for k, x in tensors.items()})

@torch.no_grad()
def rollout(velocity_fn, noise, sigmas, noise_level, generator=None):
    """B trajectories of T = len(sigmas) - 1 SDE steps from the noise z_0 [B, *D], step by step."""
    T, B = len(sigmas) - 1, noise.shape[0]
    t = sigmas[:-1, None].expand(T, B).to(noise.device).contiguous()  # [T, B]
    t_next = sigmas[1:, None].expand(T, B).to(noise.device).contiguous()  # [T, B]
    zs, log_probs, vs = [noise], [], []
    for k in range(T):
        vs.append(velocity_fn(zs[k][None], t[k : k + 1])[0])  # one step, S = 1: [B, *D]
        _check(vs[k].shape == noise.shape, f"velocity_fn gave {vs[k].shape[1:]}, not z's shape")
        z_next, log_prob = sde_step(vs[k], zs[k], t[k], t_next[k], noise_level, None, generator)[:2]
        zs.append(z_next)
        log_probs.append(log_prob)
    zs = torch.stack(zs)  # [T + 1, B, *D]
    log_probs, vs = torch.stack(log_probs), torch.stack(vs)  # [T, B], [T, B, *D]
    return Trajectory(zs[:-1], zs[1:], t, t_next, log_probs, vs, noise_level)

# === 3. Group-relative advantages (GRPO) ===
def group_advantages(rewards, group_ids, eps=1e-4, global_std=False, clip=5.0):
    """A_n = (r_n - mean of n's group) / (std + eps), clipped to [-clip, clip]; rewards, group_ids:
    [B]. A group is the samples of one prompt; std is the group's (GRPO), or the batch's."""
    _check(rewards.ndim == 1 and rewards.shape == group_ids.shape, "rewards and group_ids: [B]")
    rewards = rewards.float()
    adv = torch.empty_like(rewards)  # [B]
    for g in group_ids.unique():
        m = group_ids == g  # [B] bool
        std = (rewards if global_std else rewards[m]).std(unbiased=False)
        adv[m] = (rewards[m] - rewards[m].mean()) / (std + eps)
    return adv.clamp(-clip, clip)

# === 4. The per-step GRPO loss ===
@dataclass
class LossConfig:  # the knobs of the per-step loss and of the SDE
    noise_level: float  # the SDE's noise level (Flow-GRPO: 0.7)
    clip_range: float  # the ratio's clip (Flow-GRPO: 1e-4, sized for images; self-check E: 0.2)
    beta: float = 0.0  # weight of the KL to a reference model; 0 needs no reference

def grpo_step_loss(log_prob, log_prob_old, advantages, clip_range, mean=None, mean_ref=None,
                   std_t=None, beta=0.0):
    """One step's clipped GRPO surrogate plus beta * KL to the reference; returns (loss, stats).
    log_prob, log_prob_old, advantages: [B]; mean, mean_ref: [B, *D]; std_t from sde_step.
        ratio = exp(logp - logp_old),   L = mean_B max(-A ratio, -A clip(ratio, 1 - c, 1 + c))
        KL = mean_B mean_D (mu - mu_ref)^2 / (2 std_t^2): Flow-GRPO's, the Gaussians' KL x |dt|"""
    ratio = torch.exp(log_prob - log_prob_old)  # [B]
    clipped = torch.clamp(ratio, 1 - clip_range, 1 + clip_range)  # [B]
    loss = torch.maximum(-advantages * ratio, -advantages * clipped).mean()
    kl = torch.zeros((), device=loss.device)
    if beta > 0:
        kl = ((mean - mean_ref) ** 2 / (2 * std_t**2)).mean(dim=tuple(range(1, mean.ndim))).mean()
        loss = loss + beta * kl
    clipfrac = (torch.abs(ratio - 1.0) > clip_range).float().mean().item()
    approx_kl = 0.5 * ((log_prob - log_prob_old) ** 2).mean().item()  # k2, as Flow-GRPO logs it
    return loss, {"clipfrac": clipfrac, "kl": kl.item(), "approx_kl": approx_kl}

def make_step_loss(traj, advantages, start, stop, cfg, v_ref=None, log=None):
    """step_loss(i, v): the loss of step k = start + i given its v [B, *D], divided by len(traj.z),
    the steps trained (Flow-GRPO's loss is their mean). v_ref [stop - start, B, *D]: for the KL."""
    _check(traj.noise_level in (None, cfg.noise_level), "cfg.noise_level must be the rollout's")
    def step_loss(i, v):
        k = range(start, stop)[i]  # the step in the trajectory
        step = (traj.z[k], traj.t[k], traj.t_next[k], cfg.noise_level, traj.z_next[k])
        _, log_prob, mean, std_t = sde_step(v, *step)  # scores the stored z_{k+1} under v
        mean_ref = sde_step(v_ref[i], *step)[2] if cfg.beta > 0 else None
        loss, stats = grpo_step_loss(log_prob, traj.log_prob[k], advantages, cfg.clip_range,
                                     mean, mean_ref, std_t, cfg.beta)
        if log is not None:  # a list that collects each step's stats
            log.append(stats)
        return loss / traj.z.shape[0]
    return step_loss

# === 5. Exact per-step backward: the baseline (what Flow-GRPO does) ===
def backward_exact(velocity_fn, z, t, step_loss):
    """Exact gradient of a window z [W, B, *D], t [W, B], step i's loss step_loss(i, v): per step,
    one forward with graph, one backward. Adds to .grad like loss.backward(), returns the loss."""
    total = 0.0
    for i in range(z.shape[0]):
        loss = step_loss(i, velocity_fn(z[i : i + 1], t[i : i + 1])[0])  # v: [B, *D]
        loss.backward()  # frees this step's graph before the next step builds its own
        total += loss.item()
    return total

# === 6. JAGG: interpolate the Jacobians, back-propagate once ===
# Step k's loss L_k depends on the weights only through v_k (states and reference are fixed), so
#     grad = sum_k g_k^T J_k,   g_k = dL_k/dv_k (elementwise ops),   J_k = dv_theta(z_k, t_k)/dtheta
# and each J_k costs a backward pass. JAGG assumes that the Jacobians, like DiT features
# (Delta-DiT), change nearly linearly along a trajectory:
#     J_k ~= (1 - alpha_k) J_a + alpha_k J_b,    alpha_k = (t_a - t_k) / (t_a - t_b).
# Putting this into the sum and collecting the terms in J_a and in J_b gives
#     grad ~= G_a^T J_a + G_b^T J_b,    G_a = sum_k (1 - alpha_k) g_k,    G_b = sum_k alpha_k g_k,
# the gradient of sum(v_a * G_a) + sum(v_b * G_b) with G_a and G_b held fixed: one forward pass
# with graph on the double batch [z_a; z_b], then one backward pass. Each g_k needs v_k at the
# current weights: at an interior step, a forward without graph gives it (OURS).
# When is it exact? The abstract says: when v is linear in (z, t). We find two conditions (OURS):
#   (1) J is affine in (z, t), as for v = A z + c t + e with A, c and e any functions of theta;
#   (2) each state lies where t puts it on the segment: z_k = (1 - alpha_k) z_a + alpha_k z_b.
# Then (z_k, t_k) is the alpha_k-mix of (z_a, t_a) and (z_b, t_b), and an affine J gives exactly
# J_k = (1 - alpha_k) J_a + alpha_k J_b. Self-check A breaks each condition alone. A sampler's
# states lie far off the segment, mostly because of the SDE's noise: there JAGG approximates (B).
def interpolation_weights(t):
    """alpha_k = (t_a - t_k) / (t_a - t_b) of a window's times t [W, B]: [W, B], 0 at a, 1 at b."""
    span = t[0] - t[-1]  # [B]
    _check(bool((span != 0).all()), "a window's end steps must have different times (t_a != t_b)")
    return (t[0] - t) / span  # [W, B]

def backward_jagg_window(velocity_fn, z, t, step_loss):
    """JAGG's gradient of a window z [W, B, *D], t [W, B] (a: i = 0, b: i = W - 1): one forward with
    graph on the end steps, one backward, and one forward without graph on the interior steps; adds
    to .grad like loss.backward(), returns the loss."""
    acc_dtype = torch.promote_types(z.dtype, torch.float32)  # G_a, G_b summed in fp32 at least
    alpha = interpolation_weights(t.to(acc_dtype))  # [W, B]
    alpha = alpha.reshape(t.shape + (1,) * (z.ndim - 2))  # [W, B, 1, ...]
    with torch.no_grad():  # the interiors serve only g_k, never back-propagated: no graph
        v_mid = velocity_fn(z[1:-1], t[1:-1]) if len(z) > 2 else z[:0]  # [W-2, B, *D], or empty
    v_ab = velocity_fn(z[[0, -1]], t[[0, -1]])  # the double batch [z_a; z_b] with graph: [2, B, *D]
    v = torch.cat([v_ab[:1].detach(), v_mid.to(v_ab.dtype), v_ab[1:].detach()])  # [W, B, *D]
    # G_a = sum_k (1 - alpha_k) g_k,  G_b = sum_k alpha_k g_k, with each g_k from the loss alone
    G_a, G_b = torch.zeros((2, *v.shape[1:]), dtype=acc_dtype, device=z.device)  # [B, *D] each
    total = 0.0  # the summed loss
    for i in range(len(z)):  # step k = a + i, i < W
        v_k = v[i].detach().to(acc_dtype).requires_grad_(True)  # [B, *D], a leaf: g_k skips the net
        loss = step_loss(i, v_k)
        (g_k,) = torch.autograd.grad(loss, v_k)  # [B, *D], in fp32 at least
        G_a += (1 - alpha[i]) * g_k
        G_b += alpha[i] * g_k
        total += loss.item()
    # One backward pass: d/dtheta [sum(v_a * G_a) + sum(v_b * G_b)] = G_a^T J_a + G_b^T J_b
    (v_ab[0] * G_a.to(v_ab.dtype) + v_ab[1] * G_b.to(v_ab.dtype)).sum().backward()
    return total

# What a window costs. Exact GRPO back-propagates W rows in W backward passes; JAGG 2 rows in one,
# which we read as the abstract's "~2x backward speedup" at W = 4, plus a forward without graph on
# the W - 2 interiors. If a backward costs two forwards, exact costs 3W forwards and JAGG W + 4: 12
# against 8 at W = 4. On the first minibatch after a rollout, that interior forward only recomputes
# traj.v (the weights are still the rollout's); we run it anyway, as the next minibatches need it.
# Memory goes the other way: JAGG's backward holds 2B rows of activations at once, exact's B. If
# that does not fit, back-propagate v_a * G_a before computing v_b (G_a needs no g_b: alpha_b = 1),
# then v_b * G_b: the same gradient in exact's memory, in two passes.

# === 7. Routing: which windows take JAGG ===
# jagg_frac is the share of windows that take JAGG; the others train exactly. Which ones? The
# abstract names "a cosine-similarity rule" and does not spell it out. Our reading of it,
# linearity_score, picks the windows where the rollout's velocities run straightest. But what
# counts is the error a window adds to the batch's gradient: its relative error times its share
# of the gradient, and the low-noise windows carry the most (|g_k| grows as sqrt|dt| / std_t, and
# std_t falls with sigma). On check B's toy their velocities also run straightest, so the cosine
# rule hands JAGG the windows where it adds the most error. We take the earliest, highest-noise
# windows first (OURS): an oracle that knew each window's true error chose the same on the toy DiT
# and the small SD3 we measured (lab/reports/routing.md in this file's repository). A schedule
# needs no score, either; route="velocity" runs the cosine rule instead.
def window_bounds(num_steps, window):
    """T steps in disjoint windows of W (OURS): [(start, stop), ...], stop = b + 1; last shorter."""
    _check(window >= 2, f"window must be >= 2 steps (JAGG needs two end steps), got {window}")
    _check(window <= num_steps, f"window ({window}) is longer than the trajectory ({num_steps})")
    return [(start, min(start + window, num_steps)) for start in range(0, num_steps, window)]

def linearity_score(v, t):
    """The abstract's cosine rule as we read it: the mean cosine of each interior v_k with
    (1 - alpha_k) v_a + alpha_k v_b. v [W, B, *D], t [W, B]; 1 for a window of 2 steps."""
    if v.shape[0] <= 2:
        return 1.0
    alpha = interpolation_weights(t.float()).reshape(t.shape + (1,) * (v.ndim - 2))  # [W, B, 1..]
    v = v.float()  # [W, B, *D]
    v_line = (1 - alpha) * v[:1] + alpha * v[-1:]  # [W, B, *D]
    cos = torch.cosine_similarity(v[1:-1].flatten(2), v_line[1:-1].flatten(2), dim=-1)  # [W-2, B]
    return cos.mean().item()

def route_windows(lengths, jagg_frac, scores=None):
    """One bool per window (lengths: their steps), True for jagg_frac of the windows of 3+ steps (of
    2 steps there is no interior to save), rounded to the nearest count, halves up (0.5 of 1
    window is 1): the earliest, or with scores the highest scored (ties: the earlier)."""
    _check(0.0 <= jagg_frac <= 1.0, f"jagg_frac must be in [0, 1], got {jagg_frac}")
    eligible = [w for w, n in enumerate(lengths) if n >= 3]  # in step order: the earliest first
    if scores is not None:
        eligible = sorted(eligible, key=lambda w: -scores[w])  # a stable sort: ties stay in order
    chosen = set(eligible[: int(jagg_frac * len(eligible) + 0.5)])
    return [w in chosen for w in range(len(lengths))]

# === 8. One optimizer step's gradient over a batch of trajectories ===
def backward_batch(velocity_fn, traj, advantages, cfg, window=4, jagg_frac=1.0, ref_fn=None,
                   route="early"):
    """Add to .grad the gradient of the batch's GRPO loss (the mean over its steps and samples),
    window by window: JAGG on jagg_frac of the windows, the earliest first (route "velocity": the
    straightest, section 7), exact on the others. advantages: [B]; ref_fn: the KL reference's
    velocity_fn (cfg.beta > 0). Returns (stats, routed): the means over steps that Flow-GRPO logs
    (loss, kl, clipfrac, approx_kl) and grad_rows, the rows back-propagated; JAGG's windows."""
    _check(cfg.beta == 0 or ref_fn is not None, "beta > 0 needs ref_fn, the reference model's")
    _check(route == "early" or (route == "velocity" and traj.v is not None),
           f"route must be 'early', or 'velocity' with the rollout's v in traj, got {route!r}")
    bounds = window_bounds(traj.z.shape[0], window)  # [(start, stop), ...]
    lengths = [stop - start for start, stop in bounds]
    scores = None  # route "early" needs none: the windows' order is their rank
    if route == "velocity":
        scores = [linearity_score(traj.v[start:stop], traj.t[start:stop]) for start, stop in bounds]
    routed = route_windows(lengths, jagg_frac, scores)
    log, loss = [], 0.0  # every step's stats from grpo_step_loss; the summed loss
    for (start, stop), use_jagg in zip(bounds, routed):
        z, t = traj.z[start:stop], traj.t[start:stop]  # [W, B, *D], [W, B]
        with torch.no_grad():  # the KL reference's velocities [W, B, *D]
            v_ref = ref_fn(z, t) if cfg.beta > 0 else None
        step_loss = make_step_loss(traj, advantages, start, stop, cfg, v_ref, log)
        backward = backward_jagg_window if use_jagg else backward_exact
        loss += backward(velocity_fn, z, t, step_loss)
    stats = {key: sum(s[key] for s in log) / len(log) for key in log[0]}  # means over steps
    grad_rows = sum(2 if use_jagg else n for n, use_jagg in zip(lengths, routed))  # section 6
    stats.update(loss=loss, grad_rows=grad_rows)
    return stats, routed

# === 9. The training loop around it (Flow-GRPO's; self-check E runs it on a toy) ===
def train_epoch(velocity_fn, params, optimizer, reward_fn, noise, group_ids, sigmas, cfg,
                trained_steps, window=4, jagg_frac=1.0, route="early"):
    """One epoch: B trajectories from noise [B, *D], their rewards reward_fn(z_T) [B] and advantages
    within groups, then 2 optimizer steps on half the batch each. A model with conditions needs
    each minibatch's velocity_fn made with its samples' conditions. Returns the mean reward."""
    traj = rollout(velocity_fn, noise, sigmas, cfg.noise_level)  # no graph
    rewards = reward_fn(traj.sample)  # [B]
    advantages = group_advantages(rewards, group_ids)  # [B]
    for idx in torch.randperm(len(noise)).chunk(2):  # the second step is off-policy
        optimizer.zero_grad()
        minibatch = traj.first_steps(trained_steps).subset(idx)  # Flow-GRPO trains 9 of 10 steps
        backward_batch(velocity_fn, minibatch, advantages[idx], cfg, window, jagg_frac, route=route)
        torch.nn.utils.clip_grad_norm_(params, 1.0)  # Flow-GRPO's max_grad_norm
        optimizer.step()
    return rewards.mean().item()

# === 10. Using your own model ===
# Wrap your network as velocity_fn(z [S, B, *D], t [S, B]) -> v [S, B, *D], with t = sigma and v =
# dz/dsigma = noise - data (SD3's transformer expects t * 1000). The rollout calls it one step at a
# time, JAGG on several steps at once: both must give the same v, or the first minibatch's ratios
# drift from 1. So no dropout, and rows in step-major order (row s * B + n is sample n at step s):
# repeat a condition as c.repeat(S, 1, ...), never c.repeat_interleave(S, 0). With classifier-free
# guidance, return v_u + scale (v_c - v_u). The states come back in fp32 (section 1): cast z and t
# to your model's dtype inside velocity_fn. The backward passes add to .grad: on many GPUs, run
# them without DDP's all-reduce (no_sync) and all-reduce .grad once per optimizer step.

# === Self-check: python jagg.py [seed] prints, in seconds, what a learner should see ===
# Asserts check what holds for every seed (exactness, counts); measurements are printed as such.
def _mlp(i, o, width=32):  # i inputs, o outputs, a tanh between: v is not linear
    layers = [torch.nn.Linear(i, width), torch.nn.Tanh(), torch.nn.Linear(width, o)]
    return torch.nn.Sequential(*layers)

def _velocity_fn(net, calls=None):  # net on (z, t)
    def velocity_fn(z, t):  # z [S, B, d], t [S, B] -> v [S, B, d]
        if calls is not None:  # for C: each call's number of steps, and whether it builds a graph
            calls.append((z.shape[0], torch.is_grad_enabled()))
        return net(torch.cat([z, t[..., None]], dim=-1))  # [S, B, d + 1] -> [S, B, d]
    return velocity_fn

def _near_origin(z):  # the self-checks' reward [B] of samples z [B, D]
    return -z.norm(dim=-1)

def _grad(net, backward, *args):  # the gradient [P] that backward(*args) leaves in net's .grad
    net.zero_grad(set_to_none=True)
    backward(*args)
    return torch.cat([p.grad.flatten() for p in net.parameters()])

def _check_exactness(B=16, D=3):
    """A. Section 6's two conditions: JAGG is exact when both hold; here, not when either fails."""
    t = torch.tensor([0.9, 0.7, 0.5, 0.2])[:, None].expand(4, B)  # [W, B], unevenly spaced
    alpha = interpolation_weights(t)[..., None]  # [W, B, 1]
    z_a, z_b, coef = torch.randn(B, D), torch.randn(B, D), torch.randn(4, B, D)  # coef: [W, B, D]
    on_segment = z_a + alpha * (z_b - z_a)  # [W, B, D]: each state where its t puts it
    by_step = z_a + torch.linspace(0, 1, 4)[:, None, None] * (z_b - z_a)  # [W, B, D]: by step
    bent = on_segment + alpha * (1 - alpha)  # [W, B, D]: off the segment
    affine = torch.nn.Sequential(torch.nn.Linear(D + 1, D + 1), torch.nn.Linear(D + 1, D))
    cases = [(affine, on_segment), (affine, by_step), (affine, bent), (_mlp(D + 1, D), on_segment)]
    errors = []
    for net, z in cases:
        args = (_velocity_fn(net), z, t, lambda i, v: (coef[i] * v).sum() + (v**2).sum())  # a loss
        jagg, exact = _grad(net, backward_jagg_window, *args), _grad(net, backward_exact, *args)
        errors.append(((jagg - exact).norm() / exact.norm()).item())  # |JAGG - exact| / |exact|
    print("A. |JAGG - exact| / |exact|: {:.1e} with v affine in (z, t), states on the segment;\n"
          "   {:.1e} spaced by step; {:.1e} off it; {:.1e} for a tanh net".format(*errors))
    assert errors[0] < 1e-12 and min(errors[1:]) > 1e-6

def _check_gradient_error(net, cfg, T=10, W=4, B=16, D=3, rollouts=(16, 64, 256)):
    """B. Is it worth it, and where? Each window's error in the batch's gradient, by JAGG and by an
    unbiased shortcut with as many rows with grad (2 random steps of the window, times W/2), with
    the first n rollouts in the batch: a noise halves with 4x the rollouts, a bias stays."""
    fn, picks = _velocity_fn(net), 0
    rows = {a: [] for a in (0, W)}  # window start -> per rollout (exact, JAGG, shortcut's error^2)
    for r in range(max(rollouts)):
        traj = rollout(fn, torch.randn(B, D), sigma_schedule(T), cfg.noise_level)
        adv = group_advantages(_near_origin(traj.sample), torch.arange(B) // 4)  # [B]
        scores = [linearity_score(traj.v[a : a + W], traj.t[a : a + W]) for a in (0, W)]
        picks += route_windows([W, W], 0.5, scores)[1]  # route "velocity" gives JAGG window 4-7
        for a in (0, W):  # the two 4-step windows: 0-3, 4-7
            per_step = [_grad(net, backward_exact, fn, traj.z[k : k + 1], traj.t[k : k + 1],
                              make_step_loss(traj, adv, k, k + 1, cfg)) for k in range(a, a + W)]
            exact = sum(per_step)  # [P]
            jagg = _grad(net, backward_jagg_window, fn, traj.z[a : a + W], traj.t[a : a + W],
                         make_step_loss(traj, adv, a, a + W, cfg))  # [P]
            pairs = list(itertools.combinations(per_step, 2))  # every pair the shortcut could draw
            shortcut = sum((W / 2 * (p + q) - exact).norm() ** 2 for p, q in pairs) / len(pairs)
            rows[a].append((exact, jagg, shortcut))
    print("B. |estimate - exact| of the batch's gradient, as a share of its |exact|, with 16, 64")
    print("   and 256 rollouts in the batch\n   steps | JAGG              | 2 random steps x W/2")
    own, size = [], []  # with all rollouts: JAGG's error relative to the window's own gradient; |g|
    for a in (0, W):
        jagg_err, shortcut_err = [], []
        for n in rollouts:  # sums over the first n rollouts: the batch's gradients
            whole = sum(e for w in (0, W) for e, _, _ in rows[w][:n]).norm()  # both windows'
            exact, jagg, shortcut = (sum(x) for x in zip(*rows[a][:n]))
            jagg_err.append((jagg - exact).norm() / whole)
            shortcut_err.append(math.sqrt(shortcut) / whole)  # independent draws: squares add
        own.append(((jagg - exact).norm() / exact.norm()).item())
        size.append(exact.norm().item())
        print(f"   {a}-{a + W - 1}   | {' '.join(f'{e:.3f}' for e in jagg_err)} | "
              f"{' '.join(f'{e:.3f}' for e in shortcut_err)}")
    print(f"   Relative to the window's own gradient, JAGG's error is {own[0]:.3f} on 0-3 and "
          f"{own[1]:.3f} on 4-7;\n   but 4-7's gradient is {size[1] / size[0]:.1f}x 0-3's, and the "
          "step adds the errors, not the ratios.\n   At jagg_frac 0.5, route 'velocity' (the "
          f"cosine rule) gives JAGG window 4-7 in {picks} of {max(rollouts)}\n   rollouts; "
          "route 'early' gives it 0-3 (section 7). Which adds less error to the step?")
    return traj, adv

def _check_cost(net, cfg, traj, adv, W=4):
    print("C. Routing, and its cost in forwards from velocity_fn's calls (a backward = 2 forwards;"
          "\n   the KL's reference runs a forward at every step either way)")
    reference = _mlp(3 + 1, 3)  # the KL's reference model: another net will do
    for steps, frac in [(10, 1.0), (10, 0.5), (9, 0.0), (9, 1.0)]:
        calls, ref_calls = [], []  # (steps, builds a graph) of each call
        fn, sub = _velocity_fn(net, calls=calls), traj.first_steps(steps)
        ref_fn = _velocity_fn(reference, calls=ref_calls)
        stats, routed = backward_batch(fn, sub, adv, cfg, W, frac, ref_fn)
        grad_rows = sum(n for n, grad in calls if grad)  # the rows back-propagated
        passes = sum(grad for _, grad in calls)  # each call with a graph gets one backward pass
        no_graph = sum(n for n, grad in calls if not grad)  # the interiors' rows
        windows = [f"{a}-{b - 1}" for (a, b), r in zip(window_bounds(steps, W), routed) if r]
        print(f"   {steps} steps, jagg_frac {frac}: JAGG on {', '.join(windows) or 'none'}; "
              f"{grad_rows} rows with grad ({passes} backwards), {no_graph} without: "
              f"{3 * grad_rows + no_graph} forwards")
        assert routed == [w < int(frac * 2 + 0.5) for w in range(len(routed))]  # earliest first
        assert stats["grad_rows"] == grad_rows == steps - 2 * sum(routed)  # JAGG: 2 rows, not 4
        assert sum(n for n, _ in ref_calls) == steps  # the reference runs every step, either way

def _check_timing(W=4, B=64, D=256, repeats=7):
    """D. One window timed on a network wide enough that the backward passes dominate (a tanh MLP
    D + 1 -> 2048 -> D, float32): exact and JAGG in turn, the median of each."""
    net, z = _mlp(D + 1, D, 2048).float(), torch.randn(W, B, D).float()  # [W, B, D]
    t = torch.linspace(0.9, 0.3, W)[:, None].expand(W, B).float()  # [W, B]
    args = (_velocity_fn(net), z, t, lambda i, v: (v * v).sum())  # a loss for each step
    runs = {backward_exact: [], backward_jagg_window: []}
    for r in range(repeats + 1):  # in turn, so that a busy machine slows both alike
        for backward, seconds in runs.items():
            start = time.perf_counter()
            _grad(net, backward, *args)
            seconds.append(time.perf_counter() - start)  # the first round warms up
    exact, jagg = (sorted(seconds[1:])[repeats // 2] for seconds in runs.values())
    print(f"D. One window of W = {W} on {B} samples: exact {1e3 * exact:.0f} ms ({W} backward "
          f"passes), JAGG {1e3 * jagg:.0f} ms\n   (one backward over 2 rows, and a forward without "
          f"graph on the {W - 2} interiors): {exact / jagg:.2f}x, measured here")

def _check_training(cfg, epochs=40, B=32, D=3, T=10):
    """E. Section 9's loop: exact GRPO (jagg_frac 0) and JAGG (W = 4) from one random start."""
    rewards, state = {}, torch.get_rng_state()  # jagg_frac -> each epoch's mean reward
    cfg = replace(cfg, clip_range=0.2)  # a toy's ratios move more than an image model's
    for frac in (0.0, 1.0):
        torch.set_rng_state(state)  # the same network and first rollout for both
        net = _mlp(D + 1, D)
        params = list(net.parameters())
        optimizer = torch.optim.Adam(params, lr=1e-2)
        rewards[frac] = [train_epoch(_velocity_fn(net), params, optimizer, _near_origin,
                                     torch.randn(B, D), torch.arange(B) // 4, sigma_schedule(T),
                                     cfg, T - 1, jagg_frac=frac) for epoch in range(epochs)]
    (e0, e1), (j0, j1) = (rewards[frac][:: epochs - 1] for frac in (0.0, 1.0))
    print(f"E. Section 9's loop, {epochs} epochs of {B} samples in groups of 4: mean reward "
          f"{e0:.2f} -> {e1:.2f}\n   by exact GRPO, {j0:.2f} -> {j1:.2f} by JAGG (5 rows with grad "
          "a sample, not 9)")

if __name__ == "__main__":
    torch.set_num_threads(1)  # tiny tensors: threads would cost more than they save
    torch.set_default_dtype(torch.float64)  # so that "exact" shows as ~1e-16, not fp32's ~1e-7
    torch.manual_seed(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    _check_exactness()
    net, cfg = _mlp(3 + 1, 3), LossConfig(noise_level=0.7, clip_range=1e-4)
    traj, adv = _check_gradient_error(net, cfg)  # C reuses B's last rollout, with the KL's term
    _check_cost(net, replace(cfg, beta=0.04), traj, adv)
    _check_timing()
    _check_training(cfg)
    print("ok")
