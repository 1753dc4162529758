"""JAGG beyond the paper: backward_batch is jagg.backward_batch with our options, off by default.

jagg.py is the paper alone; this module builds on it (it imports jagg, never the reverse). The
defaults are the paper's JAGG, so JaggOptions() trains what jagg.backward_batch does, bit
for bit (max_drift's default acts only with rollout interiors, which the paper does not have).
Read jagg.py first: the notation is its own. Every option has a test against an independent
computation in tests/test_options.py.

Two meanings of "exact" below: EXACT, the gradient exact per-step back-propagation gives
(Flow-GRPO's, jagg.backward_exact); and PAPER, the gradient JAGG gives on the same anchors with
the paper's forward interiors (interior velocities from a no-graph forward at the current
weights): jagg.backward_jagg_window for two anchors, backward_jagg's forward interiors for more.
The paper's JAGG is EXACT when the Jacobian J(z, t) is affine along a window and the states lie
on the straight line between its end steps, each at its t-weight alpha_k.

The options (a JaggOptions field each; in brackets, the default), and when each is exact:
    anchors="shared"     ["window"] Adjacent windows share their end step: anchors every W - 1
                         steps and at the last step, back-propagated in one forward with graph
                         and one backward per run of adjacent segments routed to JAGG. EXACT when
                         the paper's condition holds on each segment between consecutive anchors.
                         These segments are not the paper's windows (T = 10, W = 4: 0-3 | 3-6 |
                         6-9 against 0-3 | 4-7 | 8-9), so neither condition implies the other.
                         4 rows with grad instead of the paper's 6 there, all in one graph
                         (max_graph_rows bounds it), but 6 of the 10 steps interpolated, not 4.
                         The saving depends on T (T = 8: anchors 0, 3, 6, 7, as many rows as the
                         paper's windows).
    interior="rollout"   ["forward"] An interior step's velocity is the rollout's, moved by its
                         two anchors' change since the rollout:
                             v_k ~= v_old_k + sum_j H[k, j] (v_{a_j} - v_old_{a_j}),
                         and the KL reference's interiors take the same rule with its own anchor
                         velocities. No network call between anchors. PAPER at the rollout's
                         parameters (theta = theta_old: the first optimizer step after each
                         rollout) when beta = 0, provided the training forward reproduces the
                         rollout's velocities (same precision, conditioning and CFG). With
                         beta > 0, PAPER there only if the reference's velocities differ from the
                         rollout's affinely in t across each segment. After the first step, an
                         interior errs by the part of its change since the rollout that is not
                         affine between its anchors, and the GRPO clip can turn a small ratio
                         error into a large gradient error: hence
    max_drift            [0.5; with interior="rollout" only] the drift guard: a segment whose
                         anchors' ratios moved by more than this share of the clip range takes the
                         POLICY's interiors from a no-graph forward, as forward interiors do; the
                         reference's stay interpolated. None: the rollout rule at any drift.
    weights="index"      ["time"] alpha_k = k / (W - 1), as the authors' early code; PAPER when t
                         is linear in the step index (not under SD3's shifted schedule), EXACT when
                         the Jacobian is affine in the step index along each segment.
    max_graph_rows       [None: no bound] At most this many anchor rows in a graph at once: always
                         the same gradient as without the bound, to round-off; less memory, some
                         speed lost. With rollout interiors at least 2.
    route="velocity"     ["early": jagg.py's schedule, the earliest (highest-noise) segments first]
                         Our reading of the abstract's cosine-similarity rule: the segments whose
                         rollout velocities run straightest (jagg.linearity_score, free) take JAGG. It
                         ranks segments by their noise level, lowest first, where JAGG adds the most
                         error to the step (lab/reports/routing.md).
    route="late"         The opposite schedule: the latest (lowest-noise) segments first, which is
                         what the velocity score does in effect (the same reward on the toy).
    route="step_error"   JAGG takes the segments where it would add the least error to the step,
                         estimated from what the rollout kept, with no network call:
                         (1 - cos) |G_a + G_b|, the free score's bend times the segment's loss
                         signal (step_error_score). It matched "early" at jagg_frac 0.5 and left
                         2-3x its error at 0.75 on the toy (lab/reports/routing.md).
    route="probe"        Route by the probe's measured cosine of each segment's JAGG gradient to
                         its exact one (probe.py), averaged over probes. min_cosine [None;
                         route="probe" only] trains any segment whose average is below it EXACT.
                         Routing chooses which segments are approximated, not how.
    boundaries=(b, ...)  [(): one network] For models with two experts (Wan 2.2 A14B switches
                         transformers at a timestep): the steps where another network takes over,
                         each the first step it runs (expert_boundaries, in Wan's recipe in
                         examples/diffusers_models.py, computes them). The steps from one
                         boundary to the next are tiled as a trajectory of their own, so
                         no segment holds steps of two networks (T = 10, W = 4, boundaries (5,):
                         windows 0-3 | 4 | 5-8 | 9). A segment across the switch would interpolate
                         between two networks' Jacobians: EXACT under no condition. With
                         boundaries, EXACT when the paper's condition holds on each segment for the
                         one network that runs it. Costs up to one segment more per switch.

Notation beyond jagg.py's
    anchors    a_0 = 0 < a_1 < ... < a_m = S - 1, the steps whose Jacobians are back-propagated
               (the paper: a window's a and b)
    H[k, j]    the hat weight of anchor j at step k (the paper: 1 - alpha_k and alpha_k)
    G[j]       G_j = sum_k H[k, j] g_k (the paper: G_a and G_b)
    v_old      v_k(theta_old), the rollout's velocities (Trajectory.v)
    segment    the steps from one anchor to the next, both included: (start, stop) with stop
               one past the last (the paper's windows are segments too)
"""

