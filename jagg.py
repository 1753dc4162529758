"""JAGG: GRPO for flow-matching transformers that back-propagates 2 steps of each window of W, not W.

A reference implementation of JAGG (Jacobian-Aggregated Group Gradient, arXiv 2607.17572, 2026), built on
Flow-GRPO's SDE sampler and loss (Liu et al., arXiv 2505.05470), to be read from top to bottom. The paper's
abstract gives the idea. Over a window of W sampling steps, interpolate the network's Jacobians in t between the
window's two end steps, so that one backward pass serves the whole window. A cosine-similarity rule with a knob,
jagg_frac, picks the windows that take JAGG. Where the abstract is silent we chose, and say OURS. The authors'
early code (github.com/SchumiDing/eff_grpo) has the same algebra, with weights by step index.
The saving: Flow-GRPO trains 9 steps per sample; JAGG with W = 4 back-propagates 5 of them, not 9. Counting a
backward as two forwards, the gradient costs 19 forwards' worth, not 27 (15 right after a rollout; section 6).

Notation (code name -> symbol)
    T, B       number of sampling steps; number of samples in the batch
    W          window length: a window covers the steps a, a + 1, ..., b = a + W - 1, in code i = k - a
    z_k, t_k   the state before step k; its time t_k = sigma_k (1 = pure noise, 0 = clean sample)
    v_k        v_theta(z_k, t_k), the velocity the network predicts at step k
    g_k        dL_k / dv_k, how step k's loss changes with v_k; cheap, from the loss alone
    J_k        dv_k / dtheta, how v_k changes with the weights; costs a backward pass through the network
    alpha_k    (t_a - t_k) / (t_a - t_b): 0 at the first step a, 1 at the last step b
    G_a, G_b   sum_k (1 - alpha_k) g_k and sum_k alpha_k g_k: a window's loss signal, gathered at a and b
Shapes: S a number of steps, *D one sample's shape, P the number of weights. A row: one sample at one step.
The network enters only as velocity_fn(z [S, B, *D], t [S, B]) -> v [S, B, *D] (section 9).
Run `python jagg.py` for its self-check (seconds). The repository's tests check every function against autograd
and explicit Jacobians: `python -m pytest -q tests/test_jagg.py`.
"""

import copy
import itertools
import math
from dataclasses import dataclass, replace
from functools import partial
import torch

def _check(ok, message):  # a short ValueError for a mistake a learner is likely to make
    if not ok:
        raise ValueError(message)

# === 1. SDE step: the Gaussian policy of one sampling step (Flow-GRPO) ===
# The flow ODE has no log-probability. An SDE with the same marginals makes each step a Gaussian
# policy, z_{k+1} ~ N(mu_k, std_t^2 |dt|), and GRPO needs the ratio of such densities.
def sigma_schedule(num_steps, shift=3.0):
    """sigma_0 = 1 > ... > sigma_T = 0 [T+1], fp32, for the toy: an even grid bent toward noise by SD3's shift. A
    real model takes its scheduler's sigmas: diffusers' SD3 grid ends 0.009 -> 0, this one 0.25 -> 0 (T = 10)."""
    s = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)  # [T+1]
    return (shift * s / (1 + (shift - 1) * s)).float()  # [T+1]

