"""JAGG: GRPO for flow-matching diffusion transformers with one backward per window of W steps.

The paper alone, in one file to read top to bottom: JAGG (Jacobian-Aggregated Group Gradient,
arXiv 2607.17572, 2026) on Flow-GRPO's SDE sampler and loss (Liu et al., arXiv 2505.05470). We
follow the paper's abstract; where it is silent, or where we depart from it, the comment says OURS.
Options beyond the paper, and the training step for real runs (many ranks): jagg_options.py.
In brief: a window's gradient sum_k g_k^T J_k needs a backward per step for the Jacobians J_k;
interpolating them linearly in t between the window's end steps collapses the sum into ONE backward
over the double batch [z_a; z_b] (section 6; section 7 picks the windows).

Notation (code name -> symbol)
    T, B       the steps of the trajectories at hand (a rollout's, or its trained first ones); samples
    W          window length: a window runs from step a to b = a + W - 1 (code: start:stop, stop = b + 1)
    k          always a step of the trajectory, 0 <= k < T
    i          a step's place in the window at hand, i = k - a: code holding one window's steps indexes
               them by i (there z[i] is z_{a+i}, and step_loss(i, v) is step a + i's loss)
    z_k, t_k   the latent state before step k and its flow time sigma_k (1 = pure noise, 0 = data)
    v_k        v_theta(z_k, t_k), the velocity the network predicts at step k (v = noise - data)
    g_k, J_k   dL_k / dv_k (cheap: the loss alone) and dv_k / dtheta (a backward through the network)
    alpha_k    (t_a - t_k) / (t_a - t_b): 0 at the window's first step a, 1 at its last b
    G_a, G_b   sum_k (1 - alpha_k) g_k and sum_k alpha_k g_k over k = a..b: the composite signals
    J_a, J_b   the Jacobians at the window's end steps, the only two JAGG back-propagates
Shapes: S any number of steps, *D one sample's shape, P parameters, [B, 1..] B then ones. A "row":
one step's B samples through the network. The contract with a model (section 2: what it must get right):
    velocity_fn(z [S, B, *D], t [S, B]) -> v [S, B, *D], with t = sigma and v = dz/dsigma = noise - data
(SD3's and Flux's rectified flow); it owns any conditioning (prompts, CFG).

Run it: `python jagg.py` (the self-check, seconds), `python train_toy.py` (the CPU demo), `python -m pytest -q`.
"""

import copy
import math
from dataclasses import dataclass

import torch


def _check(ok, message):  # a ValueError naming the mistake and its fix
    if not ok:
        raise ValueError(message)


# === 1. SDE step: the Gaussian policy of one sampling step (Flow-GRPO) ===
# The flow ODE has no log-probability; an SDE with the same marginals makes each step a Gaussian
# policy z_{k+1} ~ N(mu_k, std_t^2 |dt|), whose densities' ratio GRPO uses.

def sigma_schedule(num_steps, shift=3.0):
    """The sigmas sigma_0 = 1 > ... > sigma_T = 0 [T + 1], float32: an even grid s bent by SD3's
    shift, sigma = shift * s / (1 + (shift - 1) * s), more steps at high noise for shift > 1."""
    s = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)  # [T+1]
    return (shift * s / (1 + (shift - 1) * s)).float()  # [T+1]

