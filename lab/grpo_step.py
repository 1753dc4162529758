"""The lab runner's GRPO step (lab/sd_runner.py): torchrun's ranks, and one optimizer step of options.backward_batch.

JAGG's own multi-GPU rule is beyond_paper/ranks.py; this module is the runner's frozen glue
around it: starting and ending torch.distributed under torchrun, a micro-batch's gradient inside
no_sync and timed (accumulate_gradients), and accumulate_gradients then ranks.optimizer_step on one
batch (train_step), which the lab's gradient checks call.
"""

import contextlib
import datetime
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from beyond_paper import options, ranks  # noqa: E402


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


# === The step ===
def accumulate_gradients(velocity_fn, traj, advantages, cfg, opts, *, ref_velocity_fn=None,
                         no_sync=contextlib.nullcontext, probe_cosines=None):
    """Add one micro-batch's gradient (options.backward_batch') to the parameters' .grad,
    inside no_sync. Returns (stats, routed); stats["grad_seconds"]: the seconds it took."""
    start = time.perf_counter()
    with no_sync():
        stats, routed = options.backward_batch(velocity_fn, traj, advantages, cfg, opts,
                                                 ref_velocity_fn, probe_cosines)
    stats["grad_seconds"] = time.perf_counter() - start
    return stats, routed


def train_step(velocity_fn, optimizer, traj, advantages, cfg, opts, *, ref_velocity_fn=None,
               params=None, max_grad_norm=1.0, no_sync=contextlib.nullcontext,
               probe_cosines=None, step=None):
    """One optimizer step of GRPO on a batch of trajectories (traj: T steps of B samples;
    advantages: [B]; cfg: jagg.LossConfig; opts: options.JaggOptions): accumulate_gradients,
    then ranks.optimizer_step. Pass DDP's model.no_sync as no_sync; under FSDP, nothing. params:
    those clipped and averaged over ranks; None: the optimizer's. Returns (stats, routed)."""
    if params is None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
    optimizer.zero_grad(set_to_none=True)
    stats, routed = accumulate_gradients(velocity_fn, traj, advantages, cfg, opts,
                                         ref_velocity_fn=ref_velocity_fn, no_sync=no_sync,
                                         probe_cosines=probe_cosines)
    done = ranks.optimizer_step(params, optimizer, [stats["loss"]], max_grad_norm=max_grad_norm,
                                step=step)
    stats.update(done)
    return stats, routed
