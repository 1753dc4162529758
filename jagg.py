"""JAGG: GRPO for flow-matching diffusion transformers with one backward pass per window of W steps.

The paper alone, to read top to bottom: JAGG (Jacobian-Aggregated Group Gradient, arXiv 2607.17572, 2026)
on Flow-GRPO's SDE sampler and loss (Liu et al., arXiv 2505.05470). We follow the paper's abstract; where it
is silent or we depart from it, a comment says OURS. The idea: a window of W steps needs W backward passes.
If the network's Jacobian changes linearly in t across the window, one pass at its two ends does (section 6).

Notation (code name -> symbol)
    T, B       number of sampling steps; number of samples in the batch
    W          window length: a window covers the steps a, a + 1, ..., b = a + W - 1, in code i = k - a
    z_k, t_k   the state before step k; its time t_k = sigma_k (1 = pure noise, 0 = clean sample)
    v_k        v_theta(z_k, t_k), the velocity the network predicts at step k
    g_k        dL_k / dv_k, how step k's loss changes with v_k: cheap, the loss alone
    J_k        dv_k / dtheta, how v_k changes with the weights: a backward pass through the network
    alpha_k    (t_a - t_k) / (t_a - t_b): 0 at the first step a, 1 at the last step b
    G_a, G_b   sum_k (1 - alpha_k) g_k and sum_k alpha_k g_k, summed over the window
Shape letters: S a number of steps, *D the shape of one sample, P the number of weights.
A "row" is one step of the whole batch: B samples sent through the network together.
The contract with a model: velocity_fn(z [S, B, *D], t [S, B]) -> v [S, B, *D], with t = sigma and
v = dz/dsigma = noise - data (SD3's and Flux's rectified flow). velocity_fn owns any conditioning (prompts,
classifier-free guidance). Section 6 says why it gets several steps at once.
Run it: `python jagg.py`, a self-check of a few seconds; an assert checks each line it prints.
"""

import copy
import math
from dataclasses import dataclass
import torch

def _check(ok, message):  # a short ValueError for a mistake a learner is likely to make
    if not ok:
        raise ValueError(message)

# === 1. SDE step: the Gaussian policy of one sampling step (Flow-GRPO) ===
# The flow ODE has no log-probability. An SDE with the same marginals makes each step a Gaussian policy,
# z_{k+1} ~ N(mu_k, std_t^2 |dt|), and GRPO needs the ratio of such densities.
def sigma_schedule(num_steps, shift=3.0):
    """sigma_0 = 1 > ... > sigma_T = 0 [T+1]: an even grid bent by SD3's shift, more steps at high noise."""
    s = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)  # [T+1]
    return (shift * s / (1 + (shift - 1) * s)).float()  # [T+1]

def sde_step(v, z, sigma, sigma_next, noise_level, prev_sample=None, generator=None):
    """One SDE step from z at sigma to sigma_next (v, z: [B, *D]; sigma, sigma_next: [B]), as Flow-GRPO's
    sde_step_with_logprob: samples z_{k+1}, or scores prev_sample if given. Returns z_{k+1} [B, *D],
    log_prob [B] (a mean over the non-batch dims), the mean mu [B, *D] and std_t [B, 1, ...]."""
    # fp32 at least: bf16 rounding of two nearly equal log-probs would move their ratio by more than 1e-4
    dtype = torch.promote_types(torch.promote_types(v.dtype, z.dtype), torch.float32)
    v, z, shape = v.to(dtype), z.to(dtype), (-1,) + (1,) * (z.ndim - 1)
    sigma, sigma_next = sigma.to(dtype).reshape(shape), sigma_next.to(dtype).reshape(shape)  # [B, 1, ...]
    dt = sigma_next - sigma  # [B, 1, ...], negative: sigma falls from noise to data
    # std_t [B, 1, ...] = noise_level sqrt(sigma / (1 - sigma)); at sigma = 1 Flow-GRPO uses 1 - sigma_next
    std_t = noise_level * torch.sqrt(sigma / (1 - torch.where(sigma > 1 - 1e-4, sigma_next, sigma)))
    # Euler on dz = [v + std_t^2 / (2 sigma) (z + (1 - sigma) v)] dsigma + std_t dw:
    # mu [B, *D] = z (1 + std_t^2 / (2 sigma) dt) + v (1 + std_t^2 (1 - sigma) / (2 sigma)) dt
    mean = z * (1 + std_t**2 / (2 * sigma) * dt) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
    std = std_t * torch.sqrt(-dt)  # [B, 1, ...], the Gaussian's standard deviation
    if prev_sample is None:
        prev_sample = mean + std * torch.randn(z.shape, generator=generator, device=z.device, dtype=z.dtype)
    # log N(x; mu, std^2) = -(x - mu)^2 / (2 std^2) - log std - log sqrt(2 pi), per element
    log_prob = -(prev_sample.detach() - mean) ** 2 / (2 * std**2) - torch.log(std)  # [B, *D]
    log_prob = (log_prob - 0.5 * math.log(2 * math.pi)).mean(dim=tuple(range(1, z.ndim)))  # [B, *D] -> [B]
    return prev_sample.to(dtype), log_prob, mean, std_t

