"""The probe: JAGG's gradient against the exact one on your model, per window, in units of its noise.

JAGG's error depends on how linear the network's Jacobian is along a trajectory, which differs
between models. Nothing here trains: the probe computes both gradients of the same segments and
reports their cosine and JAGG's error over an optimizer step's own gradient noise, so a user
adapting JAGG sees at once whether it holds. route="probe" (options.JaggOptions) trains by its
running average (probe_average). Read jagg.py first: the notation is its own.
"""

import math

import torch
from torch.distributed.tensor import DTensor

import jagg
from jagg import _check
from beyond_paper import options
from beyond_paper.checks import checked


# === 1. Both gradients of each segment ===
def flat_grad(params, dtype=torch.float64):
    """Every parameter's .grad in one vector [P] of dtype (a missing .grad counts as zeros; FSDP's
    sharded gradients gathered whole)."""
    grads = [(p.grad if p.grad is not None else torch.zeros_like(p)) for p in params]
    whole = [g.full_tensor() if isinstance(g, DTensor) else g for g in grads]
    return torch.cat([g.flatten().to(dtype) for g in whole])


def segment_gradients(velocity_fn, params, traj, advantages, cfg, opts, ref_velocity_fn=None,
                      dtype=torch.float64):
    """For each segment of traj (options.segment_bounds), (exact, JAGG as opts trains it)
    flat gradients [P] of dtype, or None for a segment of one step (always exact), one segment
    at a time (a generator); leaves the parameters' .grad None."""
    options.check_options(opts)
    velocity_fn = checked(velocity_fn)
    T = traj.z.shape[0]
    for start, stop in options.segment_bounds(T, opts.window, opts.anchors, opts.boundaries):
        if stop - start < 2:
            yield None
            continue
        z, t = traj.z[start:stop], traj.t[start:stop]  # [S, B, *D], [S, B]
        v_rollout = traj.v[start:stop] if opts.interior == "rollout" else None
        interiors = {"v_rollout": v_rollout, "weights": opts.weights}

        def drift_fn(k, v_k, start=start):
            return options.ratio_drift(traj, cfg, start + k, v_k)
        jagg_kwargs = dict(interiors, drift_fn=drift_fn, max_drift=opts.max_drift)
        grads = []
        for backward, kwargs, ref_options in ((jagg.backward_exact, {}, {}),
                                              (options.backward_jagg, jagg_kwargs, interiors)):
            for p in params:
                p.grad = None
            v_ref = None
            if cfg.beta > 0:
                v_ref = options.reference_velocities(ref_velocity_fn, z, t, **ref_options)
            step_loss = jagg.make_step_loss(traj, advantages, start, stop, cfg, v_ref)
            backward(velocity_fn, z, t, step_loss, **kwargs)
            grads.append(flat_grad(params, dtype))  # [P]
        for p in params:
            p.grad = None
        yield grads


def gradient_cosines(velocity_fn, params, traj, advantages, cfg, opts, ref_velocity_fn=None):
    """For each segment of traj (the paper's windows by default), the cosine of its gradient by
    JAGG as opts trains it (interior, weights, max_drift) to its exact gradient; 1.0 for a
    segment of one step. Leaves the parameters' .grad None."""
    params = list(params)
    pairs = segment_gradients(velocity_fn, params, traj, advantages, cfg, opts, ref_velocity_fn)
    cosine = torch.nn.functional.cosine_similarity
    return [1.0 if pair is None else cosine(pair[0], pair[1], dim=0).item() for pair in pairs]


# === 2. The probe in units of the batch's own noise ===
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
    chunks = zip(a.split(1 << 24), b.split(1 << 24))
    return sum(torch.dot(x.double(), y.double()).item() for x, y in chunks)


