"""JAGG's multi-GPU rule: backward passes inside no_sync, one all-reduce per optimizer step, decisions taken alike.

The paper is silent on many GPUs; this is OURS, and docs/many_gpus.md shows it under DDP and FSDP2.
- Backward passes inside no_sync, then ONE all-reduce of .grad per optimizer step
  (average_gradients, called by optimizer_step). DDP's reducer pairs each forward with graph with
  the next backward, and the bounded path with rollout interiors (options.py) runs the next
  chunk's forward before this chunk's backward: DDP's own all-reduce would pair them wrongly and
  the ranks would drift apart silently. FSDP2's reduce-scatter is linear, so each backward's share
  simply adds (fsdp_no_sync keeps it unreduced through an optimizer step's micro-batches before
  the last; no_sync_for picks DDP's or FSDP2's switch from the model).
- Every decision JAGG takes from the samples (routing by a score, the drift guard) is taken on all
  ranks' samples, as one process on all of them would take it (over_ranks): every rank then runs
  the same forwards, which FSDP2 needs (each forward gathers the sharded weights from all ranks).
- A non-finite loss or gradient (bf16 rollouts of real models do give NaN log-probabilities)
  would poison the weights and the optimizer's moments for good: optimizer_step skips it on every
  rank alike, and clears the gradient it consumed, so that a forgotten zero_grad leaks nothing.
On one process every function here is the plain single-process operation.
"""

import contextlib
import math
import warnings

import torch
from torch.distributed.tensor import DTensor


def _distributed():
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


# === 1. Decisions alike on every rank ===
def over_ranks(values, op, device=None):
    """values (a list of floats) combined over torch.distributed's ranks: op "mean", "max" or
    "min"; the values themselves on one process."""
    if not _distributed():
        return list(values)
    dist = torch.distributed
    t = torch.tensor(values, dtype=torch.float64, device=device)
    reduce_op = {"mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    dist.all_reduce(t, op=reduce_op[op])
    return (t / dist.get_world_size() if op == "mean" else t).tolist()


def all_gather_cat(x):
    """Every rank's tensor x concatenated along dim 0 (x itself on one process)."""
    if not _distributed():
        return x
    parts = [torch.empty_like(x) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(parts, x.contiguous())
    return torch.cat(parts)


# === 2. Backward passes inside no_sync ===
@contextlib.contextmanager
def fsdp_no_sync(module):
    """FSDP2's accumulation switch as DDP's no_sync is one: the backward passes inside keep their
    gradients unreduced until a backward outside it, which reduces them with its own."""
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def no_sync_for(model, last):
    """The no_sync to run a micro-batch's backward passes in (last: the optimizer step's last
    micro-batch), by what wraps model: DDP's model.no_sync for every one (optimizer_step
    all-reduces once a step), fsdp_no_sync for all but the last under FSDP2 (whose backward then
    reduce-scatters the step's sum), nullcontext for a model on one process."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.no_sync
    if hasattr(model, "set_requires_gradient_sync") and not last:  # a module fully_shard wrapped
        return lambda: fsdp_no_sync(model)
    return contextlib.nullcontext


# === 3. One all-reduce per optimizer step ===
def average_gradients(params, micro_batches=1):
    """Every .grad becomes its mean over micro_batches and over ranks, in ONE all-reduce per dtype
    (the gradients flattened into one buffer). A parameter without a gradient counts as 0. FSDP's
    sharded gradients (DTensors) were averaged over ranks by its own reduce-scatter: left so."""
    for p in params:
        if p.grad is not None and micro_batches > 1:
            p.grad /= micro_batches
    if not _distributed():
        return
    world = torch.distributed.get_world_size()
    params = [p for p in params if not isinstance(p.grad, DTensor)]
    for dtype in {p.dtype for p in params}:
        group = [p for p in params if p.dtype == dtype]
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)) for p in group]
        flat = torch.cat([g.flatten() for g in grads])  # [P]
        torch.distributed.all_reduce(flat)
        flat /= world
        for p, g in zip(group, flat.split([p.numel() for p in group])):
            p.grad = g.view_as(p).clone()


def optimizer_step(params, optimizer, losses, *, micro_batches=1, max_grad_norm=1.0, step=None):
    """The optimizer step after micro_batches micro-batches' backward passes (losses: theirs): the
    gradient becomes their mean (Flow-GRPO's accumulation) and the mean over ranks, is clipped,
    and the optimizer steps unless it or a loss is not finite; then the step is skipped on every
    rank and a warning names step, the caller's step number. Either way it then clears the
    gradient it consumed (set to None): the next step starts from zero whether or not the caller
    calls zero_grad. Returns {"grad_norm", "skipped"}."""
    params = list(params)
    average_gradients(params, micro_batches)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
    finite = all(math.isfinite(x) for x in list(losses) + [grad_norm])
    finite = over_ranks([float(finite)], "min", params[0].device)[0] > 0  # skip alike
    if finite:
        optimizer.step()
    else:
        warnings.warn(f"optimizer step {'?' if step is None else step} skipped: non-finite loss "
                      f"({losses}) or gradient norm ({grad_norm}); parameters and optimizer "
                      "state left as they were", RuntimeWarning, stacklevel=2)
    for p in params:
        p.grad = None  # consumed: the next step's gradient starts from zero
    optimizer.zero_grad(set_to_none=True)  # parameters of the optimizer that params left out too
    return {"grad_norm": grad_norm, "skipped": not finite}