def sde_step(v, z, sigma, sigma_next, noise_level, prev_sample=None, generator=None):
    """One SDE step from z at sigma to sigma_next (v, z: [B, *D]; sigma, sigma_next: [B]); prev_sample (z_{k+1}),
    if given, is scored instead of sampled. Returns, as Flow-GRPO's sde_step_with_logprob, (prev_sample [B, *D],
    log_prob [B] averaged over the non-batch dims, mean mu [B, *D], std_t [B, 1..] the SDE's noise scale; the
    Gaussian's std is std_t sqrt(|dt|)). In fp32 at least: the ratio exponentiates a difference of near-equal
    log-probs, which bf16 rounding would move by more than Flow-GRPO's clip range of 1e-4."""
    dtype = torch.promote_types(torch.promote_types(v.dtype, z.dtype), torch.float32)
    v, z, shape = v.to(dtype), z.to(dtype), (-1,) + (1,) * (z.ndim - 1)
    sigma, sigma_next = sigma.to(dtype).reshape(shape), sigma_next.to(dtype).reshape(shape)  # [B, 1..] each
    dt = sigma_next - sigma  # [B, 1..], < 0: sigma decreases from noise to data
    # std_t = eta sqrt(sigma / (1 - sigma)), infinite at sigma = 1 (within 1e-4: Wan's sigmas start at
    # 1 - 1e-6), the first step, where Flow-GRPO puts the next sigma in the denominator.
    std_t = noise_level * torch.sqrt(sigma / (1 - torch.where(sigma > 1 - 1e-4, sigma_next, sigma)))  # [B, 1..]
    # Euler on dz = [v + std_t^2 / (2 sigma) (z + (1 - sigma) v)] dsigma + std_t dw (the ODE's marginals):
    # mu = z (1 + std_t^2 / (2 sigma) dt) + v (1 + std_t^2 (1 - sigma) / (2 sigma)) dt
    mean = z * (1 + std_t**2 / (2 * sigma) * dt) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt  # [B, *D]
    std = std_t * torch.sqrt(-dt)  # [B, 1..], the Gaussian's standard deviation
    if prev_sample is None:
        prev_sample = mean + std * torch.randn(z.shape, generator=generator, device=z.device, dtype=z.dtype)  # [B, *D]
    # log N(x; mu, std^2) = -(x - mu)^2 / (2 std^2) - log std - log sqrt(2 pi), per element.
    log_prob = -((prev_sample.detach() - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return prev_sample.to(dtype), log_prob.mean(dim=tuple(range(1, log_prob.ndim))), mean, std_t  # log_prob: [B]


# === 2. Rollout: sample trajectories and keep what training needs ===
# A rollout calls velocity_fn on one step, JAGG on several (z: [S, B, *D]): both must give the same v, or the
# first ratio after a rollout is not 1 (self-check D). Row s * B + n of z.reshape(S * B, *D) is sample n at step s
# (step-major): repeat the conditioning as a block, c.repeat(S), never c.repeat_interleave(S); choose a network
# (Wan 2.2's two experts) per row from t, not once per call from t[0]; no dropout. Before training, run
# jagg_options.check_velocity_fn once: it catches all of these.

def checked(velocity_fn):  # velocity_fn, refusing a v not of z's shape (broadcast, it would train silently)
    def velocity(z, t):
        v = velocity_fn(z, t)
        _check(isinstance(v, torch.Tensor) and v.shape == z.shape,
               f"velocity_fn(z {tuple(z.shape)}, t {tuple(t.shape)}) returned {getattr(v, 'shape', type(v))}: it must "
               f"return v of z's shape [S, B, *D]; end it with .reshape(z.shape)")
        return v
    return velocity

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

    sample = property(lambda self: self.z_next[-1])  # the final clean samples z_T: [B, *D], what the reward sees
    def first_steps(self, n):  # the first n steps, the ones Flow-GRPO trains (timestep_fraction: 9 of T = 10)
        _check(1 <= n <= self.z.shape[0], f"a trajectory of {self.z.shape[0]} steps has no first {n} steps to train")
        return Trajectory(**{name: getattr(self, name)[:n] for name in self.TENSORS}, noise_level=self.noise_level)

    def subset(self, idx):  # the samples idx, a minibatch (slice their conditioning with the same idx)
        return Trajectory(**{name: getattr(self, name)[:, idx] for name in self.TENSORS}, noise_level=self.noise_level)

@torch.no_grad()
def rollout(velocity_fn, noise, sigmas, noise_level, generator=None):
    """B trajectories of T = len(sigmas) - 1 SDE steps from noise z_0 [B, *D], v kept for routing (section 7)."""
    velocity_fn, B, T, z = checked(velocity_fn), noise.shape[0], len(sigmas) - 1, noise
    zs, z_nexts, log_probs, vs = [], [], [], []
    for k in range(T):
        t_k = sigmas[k].expand(1, B).to(z.device)  # [1, B]
        v = velocity_fn(z[None], t_k)[0]  # [B, *D]
        z_next, log_prob, _, _ = sde_step(v, z, t_k[0], sigmas[k + 1].expand(B).to(z.device), noise_level, None, generator)
        zs.append(z), z_nexts.append(z_next), log_probs.append(log_prob), vs.append(v)
        z = z_next
    t, t_next = (s[:, None].expand(T, B).to(noise.device).contiguous() for s in (sigmas[:-1], sigmas[1:]))  # [T, B]
    return Trajectory(z=torch.stack(zs), z_next=torch.stack(z_nexts), t=t, t_next=t_next,  # [T, B, *D] x 2
                      log_prob=torch.stack(log_probs), v=torch.stack(vs), noise_level=noise_level)  # [T, B], [T, B, *D]


# === 3. Group-relative advantages (GRPO) ===

def group_advantages(rewards, group_ids, eps=1e-4, global_std=False, clip=5.0):
    """A_i = (r_i - mean_group(i)) / (std + eps), clipped to [-clip, clip]; rewards, group_ids: [B], a group
    the samples of one prompt. std: the group's (GRPO), or with global_std all rewards' (Flow-GRPO's SD3)."""
    _check(rewards.shape == group_ids.shape and rewards.ndim == 1,
           f"rewards and group_ids must both be [B], got {tuple(rewards.shape)} and {tuple(group_ids.shape)}")
    rewards = rewards.float()
    adv = torch.empty_like(rewards)  # [B]
    for g in group_ids.unique():
        m = group_ids == g  # [B] bool
        adv[m] = (rewards[m] - rewards[m].mean()) / ((rewards if global_std else rewards[m]).std(unbiased=False) + eps)
    return adv.clamp(-clip, clip)


# === 4. The per-step GRPO loss ===

@dataclass
class LossConfig:
    """The knobs of the per-step loss (section 4) and of the SDE (section 1)."""
    noise_level: float  # the SDE's noise level (Flow-GRPO: 0.7)
    clip_range: float  # PPO/GRPO ratio clip epsilon (Flow-GRPO: 1e-4; the self-check's 0.2 lets clipping show)
    beta: float = 0.0  # weight of the KL to the reference model; 0 = no reference needed

def grpo_step_loss(log_prob, log_prob_old, advantages, clip_range, mean=None, mean_ref=None, std_t=None, beta=0.0):
    """Clipped GRPO surrogate of one step, plus beta * KL to the reference; inputs [B] (mean, mean_ref [B, *D];
    std_t [B, 1..], sde_step's). Returns (loss, detached stats).
    ratio = exp(logp - logp_old);  L = mean_B max(-A ratio, -A clip(ratio, 1 - clip_range, 1 + clip_range))
    KL term = mean_B mean_D (mu - mu_ref)^2 / (2 std_t^2)  (Flow-GRPO's): the transitions' KL times |dt|."""
    ratio = torch.exp(log_prob - log_prob_old)  # [B]
    loss = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip_range, 1 + clip_range)).mean()
    kl = torch.zeros((), device=loss.device)
    if beta > 0:
        kl = ((mean - mean_ref) ** 2 / (2 * std_t**2)).mean(dim=tuple(range(1, mean.ndim))).mean()
        loss = loss + beta * kl
    # approx_kl = E[(logp - logp_old)^2] / 2, Schulman's k2 estimator, as Flow-GRPO logs it.
    stats = {"clipfrac": (torch.abs(ratio - 1.0) > clip_range).float().mean().item(),
             "approx_kl": 0.5 * ((log_prob - log_prob_old) ** 2).mean().item(), "kl": kl.item()}
    return loss, stats

