"""The GRPO optimizer step of a real run: accumulation, many ranks, non-finite steps skipped.

A toy trains with three lines: optimizer.zero_grad(), jagg.paper_gradients(...), optimizer.step()
(train_toy.py). A real run adds what this module holds, and train_sd.py and docs/your_trainer.md
use it:
- gradient accumulation: Flow-GRPO averages an optimizer step over several micro-batches;
- many ranks (DDP or FSDP2): the step's gradient is the mean over ranks, and every decision JAGG
  takes (routing, the drift guard) is taken alike on every rank (jagg_options.over_ranks);
- a non-finite loss or gradient (bf16 rollouts of real models do give NaN log-probabilities)
  would poison the weights and the optimizer's moments for good: every rank skips the step alike.

Why DDP must not all-reduce by itself: its reducer pairs each forward with graph with the next
backward, and JAGG's bounded path with rollout interiors runs the next chunk's forward before this
chunk's backward: the ranks would drift apart silently. So every backward runs inside no_sync,
then per optimizer step ONE all-reduce of the gradients (and one of the finite flag), whatever the
mode. Under FSDP (fully_shard) the weights are sharded and every forward gathers them from all
ranks, so every rank runs the same forwards (the decisions above are agreed). FSDP's
reduce-scatter in the backward is linear, so it stays correct in any order of forwards and
backwards; its own switch (fsdp_no_sync) keeps the gradients unreduced through an optimizer step's
micro-batches before the last.

The step API: accumulate_gradients per micro-batch, then optimizer_step, which averages, clips,
steps and clears the gradient it consumed, so that a forgotten zero_grad cannot leak one step's
gradient into the next; train_step is the two for a single batch.
"""

import contextlib
import datetime
import math
import os
import sys
import time
import warnings

import torch
from torch.distributed.tensor import DTensor

import jagg_options


# === Ranks: torchrun's processes ===
def init_distributed(always=False, backend=None):
    """(rank, world) for a trainer: torch.distributed started under torchrun (backend None: NCCL on
    GPUs, gloo on CPUs; a model kept on the CPU passes "gloo"); with always, on a single rank too
    (FSDP shards over a process group). Outside torchrun: (0, 1)."""
    if "WORLD_SIZE" not in os.environ or (int(os.environ["WORLD_SIZE"]) == 1 and not always):
        return 0, 1
    if not torch.distributed.is_initialized():  # a second run in one process keeps the group
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        # a stopped rank fails its peers in minutes, not gloo's 30
        torch.distributed.init_process_group(backend, timeout=datetime.timedelta(minutes=5))
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def exit_distributed():
    """End a finished rank under torchrun: close the process group, flush, and leave with exit
    code 0 at once. At the interpreter's normal shutdown a rank sometimes aborts (SIGABRT,
    "terminate called without an active exception": a native thread still joinable at exit),
    failing a run that has finished and written everything. Outside torchrun it returns."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def all_gather_cat(x):
    """Every rank's tensor x concatenated along dim 0 (x itself on one process)."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return x
    parts = [torch.empty_like(x) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(parts, x.contiguous())
    return torch.cat(parts)


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
    """The no_sync to give accumulate_gradients for a micro-batch of an optimizer step (last: the
    step's last), by what wraps model: DDP's model.no_sync for every one (optimizer_step
    all-reduces once a step), fsdp_no_sync for all but the last under FSDP2 (whose backward then
    reduce-scatters the step's sum), nullcontext for a model on one process."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.no_sync
    if hasattr(model, "set_requires_gradient_sync") and not last:  # a module fully_shard wrapped
        return lambda: fsdp_no_sync(model)
    return contextlib.nullcontext


def average_gradients(params, micro_batches=1):
    """Every .grad becomes its mean over micro_batches and over ranks, in ONE all-reduce per dtype
    (the gradients flattened into one buffer). A parameter without a gradient counts as 0. FSDP's
    sharded gradients (DTensors) were averaged over ranks by its own reduce-scatter: left so."""
    for p in params:
        if p.grad is not None and micro_batches > 1:
            p.grad /= micro_batches
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    world = dist.get_world_size()
    params = [p for p in params if not isinstance(p.grad, DTensor)]
    for dtype in {p.dtype for p in params}:
        group = [p for p in params if p.dtype == dtype]
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)) for p in group]
        flat = torch.cat([g.flatten() for g in grads])  # [P]
        dist.all_reduce(flat)
        flat /= world
        for p, g in zip(group, flat.split([p.numel() for p in group])):
            p.grad = g.view_as(p).clone()


def finite_on_every_rank(values, device=None):
    """True only if every number in values is finite on every rank (so that all ranks skip
    alike)."""
    finite = all(math.isfinite(x) for x in values)
    return jagg_options.over_ranks([float(finite)], "min", device)[0] > 0


# === The step ===
def accumulate_gradients(velocity_fn, traj, advantages, cfg, opts, *, ref_velocity_fn=None,
                         no_sync=contextlib.nullcontext, probe_cosines=None):
    """Add one micro-batch's gradient (jagg_options.window_gradients') to the parameters' .grad,
    inside no_sync. Returns (stats, routed); stats["grad_seconds"]: the seconds it took."""
    start = time.perf_counter()
    with no_sync():
        stats, routed = jagg_options.window_gradients(velocity_fn, traj, advantages, cfg, opts,
                                                      ref_velocity_fn, probe_cosines)
    stats["grad_seconds"] = time.perf_counter() - start
    return stats, routed


def optimizer_step(params, optimizer, losses, *, micro_batches=1, max_grad_norm=1.0, step=None):
    """The optimizer step after accumulate_gradients on micro_batches batches (losses: theirs): the
    gradient becomes their mean (Flow-GRPO's accumulation) and the mean over ranks, is clipped,
    and the optimizer steps unless it or a loss is not finite; then the step is skipped on every
    rank and a warning names step, the caller's step number. Either way it then clears the
    gradient it consumed (set to None): the next step starts from zero whether or not the caller
    calls zero_grad. Returns {"grad_norm", "skipped"}."""
    params = list(params)
    average_gradients(params, micro_batches)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
    finite = finite_on_every_rank(list(losses) + [grad_norm], params[0].device)
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


def train_step(velocity_fn, optimizer, traj, advantages, cfg, opts, *, ref_velocity_fn=None,
               params=None, max_grad_norm=1.0, no_sync=contextlib.nullcontext,
               probe_cosines=None, step=None):
    """One optimizer step of GRPO on a batch of trajectories (traj: T steps of B samples;
    advantages: [B]; cfg: jagg.LossConfig; opts: jagg_options.JaggOptions): accumulate_gradients,
    then optimizer_step. Pass DDP's model.no_sync as no_sync; under FSDP, nothing. params: those
    clipped and averaged over ranks; None: the optimizer's. Returns (stats, routed)."""
    if params is None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
    optimizer.zero_grad(set_to_none=True)
    stats, routed = accumulate_gradients(velocity_fn, traj, advantages, cfg, opts,
                                         ref_velocity_fn=ref_velocity_fn, no_sync=no_sync,
                                         probe_cosines=probe_cosines)
    done = optimizer_step(params, optimizer, [stats["loss"]], max_grad_norm=max_grad_norm,
                          step=step)
    stats.update(done)
    return stats, routed