# === 2. Rollout: sample trajectories and keep what training needs ===
def checked(velocity_fn):  # velocity_fn, refusing a v not of z's shape (broadcast, it would train wrongly)
    def velocity(z, t):
        v = velocity_fn(z, t)
        _check(v.shape == z.shape, f"velocity_fn(z {z.shape}) returned {v.shape}: end it with .reshape(z.shape)")
        return v
    return velocity
@dataclass
class Trajectory:
    """A batch of sampled trajectories: everything GRPO needs, no graph attached."""
    z: torch.Tensor  # z_k, the state before each step            [T, B, *D]
    z_next: torch.Tensor  # z_{k+1}, the state after each step     [T, B, *D]
    t: torch.Tensor  # t_k = sigma_k of each step                  [T, B]
    t_next: torch.Tensor  # sigma_{k+1} of each step              [T, B]
    log_prob: torch.Tensor  # log p_old(z_{k+1} | z_k)             [T, B]
    v: torch.Tensor  # v_k under the policy that sampled           [T, B, *D]
    noise_level: float | None = None  # the SDE's noise level that drew it: the loss must score at it
    TENSORS = ("z", "z_next", "t", "t_next", "log_prob", "v")
    sample = property(lambda self: self.z_next[-1])  # the final clean samples [B, *D]: what the reward sees
    def first_steps(self, n):  # the first n steps, the ones Flow-GRPO trains (9 of T = 10)
        _check(1 <= n <= self.z.shape[0], f"a trajectory of {self.z.shape[0]} steps has no first {n} steps")
        return Trajectory(**{k: getattr(self, k)[:n] for k in self.TENSORS}, noise_level=self.noise_level)
    def subset(self, idx):  # the samples idx, a minibatch: slice advantages and conditioning with this idx
        return Trajectory(**{k: getattr(self, k)[:, idx] for k in self.TENSORS}, noise_level=self.noise_level)

@torch.no_grad()
def rollout(velocity_fn, noise, sigmas, noise_level, generator=None):
    """B trajectories of T = len(sigmas) - 1 SDE steps from the noise z_0 [B, *D], one step at a time."""
    velocity_fn, B, T = checked(velocity_fn), noise.shape[0], len(sigmas) - 1
    t = sigmas[:-1, None].expand(T, B).to(noise.device).contiguous()  # [T, B]
    t_next = sigmas[1:, None].expand(T, B).to(noise.device).contiguous()  # [T, B]
    zs, log_probs, vs = [noise], [], []  # v is kept: routing scores windows by it (section 7)
    for k in range(T):
        v = velocity_fn(zs[k][None], t[k : k + 1])[0]  # one step, S = 1: [B, *D]
        z_next, log_prob, _, _ = sde_step(v, zs[k], t[k], t_next[k], noise_level, generator=generator)
        zs.append(z_next)
        log_probs.append(log_prob)
        vs.append(v)
    zs = torch.stack(zs)  # [T + 1, B, *D]
    return Trajectory(z=zs[:-1], z_next=zs[1:], t=t, t_next=t_next, log_prob=torch.stack(log_probs),  # [T, B]
                      v=torch.stack(vs), noise_level=noise_level)  # v: [T, B, *D]

