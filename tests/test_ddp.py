"""JAGG's multi-GPU rule under DistributedDataParallel (docs/many_gpus.md): two CPU ranks (gloo), the
paper's call and every option's mode, each backward inside DDP's no_sync and one all-reduce per optimizer
step (beyond_paper/ranks.py's optimizer_step).

Each rank trains on its own rollouts. After two optimizer steps the ranks' parameters must be
identical to the last bit, and equal (to float64 round-off) to one process trained on both
ranks' batches together: the mean of the ranks' gradients, which is what data parallelism means.
"""

import contextlib
import itertools
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import jagg
from beyond_paper import options, ranks
from flows import cat_trajectories

T, W, B, D = 10, 4, 3, 3  # steps, window, samples per rank, sample size
# (anchors, interior, max_graph_rows, jagg_frac, beta, max_drift): every mode, bounded or not, routed
# or not, KL or not; rollout interiors with the drift guard (GUARD, the default) too: the ranks
# decide on the largest drift over all their samples, as one process on all of them would.
GUARD = options.JaggOptions.max_drift
# "paper": jagg.backward_batch itself, at jagg_frac 0 (exact GRPO) and 1 (JAGG on every window)
PAPER = [("paper", None, None, frac, beta, None) for frac in (0.0, 1.0) for beta in (0.0, 0.1)]
MODES = PAPER + [("window", "forward", None, 0.0, beta, None) for beta in (0.0, 0.1)] + [
    (anchors, interior, rows, frac, beta, None)
    for anchors, interior, frac, beta in itertools.product(("window", "shared"), ("forward", "rollout"), (1.0, 0.5),
                                                             (0.0, 0.1))
    for rows in (None, 1 if interior == "forward" else 2, 3)
] + [(anchors, "rollout", rows, 1.0, 0.1, GUARD) for anchors in ("window", "shared") for rows in (None, 2)]
# route="probe" with fixed cosines routes the same segments on every rank and in the reference
# (velocity routing would score each rank's own rollouts, so the ranks could route differently).
PROBE = {"window": [0.9, 0.5, 0.8], "shared": [0.5, 0.9, 0.8]}


class MLPFlow(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(D + 1, 16), torch.nn.Tanh(), torch.nn.Linear(16, D))

    def forward(self, z, t):  # z [N, D], t [N]
        return self.net(torch.cat([z, t[:, None]], dim=-1))


def velocity_fn_of(model):
    def velocity_fn(z, t):  # z [S, B, D], t [S, B]
        S, Bs = t.shape
        return model(z.reshape(S * Bs, D), t.reshape(S * Bs)).reshape(z.shape)

    return velocity_fn


def models():
    torch.manual_seed(0)
    return MLPFlow().double(), MLPFlow().double().requires_grad_(False)  # the policy, the frozen reference


def rank_data(rank, nan=False):
    """Rank's own rollouts (from the initial policy, its own noise) and advantages."""
    model, _ = models()
    g = torch.Generator().manual_seed(100 + rank)
    sigmas = jagg.sigma_schedule(T).double()
    traj = jagg.rollout(velocity_fn_of(model), torch.randn(B, D, generator=g, dtype=torch.float64), sigmas, 0.7,
                        generator=g)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    if nan:
        adv[0] = float("nan")
    return traj, adv


def gradient(model, ref, traj, adv, mode, route="probe"):
    """Add one batch's gradient to .grad as mode computes it: the paper's call, or options.backward_batch."""
    anchors, interior, rows, frac, beta, max_drift = mode[:6]
    cfg = jagg.LossConfig(noise_level=0.7, clip_range=0.2, beta=beta)
    ref_fn = velocity_fn_of(ref) if beta else None
    if anchors == "paper":
        return jagg.backward_batch(velocity_fn_of(model), traj, adv, cfg, W, frac, ref_fn)[0]
    opts = options.JaggOptions(W, frac, anchors=anchors, interior=interior, route=route, max_graph_rows=rows,
                               max_drift=max_drift)
    cosines = PROBE[anchors] if route == "probe" else None
    return options.backward_batch(velocity_fn_of(model), traj, adv, cfg, opts, ref_fn, cosines)[0]