def sde_step(v, z, sigma, sigma_next, noise_level, prev_sample=None, generator=None):
    """Flow-GRPO's sde_step_with_logprob, sigma -> sigma_next (v, z: [B, *D]; sigma, sigma_next: [B]).
    Returns z_{k+1} [B, *D] (sampled, or prev_sample), log_prob [B] (mean over *D), mu [B, *D], std_t."""
    dtype = torch.promote_types(torch.result_type(v, z), torch.float32)  # fp32 at least: bf16 moves a ratio by 1e-4
    v, z = v.to(dtype), z.to(dtype)
    shape = (-1,) + (1,) * (z.ndim - 1)  # [B, 1, ...]: one sigma per sample, broadcast over *D
    sigma, sigma_next = sigma.to(dtype).reshape(shape), sigma_next.to(dtype).reshape(shape)
    dt = sigma_next - sigma  # [B, 1, ...], negative: sigma falls from noise to data
    # std_t [B, 1, ...] = noise_level sqrt(sigma / (1 - sigma)). At sigma = 1 that divides by zero, so
    # there Flow-GRPO uses 1 - sigma_next in the denominator instead, and so do we.
    std_t = noise_level * torch.sqrt(sigma / (1 - torch.where(sigma > 1 - 1e-4, sigma_next, sigma)))
    # Euler on dz = [v + std_t^2 / (2 sigma) (z + (1 - sigma) v)] dsigma + std_t dw:
    # mu [B, *D] = z (1 + std_t^2 / (2 sigma) dt) + v (1 + std_t^2 (1 - sigma) / (2 sigma)) dt
    mean = z * (1 + std_t**2 / (2 * sigma) * dt) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
    std = std_t * torch.sqrt(-dt)  # [B, 1, ...], the Gaussian's standard deviation
    if prev_sample is None:
        noise = torch.randn(z.shape, generator=generator, device=z.device, dtype=dtype)  # [B, *D]
        prev_sample = mean + std * noise
    # log N(x; mu, std^2) = -(x - mu)^2 / (2 std^2) - log std - log sqrt(2 pi), per element
    log_prob = -(prev_sample.detach() - mean) ** 2 / (2 * std**2) - torch.log(std)  # [B, *D]
    # Flow-GRPO takes the MEAN over the sample's dimensions *D, not the sum, so a log-ratio is the full
    # Gaussian's divided by the number of elements, presumably why its clip range is as small as 1e-4.
    log_prob = (log_prob - 0.5 * math.log(2 * math.pi)).mean(dim=tuple(range(1, z.ndim)))  # [B]
    return prev_sample.to(dtype), log_prob, mean, std_t

# === 2. Rollout: sample trajectories and keep what training needs ===
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
    TENSORS = ("z", "z_next", "t", "t_next", "log_prob", "v")  # the fields above that are tensors
    @property
    def sample(self):  # z_T, the clean samples [B, *D] that the reward sees (take it before first_steps)
        return self.z_next[-1]
    def first_steps(self, n):  # the first n steps, the ones Flow-GRPO trains (9 of T = 10)
        _check(1 <= n <= len(self.z), f"a trajectory of {len(self.z)} steps has no first {n} steps")
        return replace(self, **{k: getattr(self, k)[:n] for k in self.TENSORS})
    def subset(self, idx):  # a minibatch of the samples idx; slice advantages and conditioning with idx too
        return replace(self, **{k: getattr(self, k)[:, idx] for k in self.TENSORS})

@torch.no_grad()
def rollout(velocity_fn, noise, sigmas, noise_level, generator=None):
    """B trajectories of T = len(sigmas) - 1 SDE steps from the noise z_0 [B, *D], one step at a time."""
    T, B = len(sigmas) - 1, noise.shape[0]
    t = sigmas[:-1, None].expand(T, B).to(noise.device).contiguous()  # [T, B]
    t_next = sigmas[1:, None].expand(T, B).to(noise.device).contiguous()  # [T, B]
    zs, log_probs, vs = [noise], [], []  # v is kept: routing scores windows by it (section 7)
    for k in range(T):
        vs.append(velocity_fn(zs[k][None], t[k : k + 1])[0])  # one step, S = 1: [B, *D]
        _check(vs[k].shape == noise.shape, f"velocity_fn gave {vs[k].shape[1:]}, not z's shape: it would broadcast")
        z_next, log_prob, _, _ = sde_step(vs[k], zs[k], t[k], t_next[k], noise_level, generator=generator)
        zs.append(z_next)
        log_probs.append(log_prob)
    zs = torch.stack(zs)  # [T + 1, B, *D]
    return Trajectory(zs[:-1], zs[1:], t, t_next, torch.stack(log_probs), torch.stack(vs), noise_level)

# === 3. Group-relative advantages (GRPO) ===
def group_advantages(rewards, group_ids, eps=1e-4, global_std=False, clip=5.0):
    """A_n = (r_n - mean of n's group) / (std + eps), clipped to [-clip, clip]; rewards, group_ids: [B].
    A group is the samples of one prompt; std is the group's (GRPO), or the batch's if global_std."""
    _check(rewards.shape == group_ids.shape and rewards.ndim == 1, "rewards and group_ids must be [B]")
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
    clip_range: float  # the ratio's clip (Flow-GRPO: 1e-4; the self-check's 0.2 lets clipping show)
    beta: float = 0.0  # weight of the KL to a reference model; 0 needs no reference