def make_step_loss(traj, advantages, start, stop, cfg, v_ref=None, log=None):
    """step_loss(i, v) of step k = start + i < stop of traj (v: [B, *D]), weighted 1/T so that a trajectory's loss
    is its steps' mean (Flow-GRPO's); v_ref [stop - start, B, *D] if cfg.beta > 0; each call adds its stats to log."""
    def step_loss(i, v):
        k = start + i  # the step in the trajectory
        step = (traj.z[k], traj.t[k], traj.t_next[k], cfg.noise_level, traj.z_next[k])  # z, sigma, sigma_next, eta, z_{k+1}
        _, log_prob, mean, std_t = sde_step(v, *step)  # scores the stored z_{k+1} under v
        mean_ref = sde_step(v_ref[i], *step)[2] if cfg.beta > 0 else None
        loss, stats = grpo_step_loss(log_prob, traj.log_prob[k], advantages, cfg.clip_range, mean, mean_ref, std_t, cfg.beta)
        if log is not None:
            log.append(stats)
        return loss / traj.z.shape[0]
    return step_loss


# === 5. Exact per-step backward: the baseline (what Flow-GRPO does) ===
# The backward functions (here and in section 6) take one window's z [W, B, *D], t [W, B] and
# step_loss(i, v) -> scalar; they accumulate gradients as loss.backward() does, return the summed loss.