# === 3. Group-relative advantages (GRPO) ===
def group_advantages(rewards, group_ids, eps=1e-4, global_std=False, clip=5.0):
    """A_n = (r_n - mean of n's group) / (std + eps), clipped to [-clip, clip]; rewards, group_ids: [B],
    a group the samples of one prompt. std: the group's (GRPO), or all rewards' if global_std (Flow-GRPO)."""
    _check(rewards.shape == group_ids.shape and rewards.ndim == 1, "rewards and group_ids must both be [B]")
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
    clip_range: float  # the ratio's clip epsilon (Flow-GRPO: 1e-4; the self-check's 0.2 lets clipping show)
    beta: float = 0.0  # weight of the KL to the reference model; 0 = no reference needed

def grpo_step_loss(log_prob, log_prob_old, advantages, clip_range,
                   mean=None, mean_ref=None, std_t=None, beta=0.0):
    """The clipped GRPO surrogate of one step, plus beta * KL to the reference. log_prob, log_prob_old,
    advantages: [B]; mean, mean_ref: [B, *D]; std_t: [B, 1, ...] from sde_step. Returns (loss, stats).
    ratio = exp(logp - logp_old);  L = mean_B max(-A ratio, -A clip(ratio, 1 - clip_range, 1 + clip_range))
    KL = mean_B mean_D (mu - mu_ref)^2 / (2 std_t^2), Flow-GRPO's: the two Gaussians' KL times |dt|."""
    ratio = torch.exp(log_prob - log_prob_old)  # [B]
    clipped = torch.clamp(ratio, 1 - clip_range, 1 + clip_range)  # [B]
    loss = torch.maximum(-advantages * ratio, -advantages * clipped).mean()
    kl = torch.zeros((), device=loss.device)
    if beta > 0:
        kl = ((mean - mean_ref) ** 2 / (2 * std_t**2)).mean(dim=tuple(range(1, mean.ndim))).mean()
        loss = loss + beta * kl
    # approx_kl = E[(logp - logp_old)^2] / 2, Schulman's k2 estimator, as Flow-GRPO logs it
    stats = {"clipfrac": (torch.abs(ratio - 1.0) > clip_range).float().mean().item(),
             "approx_kl": 0.5 * ((log_prob - log_prob_old) ** 2).mean().item(), "kl": kl.item()}
    return loss, stats
def make_step_loss(traj, advantages, start, stop, cfg, v_ref=None, log=None):
    """step_loss(i, v): the loss of step k = start + i < stop given its v [B, *D], over T (a trajectory's loss
    is its steps' mean, as Flow-GRPO's). v_ref [stop - start, B, *D] if cfg.beta > 0. Stats go to log."""
    _check(traj.noise_level in (None, cfg.noise_level), "score at the noise level the rollout sampled with")
    def step_loss(i, v):
        k = start + i  # the step in the trajectory
        step = (traj.z[k], traj.t[k], traj.t_next[k], cfg.noise_level, traj.z_next[k])  # the last: z_{k+1}
        _, log_prob, mean, std_t = sde_step(v, *step)  # scores the stored z_{k+1} under v
        mean_ref = sde_step(v_ref[i], *step)[2] if cfg.beta > 0 else None
        loss, stats = grpo_step_loss(log_prob, traj.log_prob[k], advantages, cfg.clip_range,
                                     mean, mean_ref, std_t, cfg.beta)
        if log is not None:
            log.append(stats)
        return loss / traj.z.shape[0]
    return step_loss

# === 5. Exact per-step backward: the baseline (what Flow-GRPO does) ===
# Both backward functions (here and in section 6) take one window, z [W, B, *D] and t [W, B], and
# step_loss(i, v) -> scalar. Like loss.backward(), they add to .grad. They return the summed loss.
def _check_window(z, t):
    _check(z.ndim >= 2 and t.shape == z.shape[:2], "a window needs z: [W, B, *D] and t: [W, B]")

def backward_exact(velocity_fn, z, t, step_loss):
    """The exact gradient of W steps: per step, one forward with graph and one backward pass."""
    _check_window(z, t)
    total = 0.0
    for i in range(z.shape[0]):
        loss = step_loss(i, velocity_fn(z[i : i + 1], t[i : i + 1])[0])  # v: [B, *D]
        loss.backward()  # frees this step's graph before the next step builds its own
        total += loss.item()
    return total