def grpo_step_loss(log_prob, log_prob_old, advantages, clip_range, mean=None, mean_ref=None, std_t=None, beta=0.0):
    """The clipped GRPO surrogate of one step, plus beta * KL to the reference. log_prob, log_prob_old,
    advantages: [B]; mean, mean_ref: [B, *D]; std_t: [B, 1, ...] from sde_step. Returns (loss, stats).
    ratio = exp(logp - logp_old);  L = mean_B max(-A ratio, -A clip(ratio, 1 - c, 1 + c)), c = clip_range
    KL = mean_B mean_D (mu - mu_ref)^2 / (2 std_t^2), Flow-GRPO's: the two Gaussians' KL times |dt|."""
    ratio = torch.exp(log_prob - log_prob_old)  # [B]
    clipped = torch.clamp(ratio, 1 - clip_range, 1 + clip_range)  # [B]
    loss = torch.maximum(-advantages * ratio, -advantages * clipped).mean()
    kl = torch.zeros((), device=loss.device)
    if beta > 0:
        kl = ((mean - mean_ref) ** 2 / (2 * std_t**2)).mean(dim=tuple(range(1, mean.ndim))).mean()
        loss = loss + beta * kl
    stats = {"clipfrac": (torch.abs(ratio - 1.0) > clip_range).float().mean().item(), "kl": kl.item(),
             "approx_kl": 0.5 * ((log_prob - log_prob_old) ** 2).mean().item()}  # Schulman's k2, as Flow-GRPO logs
    return loss, stats

def make_step_loss(traj, advantages, start, stop, cfg, v_ref=None, log=None):
    """step_loss(i, v): the loss of step k = start + i given its v [B, *D], over the trajectory's steps (its
    loss is their mean, as Flow-GRPO's). v_ref [stop - start, B, *D]: the reference's v, for cfg.beta > 0."""
    _check(traj.noise_level in (None, cfg.noise_level), "score at the noise level the rollout drew with")
    def step_loss(i, v):
        k = range(start, stop)[i]  # the step in the trajectory
        step = (traj.z[k], traj.t[k], traj.t_next[k], cfg.noise_level, traj.z_next[k])  # last: z_{k+1}
        _, log_prob, mean, std_t = sde_step(v, *step)  # scores the stored z_{k+1} under v
        mean_ref = sde_step(v_ref[i], *step)[2] if cfg.beta > 0 else None
        loss, stats = grpo_step_loss(log_prob, traj.log_prob[k], advantages, cfg.clip_range,
                                     mean, mean_ref, std_t, cfg.beta)
        if log is not None:  # every step's stats, for the caller to average
            log.append(stats)
        return loss / traj.z.shape[0]
    return step_loss

# === 5. Exact per-step backward: the baseline (what Flow-GRPO does) ===
def backward_exact(velocity_fn, z, t, step_loss):
    """The exact gradient of a window z [W, B, *D], t [W, B] whose step i's loss is step_loss(i, v): per step,
    one forward with graph and one backward pass. Like loss.backward(), it adds to .grad; returns the loss."""
    total = 0.0
    for i in range(z.shape[0]):
        loss = step_loss(i, velocity_fn(z[i : i + 1], t[i : i + 1])[0])  # v: [B, *D]
        loss.backward()  # frees this step's graph before the next step builds its own
        total += loss.item()
    return total