def probe_segments(fns, params, traj, advantages, cfg, opts, train_batch):
    """The probe per segment on the batch traj (its samples, advantages [B]): {"cosine": JAGG's
    gradient to exact (gradient_cosines'), "error_to_noise": |j - g|^2 over an optimizer step's
    noise, both as a step of train_batch samples would see them (probe_figures), and its two parts
    "error" and "noise"}. One probe's noise comes from one pair of halves, so its ratio scatters
    widely; over several probes, sum the parts before dividing (pool_probes). fns(idx) ->
    (velocity_fn, ref_velocity_fn) of the samples idx (their conditioning sliced alike); the batch
    is split into two halves. A one-step segment reports cosine 1 and error 0. Holds four float32
    gradient vectors at once (the two halves' exact and JAGG ones). Leaves .grad None."""
    params, B = list(params), advantages.shape[0]
    _check(B >= 2 and train_batch >= 1,
           f"the probe needs >= 2 samples and train_batch >= 1, got {B} and {train_batch}")
    halves = [torch.arange(B, device=advantages.device)[i::2] for i in (0, 1)]  # [n_1], [n_2]
    per_half = []  # two generators, one per half, run segment by segment side by side
    for idx in halves:
        velocity_fn, ref_velocity_fn = fns(idx)
        per_half.append(segment_gradients(velocity_fn, params, traj.subset(idx), advantages[idx],
                                          cfg, opts, ref_velocity_fn, torch.float32))
    out = {"cosine": [], "error_to_noise": [], "error": [], "noise": []}
    for first, second in zip(*per_half):  # each: [exact g_h, JAGG j_h] of one segment, or None
        if first is None:
            figures = (1.0, 0.0, 0.0, 0.0)
        else:
            figures = probe_figures(first[0], second[0], first[1], second[1], len(halves[0]),
                                    len(halves[1]), train_batch)
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
      the error's sample-to-sample part 4 times too large. The estimate is unbiased, so one
      probe's can come out below 0: an error lost in the probe's own scatter.
    - error_to_noise: error / noise, not clipped (pool the parts over probes, then divide);
      cosine: of j to g on the probe's batch."""
    vectors, B = (g_1, g_2, j_1, j_2), n_1 + n_2
    gram = [[_dot(a, b) if k <= m else None for m, b in enumerate(vectors)]
            for k, a in enumerate(vectors)]

    def quad(c, d):  # <sum_k c_k v_k, sum_m d_m v_m>
        return sum(c[k] * d[m] * gram[min(k, m)][max(k, m)] for k in range(4) for m in range(4))

    w_1, w_2 = n_1 / B, n_2 / B
    g, j, e = (w_1, w_2, 0, 0), (0, 0, w_1, w_2), (-w_1, -w_2, w_1, w_2)
    harmonic = 1 / n_1 + 1 / n_2
    sigma = quad((1, -1, 0, 0), (1, -1, 0, 0)) / harmonic  # exact: g_1 - g_2
    sigma_e = quad((-1, 1, 1, -1), (-1, 1, 1, -1)) / harmonic  # error: (j_1 - g_1) - (j_2 - g_2)
    gg, jj = quad(g, g), quad(j, j)
    cosine = quad(g, j) / math.sqrt(gg * jj) if gg * jj > 0 else 0.0
    error = quad(e, e) + sigma_e * (1 / train_batch - 1 / B)
    noise = sigma / train_batch
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
    route="probe"); between, it costs a little of the reward gain (lab/reports/probe_check.md)."""
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
        elif total <= 0:
            out["stderr"].append(0.0)
        else:
            scatter = sum((a - ratio * b) ** 2 for a, b in zip(e, v))
            out["stderr"].append(math.sqrt(n / (n - 1) * scatter) / total)
    return out


def probe_average(average, cosines, decay):
    """The running average route="probe" ranks by: average <- decay * average + (1 - decay) *
    cosines per segment position; the first probe (average None) starts it."""
    if average is None:
        return list(cosines)
    return [decay * m + (1 - decay) * c for m, c in zip(average, cosines)]