# === 6. JAGG: interpolate the Jacobians, back-propagate once ===
# Step k's loss L_k depends on the weights only through v_k (the states and the reference are fixed), so
#     grad = sum_k g_k^T J_k,    g_k = dL_k/dv_k (a few elementwise ops),    J_k = dv_theta(z_k, t_k)/dtheta,
# and each J_k costs a backward pass. Training-free DiT accelerators (Delta-DiT, ScalingCache) rely on
# features and velocities changing nearly linearly along a trajectory; JAGG bets its Jacobians do too, in t:
#     J_k ~= (1 - alpha_k) J_a + alpha_k J_b,    alpha_k = (t_a - t_k) / (t_a - t_b).
# Put that in the sum and collect the terms of J_a and of J_b:
#     grad ~= G_a^T J_a + G_b^T J_b,    G_a = sum_k (1 - alpha_k) g_k,    G_b = sum_k alpha_k g_k.
# That is the gradient of sum(v_a * G_a) + sum(v_b * G_b) with G_a, G_b held fixed: ONE forward with graph
# on the double batch [z_a; z_b], then ONE backward pass. Only the Jacobians are approximated: each g_k
# (its step's ratio and clip) uses the step's true velocity at the current weights.
# When is it exact? OURS: the abstract says "velocity linear in (z, t)"; we need more. In two lines:
#     v = A z + c t + e (A, c, e any functions of theta)  =>  J = A'z + c't + e' (' = d/dtheta), affine;
#     so J_k = (1 - alpha_k) J_a + alpha_k J_b  if  (z_k, t_k) = (1 - alpha_k)(z_a, t_a) + alpha_k(z_b, t_b).
# t_k holds by alpha's definition; z_k only if the states lie on the straight segment from z_a to z_b, and
# the SDE's noise takes them off it (self-check A). W = 2 has no interior step: always exact. Why weights
# in t, not in the step number: a flow path z_t = (1 - t) x_0 + t noise is a straight line in t.
def interpolation_weights(t):
    """alpha_k = (t_a - t_k) / (t_a - t_b) for a window's times t: [W, B]. Returns [W, B]: 0 at a, 1 at b."""
    span = t[0] - t[-1]  # [B]
    _check(bool((span != 0).all()), "a window's end steps must have different times (t_a != t_b)")
    return (t[0] - t) / span  # [W, B]

# Cost per window, in rows. Exact: W rows with grad, W backward passes. JAGG: 2 rows with grad in one
# backward pass, plus W - 2 rows without graph. The abstract's ~2x counts backward work, so its unit is
# rows with grad: W -> 2. Counting all the work, a row with grad costs about 3 forward-units (its backward
# costs about two forwards) and a row without graph 1: 3W -> W + 4, so 12 -> 8 at W = 4.
# Memory: exact frees each step's graph before building the next, so one row's activations are alive at a
# time; JAGG's double batch keeps two alive, about twice exact's peak. The interior forward keeps no graph,
# but while it runs it holds the current layer's activations for W - 2 rows: a transient that grows with W.
# Why velocity_fn gets several steps at once: JAGG calls it on the two end steps together and on the W - 2
# interior steps together; the rollout called it one step at a time. Both must give the same v up to
# rounding, or the first optimizer step after a rollout, meant to be on-policy, sees ratios away from 1
# (its approx_kl should be ~0, far under clip_range^2 / 2). z [S, B, *D] flattens step-major (row s * B + n
# is sample n at step s): repeat the conditioning as a block, c.repeat(S), never c.repeat_interleave(S);
# choose a network or expert (Wan 2.2 has two) per row from t, not once per call; no dropout.
# jagg_options.check_velocity_fn tests a velocity_fn for this; self-check D shows the first mistake.
def backward_jagg_window(velocity_fn, z, t, step_loss):
    """The paper's JAGG gradient of one window of W steps (a is i = 0, b is i = W - 1): ONE forward
    with graph on the double batch [z_a; z_b] and ONE backward pass of G_a^T J_a + G_b^T J_b."""
    _check_window(z, t)
    W = z.shape[0]
    acc = torch.promote_types(z.dtype, torch.float32)  # G_a, G_b are summed in fp32 at least
    alpha = interpolation_weights(t.to(acc)).reshape(t.shape + (1,) * (z.ndim - 2))  # [W, B, 1, ...]
    with torch.no_grad():  # the interior velocities: only for g_k, never back-propagated, so no graph
        v_mid = velocity_fn(z[1:-1], t[1:-1]) if W > 2 else z[:0]  # [W-2, B, *D]; W = 2: empty
    v_ab = velocity_fn(z[[0, -1]], t[[0, -1]])  # the double batch [z_a; z_b], with graph: [2, B, *D]
    v = torch.cat([v_ab[:1].detach(), v_mid.to(v_ab.dtype), v_ab[1:].detach()])  # [W, B, *D], no graph
    # G_a = sum_k (1 - alpha_k) g_k,  G_b = sum_k alpha_k g_k, with each g_k from the loss alone
    G_a = torch.zeros(v.shape[1:], dtype=acc, device=z.device)  # [B, *D]
    G_b, total = torch.zeros_like(G_a), 0.0  # [B, *D], the summed loss
    for i in range(W):  # step k = a + i
        v_k = v[i].detach().requires_grad_(True)  # [B, *D], a leaf: differentiate the loss, not the network
        loss = step_loss(i, v_k)
        (g_k,) = torch.autograd.grad(loss, v_k)  # [B, *D]
        G_a += (1 - alpha[i]) * g_k.to(acc)
        G_b += alpha[i] * g_k.to(acc)
        total += loss.item()
    # One backward pass: d/dtheta [sum(v_a * G_a) + sum(v_b * G_b)] = G_a^T J_a + G_b^T J_b
    (v_ab[0] * G_a.to(v_ab.dtype) + v_ab[1] * G_b.to(v_ab.dtype)).sum().backward()
    return total