# === 6. JAGG: interpolate the Jacobians, back-propagate once ===
# Step k's loss L_k depends on the weights only through v_k (the states and the reference are fixed), so
#     grad = sum_k g_k^T J_k,   g_k = dL_k/dv_k (elementwise ops),   J_k = dv_theta(z_k, t_k)/dtheta
# and each J_k costs a backward pass. JAGG assumes that the Jacobians, like DiT features (Delta-DiT), change
# nearly linearly along a trajectory:
#     J_k ~= (1 - alpha_k) J_a + alpha_k J_b,    alpha_k = (t_a - t_k) / (t_a - t_b).
# Putting this into the sum and collecting the terms in J_a and in J_b gives
#     grad ~= G_a^T J_a + G_b^T J_b,    G_a = sum_k (1 - alpha_k) g_k,    G_b = sum_k alpha_k g_k,
# the gradient of sum(v_a * G_a) + sum(v_b * G_b) with G_a and G_b held fixed: one forward pass with graph on
# the double batch [z_a; z_b], then one backward pass. Each g_k still needs v_k at the current weights: at an
# interior step, a forward pass without graph (OURS). Right after a rollout, traj.v holds it (on_policy, section 8).
# When is it exact? The abstract says: when v is linear in (z, t). We find two conditions (OURS):
#   (1) J is affine in (z, t), as for v = A z + c t + e with A, c and e any functions of theta;
#   (2) each state lies on the segment from z_a to z_b, where t puts it: z_k = (1 - alpha_k) z_a + alpha_k z_b.
# Then (z_k, t_k) is the alpha_k-mix of (z_a, t_a) and (z_b, t_b), and an affine J gives exactly
# J_k = (1 - alpha_k) J_a + alpha_k J_b. Self-check A breaks each condition alone. A sampler's states lie far off
# the segment, mostly because of the SDE's noise: there JAGG is an approximation (self-check B measures it).
def interpolation_weights(t):
    """alpha_k = (t_a - t_k) / (t_a - t_b) of a window's times t [W, B]: [W, B], 0 at a, 1 at b."""
    span = t[0] - t[-1]  # [B]
    _check(bool((span != 0).all()), "a window's end steps must have different times (t_a != t_b)")
    return (t[0] - t) / span  # [W, B]

def backward_jagg_window(velocity_fn, z, t, step_loss, alpha=None, v_mid=None):
    """JAGG's gradient of a window (a: i = 0, b: i = W - 1): one forward with graph, one backward. alpha [W, B]:
    the weights, by default the paper's interpolation_weights(t); the authors' early code weights by step index.
    v_mid [W-2, B, *D]: the interior velocities if known at the current weights, saving their forward (OURS)."""
    W = z.shape[0]
    acc = torch.promote_types(z.dtype, torch.float32)  # G_a, G_b are summed in fp32 at least
    alpha = interpolation_weights(t.to(acc)) if alpha is None else alpha  # [W, B]
    alpha = alpha.to(acc).reshape(t.shape + (1,) * (z.ndim - 2))  # [W, B, 1, ...]
    if v_mid is None:
        with torch.no_grad():  # the interior velocities: only for g_k, never back-propagated, so no graph
            v_mid = velocity_fn(z[1:-1], t[1:-1]) if W > 2 else z[:0]  # [W-2, B, *D]; W = 2: empty
    v_ab = velocity_fn(z[[0, -1]], t[[0, -1]])  # the double batch [z_a; z_b], with graph: [2, B, *D]
    v = torch.cat([v_ab[:1].detach(), v_mid.to(v_ab.dtype), v_ab[1:].detach()])  # [W, B, *D], no graph
    # G_a = sum_k (1 - alpha_k) g_k,  G_b = sum_k alpha_k g_k, with each g_k from the loss alone
    G_a, G_b = torch.zeros((2, *v.shape[1:]), dtype=acc, device=z.device)  # [B, *D] each
    total = 0.0  # the summed loss
    for i in range(W):  # step k = a + i
        v_k = v[i].detach().to(acc).requires_grad_(True)  # [B, *D], a leaf: the loss's gradient, not the net's
        loss = step_loss(i, v_k)
        (g_k,) = torch.autograd.grad(loss, v_k)  # [B, *D], in fp32 at least
        G_a += (1 - alpha[i]) * g_k
        G_b += alpha[i] * g_k
        total += loss.item()
    # One backward pass: d/dtheta [sum(v_a * G_a) + sum(v_b * G_b)] = G_a^T J_a + G_b^T J_b
    (v_ab[0] * G_a.to(v_ab.dtype) + v_ab[1] * G_b.to(v_ab.dtype)).sum().backward()
    return total

# Cost of one window. Exact: W rows with graph and W backward passes. JAGG: 2 rows with graph, 1 backward pass and
# W - 2 rows without graph; we read the paper's "~2x" as this drop from W to 2 (OURS). With a backward costing two
# forwards (ASSUMED): 3W forwards' worth against W + 4, 12 against 8 at W = 4 (6 on-policy). A KL reference adds W
# rows without graph to both. Memory: JAGG holds 2B rows of graph (4B with CFG); z_a, z_b one at a time hold B.