def _check_window(z, t):  # z: [W, B, *D], t: [W, B]
    _check(z.ndim >= 2 and t.shape == z.shape[:2], f"a window needs z: [W, B, *D] and t: [W, B] with matching W and "
                                                  f"B, got z {tuple(z.shape)}, t {tuple(t.shape)}")

def backward_exact(velocity_fn, z, t, step_loss):
    """Exact gradient of W steps: one forward with graph and one backward per step (W of each)."""
    _check_window(z, t)
    total = 0.0
    for i in range(z.shape[0]):
        loss = step_loss(i, velocity_fn(z[i : i + 1], t[i : i + 1])[0])  # v: [B, *D]
        loss.backward()  # frees this step's graph before the next builds its own: one row alive at a time
        total += loss.item()
    return total


# === 6. JAGG: interpolate the Jacobians, back-propagate once ===
# A step's loss L_k depends on the weights only through v_k (the states and the reference are fixed), so
#     grad = sum_k g_k^T J_k,    g_k = dL_k/dv_k (a few elementwise ops),  J_k = dv_theta(z_k, t_k)/dtheta,
# a backward per J_k. Training-free DiT accelerators (Delta-DiT, ScalingCache) exploit that a DiT's features and
# velocities change smoothly, nearly linearly, along a trajectory; JAGG bets its Jacobians do too, weighted by t:
#     J_k ~= (1 - alpha_k) J_a + alpha_k J_b,        alpha_k = (t_a - t_k) / (t_a - t_b),
#     grad ~= G_a^T J_a + G_b^T J_b,   G_a = sum_k (1 - alpha_k) g_k,  G_b = sum_k alpha_k g_k   (by linearity),
# which ONE backward of sum(v_a * G_a) + sum(v_b * G_b) through one forward on the double batch [z_a; z_b]
# computes. Only the Jacobians are approximated: each g_k (its step's ratio and clip) comes from the step's true
# velocity at the current weights, by a forward without graph at the interior steps.
# Cost per window, in the abstract's unit, rows with grad (backward passes over B samples; the double batch
# counts 2): exact W, JAGG 2. In forward-units (a row with grad ~3, as a backward costs about two forwards; a row
# without graph 1) 3W becomes 2 x 3 + (W - 2) = W + 4: 1.5x at W = 4, under 3x at any W.
# When it is exact (OURS, more than the abstract's "velocity linear in (z, t)"): the error is sum_k g_k^T (J_k -
# (1 - alpha_k) J_a - alpha_k J_b). (1) v = A z + c t + e, with A, c, e any functions of theta, makes J = A'z + c't
# + e' (' = d/dtheta) affine in (z, t), so J_k interpolates exactly if (z_k, t_k) = (1 - alpha_k)(z_a, t_a) +
# alpha_k (z_b, t_b). (2) t_k is there by alpha's definition; z_k only if the states lie on the straight segment,
# and the SDE's noise takes them off it (self-check A: bent states break it). Why weights in t: flow paths
# z_t = (1 - t) x_0 + t noise are straight lines in t. W = 2 (no interior step) is always exact.

def interpolation_weights(t):
    """alpha_k = (t_a - t_k) / (t_a - t_b) for a window's times t: [W, B]. Returns [W, B]: 0 at a, 1 at b."""
    span = t[0] - t[-1]  # [B]
    _check(bool((span != 0).all()), "a window's end steps must have different times (t_a != t_b)")
    return (t[0] - t) / span  # [W, B]