from dataclasses import dataclass, replace

import torch

import jagg
from jagg import _check
from beyond_paper.checks import checked
from beyond_paper.ranks import over_ranks

ANCHOR_MODES = ("window", "shared")  # the paper's disjoint windows; OURS: windows sharing end steps
INTERIOR_MODES = ("forward", "rollout")  # the paper's no-graph forwards; OURS: rollout velocities
WEIGHTS = ("time", "index")  # the paper's alpha_k by t; the authors' early code's by step index
ROUTES = ("early", "velocity", "late", "step_error", "probe")  # jagg.py's schedule first


@dataclass
class JaggOptions:
    """How a batch's gradient is computed. The paper's knobs come first; every other field is an
    option beyond the paper whose default is the paper's behaviour (the header says each one)."""

    window: int = 4  # W, sampling steps per window
    jagg_frac: float = 1.0  # the share of windows of >= 3 steps JAGG takes (the best scored)
    # --- beyond the paper (OURS)
    anchors: str = "window"  # "window": the paper's windows; "shared": windows share end steps
    interior: str = "forward"  # "forward": the paper's no-graph forwards; "rollout": traj.v moved
    weights: str = "time"  # "time": the paper's alpha_k by t; "index": alpha_k = k / (W - 1)
    max_graph_rows: int = None  # at most this many anchor rows in a graph at once; None: no bound
    max_drift: float = 0.5  # rollout interiors while the anchors' ratios drift less than this
    route: str = "early"  # "early" / "late": the earliest / latest segments first (jagg.py: early);
    # "velocity": linearity_score; "step_error": the smallest (1 - cos) |G_a + G_b|; "probe": its cosines
    min_cosine: float = None  # route="probe": a window whose cosine is below this stays exact
    boundaries: tuple = ()  # two experts: each network's first step; no segment spans two

    def mode_name(self, method="jagg"):
        """The training mode's name in metrics and tables: exact, jagg, jagg_shared, jagg_rollout
        or jagg_shared_rollout (method "exact": every window exact, whatever the options)."""
        if method == "exact":
            return "exact"
        shared = "_shared" if self.anchors == "shared" else ""
        rollout = "_rollout" if self.interior == "rollout" else ""
        return "jagg" + shared + rollout

    def paper_backward(self):
        """True when a JAGG segment's backward is the paper's, jagg.backward_jagg_window."""
        return (self.anchors == "window" and self.interior == "forward" and self.weights == "time"
                and (self.max_graph_rows is None or self.max_graph_rows >= 2))


def check_batch(traj, advantages, cfg):
    """A batch's trajectories, advantages and loss agree (before any work)."""
    _check(traj.noise_level is None or traj.noise_level == cfg.noise_level,
           f"the trajectories were drawn at noise_level {traj.noise_level} but the loss scores them"
           f" at {cfg.noise_level}: pass the same noise level to rollout and LossConfig")
    _check(advantages.shape == traj.log_prob.shape[1:],
           f"advantages must be [B] = {tuple(traj.log_prob.shape[1:])}, "
           f"got {tuple(advantages.shape)}")