def train(model, ref, traj, adv, mode, no_sync=contextlib.nullcontext, steps=2):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    skipped = []
    for step in range(steps):  # the second step is off-policy: rollout interiors are then approximate
        with no_sync():  # the rule: no all-reduce in the backward passes...
            stats = gradient(model, ref, traj, adv, mode)
        params = list(model.parameters())  # ...and one in the optimizer step
        done = ranks.optimizer_step(params, opt, [stats["loss"]], max_grad_norm=1e9, step=step)
        skipped.append(done["skipped"])
    return skipped


def flat(module):
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def worker(rank, world, init_file, out, nan_rank):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = {}
    for i, mode in enumerate(MODES):
        for nan in (False, True):
            model, ref = models()
            net = torch.nn.parallel.DistributedDataParallel(model)
            traj, adv = rank_data(rank, nan=nan and rank == nan_rank)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # the skipped step's warning
                skipped = train(net, ref, traj, adv, mode, no_sync=ranks.no_sync_for(net, last=True),
                                steps=2 if not nan else 1)  # DDP's no_sync: optimizer_step all-reduces
            results[f"{i}_{nan}"] = flat(model)
            results[f"{i}_{nan}_skipped"] = torch.tensor(skipped)
    torch.save(results, os.path.join(out, f"rank{rank}.tmp"))
    os.replace(os.path.join(out, f"rank{rank}.tmp"), os.path.join(out, f"rank{rank}.pt"))  # whole, or absent
    dist.barrier()  # no rank tears gloo down while the other still talks to it
    dist.destroy_process_group()


def spawned(worker, tmp_path_factory, name):
    """Run worker(rank, 2, init_file, out, nan_rank=1) on two gloo ranks; [rank0, rank1] of the
    {key: tensor} each saved to out/rank<r>.pt."""
    out = tmp_path_factory.mktemp(name)
    try:
        mp.spawn(worker, args=(2, str(out / "init"), str(out), 1), nprocs=2, join=True)
    except mp.ProcessExitedException as e:
        # gloo can abort a rank at exit ("terminate called without an active exception") after its
        # work is done and saved: what the tests check is the saved results, so that abort alone is
        # tolerated; a rank that died before saving leaves no file and fails below.
        if not all((out / f"rank{r}.pt").exists() for r in range(2)):
            raise
        warnings.warn(f"a rank ended abnormally after saving its results: {e}", RuntimeWarning)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Both ranks' parameters after training in every mode: [rank0, rank1] of {key: tensor}."""
    return spawned(worker, tmp_path_factory, "ddp")


@pytest.mark.parametrize("i", range(len(MODES)), ids=["-".join(map(str, m)) for m in MODES])
def test_ranks_stay_identical_and_equal_one_process_on_both_batches(results, i):
    mode = MODES[i]
    p0, p1 = results[0][f"{i}_False"], results[1][f"{i}_False"]
    assert torch.equal(p0, p1), f"ranks drifted in mode {mode}: max difference {(p0 - p1).abs().max().item():.3g}"
    # One process on both ranks' batches together: its loss is the mean over 2B samples, so its
    # gradient is the mean of the ranks' gradients, what DDP's all-reduce computes.
    (t0, a0), (t1, a1) = rank_data(0), rank_data(1)
    both = cat_trajectories([t0, t1])
    model, ref = models()
    train(model, ref, both, torch.cat([a0, a1]), mode)
    assert not torch.equal(flat(model), flat(models()[0]))  # it did train
    torch.testing.assert_close(p0, flat(model), rtol=0, atol=1e-12)


@pytest.mark.parametrize("i", range(len(MODES)), ids=["-".join(map(str, m)) for m in MODES])
def test_one_ranks_nan_makes_every_rank_skip(results, i):
    initial = flat(models()[0])
    for r in range(2):
        assert results[r][f"{i}_True_skipped"].tolist() == [True], f"rank {r} did not skip in mode {MODES[i]}"
        assert torch.equal(results[r][f"{i}_True"], initial)