def backward_jagg_window(velocity_fn, z, t, step_loss):
    """The paper's JAGG gradient of one window of W steps (a is i = 0, b is i = W - 1): ONE forward
    with graph on the double batch [z_a; z_b] and ONE backward of G_a^T J_a + G_b^T J_b."""
    _check_window(z, t)
    W = z.shape[0]  # W = 1 fails in interpolation_weights: t_a = t_b
    acc = torch.promote_types(z.dtype, torch.float32)  # G_a, G_b summed in fp32 at least, whatever the network's
    alpha = interpolation_weights(t.to(acc))  # [W, B]: 0 at a, 1 at b
    alpha = alpha.reshape(alpha.shape + (1,) * (z.ndim - 2))  # [W, B, 1..]
    # The interior velocities, at the current weights: needed only for g_k = dL_k/dv_k, never
    # back-propagated through the network, so no graph: all W - 2 in one forward that stores nothing.
    with torch.no_grad():
        v_mid = velocity_fn(z[1:-1], t[1:-1]) if W > 2 else z[:0]  # [W-2, B, *D]; W = 2: empty [0, B, *D]
    # The end steps: one forward with graph on the double batch [z_a; z_b].
    v_ab = velocity_fn(z[[0, -1]], t[[0, -1]])  # [2, B, *D]
    v = torch.cat([v_ab[:1].detach(), v_mid.to(v_ab.dtype), v_ab[1:].detach()])  # [W, B, *D], no graph
    # G_a = sum_k (1 - alpha_k) g_k,  G_b = sum_k alpha_k g_k, with g_k from the loss alone.
    G_a = torch.zeros(v.shape[1:], dtype=acc, device=z.device)  # [B, *D]
    G_b, total = torch.zeros_like(G_a), 0.0  # [B, *D]
    for i in range(W):  # step k = a + i
        v_k = v[i].detach().requires_grad_(True)  # [B, *D], a leaf: differentiate the loss, not the network
        loss = step_loss(i, v_k)
        (g_k,) = torch.autograd.grad(loss, v_k)  # [B, *D]
        G_a += (1 - alpha[i]) * g_k.to(acc)
        G_b += alpha[i] * g_k.to(acc)
        total += loss.item()
    # One backward: d/dtheta [sum(v_a * G_a) + sum(v_b * G_b)] = G_a^T J_a + G_b^T J_b.
    (v_ab[0] * G_a.to(v_ab.dtype) + v_ab[1] * G_b.to(v_ab.dtype)).sum().backward()
    return total


# === 7. Routing: which windows are linear enough for JAGG ===
# Windows tile the trained steps from the first, the last one shorter (OURS, and W = 4 our default): T = 10
# gives windows of 4, 4 and 2 steps, Flow-GRPO's 9 trained steps 4, 4 and 1.
# The abstract routes by "a cosine-similarity rule" with a knob jagg_frac, as if by a threshold. OURS, the score
# and a rank rule: a window's score is the cosine of its interior velocities with their interpolation between its
# end steps, free from the rollout's velocities (if v moves linearly in t, the Jacobians likely do too). Scores
# sit near 1 on a scale that varies by model, so jagg_frac is no threshold but the share of windows of 3 steps or
# more that JAGG takes, best first, round()ed (half to even); the rest train exactly. A 2-step window has no
# interior step, so JAGG would save nothing there: never. Worked example, the self-check's windows 0-3, 4-7, 8-9
# score 0.86, 0.97, 1 (no interior): jagg_frac 0.5 takes round(0.5 x 2) = 1 window, 4-7, to JAGG: 4 + 2 + 2 = 8
# rows with grad, not 10; jagg_frac 0.25 takes round(0.5) = 0.
# What the score can tell: over 40 seeds of that setting (tests/test_jagg.py::test_the_routing_score_ranks_window_
# positions_more_than_trajectories) its rank correlation with JAGG's gradient cosine is 0.57 over all 80 windows,
# but 0.23 and 0.40 within the first and the second: it mostly says "the high-noise window is worse" (scored lower
# in 39 of 40 seeds, its cosine lower in 34) and barely ranks trajectories at one position. To rank by the cosines
# themselves: jagg_options' route="probe".