# === 1. Anchors: windows that share their end steps ===
# The paper's two end steps generalise to sorted anchor steps a_0 = 0 < ... < a_m = S - 1. A step
# between consecutive anchors a_j, a_{j+1} interpolates between those two ("hat" weights H in
# t; an anchor keeps weight 1 on itself):
#     J_k ~= sum_j H[k, j] J_{a_j},    grad ~= sum_j G_j^T J_{a_j},    G_j = sum_k H[k, j] g_k,
# still ONE forward with graph (on the anchor rows) and ONE backward. The paper's window is
# anchors (0, S - 1): H[k, 0] = 1 - alpha_k, H[k, 1] = alpha_k. Every step an anchor is exact
# training. anchors="shared": adjacent windows share their end step, so anchors fall every W - 1
# steps (T = 10, W = 4: anchors 0, 3, 6, 9; 4 rows with grad instead of the paper's 6).
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


def anchor_steps(anchors, S):
    """anchors as a list of ints, checked: increasing step indices from 0 to S - 1."""
    steps = list(anchors)
    increasing = all(a < b for a, b in zip(steps, steps[1:]))
    _check(len(steps) >= 2 and steps[0] == 0 and steps[-1] == S - 1 and increasing
           and all(int(a) == a for a in steps),
           f"anchors must be increasing step indices from 0 to S - 1 = {S - 1}, got {steps}")
    return [int(a) for a in steps]


# Two experts (boundaries). Wan 2.2 A14B runs one transformer at high noise and another below a
# switch. A segment across the switch would interpolate between two networks' Jacobians, so each
# network's steps are tiled on their own: segments end at every boundary.
def check_boundaries(boundaries, num_steps=None):
    """boundaries: increasing step indices inside (0, T) (T = num_steps, if known)."""
    steps = list(boundaries) if isinstance(boundaries, (tuple, list)) else None
    inside = steps is not None and all(
        isinstance(b, int) and 0 < b and (num_steps is None or b < num_steps) for b in steps)
    T = "T" if num_steps is None else f"T = {num_steps}"
    _check(inside and all(a < b for a, b in zip(steps, steps[1:])),
           f"boundaries must be increasing step indices inside (0, {T}), each the first step of "
           "another network (examples/diffusers_models.expert_boundaries computes them; drop "
           f"those >= T when training fewer steps), got {boundaries!r}")


def segment_bounds(num_steps, window, anchors="window", boundaries=()):
    """The segments routing chooses between, [(start, stop), ...]. "window": the paper's
    disjoint windows (jagg.window_bounds). "shared": anchors every W - 1 steps and at T - 1, each
    segment running from one anchor to the next inclusive: W steps (the last may be shorter),
    and consecutive segments share their end step (T = 10, W = 4: anchors 0, 3, 6, 9).
    boundaries: the steps from one to the next are tiled alone, as a trajectory of their own, so
    that no segment holds steps of two networks (a network of 1 step: a segment of 1)."""
    _check(anchors in ANCHOR_MODES, f"anchors must be one of {ANCHOR_MODES}, got {anchors!r}")
    check_boundaries(boundaries, num_steps)
    bounds = jagg.window_bounds(num_steps, window)
    if anchors == "window" and not boundaries:
        return bounds
    out = []
    for first, end in zip((0, *boundaries), (*boundaries, num_steps)):  # one network's steps
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
        return [("jagg" if r else "exact", start, stop, [start, stop - 1])
                for (start, stop), r in zip(bounds, routed)]
    runs = []  # (start, stop, anchor steps) of each JAGG call
    for (start, stop), use_jagg in zip(bounds, routed):
        if not use_jagg:
            continue
        if runs and runs[-1][1] == start + 1:  # starts on the previous call's last anchor
            first, _, steps = runs[-1]
            runs[-1] = (first, stop, steps + [stop - 1])
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
    delta = v_anchor.to(H.dtype) - v_old[anchors]  # [M, B, *D]: each anchor's move since then
    v = v_old + (H * delta).sum(dim=1)  # [S, B, *D]
    v[anchors] = v_anchor.to(H.dtype)  # known there, not interpolated (no rounding either)
    return v