# === 7. Routing: which windows take JAGG ===
# The abstract routes windows by "a cosine-similarity rule" with a knob jagg_frac. The score and the rule are OURS.
# Score: the mean cosine between a window's interior velocities and the straight line in t between its end
# velocities. It is free, as the rollout kept every v_k, but it sees how v bends, not J.
# Rule: the jagg_frac share of windows with the highest scores take JAGG. (Scores sit near 1, on scales that differ
# between models, so a threshold would not carry over.) The default, jagg_frac = 1, sends every window to JAGG.
# Self-check B finds that it mostly ranks windows by noise level: a fixed rule, JAGG on the low-noise windows,
# picks the same windows there, and any jagg_frac below 1 should be compared with that rule.
# Windows tile the trained steps from the first (W = 4, OURS). A window of 2 steps has nothing to save: it is exact.
def window_bounds(num_steps, window):
    """Split T steps into windows of W: [(start, stop), ...], stop = b + 1; the last may be shorter."""
    _check(window >= 2, f"window must be >= 2 steps (JAGG interpolates two end steps), got {window}")
    _check(window <= num_steps, f"window ({window}) is longer than the trajectory ({num_steps} steps)")
    return [(start, min(start + window, num_steps)) for start in range(0, num_steps, window)]

def linearity_score(v, t):
    """Mean cosine of the interior v_k with (1 - alpha_k) v_a + alpha_k v_b; v [W, B, *D], t [W, B]."""
    if v.shape[0] <= 2:
        return 1.0
    alpha = interpolation_weights(t.float()).reshape(t.shape + (1,) * (v.ndim - 2))  # [W, B, 1, ...]
    v = v.float()  # [W, B, *D]
    v_line = (1 - alpha) * v[:1] + alpha * v[-1:]  # [W, B, *D]
    cos = torch.cosine_similarity(v[1:-1].flatten(2), v_line[1:-1].flatten(2), dim=-1)  # [W-2, B]
    return cos.mean().item()

def route_windows(scores, lengths, jagg_frac):
    """One bool per window (scores, lengths: one each), True for the round(jagg_frac x eligible) best
    windows of 3 or more steps; round() takes halves to even. Among equal scores the earlier window wins."""
    _check(0.0 <= jagg_frac <= 1.0, f"jagg_frac must be in [0, 1], got {jagg_frac}")
    eligible = [w for w, n in enumerate(lengths) if n >= 3]
    chosen = set(sorted(eligible, key=lambda w: -scores[w])[: round(jagg_frac * len(eligible))])
    return [w in chosen for w in range(len(scores))]

# === 8. One training step's gradient over a batch of trajectories ===
# paper_gradients: the paper's JAGG with our routing; self-check D wraps it in the optimizer step. The trainers
# run this loop with options (jagg_options.py), by default calling backward_jagg_window and backward_exact.
def paper_gradients(velocity_fn, traj, advantages, cfg, window=4, jagg_frac=1.0, ref_fn=None, on_policy=False):
    """Add to .grad the gradient of the batch's GRPO loss (the mean over traj's T steps and B samples), window by
    window. advantages: [B]; ref_fn: the reference's velocity_fn, if cfg.beta > 0; on_policy: the weights are still
    those that sampled traj (one step after a rollout), so JAGG's interiors take traj.v. Returns (stats, routed)."""
    bounds = window_bounds(traj.z.shape[0], window)  # [(start, stop), ...]
    lengths = [stop - start for start, stop in bounds]
    scores = [linearity_score(traj.v[start:stop], traj.t[start:stop]) for start, stop in bounds]
    routed = route_windows(scores, lengths, jagg_frac)
    log, loss = [], 0.0  # every step's stats from grpo_step_loss; the summed loss
    for (start, stop), use_jagg in zip(bounds, routed):
        z, t = traj.z[start:stop], traj.t[start:stop]  # [W, B, *D], [W, B]
        with torch.no_grad():  # the KL reference's velocities [W, B, *D]
            v_ref = ref_fn(z, t) if cfg.beta > 0 else None
        step_loss = make_step_loss(traj, advantages, start, stop, cfg, v_ref, log)
        v_mid = traj.v[start + 1 : stop - 1] if on_policy else None  # [W-2, B, *D] or None: a forward
        backward = partial(backward_jagg_window, v_mid=v_mid) if use_jagg else backward_exact
        loss += backward(velocity_fn, z, t, step_loss)
    stats = {key: sum(s[key] for s in log) / len(log) for key in log[0]}  # means over steps
    grad_rows = sum(2 if use_jagg else n for n, use_jagg in zip(lengths, routed))  # section 6's cost
    stats.update(loss=loss, grad_rows=grad_rows, window_scores=scores,
                 routed_frac=sum(routed) / max(sum(n >= 3 for n in lengths), 1))  # of 3+ step windows
    return stats, routed