def window_bounds(num_steps, window):
    """Split T steps into windows of W steps: [(start, stop), ...] with stop = b + 1; the last may be shorter."""
    _check(window >= 2, f"window must be >= 2 steps (JAGG interpolates between two end steps), got {window}")
    _check(window <= num_steps,
           f"window ({window}) is longer than the trajectory ({num_steps} steps): use a window <= {num_steps}")
    return [(start, min(start + window, num_steps)) for start in range(0, num_steps, window)]

def linearity_score(v, t):
    """Cosine similarity of the interior velocities v_k with (1 - alpha_k) v_a + alpha_k v_b,
    averaged over interior steps and samples. v: [W, B, *D], t: [W, B]. 1.0 when W <= 2."""
    if v.shape[0] <= 2:
        return 1.0
    alpha = interpolation_weights(t.float())  # [W, B]
    alpha, v = alpha.reshape(alpha.shape + (1,) * (v.ndim - 2)), v.float()  # [W, B, 1..], [W, B, *D]
    v_lin = (1 - alpha) * v[:1] + alpha * v[-1:]  # [W, B, *D]
    return torch.nn.functional.cosine_similarity(v[1:-1].flatten(2), v_lin[1:-1].flatten(2), dim=-1).mean().item()

def route_windows(scores, lengths, jagg_frac):
    """Send round(jagg_frac x the windows of 3 or more steps) of them, the highest scores first, to
    JAGG. scores, lengths: one per window. Returns a list of bools, True for JAGG."""
    _check(0.0 <= jagg_frac <= 1.0, f"jagg_frac must be in [0, 1], got {jagg_frac}")
    eligible = [w for w, n in enumerate(lengths) if n >= 3]
    # sorted() is stable: among equal scores the earlier window wins, so routing is reproducible.
    chosen = set(sorted(eligible, key=lambda w: -scores[w])[: round(jagg_frac * len(eligible))])
    return [w in chosen for w in range(len(scores))]


# === 8. One training step over a batch of trajectories ===
# Window by window: those routing gives to JAGG run backward_jagg_window, the others backward_exact; the KL's
# reference velocities need no graph. Then a plain optimizer step. The caller loops over minibatches
# (traj.subset(idx)): the first optimizer step on-policy, the next off-policy. The trainers run this loop with
# options added, jagg_options.window_gradients: with the default options it routes as here and hands each window
# to this file's backward_jagg_window or backward_exact (tests/test_jagg.py counts the calls).

def paper_gradients(velocity_fn, traj, advantages, cfg, window=4, jagg_frac=1.0, ref_velocity_fn=None):
    """Accumulate the gradient of the batch's GRPO loss (mean over traj's T steps and B samples; advantages
    [B]) into .grad, window by window, exact or JAGG. Returns (stats, routed): routed[w] True for JAGG."""
    _check(cfg.beta == 0 or ref_velocity_fn is not None, "beta > 0 needs a ref_velocity_fn (the frozen reference model)")
    velocity_fn = checked(velocity_fn)
    bounds = window_bounds(traj.z.shape[0], window)  # [(start, stop), ...]
    scores = [linearity_score(traj.v[start:stop], traj.t[start:stop]) for start, stop in bounds]
    routed = route_windows(scores, [stop - start for start, stop in bounds], jagg_frac)
    log, loss = [], 0.0  # log: every step's stats from grpo_step_loss
    for (start, stop), use_jagg in zip(bounds, routed):
        z, t = traj.z[start:stop], traj.t[start:stop]  # [W, B, *D], [W, B]
        with torch.no_grad():  # the KL reference's velocities [W, B, *D], when there is a KL term
            v_ref = checked(ref_velocity_fn)(z, t) if cfg.beta > 0 else None
        step_loss = make_step_loss(traj, advantages, start, stop, cfg, v_ref, log)
        loss += (backward_jagg_window if use_jagg else backward_exact)(velocity_fn, z, t, step_loss)
    # grad_rows: rows run with grad (1 a step exact, 2 a JAGG window); routed_frac: JAGG's share of windows >= 3 steps
    grad_rows = sum(2 if use_jagg else stop - start for (start, stop), use_jagg in zip(bounds, routed))
    stats = {key: sum(s[key] for s in log) / len(log) for key in log[0]}  # means over steps
    eligible = sum(stop - start >= 3 for start, stop in bounds)
    stats.update(loss=loss, routed_frac=sum(routed) / max(eligible, 1), grad_rows=grad_rows, window_scores=scores)
    return stats, routed