# Once the policy has moved. From the second optimizer step on a rollout, theta != theta_old and
# the rule above errs by the part of each interior's change that is not affine between its
# anchors. That error moves the interiors' ratios, and GRPO's clip turns a small ratio error into
# a wrong gradient wherever it carries a sample across the clip boundary: measured, rollout
# interiors stay as close to exact as forward interiors until ratios near the boundary, then fall
# far behind (lab/reports/offpolicy.md). The anchors show how far their ratios have moved, free:
#     drift_j = max_b |ratio_{a_j, b} - 1| / clip_range      (0 on-policy; 1: at the clip boundary)
# A segment with an anchor drifted past max_drift takes its interior velocities from a no-graph
# forward instead, as forward interiors do: their accuracy, at their cost, there only.
def ratio_drift(traj, cfg, k, v_k):
    """drift at step k of traj with velocity v_k [B, *D]: max_b |ratio - 1| / cfg.clip_range, the
    samples b of every rank."""
    log_prob = jagg.sde_step(v_k, traj.z[k], traj.t[k], traj.t_next[k], cfg.noise_level,
                             prev_sample=traj.z_next[k])[1]  # [B]
    drift = ((log_prob - traj.log_prob[k]).exp() - 1).abs().max().item() / cfg.clip_range
    return over_ranks([drift], "max", v_k.device)[0]


def stale_segments(drifts, max_drift, record=None):
    """The segments j (between anchors j and j + 1) whose rollout interiors must not be trusted:
    an anchor's drift above max_drift (None: trust them at any drift). drifts: one per anchor
    (the training step passes one segment's two). record (a dict), if given, adds the segments
    seen and refreshed under "rollout_segments" and "rollout_refreshed" and keeps the largest
    drift under "anchor_drift"."""
    stale = [j for j in range(len(drifts) - 1)
             if max_drift is not None and max(drifts[j], drifts[j + 1]) > max_drift]
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
#   chunk is back-propagated once the next chunk has run its forward: chunks of
#   max_graph_rows // 2, at most two alive at once (a bound of at least 2). Earlier anchors'
#   velocities are kept detached.
# Every step's g_k is computed once and no network row runs twice: without a bound, one chunk.
def min_graph_rows(interior):
    """The smallest max_graph_rows a mode allows: 1, or 2 with rollout interiors (an interior step
    needs both its anchors' current velocities at once)."""
    return 2 if interior == "rollout" else 1


def check_max_graph_rows(max_graph_rows, interior):
    least = min_graph_rows(interior)
    why = " with rollout interiors (an interior step needs both its anchors at once)"
    _check(max_graph_rows is None or (isinstance(max_graph_rows, int) and max_graph_rows >= least),
           f"max_graph_rows must be an integer >= {least}{why if interior == 'rollout' else ''}"
           f" or None (no bound), got {max_graph_rows!r}")


