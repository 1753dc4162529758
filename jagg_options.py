"""Beyond the paper: our options for JAGG, the training step for real runs, and a run's folder.

jagg.py is the paper alone; this module builds on it (it imports jagg, never the reverse). The
defaults are the paper's JAGG, so JaggOptions() trains what jagg.py's paper_gradients does, bit
for bit (max_drift's default acts only with rollout interiors, which the paper does not have).
Read jagg.py first: the notation is its own.

Two meanings of "exact" below: EXACT, the gradient exact per-step back-propagation gives
(Flow-GRPO's, jagg.backward_exact); and PAPER, the gradient JAGG gives on the same anchors with
the paper's forward interiors (interior velocities from a no-graph forward at the current
weights): jagg.backward_jagg_window for two anchors, backward_jagg's forward interiors for more.
The paper's JAGG is EXACT when the Jacobian J(z, t) is affine along a window and the states lie
on the straight line between its end steps, each at its t-weight alpha_k.

The options (a JaggOptions field each; in brackets, the default), and when each is exact:
    anchors="shared"     ["window"] Adjacent windows share their end step: anchors every W - 1
                         steps and at the last step, back-propagated in one forward with graph
                         and one backward per run of adjacent segments routed to JAGG (per chunk
                         under max_graph_rows). EXACT when the paper's condition holds on each
                         segment between consecutive anchors; these segments are not the paper's
                         windows (T = 10, W = 4: 0-3 | 3-6 | 6-9 against 0-3 | 4-7 | 8-9), so
                         neither condition implies the other. Costs and gains: 4 rows with grad
                         instead of the paper's 6 there, all in one graph (max_graph_rows bounds
                         it), but 6 of the 10 steps interpolated instead of 4; the saving depends
                         on T (T = 8: anchors 0, 3, 6, 7, 4 rows as the paper's windows have).
    interior="rollout"   ["forward"] An interior step's velocity is the rollout's, moved by its
                         two anchors' change since the rollout:
                             v_k ~= v_old_k + sum_j H[k, j] (v_{a_j} - v_old_{a_j}),
                         and the KL reference's interiors take the same rule with its own anchor
                         velocities. No network call between anchors, except in refreshed
                         segments (below). PAPER at the rollout's parameters (theta = theta_old:
                         the first optimizer step after each rollout) when beta = 0, provided the
                         training forward reproduces the rollout's velocities (same precision,
                         conditioning and CFG). With beta > 0, PAPER there only if the reference's
                         velocities differ from the rollout's affinely in the interpolation
                         variable (t, or the step index with weights="index") across each
                         segment, e.g. a reference equal to the rollout's model. After the first
                         step, the policy's interiors err by the part of each one's change since
                         the rollout that is not affine between its anchors (zero if v_theta
                         changes affinely in (z, t) there and the states lie on the straight line),
                         the reference's as at the first step; and the GRPO clip can turn a small
                         ratio error into a large gradient error: hence
    max_drift            [0.5; with interior="rollout" only] the drift guard: a segment whose
                         anchors' ratios moved by more than this share of the clip range takes the
                         POLICY's interiors from a no-graph forward, as forward interiors do; the
                         reference's stay interpolated. So a refreshed segment is PAPER when
                         beta = 0. None: the rollout rule at any drift.
    weights="index"      ["time"] alpha_k = k / (W - 1), as the authors' early code; PAPER when t
                         is linear in the step index (not under SD3's shifted schedule), EXACT when
                         the Jacobian is affine in the step index along each segment.
    max_graph_rows       [None: no bound] At most this many anchor rows in a graph at once: always
                         the same gradient as without the bound, to round-off; less memory, some
                         speed lost. With rollout interiors at least 2 (chunks of bound // 2 anchors).
    route="probe"        ["velocity", jagg.linearity_score] Route by the probe's measurements:
                         every few steps, on a few samples, the cosine of each segment's JAGG
                         gradient to its exact one (gradient_cosines, probe_segments, section 5),
                         averaged over probes (probe_average). min_cosine [None; route="probe"
                         only] trains any segment whose average is below it EXACT. Routing chooses
                         which segments are approximated, not how.
    boundaries=(b, ...)  [(): one network] For models with two experts (Wan 2.2 A14B switches
                         transformers at a timestep): the steps where another network takes over,
                         each the first step it runs (expert_boundaries computes them from the
                         schedule). The steps from one boundary to the next are tiled into
                         windows, or shared-anchor segments, as a trajectory of their own, so no
                         segment holds steps of two networks (T = 10, W = 4, boundaries (5,):
                         windows 0-3 | 4 | 5-8 | 9). A segment across the switch would interpolate
                         between two networks' Jacobians, crediting each with the other's steps:
                         EXACT under no condition. With boundaries, EXACT when the paper's
                         condition holds on each segment for the one network that runs it. Costs
                         up to one segment more per switch (one under 3 steps trains exactly).
Then the SDE window (section 6) and the real-run step (section 7): many ranks (DDP, one all-reduce
per optimizer step), gradient accumulation, and non-finite steps skipped on every rank alike.
Section 0 holds what callers need from jagg.py's world but a learner does not: check_velocity_fn
(run it once before training), cat_trajectories, check_batch. Section 8 is what the two trainers
share that is not JAGG's: a run's folder (a lock, whole files, resuming with the run's flags).

Notation beyond jagg.py's
    anchors    a_0 = 0 < a_1 < ... < a_m = S - 1, the steps whose Jacobians are back-propagated
               (the paper: a window's a and b)
    H[k, j]    the hat weight of anchor j at step k (the paper: 1 - alpha_k and alpha_k)
    G[j]       G_j = sum_k H[k, j] g_k (the paper: G_a and G_b)
    v_old      v_k(theta_old), the rollout's velocities (Trajectory.v)
    segment    the steps from one anchor to the next, both included: (start, stop) with stop
               one past the last (the paper's windows are segments too)
"""

import contextlib
import datetime
import fcntl
import glob
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, replace

import torch
from torch.distributed.tensor import DTensor

import jagg
from jagg import _check


def checked(velocity_fn):  # refuses a v not of z's shape: it would broadcast and train wrongly
    def velocity(z, t):
        v = velocity_fn(z, t)
        _check(v.shape == z.shape, f"velocity_fn(z {z.shape}) returned {v.shape}: end it with .reshape(z.shape)")
        return v
    return velocity


def _check_window(z, t):  # one window: z [W, B, *D] and t [W, B]
    _check(z.ndim >= 2 and t.shape == z.shape[:2], "a window needs z: [W, B, *D] and t: [W, B]")


ANCHOR_MODES = ("window", "shared")  # the paper's disjoint windows; OURS: windows sharing end steps
INTERIOR_MODES = ("forward", "rollout")  # the paper's no-graph forwards; OURS: rollout velocities
WEIGHTS = ("time", "index")  # the paper's alpha_k by t; the authors' early code's by step index
ROUTES = ("velocity", "probe")  # jagg.linearity_score (free), or the probe's cosines (OURS)