# === 7. Routing: which windows are linear enough for JAGG ===
# Windows tile the trained steps from the first; the last may be shorter (OURS, as is the default W = 4).
# T = 10 gives windows of 4, 4 and 2 steps; Flow-GRPO's 9 trained steps give 4, 4 and 1.
# The abstract routes by "a cosine-similarity rule" with a knob jagg_frac. OURS: the score and a rank rule.
# Score: the cosine of a window's interior velocities with the straight line between its end steps'. It is
# free (the rollout stored every v_k). It sees whether v bends along the window, not whether J does: a cheap
# hint, not a measure of JAGG's error. Self-check B prints the two side by side.
# Rule: scores sit near 1, on a scale that differs by model, so jagg_frac is not a threshold but the share
# of windows of 3 or more steps that go to JAGG, highest scores first; the rest train exactly. A 2-step
# window has no interior step, so JAGG would save nothing there. The count is Python's round() (halves to
# even). Worked example, self-check B: steps 0-3, 4-7 and 8-9 score 0.86, 0.97 and 1; two are eligible.
# jagg_frac 0.5 takes round(1.0) = 1, the best, 4-7: 4 + 2 + 2 = 8 rows with grad, not 10. 0.25 takes none.
def window_bounds(num_steps, window):
    """Split T steps into windows of W steps: [(start, stop), ...], stop = b + 1; the last may be shorter."""
    _check(window >= 2, f"window must be >= 2 steps (JAGG interpolates between two end steps), got {window}")
    _check(window <= num_steps, f"window ({window}) is longer than the trajectory ({num_steps} steps)")
    return [(start, min(start + window, num_steps)) for start in range(0, num_steps, window)]
def linearity_score(v, t):
    """Cosine of the interior velocities v_k with (1 - alpha_k) v_a + alpha_k v_b, averaged over
    interior steps and samples. v: [W, B, *D], t: [W, B]. 1.0 when W <= 2."""
    if v.shape[0] <= 2:
        return 1.0
    alpha = interpolation_weights(t.float())  # [W, B]
    alpha, v = alpha.reshape(alpha.shape + (1,) * (v.ndim - 2)), v.float()  # [W, B, 1, ...], [W, B, *D]
    v_line = (1 - alpha) * v[:1] + alpha * v[-1:]  # [W, B, *D]
    cos = torch.cosine_similarity(v[1:-1].flatten(2), v_line[1:-1].flatten(2), dim=-1)  # [W-2, B]
    return cos.mean().item()