def backward_jagg(velocity_fn, z, t, step_loss, record=None, anchors=None, v_rollout=None,
                  weights="time", max_graph_rows=None, drift_fn=None, max_drift=None):
    """jagg.backward_jagg_window generalised: forwards with graph on the anchor steps only and one
    backward of their composite signals G_j (sections 1-3). Adds to .grad, returns the loss.

    anchors: sorted step indices containing 0 and S - 1; None is (0, S - 1), the paper's window.
    v_rollout: [S, B, *D] the rollout's velocities (rollout interiors, section 2), or None for
    the paper's no-graph forward of the interior steps. weights: "time" or "index" (hat_weights).
    max_graph_rows: at most this many anchor rows in a graph at once (None: all M in one), the
    same gradient up to the order of floating-point sums. drift_fn(k, v_k) -> float, max_drift:
    with v_rollout, a segment with an anchor whose drift (ratio_drift, as backward_batch
    passes it) is above max_drift takes the policy's interiors from a no-graph forward
    (stale_segments, whose counts record receives); None: the rollout rule at any drift.
    EXACT under the paper's condition between each pair of anchors; with v_rollout, PAPER (the
    same with forward interiors) while theta = theta_old (the header: when each option is exact).
    """
    _check(z.ndim >= 2 and t.shape == z.shape[:2], "a window needs z: [W, B, *D] and t: [W, B]")
    S = z.shape[0]
    _check(S >= 2, f"JAGG needs a window of at least 2 steps, got W = {S}")
    anchors = anchor_steps((0, S - 1) if anchors is None else anchors, S)
    _check(v_rollout is None or tuple(v_rollout.shape) == tuple(z.shape),
           f"v_rollout must be [S, B, *D] like z {tuple(z.shape)}, "
           f"got {None if v_rollout is None else tuple(v_rollout.shape)}")
    rollout = v_rollout is not None
    check_max_graph_rows(max_graph_rows, "rollout" if rollout else "forward")
    acc_dtype = torch.promote_types(z.dtype, torch.float32)  # G_j in fp32 at least
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
    v_anchor = {}  # j -> v_{a_j} [B, *D] detached, once its chunk has run
    checked_segments = set()  # the segments whose drift has been checked
    g, total = {}, 0.0  # k -> g_k [B, *D]; the summed loss

    def check_drift(j):
        """Rollout interiors of segment j (between a_j and a_{j+1}): from a no-graph forward if an
        anchor drifted past max_drift (section 2), once."""
        checked_segments.add(j)
        steps = list(range(anchors[j] + 1, anchors[j + 1]))
        drifts = [0.0, 0.0]
        if drift_fn is not None:
            drifts = [drift_fn(anchors[i], v_anchor[i]) for i in (j, j + 1)]
        if steps and stale_segments(drifts, max_drift, record):
            with torch.no_grad():
                v_mid.update(zip(steps, velocity_fn(z[steps], t[steps])))  # [R] x [B, *D]

    def velocity(k):
        """Step k's velocity without graph: an anchor's own, a forward interior's, or the rollout
        interior v_old_k + sum_j H[k, j] (v_{a_j} - v_old_{a_j}) from its two anchors."""
        if k in index:
            return v_anchor[index[k]]
        j = max(i for i, a in enumerate(anchors) if a < k)  # k lies between a_j and a_{j+1}
        if rollout and j not in checked_segments:
            check_drift(j)
        if k in v_mid:
            return v_mid[k].to(v_anchor[j].dtype)
        moved = sum(H[k, i] * (v_anchor[i].to(acc_dtype) - v_old[anchors[i]]) for i in (j, j + 1))
        return (v_old[k] + moved).to(v_anchor[j].dtype)

    def upstream(k):
        """g_k = dL_k/dv_k from the loss alone, once per step: detach v_k, make it a leaf."""
        nonlocal total
        if k not in g:
            v_k = velocity(k).detach().requires_grad_(True)  # [B, *D]
            loss = step_loss(k, v_k)
            (g[k],) = torch.autograd.grad(loss, v_k)  # [B, *D]
            total += loss.item()
        return g[k].to(acc_dtype)

    def forward(chunk):
        """The chunk's anchors: one forward with graph on their stacked rows ([z_a; z_b])."""
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
        # d/dtheta sum_j sum(v_{a_j} * G_j) = sum_j G_j^T J_{a_j}  (paper: G_a^T J_a + G_b^T J_b)
        (v * G.to(v.dtype)).sum().backward()  # frees this chunk's graph

    if max_graph_rows is None:
        size = M
    else:
        size = max_graph_rows // 2 if rollout else max_graph_rows
    chunks = [list(range(i, min(i + size, M))) for i in range(0, M, size)]
    alive = forward(chunks[0])
    for n, chunk in enumerate(chunks):
        last = n + 1 == len(chunks)
        if rollout:  # the next chunk's first anchor closes this chunk's last segment: run it first
            following = None if last else forward(chunks[n + 1])
            backward(chunk, alive)
            alive = following
        else:
            backward(chunk, alive)
            alive = None if last else forward(chunks[n + 1])
    return total