@dataclass
class JaggOptions:
    """How a batch's gradient is computed. The paper's knobs come first; every other field is an
    option beyond the paper whose default is the paper's behaviour."""

    window: int = 4  # W, sampling steps per window
    jagg_frac: float = 1.0  # the share of windows of >= 3 steps (the most linear, rounded) JAGG takes; the rest exact
    # --- beyond the paper (OURS)
    anchors: str = "window"  # "window": the paper's disjoint windows; "shared": windows share end steps (section 1)
    interior: str = "forward"  # "forward": the paper's no-graph forwards; "rollout": the rollout's velocities (2)
    weights: str = "time"  # "time": the paper's alpha_k by t; "index": alpha_k = k / (W - 1) (section 3)
    max_graph_rows: int = None  # at most this many anchor rows in a graph at once, same gradient (3); None: no bound
    max_drift: float = 0.5  # rollout interiors only while the anchors' ratios stay within this share of the clip (2)
    route: str = "velocity"  # "velocity": by linearity_score; "probe": by the probe's cosines (gradient_cosines, 5)
    min_cosine: float = None  # route="probe" never lets JAGG take a window whose cosine is below this
    boundaries: tuple = ()  # two experts: each network's first step (expert_boundaries); no segment spans two (1)

    def is_paper(self):
        """True when nothing beyond the paper is asked for: jagg.paper_gradients computes it all
        (a bound of 2 or more rows changes nothing for the paper's windows of two anchors)."""
        return self.paper_backward() and self.route == "velocity" and not self.boundaries

    def mode_name(self, method="jagg"):
        """The training mode's name in metrics and tables: exact, jagg, jagg_shared, jagg_rollout or
        jagg_shared_rollout (method "exact": every window exact, whatever the options)."""
        return "exact" if method == "exact" else "jagg" + "_shared" * (self.anchors == "shared") + "_rollout" * (
            self.interior == "rollout")

    def paper_backward(self):
        """True when a JAGG segment's backward is the paper's, jagg.backward_jagg_window."""
        return (self.anchors == "window" and self.interior == "forward" and self.weights == "time"
                and (self.max_graph_rows is None or self.max_graph_rows >= 2))


# === 0. Helpers for callers (moved from jagg.py) ===
# jagg.py keeps what a learner reads; what the trainers, the tests and the lab call besides lives here.


@torch.no_grad()
def check_velocity_fn(velocity_fn, z, sigmas, rtol=None):
    """Check velocity_fn once before training, on noise z: [B, *D] of samples with different
    conditioning and the schedule sigmas: [T + 1]: v of z's shape and finite, two equal calls
    equal, one call on S steps equal to S one-step calls (jagg.py section 9: step-major). A
    ValueError names the mistake and its fix. rtol, relative to |v|; None: 1e-4 in fp32, 2e-2 in
    bf16 / fp16 or under autocast (pass 2e-2 if velocity_fn autocasts inside). Returns the largest
    relative difference."""
    S = min(3, len(sigmas) - 1)  # steps spread over the schedule: its first, middle and last: [S]
    t = sigmas[torch.linspace(0, len(sigmas) - 2, S).round().long()].to(z.device)[:, None].expand(S, z.shape[0])  # [S, B]
    zs = torch.stack([z * (1 - 0.1 * s) for s in range(S)])  # [S, B, *D]: a different state at each step
    velocity_fn = checked(velocity_fn)
    v = velocity_fn(zs, t)  # [S, B, *D]
    _check(v.dtype.is_floating_point and bool(torch.isfinite(v).all()), "velocity_fn returned non-finite values")
    low = v.dtype in (torch.bfloat16, torch.float16) or torch.is_autocast_enabled(z.device.type)
    rtol = (2e-2 if low else 1e-4) if rtol is None else rtol
    again = (velocity_fn(zs, t).float() - v.float()).norm().item() / v.float().norm().item()
    _check(again <= rtol, f"two equal calls of velocity_fn differ by {again:.1e} of |v|: put the model in eval mode "
                          f"(no dropout) for rollouts and training alike, or the first ratio is not 1")
    one = torch.stack([velocity_fn(zs[s : s + 1], t[s : s + 1])[0] for s in range(S)])  # [S, B, *D]
    error = (v.float() - one.float()).norm().item() / v.float().norm().item()
    _check(error <= rtol, f"velocity_fn on {S} steps at once differs from {S} one-step calls by {error:.1e} of |v| "
                          f"(rtol {rtol:.0e}): it is step-major (entry s * B + i is sample i at step s), so repeat "
                          f"the conditioning as a block, c.repeat(S) or .repeat(S, 1, 1), never repeat_interleave; "
                          f"choose a network (an expert, e.g. Wan 2.2's two) per row from t, not once per call from "
                          f"t[0]; and make no row depend on the others (batch statistics)")
    return max(error, again)


def cat_trajectories(trajs):
    """One jagg.Trajectory from several, joined on B (a rollout drawn in chunks, or gathered from ranks)."""
    levels = {traj.noise_level for traj in trajs}
    _check(len(levels) == 1, f"trajectories drawn at different noise levels cannot form one batch: {levels}")
    return jagg.Trajectory(**{name: torch.cat([getattr(traj, name) for traj in trajs], dim=1)
                              for name in jagg.Trajectory.TENSORS}, noise_level=levels.pop())


def check_batch(traj, advantages, cfg):
    """A batch's trajectories, advantages and loss agree (before any work)."""
    _check(traj.noise_level is None or traj.noise_level == cfg.noise_level,
           f"the trajectories were drawn at noise_level {traj.noise_level} but the loss scores them at "
           f"{cfg.noise_level}: pass the same noise level to rollout and LossConfig")
    _check(advantages.shape == traj.log_prob.shape[1:],
           f"advantages must be [B] = {tuple(traj.log_prob.shape[1:])}, got {tuple(advantages.shape)}")


# Many ranks: every decision is taken on all ranks' samples, as one process on all of them would
# take it, so that every rank takes it alike: routing by the velocities' linearity (the mean of
# the ranks' scores) and the drift guard (the largest drift on any rank). Under FSDP the ranks
# must also run the same forwards, since each gathers the sharded weights from all the others.


def _distributed():
    return torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def _agreed(values, op, device=None):
    """values (a list of floats) combined over ranks: op "mean" or "max"; themselves on one process."""
    if not _distributed():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX if op == "max" else torch.distributed.ReduceOp.SUM)
    return (t if op == "max" else t / torch.distributed.get_world_size()).tolist()


