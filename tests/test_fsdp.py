"""JAGG's multi-GPU rule under FSDP2 (fully_shard, every layer, then the root; docs/many_gpus.md): two
CPU ranks (gloo), the paper's call and every option's mode, and gradient accumulation through FSDP's own
switch (beyond_paper/ranks.py's no_sync_for).

Each rank trains on its own rollouts. After two optimizer steps the ranks' full parameters must be
identical to the last bit, and equal, to float64 round-off (atol 1e-12), to one process trained
on both ranks' batches together; a NaN on one rank skips the step on both.
"""

import os
import warnings

import pytest
import torch
import torch.distributed as dist

from beyond_paper import options, ranks
from flows import cat_trajectories
from test_ddp import flat, gradient, models, rank_data, spawned

GUARD = options.JaggOptions.max_drift
# (anchors, interior, max_graph_rows, jagg_frac, beta, max_drift, route): exact, the paper's, shared
# anchors, rollout interiors with the guard, the two bounds, probe routing, velocity routing.
MODES = [
    ("paper", None, None, 0.0, 0.1, None, None),
    ("paper", None, None, 1.0, 0.1, None, None),
    ("window", "forward", None, 0.0, 0.1, None, "velocity"),
    ("window", "forward", None, 1.0, 0.1, None, "velocity"),
    ("shared", "forward", None, 1.0, 0.0, None, "velocity"),
    ("window", "rollout", None, 1.0, 0.1, GUARD, "velocity"),
    ("shared", "rollout", None, 1.0, 0.1, GUARD, "velocity"),
    ("shared", "rollout", 2, 1.0, 0.1, GUARD, "velocity"),
    ("shared", "forward", 1, 1.0, 0.1, None, "velocity"),
    ("window", "forward", 1, 0.5, 0.0, None, "probe"),
    ("shared", "rollout", None, 0.5, 0.1, None, "velocity"),
]


def sharded(model):
    """The model with every Linear sharded over the ranks, then the root (FSDP2)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def train(model, ref, batches, mode, steps=2):
    """steps optimizer steps, each accumulating the micro-batches `batches` [(traj, adv), ...]; a sharded
    model's switch keeps all but the last micro-batch unreduced (ranks.no_sync_for)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    skipped = []
    for step in range(steps):  # the second step is off-policy: rollout interiors are then approximate
        losses = []
        for n, (traj, adv) in enumerate(batches):
            with ranks.no_sync_for(model, last=n == len(batches) - 1)():
                losses.append(gradient(model, ref, traj, adv, mode, route=mode[6])["loss"])
        out = ranks.optimizer_step(list(model.parameters()), opt, losses, micro_batches=len(batches),
                                          max_grad_norm=1e9, step=step)
        skipped.append(out["skipped"])
    return skipped


def full(model):
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten() for p in model.parameters()])


def split(traj, adv):
    """Two micro-batches of a rank's batch: samples 0..1 and 2."""
    return [(traj.subset([0, 1]), adv[[0, 1]]), (traj.subset([2]), adv[[2]])]


def worker(rank, world, init_file, out, nan_rank):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = {}
    for i, mode in enumerate(MODES):
        for case in ("plain", "accumulated", "nan"):
            model, ref = models()
            sharded(model)
            traj, adv = rank_data(rank, nan=case == "nan" and rank == nan_rank)
            batches = split(traj, adv) if case == "accumulated" else [(traj, adv)]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # the skipped step's warning
                skipped = train(model, ref, batches, mode, steps=1 if case == "nan" else 2)
            results[f"{i}_{case}"] = full(model)
            results[f"{i}_{case}_skipped"] = torch.tensor(skipped)
    torch.save(results, os.path.join(out, f"rank{rank}.tmp"))
    os.replace(os.path.join(out, f"rank{rank}.tmp"), os.path.join(out, f"rank{rank}.pt"))  # whole, or absent
    dist.barrier()  # no rank tears gloo down while the other still talks to it
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Both ranks' full parameters after training in every mode: [rank0, rank1] of {key: tensor}."""
    return spawned(worker, tmp_path_factory, "fsdp")


@pytest.mark.parametrize("i", range(len(MODES)), ids=["-".join(map(str, m)) for m in MODES])
def test_fsdp_ranks_agree_and_equal_one_process_on_both_batches(results, i):
    mode = MODES[i]
    (t0, a0), (t1, a1) = rank_data(0), rank_data(1)
    both = cat_trajectories([t0, t1])
    model, ref = models()
    train(model, ref, [(both, torch.cat([a0, a1]))], mode)  # one process, the mean over 2B samples
    assert not torch.equal(flat(model), flat(models()[0]))  # it did train
    for case in ("plain", "accumulated"):  # accumulated: compared with one process below
        p0, p1 = results[0][f"{i}_{case}"], results[1][f"{i}_{case}"]
        assert torch.equal(p0, p1), f"ranks drifted in mode {mode} ({case}): {(p0 - p1).abs().max().item():.3g}"
    torch.testing.assert_close(results[0][f"{i}_plain"], flat(model), rtol=0, atol=1e-12)


def test_fsdp_accumulation_equals_one_process_accumulating_alike(results):
    """Accumulated micro-batches under FSDP's switch equal one process accumulating the same
    micro-batches (the two ranks' first micro-batches, then their second)."""
    for i, mode in enumerate(MODES):
        (t0, a0), (t1, a1) = rank_data(0), rank_data(1)
        (m00, m01), (m10, m11) = split(t0, a0), split(t1, a1)
        micro = [(cat_trajectories([m00[0], m10[0]]), torch.cat([m00[1], m10[1]])),
                 (cat_trajectories([m01[0], m11[0]]), torch.cat([m01[1], m11[1]]))]
        model, ref = models()
        train(model, ref, micro, mode)
        torch.testing.assert_close(results[0][f"{i}_accumulated"], flat(model), rtol=0, atol=1e-12, msg=str(mode))


@pytest.mark.parametrize("i", range(len(MODES)), ids=["-".join(map(str, m)) for m in MODES])
def test_fsdp_one_ranks_nan_makes_every_rank_skip(results, i):
    initial = flat(models()[0])
    for r in range(2):
        assert results[r][f"{i}_nan_skipped"].tolist() == [True], f"rank {r} did not skip in mode {MODES[i]}"
        assert torch.equal(results[r][f"{i}_nan"], initial)