# === 4. The batch's gradient with every option ===
# jagg.backward_batch, generalised: segments between anchors instead of windows, routing by the
# probe's cosines, the reference model's velocities at the anchors only with rollout interiors.
# A segment that asks for nothing beyond the paper runs jagg.py's own backward_jagg_window, so
# JaggOptions() trains bit for bit what jagg.backward_batch does.
def check_options(opts, num_segments=None, probe_cosines=None, num_steps=None):
    """Every JaggOptions field in range, before any work: a ValueError whose first word is the
    field (so that a script can report it under its flag's name)."""
    _check(isinstance(opts.window, int) and opts.window >= 2,
           f"window must be an integer >= 2, got {opts.window!r}")
    _check(0 <= opts.jagg_frac <= 1, f"jagg_frac must be in [0, 1], got {opts.jagg_frac!r}")
    _check(opts.min_cosine is None or -1 <= opts.min_cosine <= 1,
           f"min_cosine must be in [-1, 1] or None, got {opts.min_cosine!r}")
    check_boundaries(opts.boundaries, num_steps)
    _check(opts.anchors in ANCHOR_MODES,
           f"anchors must be one of {ANCHOR_MODES}, got {opts.anchors!r}")
    _check(opts.interior in INTERIOR_MODES,
           f"interior must be one of {INTERIOR_MODES}, got {opts.interior!r}")
    _check(opts.route in ROUTES, f"route must be one of {ROUTES}, got {opts.route!r}")
    _check(opts.weights in WEIGHTS, f"weights must be one of {WEIGHTS}, got {opts.weights!r}")
    _check(opts.max_drift is None or opts.max_drift >= 0,
           f"max_drift must be >= 0 or None, got {opts.max_drift!r}")
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
        anchors = anchor_steps((0, z.shape[0] - 1) if anchors is None else anchors, z.shape[0])
        v_anc = ref_velocity_fn(z[anchors], t[anchors])  # [M, B, *D]
        acc_dtype = torch.promote_types(z.dtype, torch.float32)
        H = hat_weights(t.to(acc_dtype), anchors, weights)  # [S, M, B]
        return interpolate_from_anchors(v_anc, v_rollout, H, anchors).to(v_anc.dtype)  # [S, B, *D]


# Routing by a score of the rollout. jagg.py takes the earliest windows first (its section 7 says
# why); these scores read the rollout's velocities instead, so each needs traj.v.
# route="velocity": our reading of the abstract's "cosine-similarity rule", jagg.linearity_score
# (jagg.py section 7 says why jagg.py routes by a schedule instead).
# route="step_error": the error JAGG would add to the step. The velocity score measures how
# straight the velocities run relative to the segment itself; but a segment's share of the step's error is its relative error times the size
# of its gradient, and the low-noise segments carry the largest gradients (g_k grows as the SDE's
# noise shrinks). The score multiplies the two, from the rollout's own velocities alone:
#     score = (1 - cos) |G_a + G_b|,    G_a + G_b = sum_k g_k,
# cos the free score, g_k = dL_k/dv_k at the rollout's v_k (the clipped surrogate only, no KL:
# exact on the first optimizer step after the rollout, a proxy after). The smallest scores take JAGG.
def step_error_score(traj, advantages, cfg, start, stop):
    """(1 - linearity_score) x |sum_k g_k| of the segment start..stop - 1 of traj (norm over the
    batch): an estimate of the error JAGG would add to the step there, in the loss's units."""
    cos = jagg.linearity_score(traj.v[start:stop], traj.t[start:stop])
    policy_loss = jagg.make_step_loss(traj, advantages, start, stop, replace(cfg, beta=0.0))
    signal = 0.0
    for i in range(stop - start):
        v_k = traj.v[start + i].detach().to(torch.promote_types(traj.v.dtype, torch.float32))
        v_k.requires_grad_(True)  # [B, *D], the rollout's, in fp32 at least
        (g_k,) = torch.autograd.grad(policy_loss(i, v_k), v_k)  # [B, *D]
        signal = signal + g_k
    return (1 - cos) * float(torch.linalg.vector_norm(signal))


def route_segments(ranks, lengths, jagg_frac, floor=None):
    """jagg.route_windows by ranks (the highest first; of equal ranks, the earlier), then none ranked
    below floor (None: no floor)."""
    routed = jagg.route_windows(lengths, jagg_frac, ranks)
    return [r and (floor is None or rank >= floor) for r, rank in zip(routed, ranks)]