# === 1. Anchors: windows that share their end steps ===
# The paper's two end steps generalise to sorted anchor steps a_0 = 0 < ... < a_m = S - 1. A step
# between consecutive anchors a_j, a_{j+1} interpolates between those two ("hat" weights H in
# t; an anchor keeps weight 1 on itself):
#     J_k ~= sum_j H[k, j] J_{a_j},    grad ~= sum_j G_j^T J_{a_j},    G_j = sum_k H[k, j] g_k,
# still ONE forward with graph (on the anchor rows) and ONE backward. The paper's window is
# anchors (0, S - 1): H[k, 0] = 1 - alpha_k, H[k, 1] = alpha_k. Every step an anchor is exact
# training. Exact under the paper's conditions, segment by segment between anchors.
# anchors="shared": adjacent windows share their end step, so anchors fall every W - 1 steps
# (T = 10, W = 4: anchors 0, 3, 6, 9; 4 rows with grad instead of the paper's 6).


def segment_weights(t, weights="time"):
    """alpha_k over one segment's times t: [S, B] -> [S, B], 0 at its first step, 1 at its last:
    by time (the paper's interpolation_weights) or by index, alpha_k = k / (S - 1)."""
    _check(weights in WEIGHTS, f"weights must be one of {WEIGHTS}, got {weights!r}")
    if weights == "time":
        return jagg.interpolation_weights(t)
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


# Two experts (boundaries). Wan 2.2 A14B runs one transformer at high noise and another below a
# switch. A segment across the switch would interpolate between two networks' Jacobians, so each
# network's steps are tiled on their own: segments end at every boundary.


def expert_boundaries(sigmas, switch_sigma):
    """JaggOptions.boundaries for a model with two experts: the first network runs the steps whose
    sigma is >= switch_sigma, the second the others, as diffusers' WanPipeline does (its
    transformer at timesteps >= boundary_ratio x 1000, so switch_sigma = boundary_ratio: Wan 2.2
    A14B's 0.875 text-to-video, 0.9 image-to-video; a switch at timestep t_b of a model whose time
    is sigma x 1000 is switch_sigma = t_b / 1000). sigmas: [T + 1], decreasing, the schedule
    given to jagg.rollout (step k runs at sigmas[k]; the last entry runs no step). Returns (k,),
    the second network's first step, or () when all T steps run one network. Training only a
    trajectory's first n steps (first_steps), keep the boundaries below n."""
    s = torch.as_tensor(sigmas, dtype=torch.float64).flatten()[:-1]  # the steps' sigmas [T]
    _check(len(s) >= 1 and bool((s[1:] <= s[:-1]).all()),
           f"sigmas must be a decreasing schedule [T + 1] as given to rollout, got {torch.as_tensor(sigmas).tolist()}")
    k = int((s >= switch_sigma).sum())  # the steps of the first network: they come first
    return (k,) if 0 < k < len(s) else ()


def check_boundaries(boundaries, num_steps=None):
    """boundaries: increasing step indices inside (0, T) (T = num_steps, if known)."""
    steps = list(boundaries) if isinstance(boundaries, (tuple, list)) else None
    _check(steps is not None and all(isinstance(b, int) and 0 < b and (num_steps is None or b < num_steps) for b in steps)
           and all(a < b for a, b in zip(steps, steps[1:])),
           f"boundaries must be increasing step indices inside (0, T{'' if num_steps is None else f' = {num_steps}'}), "
           f"each the first step of another network (expert_boundaries computes them; drop those >= T when training "
           f"fewer steps), got {boundaries!r}")


def segment_bounds(num_steps, window, anchors="window", boundaries=()):
    """The segments routing chooses between, [(start, stop), ...]. "window": the paper's
    disjoint windows (jagg.window_bounds). "shared": anchors every W - 1 steps and at T - 1, each
    segment running from one anchor to the next inclusive: W steps (the last may be shorter),
    and consecutive segments share their end step (T = 10, W = 4: anchors 0, 3, 6, 9).
    boundaries (JaggOptions'): the steps from one to the next are tiled alone, as a trajectory of
    their own, so that no segment holds steps of two networks (a network of 1 step: a segment of 1)."""
    _check(anchors in ANCHOR_MODES, f"anchors must be one of {ANCHOR_MODES}, got {anchors!r}")
    check_boundaries(boundaries, num_steps)
    bounds = jagg.window_bounds(num_steps, window)
    if anchors == "window" and not boundaries:
        return bounds
    out = []
    for first, end in zip((0, *boundaries), (*boundaries, num_steps)):  # one network's steps first .. end - 1
        if anchors == "window":
            out += [(a, min(a + window, end)) for a in range(first, end, window)]
            continue
        ends = list(range(first, end - 1, window - 1)) + [end - 1]  # the anchor steps
        out += [(a, b + 1) for a, b in zip(ends, ends[1:])] or [(first, end)]
    return out


def backward_calls(bounds, routed, anchors="window"):
    """The batch's backward calls [(kind, start, stop, anchor steps)], kind "jagg" or "exact",
    in step order. The paper's windows: one call each. Shared anchors: routed segments that touch
    (one ends on the step where the next starts) merge into one JAGG call with all their anchors;
    an exact call takes each segment's steps that no JAGG call or earlier segment has taken."""
    if anchors == "window":
        return [("jagg" if r else "exact", start, stop, [start, stop - 1]) for (start, stop), r in zip(bounds, routed)]
    runs = []  # (start, stop, anchor steps) of each JAGG call
    for (start, stop), use_jagg in zip(bounds, routed):
        if not use_jagg:
            continue
        if runs and runs[-1][1] == start + 1:  # starts on the previous call's last anchor: extend that call
            runs[-1] = (runs[-1][0], stop, runs[-1][2] + [stop - 1])
        else:
            runs.append((start, stop, [start, stop - 1]))
    done = {k for start, stop, _ in runs for k in range(start, stop)}
    calls = [("jagg", start, stop, steps) for start, stop, steps in runs]
    for start, stop in bounds:
        steps = [k for k in range(start, stop) if k not in done]
        done.update(steps)
        if steps:
            calls.append(("exact", steps[0], steps[-1] + 1, None))
    return sorted(calls, key=lambda call: call[1])


# === 2. Rollout interiors: no interior step calls the network ===
# The rollout stored v_k(theta_old). To first order, with JAGG's own interpolated Jacobian,
#     v_k(theta) ~= v_k(theta_old) + sum_j H[k, j] (v_{a_j}(theta) - v_{a_j}(theta_old)),
# so the interior steps call no network at all: the anchors' current velocities come from the
# one forward with graph, and the KL reference takes the same rule with its own anchor
# velocities. Exact while theta = theta_old (the first optimizer step after a rollout), and
# whenever v_theta changes affinely in (z, t) between anchors on a straight path. The
# reference's interiors are exact at theta_old only where the reference's velocities differ
# from the rollout's affinely in t across the segment; the drift guard below refreshes the
# policy's interiors, never the reference's.


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
    """drift at step k of traj with velocity v_k [B, *D]: max_b |ratio - 1| / cfg.clip_range, the
    samples b of every rank."""
    _, log_prob, _, _ = jagg.sde_step(v_k, traj.z[k], traj.t[k], traj.t_next[k], cfg.noise_level,
                                      prev_sample=traj.z_next[k])
    drift = ((log_prob - traj.log_prob[k]).exp() - 1).abs().max().item() / cfg.clip_range
    return _agreed([drift], "max", v_k.device)[0]


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