# === 9. Using your own model ===
# Wrap your network as velocity_fn(z [S, B, *D], t [S, B]) -> v [S, B, *D], with t = sigma and v = dz/dsigma =
# noise - data (SD3's rectified flow); cast z to the network's dtype inside it (sde_step keeps states in fp32).
# The rollout calls it one step at a time, JAGG on several steps at once; both must give the same v up to
# rounding, or the first update after a rollout sees ratios away from 1. So use no dropout, and flatten z
# step-major (row s * B + n is sample n at step s): repeat a condition c [B, ...] as a block, c.repeat(S, 1, ...),
# never c.repeat_interleave(S, 0). With classifier-free guidance, return the guided v_u + s (v_c - v_u) that the
# sampler steps with; SD3's transformer takes t * 1000. Both backward functions add to .grad like loss.backward():
# accumulate minibatches as usual; under DDP, skip the sync (model.no_sync()) on all but a step's last backward.

# === Self-check: python jagg.py prints, in a few seconds, what a learner should see; asserts check it ===
def _velocity_fn(net, c=None, calls=None):  # net on (z, t) and each sample's condition c [B, C], as in section 9
    def velocity_fn(z, t):  # z [S, B, d], t [S, B] -> v [S, B, d]
        if calls is not None:  # for C: each call's number of steps, and whether it builds a graph
            calls.append((z.shape[0], torch.is_grad_enabled()))
        x = [z.flatten(0, 1), t.reshape(-1, 1)] + ([c.repeat(len(z), 1)] if c is not None else [])  # rows [S * B]
        return net(torch.cat(x, dim=-1)).reshape(z.shape)  # [S, B, d]
    return velocity_fn
def _mlp(n_in, n_out):  # a network whose velocity is not linear
    return torch.nn.Sequential(torch.nn.Linear(n_in, 32), torch.nn.Tanh(), torch.nn.Linear(32, n_out))
def _grad(net, backward, *args):  # the gradient [P] that backward(*args) leaves in net's .grad
    net.zero_grad(set_to_none=True)
    backward(*args)
    return torch.cat([p.grad.flatten() for p in net.parameters()])
def _error(estimate, exact):  # |estimate - exact| / |exact|
    return ((estimate - exact).norm() / exact.norm()).item()

def _check_exactness(B=16, D=3):
    """A. Section 6's two conditions: JAGG is exact when both hold, and not when either fails."""
    t = torch.tensor([0.9, 0.7, 0.5, 0.2])[:, None].expand(4, B)  # [W, B], unevenly spaced
    alpha = interpolation_weights(t)[..., None]  # [W, B, 1]
    z_a, z_b, coef = torch.randn(B, D), torch.randn(B, D), torch.randn(4, B, D)  # [B, D], [B, D], [W, B, D]
    on_segment = z_a + alpha * (z_b - z_a)  # [W, B, D]: each state where its t puts it
    by_step = z_a + torch.linspace(0, 1, 4)[:, None, None] * (z_b - z_a)  # [W, B, D]: evenly by step instead
    bent = on_segment + 0.5 * alpha * (1 - alpha)  # [W, B, D]: off the segment
    affine = torch.nn.Sequential(torch.nn.Linear(D + 1, D + 1), torch.nn.Linear(D + 1, D))  # v affine in (z, t)
    errors = []
    for net, z in [(affine, on_segment), (affine, by_step), (affine, bent), (_mlp(D + 1, D), on_segment)]:
        args = (_velocity_fn(net), z, t, lambda i, v: (coef[i] * v).sum() + (v**2).sum())  # a made-up loss
        errors.append(_error(_grad(net, backward_jagg_window, *args), _grad(net, backward_exact, *args)))
    print(f"A. |JAGG - exact| / |exact|: {errors[0]:.1e} with v affine in (z, t) and the states on the segment\n"
          f"   at alpha_k; {errors[1]:.1e} spaced by step; {errors[2]:.1e} off it; {errors[3]:.1e} for a tanh net")
    assert errors[0] < 1e-12 and min(errors[1:]) > 1e-3