def backward_batch(velocity_fn, traj, advantages, cfg, opts, ref_velocity_fn=None,
                     probe_cosines=None):
    """jagg.backward_batch with JaggOptions' every field: add the batch's gradient to .grad,
    segment by segment (segment_bounds), routed between exact and JAGG. Returns (stats, routed).
    route="probe" ranks the segments by probe_cosines (probe.probe_average's) once there are
    any, never routing one below opts.min_cosine; before the first probe, by velocity."""
    T = traj.z.shape[0]
    bounds = segment_bounds(T, opts.window, opts.anchors, opts.boundaries)
    check_options(opts, len(bounds), probe_cosines, num_steps=T)
    check_batch(traj, advantages, cfg)
    _check(cfg.beta == 0 or ref_velocity_fn is not None,
           "beta > 0 needs a ref_velocity_fn (the frozen reference model)")
    reads_v = opts.interior == "rollout" or opts.route in ("velocity", "step_error", "probe")
    _check(traj.v is not None or not reads_v,
           f"interior={opts.interior!r}, route={opts.route!r} read the rollout's velocities: give "
           "jagg.Trajectory its v (jagg.rollout keeps it)")
    velocity_fn = checked(velocity_fn)
    scores = None  # the velocity score of each segment, logged where the rollout kept v
    if traj.v is not None:
        scores = [jagg.linearity_score(traj.v[a:b], traj.t[a:b]) for a, b in bounds]
        scores = over_ranks(scores, "mean", traj.z.device)  # every rank's samples: all route alike
    ranks = [float(-i) for i in range(len(bounds))]  # "early", jagg.py's: the earlier, the higher
    if opts.route == "late":
        ranks = [float(i) for i in range(len(bounds))]
    if opts.route in ("velocity", "probe"):  # probe: by velocity until the first probe
        ranks = scores
    if opts.route == "step_error":  # the smallest estimated error first, agreed over the ranks
        ranks = [-step_error_score(traj, advantages, cfg, a, b) for a, b in bounds]
        ranks = over_ranks(ranks, "mean", traj.z.device)
    by_probe = opts.route == "probe" and probe_cosines is not None
    lengths = [stop - start for start, stop in bounds]
    floor = opts.min_cosine if by_probe else None
    routed = route_segments(probe_cosines if by_probe else ranks, lengths, opts.jagg_frac, floor)

    calls = backward_calls(bounds, routed, opts.anchors)  # [(kind, start, stop, anchor steps)]
    v_old = traj.v if opts.interior == "rollout" else None
    log, loss, record = [], 0.0, {}  # every step's stats; the summed loss; the drift guard's counts
    for kind, start, stop, steps in calls:
        z, t = traj.z[start:stop], traj.t[start:stop]  # [S, B, *D], [S, B]
        options = {}  # a JAGG call's: its anchors, rollout interiors, weights
        if kind == "jagg":
            options = {"anchors": [s - start for s in steps], "weights": opts.weights,
                       "v_rollout": None if v_old is None else v_old[start:stop]}
        v_ref = None
        if cfg.beta > 0:
            v_ref = reference_velocities(ref_velocity_fn, z, t, **options)  # [S, B, *D]
        step_loss = jagg.make_step_loss(traj, advantages, start, stop, cfg, v_ref, log)
        if kind == "exact":
            loss += jagg.backward_exact(velocity_fn, z, t, step_loss)
        elif opts.paper_backward():  # the paper's window: jagg.py's own function
            loss += jagg.backward_jagg_window(velocity_fn, z, t, step_loss)
        else:
            def drift_fn(k, v_k, start=start):  # the drift guard's measure (section 2)
                return ratio_drift(traj, cfg, start + k, v_k)
            loss += backward_jagg(velocity_fn, z, t, step_loss, record=record, **options,
                                  max_graph_rows=opts.max_graph_rows, drift_fn=drift_fn,
                                  max_drift=opts.max_drift)
    grad_rows = sum(stop - start if kind == "exact" else len(steps)
                    for kind, start, stop, steps in calls)
    stats = {key: sum(s[key] for s in log) / len(log) for key in log[0]}  # means over steps
    eligible = sum(n >= 3 for n in lengths)  # the segments jagg_frac counts, as jagg.py's
    stats.update(loss=loss, routed_frac=sum(routed) / max(eligible, 1), grad_rows=grad_rows,
                 window_scores=scores)
    if opts.interior == "rollout":  # how often the drift guard sent a segment to a forward
        stats.update(rollout_refreshed=record.get("rollout_refreshed", 0),
                     anchor_drift=record.get("anchor_drift", 0.0))
    return stats, routed