def route_windows(scores, lengths, jagg_frac):
    """One bool per window (scores, lengths: one each), True for the round(jagg_frac x eligible) best."""
    _check(0.0 <= jagg_frac <= 1.0, f"jagg_frac must be in [0, 1], got {jagg_frac}")
    eligible = [w for w, n in enumerate(lengths) if n >= 3]
    # sorted() is stable: among equal scores the earlier window wins, so routing is reproducible
    chosen = set(sorted(eligible, key=lambda w: -scores[w])[: round(jagg_frac * len(eligible))])
    return [w in chosen for w in range(len(scores))]

# === 8. One training step over a batch of trajectories ===
# Window by window, JAGG's windows by backward_jagg_window, the others by backward_exact; then an optimizer
# step. "paper_" marks the paper's method alone: the trainers run this loop with options
# (jagg_options.window_gradients hands each window to backward_jagg_window / backward_exact).
def paper_gradients(velocity_fn, traj, advantages, cfg, window=4, jagg_frac=1.0, ref_velocity_fn=None):
    """Add to .grad the gradient of the batch's GRPO loss (the mean over traj's T steps and B samples;
    advantages: [B]), window by window. Returns (stats, routed), routed[w] True for JAGG."""
    velocity_fn = checked(velocity_fn)
    bounds = window_bounds(traj.z.shape[0], window)  # [(start, stop), ...]
    lengths = [stop - start for start, stop in bounds]
    scores = [linearity_score(traj.v[start:stop], traj.t[start:stop]) for start, stop in bounds]
    routed = route_windows(scores, lengths, jagg_frac)
    log, loss = [], 0.0  # log: every step's stats from grpo_step_loss
    for (start, stop), use_jagg in zip(bounds, routed):
        z, t = traj.z[start:stop], traj.t[start:stop]  # [W, B, *D], [W, B]
        with torch.no_grad():  # the KL reference's velocities [W, B, *D]
            v_ref = checked(ref_velocity_fn)(z, t) if cfg.beta > 0 else None
        step_loss = make_step_loss(traj, advantages, start, stop, cfg, v_ref, log)
        backward = backward_jagg_window if use_jagg else backward_exact
        loss += backward(velocity_fn, z, t, step_loss)
    stats = {key: sum(s[key] for s in log) / len(log) for key in log[0]}  # means over steps
    grad_rows = sum(2 if use_jagg else n for n, use_jagg in zip(lengths, routed))  # section 6's cost
    stats.update(loss=loss, grad_rows=grad_rows, window_scores=scores,
                 routed_frac=sum(routed) / max(sum(n >= 3 for n in lengths), 1))  # of windows of 3+ steps
    return stats, routed

def paper_train_step(velocity_fn, optimizer, traj, advantages, cfg, window=4, jagg_frac=1.0,
                     ref_velocity_fn=None):
    """paper_gradients, clipped to norm 1 (Flow-GRPO's max_grad_norm), then an optimizer step."""
    optimizer.zero_grad(set_to_none=True)
    stats, routed = paper_gradients(velocity_fn, traj, advantages, cfg, window, jagg_frac, ref_velocity_fn)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    stats["grad_norm"] = torch.nn.utils.clip_grad_norm_(params, 1.0).item()
    optimizer.step()
    return stats, routed