# === 3. The general JAGG backward: anchors, rollout interiors, index weights, bounded rows ===
# Index weights: the authors' early code (SchumiDing/eff_grpo, fastvideo/
# train_grpo_qwenimage_jagg.py) weights steps by index, alpha_k = k / (W - 1) (weights="index"),
# which equals the t-weighting only when t is linear in k (segment_weights, section 1). With
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


def backward_jagg(velocity_fn, z, t, step_loss, record=None, anchors=None, v_rollout=None, weights="time",
                  max_graph_rows=None, drift_fn=None, max_drift=None):
    """jagg.backward_jagg_window generalised: forwards with graph on the anchor steps only and one
    backward of their composite signals G_j (sections 1-3).

    anchors: sorted step indices containing 0 and S - 1; None is (0, S - 1), the paper's window.
    v_rollout: [S, B, *D] the rollout's velocities (rollout interiors, section 2), or None for
    the paper's no-graph forward of the interior steps. weights: "time" or "index" (hat_weights).
    max_graph_rows: at most this many anchor rows in a graph at once (None: all M in one), the
    same gradient up to the order of floating-point sums. drift_fn(k, v_k) -> float, max_drift:
    with v_rollout, a segment with an anchor whose drift (ratio_drift, as the training step
    passes it) is above max_drift takes the policy's interiors from a no-graph forward
    (stale_segments, whose counts record receives); None: the rollout rule at any drift.
    EXACT under the paper's condition between each pair of anchors; with v_rollout, PAPER (the
    same with forward interiors) while theta = theta_old (the header: when each option is exact).
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
        with torch.no_grad():
            v_mid = dict(zip(interior, velocity_fn(z[interior], t[interior])))  # [S-M] x [B, *D]
    v_old = v_rollout.to(acc_dtype) if rollout else None  # [S, B, *D]
    v_anchor, checked = {}, set()  # j -> v_{a_j} [B, *D] detached, once its chunk has run; segments checked
    g, total = {}, 0.0  # k -> g_k [B, *D]

    def check_drift(j):
        """Rollout interiors of segment j (between a_j and a_{j+1}): from a no-graph forward if an
        anchor drifted past max_drift (section 2), once."""
        checked.add(j)
        steps = list(range(anchors[j] + 1, anchors[j + 1]))
        drifts = [drift_fn(anchors[i], v_anchor[i]) if drift_fn is not None else 0.0 for i in (j, j + 1)]
        if steps and stale_segments(drifts, max_drift, record):
            with torch.no_grad():
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


# === 4. The batch's gradient with every option ===
# jagg.paper_gradients, generalised: segments between anchors instead of windows, routing by the
# probe's cosines, the reference model's velocities at the anchors only with rollout interiors.
# A segment that asks for nothing beyond the paper runs jagg.py's own backward_jagg_window, so
# JaggOptions() trains bit for bit what paper_gradients does. timings, if given, receives the
# seconds of each part (timed_backward).


def interleaved_medians(fns, repeats, warmup=1):
    """Call each fn() -> {key: seconds} warmup + repeats times, rotating which goes first so that
    drift on a shared machine hits all alike. Returns {name: {key: median over repeats}}."""
    names, runs = list(fns), {name: [] for name in fns}
    for r in range(warmup + repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            out = fns[name]()
            if r >= warmup:
                runs[name].append(out)
    return {name: {key: statistics.median(run[key] for run in rs) for key in rs[0]} for name, rs in runs.items()}


@contextlib.contextmanager
def timed(timings, key, device):
    """Add the seconds of the block to timings[key] (synchronised on CUDA, so the numbers mean
    something); timings None: do nothing."""
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


def timed_backward(backward, velocity_fn, z, t, step_loss, timings=None, **kwargs):
    """backward(velocity_fn, z, t, step_loss, **kwargs), its seconds added to timings (if given):
    the network's forwards with graph under "fwd_graph" (with the per-step losses, which run
    while the graph is alive), those without under "fwd_nograd", and the rest under "backward"
    (the backward passes, and each loss's own derivative g_k). jagg.py's functions stay untimed."""
    if timings is None:
        return backward(velocity_fn, z, t, step_loss, **kwargs)
    parts = {}

    def velocity(z_, t_):
        with timed(parts, "fwd_graph" if torch.is_grad_enabled() else "fwd_nograd", z.device):
            return velocity_fn(z_, t_)

    def loss(k, v_k):
        with timed(parts, "fwd_graph", z.device):
            return step_loss(k, v_k)

    with timed(parts, "call", z.device):
        total = backward(velocity, z, t, loss, **kwargs)
    call = parts.pop("call")
    for key, seconds in parts.items():
        timings[key] = timings.get(key, 0.0) + seconds
    timings["backward"] = timings.get("backward", 0.0) + call - sum(parts.values())
    return total


def check_options(opts, num_segments=None, probe_cosines=None, num_steps=None):
    """Every JaggOptions field in range, before any work: a ValueError whose first word is the field
    (so that a script can report it under its flag's name)."""
    _check(isinstance(opts.window, int) and opts.window >= 2, f"window must be an integer >= 2, got {opts.window!r}")
    _check(0 <= opts.jagg_frac <= 1, f"jagg_frac must be in [0, 1], got {opts.jagg_frac!r}")
    _check(opts.min_cosine is None or -1 <= opts.min_cosine <= 1, f"min_cosine must be in [-1, 1] or None, got "
                                                                  f"{opts.min_cosine!r}")
    check_boundaries(opts.boundaries, num_steps)
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


def route_segments(scores, lengths, jagg_frac, floor=None):
    """jagg.route_windows, then none whose score is below floor (None: no floor)."""
    routed = jagg.route_windows(scores, lengths, jagg_frac)
    return [r and (floor is None or s >= floor) for r, s in zip(routed, scores)]


def window_gradients(velocity_fn, traj, advantages, cfg, opts, ref_velocity_fn=None, timings=None,
                     probe_cosines=None):
    """jagg.paper_gradients with JaggOptions' every field: accumulate the batch's gradient, segment
    by segment (segment_bounds), routed between exact and JAGG. Returns (stats, routed).
    route="probe" ranks the segments by probe_cosines (probe_average's) once there are any,
    never routing one below opts.min_cosine; before the first probe, by velocity."""
    T = traj.z.shape[0]
    bounds = segment_bounds(T, opts.window, opts.anchors, opts.boundaries)
    check_options(opts, len(bounds), probe_cosines, num_steps=T)
    check_batch(traj, advantages, cfg)
    _check(cfg.beta == 0 or ref_velocity_fn is not None, "beta > 0 needs a ref_velocity_fn (the frozen reference model)")
    velocity_fn = checked(velocity_fn)
    scores = _agreed([jagg.linearity_score(traj.v[start:stop], traj.t[start:stop]) for start, stop in bounds], "mean",
                     traj.z.device)  # every rank's samples, so that all route alike
    by_probe = opts.route == "probe" and probe_cosines is not None
    routed = route_segments(probe_cosines if by_probe else scores, [stop - start for start, stop in bounds],
                            opts.jagg_frac, floor=opts.min_cosine if by_probe else None)

    calls = backward_calls(bounds, routed, opts.anchors)  # [(kind, start, stop, anchor steps)]
    v_old = traj.v if opts.interior == "rollout" else None
    log, loss, record = [], 0.0, {} if timings is None else timings  # record: the drift guard's counts
    for kind, start, stop, steps in calls:
        z, t = traj.z[start:stop], traj.t[start:stop]  # [S, B, *D], [S, B]
        options = {}  # a JAGG call's: its anchors, rollout interiors, weights
        if kind == "jagg":
            options = {"anchors": [s - start for s in steps], "v_rollout": None if v_old is None else v_old[start:stop],
                       "weights": opts.weights}
        v_ref = None
        if cfg.beta > 0:
            with timed(timings, "fwd_ref", traj.z.device):
                v_ref = reference_velocities(ref_velocity_fn, z, t, **options)  # [S, B, *D]
        step_loss = jagg.make_step_loss(traj, advantages, start, stop, cfg, v_ref, log)
        if kind == "exact":
            loss += timed_backward(jagg.backward_exact, velocity_fn, z, t, step_loss, timings)
        elif opts.paper_backward():  # the paper's window: jagg.py's own function
            loss += timed_backward(jagg.backward_jagg_window, velocity_fn, z, t, step_loss, timings)
        else:
            drift_fn = lambda k, v_k, start=start: ratio_drift(traj, cfg, start + k, v_k)  # noqa: E731 (section 2)
            loss += timed_backward(backward_jagg, velocity_fn, z, t, step_loss, timings, record=record, **options,
                                   max_graph_rows=opts.max_graph_rows, drift_fn=drift_fn, max_drift=opts.max_drift)
    grad_rows = sum(stop - start if kind == "exact" else len(steps) for kind, start, stop, steps in calls)
    stats = {key: sum(s[key] for s in log) / len(log) for key in log[0]}
    eligible = sum(stop - start >= 3 for start, stop in bounds)  # the segments jagg_frac counts, as jagg.py's
    stats.update(loss=loss, routed_frac=sum(routed) / max(eligible, 1), grad_rows=grad_rows, window_scores=scores)
    if opts.interior == "rollout":  # how often the drift guard (section 2) sent a segment to forward interiors
        stats.update(rollout_refreshed=record.get("rollout_refreshed", 0), anchor_drift=record.get("anchor_drift", 0.0))
    return stats, routed


def time_gradients(velocity_fn, params, traj, advantages, cfg, opts, ref_velocity_fn=None, repeats=5):
    """Is JAGG faster on YOUR model? The batch's gradient (window_gradients) computed exactly
    (opts with jagg_frac 0) and with opts, each repeats times after a warm-up round, interleaved
    (interleaved_medians) so that a shared machine's drift hits both alike. Returns
    {"exact": ..., "jagg": ...}, each {"backward_s", "step_s": medians in seconds (the backward
    passes; the whole gradient), "grad_rows"}. params' .grad are cleared before each call."""
    grad_rows = {}

    def run(method, method_opts):
        def call():
            for p in params:
                p.grad = None
            timings = {}
            with timed(timings, "step", traj.z.device):
                stats = window_gradients(velocity_fn, traj, advantages, cfg, method_opts, ref_velocity_fn, timings)[0]
            grad_rows[method] = stats["grad_rows"]
            return {"backward_s": timings["backward"], "step_s": timings["step"]}
        return call
    # rounds run jagg then exact, exact then jagg, ...: after an even number of repeats, exact ran last
    times = interleaved_medians({"jagg": run("jagg", opts), "exact": run("exact", replace(opts, jagg_frac=0.0))},
                                repeats)
    return {m: {**times[m], "grad_rows": grad_rows[m]} for m in ("exact", "jagg")}


# === 5. The fidelity probe: is the approximation good on YOUR model? ===
# JAGG's error depends on how linear the network's Jacobian is along a trajectory, which differs
# between models. The probe computes both gradients of the same segments and reports their
# cosine, so a user adapting JAGG sees at once whether it holds; route="probe" keeps an
# exponential average of the cosines per segment position (probe_average) and routes by it.


def flat_grad(params, dtype=torch.float64):
    """Every parameter's .grad in one vector [P] of dtype (a missing .grad counts as zeros; FSDP's
    sharded gradients gathered whole)."""
    grads = [(p.grad if p.grad is not None else torch.zeros_like(p)) for p in params]
    return torch.cat([(g.full_tensor() if isinstance(g, DTensor) else g).flatten().to(dtype) for g in grads])


def _segment_gradients(velocity_fn, params, traj, advantages, cfg, opts, ref_velocity_fn=None, dtype=torch.float64):
    """For each segment of traj (segment_bounds), (exact, JAGG as opts trains it) flat gradients
    [P] of dtype, or None for a segment of one step (always exact), one segment at a time (a
    generator); leaves the parameters' .grad None."""
    check_options(opts)
    velocity_fn = checked(velocity_fn)
    for start, stop in segment_bounds(traj.z.shape[0], opts.window, opts.anchors, opts.boundaries):
        if stop - start < 2:
            yield None
            continue
        z, t = traj.z[start:stop], traj.t[start:stop]  # [S, B, *D], [S, B]
        options = {"v_rollout": traj.v[start:stop] if opts.interior == "rollout" else None, "weights": opts.weights}
        jagg_kwargs = dict(options, drift_fn=lambda k, v_k, start=start: ratio_drift(traj, cfg, start + k, v_k),
                           max_drift=opts.max_drift)
        grads = []
        for backward, kwargs, ref_options in ((jagg.backward_exact, {}, {}), (backward_jagg, jagg_kwargs, options)):
            for p in params:
                p.grad = None
            v_ref = reference_velocities(ref_velocity_fn, z, t, **ref_options) if cfg.beta > 0 else None
            backward(velocity_fn, z, t, jagg.make_step_loss(traj, advantages, start, stop, cfg, v_ref), **kwargs)
            grads.append(flat_grad(params, dtype))  # [P]
        for p in params:
            p.grad = None
        yield grads


def gradient_cosines(velocity_fn, params, traj, advantages, cfg, opts, ref_velocity_fn=None):
    """For each segment of traj (segment_bounds; the paper's windows by default), the cosine of its
    gradient by JAGG between its two end steps, as opts trains it (interior, weights, max_drift),
    to its exact gradient; 1.0 for a segment of one step. Leaves the parameters' .grad None."""
    params = list(params)
    return [1.0 if pair is None else torch.nn.functional.cosine_similarity(pair[0], pair[1], dim=0).item()
            for pair in _segment_gradients(velocity_fn, params, traj, advantages, cfg, opts, ref_velocity_fn)]


# The probe in units of the batch's own noise. A cosine of 0.94 matters or not depending on how
# noisy the batch's exact gradient already is. The probe batch's two halves give two independent
# exact gradients g_1, g_2 of n_1 and n_2 samples; their difference estimates the per-sample
# covariance's trace, Sigma = |g_1 - g_2|^2 / (1/n_1 + 1/n_2), and so the noise of an optimizer
# step's gradient of N samples, Sigma / N. JAGG's error e = j - g, as a step of N samples has it,
# over that noise:
#     error_to_noise = (|e|^2 + Sigma_e (1/N - 1/B)) / (Sigma / N)
# where |e|^2 is measured on the probe's B samples and Sigma_e, the error's own sample-to-sample
# part, comes from the halves' errors as Sigma does: it moves that part from B samples to N.
# 0.05: JAGG's error weighs as much as the noise of a batch about 5 % smaller, were it unbiased;
# 1: as much as the batch's noise itself. The halves run the rows the whole batch would: no more
# cost than the cosine alone.


def _dot(a, b):
    """a . b in float64, chunk by chunk: no float64 copy of a vector of billions of parameters."""
    return sum(torch.dot(x.double(), y.double()).item() for x, y in zip(a.split(1 << 24), b.split(1 << 24)))


def probe_segments(fns, params, traj, advantages, cfg, opts, train_batch):
    """The probe per segment on the batch traj (its samples, advantages [B]): {"cosine": JAGG's
    gradient to exact (gradient_cosines'), "error_to_noise": |j - g|^2 over an optimizer step's
    noise, both as a step of train_batch samples would see them (probe_figures), and its two parts
    "error" and "noise"}. One probe's noise comes from one pair of halves, so its ratio scatters
    widely; over several probes, sum the parts before dividing (a mean of ratios is biased high,
    E[1 / noise] > 1 / E[noise]). fns(idx) -> (velocity_fn, ref_velocity_fn) of the samples idx
    (their conditioning sliced alike); the batch is split into two halves. A one-step segment
    reports cosine 1 and error 0. Holds four float32 gradient vectors at once (the two halves'
    exact and JAGG ones), the memory of gradient_cosines' two float64 ones. Leaves .grad None."""
    params, B = list(params), advantages.shape[0]
    _check(B >= 2 and train_batch >= 1, f"the probe needs >= 2 samples and train_batch >= 1, got {B} and {train_batch}")
    halves = [torch.arange(B, device=advantages.device)[i::2] for i in (0, 1)]  # [n_1], [n_2]
    per_half = []  # two generators, one per half, run segment by segment side by side
    for idx in halves:
        velocity_fn, ref_velocity_fn = fns(idx)
        per_half.append(_segment_gradients(velocity_fn, params, traj.subset(idx), advantages[idx], cfg, opts,
                                           ref_velocity_fn, torch.float32))
    out = {"cosine": [], "error_to_noise": [], "error": [], "noise": []}
    for first, second in zip(*per_half):  # each: [exact g_h, JAGG j_h] of one segment, or None
        figures = (1.0, 0.0, 0.0, 0.0) if first is None else probe_figures(
            first[0], second[0], first[1], second[1], len(halves[0]), len(halves[1]), train_batch)
        for key, value in zip(out, figures):
            out[key].append(value)
    return out


def probe_figures(g_1, g_2, j_1, j_2, n_1, n_2, train_batch):
    """(cosine, error_to_noise, error, noise) of one segment from its two halves' exact and JAGG
    gradients (g_h, j_h: means over n_h samples each). The whole probe batch's g and j weigh the
    halves by their sizes; every term is a dot product of the four vectors (no fifth copy).
    - noise: the sample-to-sample variance of the exact gradient, |g_1 - g_2|^2 / (1/n_1 + 1/n_2),
      over train_batch: what an optimizer step of that many samples carries.
    - error: |j - g|^2 of a step of train_batch samples. On the probe's B = n_1 + n_2 samples
      E|j - g|^2 = |mean error|^2 + S_e / B, where S_e, the error's own sample-to-sample variance,
      comes from the halves' errors as the noise does; a step of train_batch samples has S_e /
      train_batch in its place. Without the exchange a probe of 4 samples for a step of 16 reads
      the error's sample-to-sample part 4 times too large (docs/probe_check.md). The estimate is
      unbiased, so one probe's can come out below 0: an error lost in the probe's own scatter.
    - error_to_noise: error / noise, not clipped (pool the parts over probes, then divide);
      cosine: of j to g on the probe's batch."""
    vectors, B = (g_1, g_2, j_1, j_2), n_1 + n_2
    gram = [[_dot(a, b) if k <= m else None for m, b in enumerate(vectors)] for k, a in enumerate(vectors)]

    def quad(c, d):  # <sum_k c_k v_k, sum_m d_m v_m>
        return sum(c[k] * d[m] * gram[min(k, m)][max(k, m)] for k in range(4) for m in range(4))

    w_1, w_2 = n_1 / B, n_2 / B
    g, j, e = (w_1, w_2, 0, 0), (0, 0, w_1, w_2), (-w_1, -w_2, w_1, w_2)
    harmonic = 1 / n_1 + 1 / n_2
    sigma = quad((1, -1, 0, 0), (1, -1, 0, 0)) / harmonic  # exact: g_1 - g_2
    sigma_e = quad((-1, 1, 1, -1), (-1, 1, 1, -1)) / harmonic  # the error: (j_1 - g_1) - (j_2 - g_2)
    gg, jj = quad(g, g), quad(j, j)
    cosine = quad(g, j) / math.sqrt(gg * jj) if gg * jj > 0 else 0.0
    error, noise = quad(e, e) + sigma_e * (1 / train_batch - 1 / B), sigma / train_batch
    return cosine, (error / noise if sigma > 0 else math.inf), error, noise


def pool_probes(probes):
    """A run's probes pooled per segment position: probes, a list of probe_segments' dicts (their
    "cosine", "error" and "noise" lists). Returns {"cosine": the mean cosine, "error_to_noise":
    the errors summed over the noises summed (a mean of the ratios would be biased high, each
    probe's noise being one pair of halves), "stderr": that figure's standard error from the
    probes' scatter about it, sqrt(n / (n - 1) sum_i (e_i - R v_i)^2) / sum_i v_i (None with
    fewer than 2 probes)}, each a list over positions; None without probes. The figure is not
    clipped: below 0, JAGG's error is lost in the probes' own scatter. How to read it: an upper
    end (figure + 1.96 stderr) at 0.1 or less, JAGG's error weighs less than a tenth of the
    step's own noise; near 1 or above, as much as the noise: train those segments exactly (or
    route="probe"); between, it costs a little of the reward gain (docs/probe_check.md)."""
    if not probes:
        return None
    out = {"cosine": [], "error_to_noise": [], "stderr": []}
    for j in range(len(probes[0]["cosine"])):
        e, v = [p["error"][j] for p in probes], [p["noise"][j] for p in probes]
        n, total = len(e), sum(v)
        ratio = sum(e) / total if total > 0 else 0.0
        out["cosine"].append(sum(p["cosine"][j] for p in probes) / n)
        out["error_to_noise"].append(ratio)
        if n < 2:
            out["stderr"].append(None)
        else:
            out["stderr"].append(math.sqrt(n / (n - 1) * sum((a - ratio * b) ** 2 for a, b in zip(e, v))) / total
                                 if total > 0 else 0.0)
    return out


def probe_average(average, cosines, decay):
    """The running average route="probe" ranks by: average <- decay * average + (1 - decay) *
    cosines per segment position; the first probe (average None) starts it."""
    if average is None:
        return list(cosines)
    return [decay * m + (1 - decay) * c for m, c in zip(average, cosines)]


# === 6. An SDE window: only a few steps of each trajectory are stochastic and trained ===
# Flow-GRPO-Fast and MixGRPO sample K consecutive steps with the SDE and the rest with the
# deterministic ODE (Euler, noise level 0, no log-probability), and train the K steps alone. The
# window's steps are then a trajectory of K steps like any other: the loss, the KL, routing, the
# probe and every JAGG mode see them and nothing else. JAGG inside a window of K steps at W = K
# runs 2 rows with grad where exact runs K. Where the window sits, epoch by epoch:
# - "random" (Flow-GRPO-Fast): its first step uniform in [low, high - K], drawn anew each epoch;
# - "slide" (MixGRPO): it starts at low and moves one step later every `every` epochs, then stays
#   at high - K once it gets there.

PLACEMENTS = ("random", "slide")


def window_start(placement, epoch, size, low, high, every=1, seed=0):
    """The first SDE step of epoch's rollouts (epochs count from 1), the same on every rank: a
    window of size steps within steps low .. high - 1 of the schedule."""
    _check(placement in PLACEMENTS, f"placement must be one of {PLACEMENTS}, got {placement!r}")
    _check(0 <= low and size >= 1 and low + size <= high,
           f"an SDE window of {size} steps does not fit in steps {low} to {high - 1}")
    if placement == "random":
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        return low + int(torch.randint(high - size - low + 1, (1,), generator=g))
    return min(low + (epoch - 1) // every, high - size)


@torch.no_grad()
def window_rollout(velocity_fn, noise, sigmas, noise_level, start, size, generator=None):
    """Sample B trajectories of T = len(sigmas) - 1 steps from the noise [B, *D]: steps start ..
    start + size - 1 by the SDE at noise_level, the others by the ODE. Returns (traj, sample): the
    window's steps as a jagg.Trajectory of size steps (its .t holds their sigmas) and the final
    clean samples z_T [B, *D] to reward. start 0 and size T is jagg.rollout, bit for bit."""
    T = len(sigmas) - 1
    _check(0 <= start and size >= 1 and start + size <= T, f"an SDE window of {size} steps from step {start} does not "
                                                           f"fit in a trajectory of {T} steps")
    velocity_fn, z = checked(velocity_fn), noise

    def ode(z, k):  # Euler, the SDE step's mean at noise level 0: z + v dt, in fp32 at least like jagg.sde_step
        v = velocity_fn(z[None], sigmas[k].expand(1, z.shape[0]).to(z.device))[0]  # [B, *D]
        dtype = torch.promote_types(torch.promote_types(v.dtype, z.dtype), torch.float32)
        return z.to(dtype) + v.to(dtype) * (sigmas[k + 1] - sigmas[k]).to(z.device, dtype)  # [B, *D]

    for k in range(start):
        z = ode(z, k)
    traj = jagg.rollout(velocity_fn, z, sigmas[start : start + size + 1], noise_level, generator)
    z = traj.sample
    for k in range(start + size, T):
        z = ode(z, k)
    return traj, z


# === 7. train_step for real runs: averaged over ranks, clipped, and a step if it is finite ===
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
# Under FSDP (fully_shard) the weights are sharded and every forward gathers them from all ranks,
# so every rank runs the same forwards (the decisions above are agreed). FSDP's reduce-scatter in
# the backward is linear, so it stays correct in any order of forwards and backwards: each
# backward adds its averaged shard to .grad. Its own accumulation switch, fsdp_no_sync, keeps the
# gradients unreduced through the micro-batches before an optimizer step's last, and
# optimizer_step leaves the already averaged (DTensor) gradients alone: one mechanism for both.


def init_distributed(always=False, backend=None):
    """(rank, world) for a trainer: torch.distributed started under torchrun (backend None: NCCL on
    GPUs, gloo on CPUs; a model kept on the CPU passes "gloo"); with always, on a single rank too
    (FSDP shards over a process group). Outside torchrun: (0, 1)."""
    if "WORLD_SIZE" not in os.environ or (int(os.environ["WORLD_SIZE"]) == 1 and not always):
        return 0, 1
    if not torch.distributed.is_initialized():  # a second run in one process keeps the group
        torch.distributed.init_process_group(  # a stopped rank fails its peers in minutes, not gloo's 30
            backend or ("nccl" if torch.cuda.is_available() else "gloo"), timeout=datetime.timedelta(minutes=5))
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def exit_distributed():
    """End a finished rank under torchrun: close the process group, flush, and leave with exit code 0
    at once. At the interpreter's normal shutdown a rank sometimes aborts (SIGABRT, "terminate called
    without an active exception": a native thread still joinable at exit), failing a run that has
    finished and written everything. Outside torchrun (no group) it returns and Python exits as usual."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def all_gather_cat(x):
    """Every rank's tensor x concatenated along dim 0 (x itself on one process): groups spread over ranks."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return x
    parts = [torch.empty_like(x) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def _average_gradients_over_ranks(params):
    """Every rank's .grad becomes the mean over ranks, in ONE all-reduce per dtype (the gradients
    flattened into one buffer). A parameter without a gradient counts as 0. FSDP's sharded
    gradients (DTensors) were averaged by FSDP's own reduce-scatter in the backward: left alone."""
    if not _distributed():
        return
    world = torch.distributed.get_world_size()
    params = [p for p in params if not isinstance(p.grad, DTensor)]
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


@contextlib.contextmanager
def fsdp_no_sync(module):
    """FSDP2's accumulation switch as DDP's no_sync is one: the backward passes inside keep their
    gradients unreduced until a backward outside it, which reduces them with its own. Give it to
    every micro-batch of an optimizer step but the last; the last runs with nullcontext."""
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def no_sync_for(model, last):
    """The no_sync to give accumulate_gradients for a micro-batch of an optimizer step (last: the step's
    last), by what wraps model: DDP's model.no_sync for every one (optimizer_step all-reduces once a
    step, see above), fsdp_no_sync for all but the last under FSDP2 (whose backward then reduce-scatters
    the step's sum), nullcontext for a model on one process."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.no_sync
    if hasattr(model, "set_requires_gradient_sync") and not last:  # a module fully_shard wrapped
        return lambda: fsdp_no_sync(model)
    return contextlib.nullcontext


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


def epoch_stats(stats):
    """An epoch's figures from its micro-batches' stats (accumulate_gradients', each optimizer step's
    last merged with optimizer_step's, as train_step returns them): the diagnostics' means, the
    counts' and times' sums. Keys as in metrics.jsonl: train/... and time/..."""
    mean = lambda key: sum(s[key] for s in stats) / len(stats) if stats else float("nan")  # noqa: E731
    steps = [s for s in stats if "grad_norm" in s]  # one per optimizer step
    guard = [k for k in ("rollout_refreshed", "anchor_drift") if stats and k in stats[0]]  # rollout interiors'
    return {**{f"train/{k}": mean(k) for k in ["loss", "clipfrac", "approx_kl", "kl", "routed_frac", *guard]},
            "train/grad_norm": sum(s["grad_norm"] for s in steps) / max(len(steps), 1),
            "train/grad_rows": sum(s["grad_rows"] for s in stats), "train/skipped_steps": sum(s["skipped"] for s in steps),
            "train/optimizer_steps": sum(not s["skipped"] for s in steps),
            "time/backward_seconds": sum(s["backward_seconds"] for s in stats),
            "time/grad_seconds": sum(s["grad_seconds"] for s in stats)}


def train_step(velocity_fn, optimizer, traj, advantages, cfg, opts, *, ref_velocity_fn=None, params=None,
               max_grad_norm=1.0, no_sync=contextlib.nullcontext, probe_cosines=None, step=None):
    """One optimizer step of GRPO on a batch of trajectories (traj: T steps of B samples;
    advantages: [B]; cfg: jagg.LossConfig; opts: JaggOptions): jagg.paper_gradients with the
    options (accumulate_gradients), then the clip and the optimizer step (optimizer_step). Pass
    DDP's model.no_sync as no_sync; under FSDP, nothing. params: those clipped and averaged over
    ranks; None: the optimizer's. Returns (stats, routed)."""
    if params is None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
    optimizer.zero_grad(set_to_none=True)
    stats, routed = accumulate_gradients(velocity_fn, traj, advantages, cfg, opts, ref_velocity_fn=ref_velocity_fn,
                                         no_sync=no_sync, probe_cosines=probe_cosines)
    stats.update(optimizer_step(params, optimizer, [stats["loss"]], max_grad_norm=max_grad_norm, step=step))
    return stats, routed


# === 8. A run's folder, for the two trainers: one run per folder, files whole or absent ===
# Not JAGG's: what train_sd.py and train_toy.py share around it. Each error is a ValueError whose
# message is one line naming the file or flag and the fix; the trainers print it and exit.


class WriteError(OSError):
    """atomic_write could not write a file (a full disk, say); the file it would replace stands."""


def atomic_write(path, data, mode="w"):
    """Write data (a str, bytes, or a function of the open file) into a temporary file beside path,
    then rename it over path: a reader, or a killed run, sees the old file or the new, never half.
    An OSError becomes a WriteError whose message is one line naming path."""
    folder, tmp = os.path.dirname(os.path.abspath(path)), None
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        with os.fdopen(fd, mode) as f:
            data(f) if callable(data) else f.write(data)
        os.chmod(tmp, 0o644)  # not mkstemp's 0600
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, OSError):
            raise WriteError(f"cannot write {path} ({e.strerror or e}); what was there before stands") from e
        raise


def json_text(obj, indent=None):
    """JSON of obj with a non-finite number written as null: JSON has no NaN."""
    def clean(o):
        if isinstance(o, dict):
            return {k: clean(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [clean(v) for v in o]
        return None if isinstance(o, float) and not math.isfinite(o) else o
    return json.dumps(clean(obj), indent=indent, sort_keys=True, allow_nan=False)


def write_json(path, obj):
    atomic_write(path, json_text(obj, indent=2))


def claim_folder(out, run_files, resume=False, overwrite=False, resume_flag="--resume"):
    """Lock the folder out for this process (the lock holds until the returned file is closed) and
    check it may take a run: one that another process holds, that cannot be written, or that holds
    a run (any of run_files: paths inside out, glob patterns) without resume or overwrite is refused.
    Removes the temporary files of a killed write; with overwrite, the old run's files too."""
    try:
        os.makedirs(out, exist_ok=True)
        lock = open(os.path.join(out, ".lock"), "a+")
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ValueError(f"--out {out!r} is in use by another run (it holds {out}/.lock): wait for it, or pick "
                         "another folder") from None
    except OSError as e:
        raise ValueError(f"--out {out!r} cannot be created or written to ({e.strerror or e}); pass a writable "
                         "folder") from None
    inside = lambda pattern: glob.glob(os.path.join(glob.escape(out), pattern))  # noqa: E731
    found = sorted({os.path.relpath(path, out) for name in run_files for path in inside(name)})
    if found and not resume and not overwrite:
        lock.close()
        raise ValueError(f"--out {out!r} holds a run ({', '.join(found)}): continue it with {resume_flag}, start "
                         "afresh with --overwrite, or pick another folder")
    for tmp in inside(".tmp-*") + inside("*/.tmp-*"):
        os.remove(tmp)
    for name in found if overwrite else ():
        os.remove(os.path.join(out, name))
    return lock


def read_checkpoint(path, keys, owner, mmap=False):
    """owner's checkpoint, a dict of tensors and plain data, read safely (weights_only), or one line naming
    it when it is cut, foreign, or lacks one of keys."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        missing = set(keys) - set(ckpt if isinstance(ckpt, dict) else ())
        if missing:
            raise ValueError(f"it has no {', '.join(sorted(missing))}")
    except Exception as e:
        raise ValueError(f"cannot resume: {path} is not a whole {owner} checkpoint ({type(e).__name__}: "
                         f"{str(e)[:200]}); start afresh with --overwrite") from None
    return ckpt


def changed_flags(saved, flags, may_change=()):
    """Why resuming with flags (a dict) would train another run than the saved flags did: one text
    per flag not in may_change whose value differs; empty when none does."""
    return [f"--{k.replace('_', '-')} {flags[k]} differs from the run's {v}" for k, v in saved.items()
            if k in flags and k not in may_change and flags[k] != v]


@contextlib.contextmanager
def stop_on_signals():
    """Inside, Ctrl-C (SIGINT) and SIGTERM are recorded in the yielded list instead of stopping the
    process, so that a trainer ends its epoch, checkpoints and exits; a second one acts at once."""
    received = []

    def handler(signum, frame):
        received.append(signal.Signals(signum).name)
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