def _check_gradient_error(net, cfg, T=10, W=4, B=16, D=3, rollouts=16):
    """B. Is it worth it? JAGG's gradient error on rollouts, beside a cheaper unbiased estimate's: 2 random steps of
    the window times W/2 (cost 6, JAGG's 8). A row sums a position's windows over the rollouts, as a batch does."""
    fn = _velocity_fn(net)
    windows = []  # one dict per window
    for _ in range(rollouts):
        traj = rollout(fn, torch.randn(B, D), sigma_schedule(T), cfg.noise_level)
        adv = group_advantages(-traj.sample.norm(dim=-1), torch.arange(B) // 4).double()  # [B], 4 groups
        for start, stop in window_bounds(T, W)[:2]:  # steps 0-3, then 4-7
            z, t = traj.z[start:stop], traj.t[start:stop]  # [W, B, D], [W, B]
            step_loss = make_step_loss(traj, adv, start, stop, cfg)
            per_step = []  # each step's exact gradient [P]
            for k in range(start, stop):
                loss_k = make_step_loss(traj, adv, k, k + 1, cfg)
                per_step.append(_grad(net, backward_exact, fn, traj.z[k : k + 1], traj.t[k : k + 1], loss_k))
            exact = sum(per_step)  # [P]
            jagg = _grad(net, backward_jagg_window, fn, z, t, step_loss)  # [P]
            # The alternative draws 2 of the W steps; its mean square error over the 6 equally likely pairs:
            pairs = list(itertools.combinations(per_step, 2))
            alt_sq = sum((W / 2 * (p + q) - exact).norm() ** 2 for p, q in pairs) / len(pairs)
            windows.append({"steps": f"{start}-{stop - 1}", "score": linearity_score(traj.v[start:stop], t),
                            "exact": exact, "jagg": jagg, "alt_sq": alt_sq})
    print(f"B. |estimate - exact| / |exact| of the gradient summed over {rollouts} rollouts; the median score:\n"
          "   steps | score | JAGG | 2 random steps x W/2")
    for steps in ("0-3", "4-7"):
        ws = [w for w in windows if w["steps"] == steps]
        exact = sum(w["exact"] for w in ws)  # [P]
        jagg_error = _error(sum(w["jagg"] for w in ws), exact)
        alt_error = math.sqrt(sum(w["alt_sq"] for w in ws)) / exact.norm().item()  # independent draws: squares add
        score = torch.tensor([w["score"] for w in ws]).median().item()
        print(f"   {steps:>5} | {score:.3f} | {jagg_error:4.2f} | {alt_error:20.2f}")
        assert jagg_error < alt_error
    late = sum(b["score"] > a["score"] for a, b in zip(windows[0::2], windows[1::2]))  # a: steps 0-3, b: 4-7
    print(f"   At jagg_frac = 0.5 the score picked the low-noise steps 4-7 in {late} of {rollouts} rollouts.")
    assert late > rollouts / 2
    return traj, adv

def _check_cost(net, cfg, traj, adv, W=4):
    """C. Routing a rollout's windows, and the cost per sample, counted from velocity_fn's calls."""
    print("C. steps | jagg_frac | on_policy | to JAGG               | grad rows | backwards | no-graph rows | cost")
    for steps, frac, on in [(10, 0.0, 0), (10, 1.0, 0), (10, 0.5, 0), (9, 1.0, 0), (9, 1.0, 1)]:
        calls = []  # (steps, builds a graph) of each call
        fn = _velocity_fn(net, calls=calls)
        stats, routed = paper_gradients(fn, traj.first_steps(steps), adv, cfg, W, frac, on_policy=bool(on))
        grad_rows = sum(n for n, grad in calls if grad)  # the rows back-propagated
        passes = sum(grad for _, grad in calls)  # each call with a graph gets one backward pass
        no_graph = sum(n for n, grad in calls if not grad)  # the interiors' rows
        print(f"   {steps:5} | {frac:9} | {str(bool(on)):9} | {str(routed):21} | {grad_rows:9} | {passes:9} | "
              f"{no_graph:13} | {3 * grad_rows + no_graph:4}")  # in forwards, if a backward costs two (section 6)
        n_jagg = sum(routed)  # 4-step windows sent to JAGG, each 2 rows with grad, not 4, in 1 backward, not 4
        assert n_jagg == round(frac * 2) and not routed[2] and stats["grad_rows"] == grad_rows  # 2 steps: exact
        assert (grad_rows, passes, no_graph) == (steps - 2 * n_jagg, steps - 3 * n_jagg, 2 * n_jagg * (1 - on))

def _train(jagg_frac, epochs=10, T=10, W=4, seed=1):
    """D. The loop as Flow-GRPO runs it: 32 samples for 4 prompts, rewarded, then an optimizer step on each half
    (the second off-policy) over 9 of the 10 steps, clip and KL included. jagg_frac = 0: exact GRPO."""
    torch.manual_seed(seed)
    prompt_of = torch.arange(32) // 8  # [B], each sample's prompt: 4 prompts, 8 samples each
    targets = torch.randn(4, 2)[prompt_of]  # [B, 2]: each prompt asks for a point; the reward is -distance
    policy = _mlp(2 + 1 + 2, 2)  # on (z, t, target)
    reference = copy.deepcopy(policy)  # the KL's reference, never trained: the optimizer holds only the policy
    optimizer, cfg = torch.optim.Adam(policy.parameters(), lr=3e-2), LossConfig(0.7, clip_range=0.2, beta=0.04)
    rewards = []  # the mean reward per epoch
    for epoch in range(epochs):
        batch = rollout(_velocity_fn(policy, c=targets), torch.randn(32, 2), sigma_schedule(T), cfg.noise_level)
        reward = -(batch.sample - targets).norm(dim=-1)  # [B]
        rewards.append(reward.mean().item())
        advantages = group_advantages(reward, prompt_of).double()  # [B]
        for half, idx in enumerate(torch.randperm(32).chunk(2)):  # two minibatches of 16, the first on-policy
            fn, ref_fn = _velocity_fn(policy, c=targets[idx]), _velocity_fn(reference, c=targets[idx])
            minibatch, adv = batch.first_steps(9).subset(idx), advantages[idx]  # Flow-GRPO trains 9 of 10 steps
            optimizer.zero_grad(set_to_none=True)
            stats, _ = paper_gradients(fn, minibatch, adv, cfg, W, jagg_frac, ref_fn, on_policy=half == 0)
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)  # Flow-GRPO's max_grad_norm
            optimizer.step()
            assert half == 1 or stats["approx_kl"] < 1e-20  # on-policy, every ratio is 1: step-major (section 9)
    return rewards, stats  # stats: the last step's, off-policy

if __name__ == "__main__":
    torch.set_num_threads(1)  # tiny tensors: threads would cost more than they save
    torch.set_default_dtype(torch.float64)  # so that "exact" shows as ~1e-16, not fp32's ~1e-7
    torch.manual_seed(0)
    _check_exactness()
    net, cfg = _mlp(3 + 1, 3), LossConfig(noise_level=0.7, clip_range=0.2)
    _check_cost(net, cfg, *_check_gradient_error(net, cfg))
    print("D. GRPO as Flow-GRPO trains, from one start per seed: the mean reward in 10 epochs")
    for seed in (1, 2, 3):
        (jagg, stats), (exact, _) = _train(jagg_frac=1.0, seed=seed), _train(jagg_frac=0.0, seed=seed)
        print(f"   seed {seed}: {jagg[0]:.2f} -> {jagg[-1]:.2f} JAGG, {exact[-1]:.2f} exact; KL {stats['kl']:.3f}")
        assert jagg[-1] > jagg[0] + 0.5 and exact[-1] > exact[0] + 0.5 and stats["kl"] > 0
    print("ok")