# === Run it: python jagg.py prints what a learner should see; an assert checks each line ===
def _self_check():
    torch.set_default_dtype(torch.float64)  # so that "exact" shows as ~1e-16, not fp32's ~1e-7
    torch.manual_seed(0)
    nn, T, W, B, D = torch.nn, 10, 4, 16, 3
    calls = []  # one record per velocity_fn call: which network, how many steps, grad on or off
    def velocity_fn_of(net, name="policy"):  # velocity_fn(z [S, B, D], t [S, B]) -> v [S, B, D]
        def velocity_fn(z, t):
            calls.append({"net": name, "steps": z.shape[0], "grad": torch.is_grad_enabled()})
            return net(torch.cat([z, t[..., None]], dim=-1))  # the network sees (z, t): [S, B, D + 1]
        return velocity_fn
    def flat_grad(net, backward, *args):  # run backward(velocity_fn, *args) from zero; net's gradient [P]
        net.zero_grad(set_to_none=True)
        backward(velocity_fn_of(net), *args)
        return torch.cat([p.grad.flatten() for p in net.parameters()])
    # A. Section 6's exactness condition, and each half of it failing on its own. A made-up loss.
    linear = nn.Sequential(nn.Linear(D + 1, D + 1), nn.Linear(D + 1, D))  # v affine in (z, t), not in theta
    t = torch.tensor([0.9, 0.7, 0.5, 0.2])[:, None].expand(W, B)  # [W, B], uneven: weights by step would fail
    alpha, w = interpolation_weights(t)[..., None], torch.randn(W, B, D)  # [W, B, 1], [W, B, D]
    straight = (1 - alpha) * torch.randn(B, D) + alpha * torch.randn(B, D)  # [W, B, D], on a segment
    bent = straight + 0.5 * alpha * (1 - alpha)  # [W, B, D], off it
    net = nn.Sequential(nn.Linear(D + 1, 32), nn.Tanh(), nn.Linear(32, D))  # J not affine in (z, t)
    def loss(i, v):
        return (w[i] * v).sum() + (v**2).sum()
    def jagg_error(net, z):  # |JAGG - exact| / |exact| of net's gradient on the window z
        exact = flat_grad(net, backward_exact, z, t, loss)
        return ((flat_grad(net, backward_jagg_window, z, t, loss) - exact).norm() / exact.norm()).item()
    exact_case = jagg_error(linear, straight)
    bent_case, tanh_case = jagg_error(linear, bent), jagg_error(net, straight)
    assert exact_case < 1e-12 and bent_case > 1e-3 and tanh_case > 1e-3
    print(f"A. |JAGG - exact| / |exact| on a window of W = {W}: {exact_case:.1e} with v affine in (z, t) and "
          f"straight states;\n   {bent_case:.1e} when the states bend; {tanh_case:.1e} with a tanh network "
          f"on the straight states")
    # B. The tanh network on its own rollouts, groups of 4, with a KL to a reference a little away.
    frozen = copy.deepcopy(net).requires_grad_(False)
    frozen[0].bias.data += 0.05  # so that the KL term has a gradient
    ref, cfg = velocity_fn_of(frozen, "reference"), LossConfig(noise_level=0.7, clip_range=0.2, beta=0.04)
    traj = rollout(velocity_fn_of(net), torch.randn(B, D), sigma_schedule(T), noise_level=0.7)
    advantages = group_advantages(-traj.sample.norm(dim=-1), torch.arange(B) // 4).double()  # reward: near 0
    bounds = window_bounds(T, W)
    assert bounds == [(0, 4), (4, 8), (8, 10)] and window_bounds(9, W) == [(0, 4), (4, 8), (8, 9)]
    print(f"B. the tanh network on its own rollouts, T = {T}, W = {W}: windows {bounds} (start, stop)")
    for start, stop in bounds:
        z, t = traj.z[start:stop], traj.t[start:stop]  # [W, B, D], [W, B]
        step_loss = make_step_loss(traj, advantages, start, stop, cfg, ref(z, t))
        exact = flat_grad(net, backward_exact, z, t, step_loss)
        jagg = flat_grad(net, backward_jagg_window, z, t, step_loss)
        cos = torch.cosine_similarity(exact, jagg, dim=0).item()
        score = linearity_score(traj.v[start:stop], t)
        assert cos > 0.9 if stop - start > 2 else abs(cos - 1) < 1e-12
        print(f"   steps {start}-{stop - 1}: routing score {score:.5f}, "
              f"JAGG's gradient cosine to exact {cos:.5f}")
    # C. The whole batch at jagg_frac 0 (all exact), 1 and 0.5, counting the network's calls.
    expected = {0.0: {"routed": [False, False, False], "rows": 10, "passes": 10, "units": 30},
                1.0: {"routed": [True, True, False], "rows": 6, "passes": 4, "units": 22},
                0.5: {"routed": [False, True, False], "rows": 8, "passes": 7, "units": 26}}
    grad_exact = flat_grad(net, paper_gradients, traj, advantages, cfg, W, 0.0, ref)
    for frac, want in expected.items():
        calls.clear()
        net.zero_grad(set_to_none=True)
        stats, routed = paper_gradients(velocity_fn_of(net), traj, advantages, cfg, W, frac, ref)
        grad = torch.cat([p.grad.flatten() for p in net.parameters()])  # [P]
        cos = torch.cosine_similarity(grad, grad_exact, dim=0).item()
        rows = [c["steps"] for c in calls if c["grad"]]  # each a forward with graph, then a backward pass
        no_graph = sum(c["steps"] for c in calls if c["net"] == "policy" and not c["grad"])  # the interiors
        units = 3 * sum(rows) + no_graph
        assert routed == want["routed"] and sum(rows) == stats["grad_rows"] == want["rows"]
        assert len(rows) == want["passes"] and units == want["units"] and cos > 0.99
        print(f"C. jagg_frac {frac}: windows to JAGG {routed}; {sum(rows)} rows with grad in {len(rows)} "
              f"backward passes,\n   {no_graph} rows without graph; {units} forward-units; "
              f"cosine to exact {cos:.5f}")
    stats_9, _ = paper_gradients(velocity_fn_of(net), traj.first_steps(9), advantages, cfg, W, 1.0, ref)
    assert stats_9["grad_rows"] == 5
    print(f"   Rows with grad, the abstract's unit: 10 -> 6 here, 9 -> {stats_9['grad_rows']} on Flow-GRPO's "
          f"9 trained steps\n   (windows {window_bounds(9, W)}), 4 -> 2 in one window: its ~2x. "
          f"Forward-units also count\n   the interior forwards JAGG keeps: 30 -> 22 = {30 / 22:.2f}x, "
          f"another measure.")
    # D. A tiny GRPO run: 4 prompts, 8 samples each. A prompt is a target point; reward -|sample - target|.
    prompts, prompt_of, lr = torch.randn(4, 2), torch.arange(32) // 8, 3e-2  # prompt_of: [B], each sample's
    policy = nn.Sequential(nn.Linear(2 + 1 + 2, 32), nn.Tanh(), nn.Linear(32, 2))  # sees (z, t, prompt)
    optimizer, cfg = torch.optim.Adam(policy.parameters(), lr=lr), LossConfig(noise_level=0.7, clip_range=0.2)
    def prompted_velocity_fn(c, interleave=False):  # c: [B, 2], each sample's prompt
        def velocity_fn(z, t):  # z: [S, B, 2], t: [S, B], flattened step-major to S * B rows
            S, n = t.shape
            c_rows = c.repeat_interleave(S, dim=0) if interleave else c.repeat(S, 1)  # [S * B, 2]
            x = torch.cat([z.reshape(S * n, 2), t.reshape(S * n, 1), c_rows], dim=-1)  # [S * B, 5]
            return policy(x).reshape(z.shape)  # [S, B, 2]
        return velocity_fn
    print(f"D. a tiny GRPO run, Adam lr {lr}: each epoch a rollout, then 2 optimizer steps on half batches")
    rewards = []
    for epoch in range(10):
        c = prompts[prompt_of]  # [B, 2]
        traj = rollout(prompted_velocity_fn(c), torch.randn(len(c), 2), sigma_schedule(T), noise_level=0.7)
        reward = -(traj.sample - c).norm(dim=-1)  # [B]
        advantages = group_advantages(reward, prompt_of).double()  # [B]
        rewards.append(reward.mean().item())
        approx_kl = []
        for idx in torch.randperm(len(c)).chunk(2):  # the samples of one minibatch
            velocity_fn = prompted_velocity_fn(c[idx])  # slice the conditioning with the same idx
            stats, _ = paper_train_step(velocity_fn, optimizer, traj.subset(idx), advantages[idx], cfg, W)
            approx_kl.append(stats["approx_kl"])
        assert approx_kl[0] < 1e-20 and approx_kl[1] > 1e-8  # on-policy: every ratio 1, up to rounding
        print(f"   epoch {epoch}: reward {rewards[-1]:.3f}; approx_kl {approx_kl[0]:.1e} at the first step, "
              f"{approx_kl[1]:.1e} at the second")
    assert rewards[-1] > rewards[0] + 0.5
    # The step-major lesson: the same network, its conditioning repeated per sample instead of as a block.
    wrong, _ = paper_gradients(prompted_velocity_fn(c, interleave=True), traj, advantages, cfg, W)
    assert wrong["approx_kl"] > 1e-8
    print(f"   c.repeat_interleave(S) for c.repeat(S): approx_kl {wrong['approx_kl']:.1e} at the first step")
    print("ok")

if __name__ == "__main__":
    _self_check()