def paper_train_step(velocity_fn, optimizer, traj, advantages, cfg, window=4, jagg_frac=1.0, ref_velocity_fn=None):
    """paper_gradients, clipped to norm 1 (Flow-GRPO's max_grad_norm), then an optimizer step. Returns (stats, routed)."""
    optimizer.zero_grad(set_to_none=True)
    stats, routed = paper_gradients(velocity_fn, traj, advantages, cfg, window, jagg_frac, ref_velocity_fn)
    stats["grad_norm"] = torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 1.0).item()
    optimizer.step()
    return stats, routed


# === Run it: python jagg.py (tests/test_jagg.py checks the rest against autograd and torch.func) ===

def _self_check():  # what a learner should see, each line checked
    torch.set_default_dtype(torch.float64)  # exactness shows as ~1e-16, not fp32's ~1e-7
    torch.manual_seed(0)
    T, W, B, D, calls = 10, 4, 16, 3, []  # calls: (network, rows, grad enabled) of each velocity_fn call
    def velocity_fn_of(net, name="policy"):  # velocity_fn(z [S, B, D], t [S, B]) -> [S, B, D], recording its calls
        def velocity_fn(z, t):
            calls.append((name, z.shape[0], torch.is_grad_enabled()))
            return net(torch.cat([z, t[..., None]], dim=-1))
        return velocity_fn
    def grad(net, backward, *args):  # (the flat gradient [P] that backward(velocity_fn, *args) accumulates, its output)
        net.zero_grad(set_to_none=True)
        out = backward(velocity_fn_of(net), *args)
        return torch.cat([p.grad.flatten() for p in net.parameters()]), out
    cosine = lambda a, b: torch.nn.functional.cosine_similarity(a, b, dim=0).item()  # noqa: E731

    # A. v affine in (z, t), nonlinear in theta, a straight window, a made-up loss: JAGG is exact (section 6).
    linear = torch.nn.Sequential(torch.nn.Linear(D + 1, D + 1), torch.nn.Linear(D + 1, D))
    t = torch.tensor([0.9, 0.7, 0.5, 0.2])[:, None].expand(W, B)  # [W, B], uneven: weights by index would fail
    alpha, w = interpolation_weights(t)[..., None], torch.randn(W, B, D)  # [W, B, 1], [W, B, D]
    z = (1 - alpha) * torch.randn(B, D) + alpha * torch.randn(B, D)  # [W, B, D], on the straight segment
    def error(net, z):  # |JAGG - exact| / |exact| of net's gradient on the window z, loss sum_i w_i.v_i + |v_i|^2
        (exact, _), (approx, _) = (grad(net, f, z, t, lambda i, v: (w[i] * v).sum() + (v**2).sum())
                                     for f in (backward_exact, backward_jagg_window))
        return ((approx - exact).norm() / exact.norm()).item()
    net = torch.nn.Sequential(torch.nn.Linear(D + 1, 32), torch.nn.Tanh(), torch.nn.Linear(32, D))  # v, J not affine
    rel, bent, curved_j = error(linear, z), error(linear, z + 0.5 * alpha * (1 - alpha)), error(net, z)
    assert rel < 1e-12 and bent > 1e-3 and curved_j > 1e-3, (rel, bent, curved_j)
    print(f"A. |JAGG - exact| / |exact| on a window of W = {W}: {rel:.1e} with v affine in (z, t) and straight states; "
          f"{bent:.1e} when the states bend; {curved_j:.1e} with a tanh network on the straight states")

    # B. That tanh network on its own rollouts, groups of 4, the KL to a reference a little away (so it has a gradient).
    frozen = copy.deepcopy(net).requires_grad_(False)
    frozen[0].bias.data += 0.05
    ref, cfg = velocity_fn_of(frozen, "reference"), LossConfig(noise_level=0.7, clip_range=0.2, beta=0.04)
    traj = rollout(velocity_fn_of(net), torch.randn(B, D), sigma_schedule(T), noise_level=0.7)
    advantages = group_advantages(-traj.sample.norm(dim=-1), torch.arange(B) // 4).double()  # reward: near 0
    assert window_bounds(T, W) == [(0, 4), (4, 8), (8, 10)] and window_bounds(9, W) == [(0, 4), (4, 8), (8, 9)]
    print(f"B. a tanh network on its own rollouts, T = {T}, W = {W}: windows {window_bounds(T, W)} (start, stop)")
    for start, stop in window_bounds(T, W):
        z, t = traj.z[start:stop], traj.t[start:stop]  # [W, B, D], [W, B]
        exact, approx = (grad(net, f, z, t, make_step_loss(traj, advantages, start, stop, cfg, ref(z, t)))[0]
                         for f in (backward_exact, backward_jagg_window))
        score, cos = linearity_score(traj.v[start:stop], traj.t[start:stop]), cosine(exact, approx)
        assert cos > 0.9 if stop - start > 2 else abs(cos - 1) < 1e-12, (cos, score)
        print(f"   steps {start}-{stop - 1}: routing score {score:.5f}, JAGG's gradient cosine to exact {cos:.5f}")

    grads = {}  # C. The batch's gradient at jagg_frac 0 (exact), 1, 0.5: (rows with grad, forward-units, windows to JAGG)
    for frac, rows, units, jagg_windows in ((0.0, 10, 30, [0, 0, 0]), (1.0, 6, 22, [1, 1, 0]), (0.5, 8, 26, [0, 1, 0])):
        calls.clear()
        grads[frac], (stats, routed) = grad(net, paper_gradients, traj, advantages, cfg, W, frac, ref)
        graph = [n for name, n, with_grad in calls if with_grad]  # the forwards with graph: a backward each
        interior, cos = sum(n for name, n, g in calls if name == "policy" and not g), cosine(grads[frac], grads[0])
        assert sum(graph) == stats["grad_rows"] == rows and 3 * sum(graph) + interior == units, (graph, interior)
        assert routed == jagg_windows and cos > 0.99, (routed, cos)  # (a list of bools equals one of 0 / 1)
        print(f"C. jagg_frac {frac}: windows to JAGG {routed}; {sum(graph)} rows with grad in {len(graph)} backward passes, "
              f"{interior} without graph: {3 * sum(graph) + interior} forward-units; cosine to exact {cos:.5f}")
    rows_9 = grad(net, paper_gradients, traj.first_steps(9), advantages, cfg, W, 1.0, ref)[1][0]["grad_rows"]
    assert rows_9 == 5  # Flow-GRPO trains the first 9 steps of T = 10
    print(f"   Rows with grad are the abstract's unit (a backward over B samples; JAGG's double batch counts 2): 10 -> 6 "
          f"here,\n   9 -> {rows_9} on Flow-GRPO's 9 trained steps (windows {window_bounds(9, W)}), 4 -> 2 in a 4-step "
          f"window: its ~2x.\n   Forward-units (with grad 3: a backward costs about two forwards; without graph 1) also "
          f"count the interior\n   forwards JAGG keeps: 30 -> 22 = {30 / 22:.2f}x is another measure, not a contradiction.")

    # D. Section 2's lesson with two experts as Wan 2.2's, net above sigma 0.8, linear below, chosen per row or per call.
    high, low = velocity_fn_of(net), velocity_fn_of(linear)
    per_row = lambda z, t: torch.where(t[..., None] > 0.8, high(z, t), low(z, t))  # noqa: E731
    per_call = lambda z, t: (high if t[0, 0] > 0.8 else low)(z, t)  # noqa: E731  (the mistake)
    traj = rollout(per_row, torch.randn(B, D), sigma_schedule(T), noise_level=0.7)  # (approx_kl reads no advantages)
    kls = [paper_gradients(fn, traj, advantages, LossConfig(0.7, 0.2), W)[0]["approx_kl"] for fn in (per_row, per_call)]
    assert kls[0] < 1e-20 < 1e-8 < kls[1], kls
    print(f"D. two experts switching at sigma 0.8, on-policy: chosen per row from t, approx_kl {kls[0]:.1e} (every ratio 1);"
          f"\n   chosen once per call from t[0], approx_kl {kls[1]:.1e}: JAGG's call on steps 4, 7 ran 7 on the wrong expert")
    print("ok")


if __name__ == "__main__":
    _self_check()
