"""A run's checkpoint: the trained state saved whole, read back safely, resumed only as its own run.

Not JAGG's: what lab/sd_runner.py needs to stop and go on. Under FSDP2 a parameter is a shard on each
rank (a DTensor): gather_state makes every tensor whole on the CPU, load_weights lays whole tensors
out as the parameters' shards again, so one checkpoint serves any sharding. A checkpoint holds
tensors and plain data only, so that torch.load reads it with weights_only. A resumed run must be
the run that was saved: the same flags (changed_flags) and the same identity (run_identity: the
number of processes, the model, the prompts and the trainer's fixed settings). Each error is a
ValueError whose message is one line naming what differs and the fix.
"""

import hashlib
import json
import os

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor, distribute_tensor


def trainable(model):
    """{name: parameter} of the parameters that train."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def whole(tensors):
    """{name: tensor} gathered whole (FSDP's shards), detached, in fp32 on the CPU."""
    return {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu()
            .contiguous() for n, t in tensors.items()}


def as_param(w, p):
    """A whole tensor w laid out as the parameter p: its device, dtype and sharding."""
    w = w.to(p.device, p.dtype)
    return distribute_tensor(w, p.device_mesh, p.placements) if isinstance(p, DTensor) else w


def load_weights(model, weights):
    """Copy whole tensors {name: tensor} into the model's trainable parameters."""
    params = trainable(model)
    if params.keys() != weights.keys():
        raise ValueError(f"{len(weights)} saved weights for {len(params)} trainable parameters: "
                         "the same --lora-rank?")
    with torch.no_grad():
        for n, w in weights.items():
            params[n].copy_(as_param(w, params[n]))


def gather_state(model, optimizer, ema=None):
    """The trained state, whole on every rank: weights, the EMA's (or None) and the optimizer's
    (keyed by parameter name). Every rank calls it: FSDP gathers from all of them."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return dict(weights=whole(trainable(model)), ema=ema and whole(ema),
                optimizer=get_optimizer_state_dict(model, optimizer, options=options))


def load_state(model, optimizer, state, ema=None):
    """gather_state's weights and optimizer state back into the model and optimizer, sharded as
    they are; returns the EMA laid out as the parameters (None without one)."""
    load_weights(model, state["weights"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"],
                             options=StateDictOptions(full_state_dict=True))
    if ema is None:
        return None
    return {n: as_param(state["ema"][n], p) for n, p in trainable(model).items()}


def read(path, keys, owner, mmap=False):
    """owner's checkpoint, a dict of tensors and plain data, read safely (weights_only), or one
    line naming it when it is cut, foreign, or lacks one of keys."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        missing = set(keys) - set(ckpt if isinstance(ckpt, dict) else ())
        if missing:
            raise ValueError(f"it has no {', '.join(sorted(missing))}")
    except Exception as e:
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        if "Weights only load failed" in str(e):  # torch's advice to unpickle it would run its code
            why = "it holds more than tensors and plain data: not ours, or tampered with"
        raise ValueError(f"cannot resume: {path} is not a whole {owner} checkpoint "
                         f"({type(e).__name__}: {why}); the run cannot go on from it: start it "
                         "again in another --out, or here with --overwrite (which deletes its "
                         "files)") from None
    return ckpt


def changed_flags(saved, flags, may_change=()):
    """Why resuming with flags (a dict) would train another run than the saved flags did: one text
    per flag not in may_change whose value differs; empty when none does."""
    return [f"--{k.replace('_', '-')} {flags[k]} differs from the run's {v}"
            for k, v in saved.items() if k in flags and k not in may_change and flags[k] != v]


def model_identity(model):
    """A model folder by what it holds, not by the string typed: its resolved path and a hash of its
    json files (model_index, configs, the tokenizers') and of its weight files' names and sizes.
    A hub id: the id itself (resolved only once it loads)."""
    path = os.path.expanduser(model)
    if not os.path.isdir(path):
        return {"path": model, "hash": None}
    digest = hashlib.sha256()
    for folder, _, files in sorted(os.walk(path)):
        for name in sorted(files):
            file = os.path.join(folder, name)
            digest.update(os.path.relpath(file, path).encode())
            if name.endswith(".json"):
                with open(file, "rb") as f:
                    digest.update(f.read())
            else:  # weights and the rest: their size (reading gigabytes would take minutes)
                digest.update(str(os.path.getsize(file)).encode())
    return {"path": os.path.realpath(path), "hash": digest.hexdigest()}


def run_identity(model, prompts, fixed):
    """What makes a run the run it is beyond its flags: the number of processes (a group's samples
    span the ranks, so another count trains another run), the model (model_identity), the prompts
    (a hash of the list) and the trainer's fixed settings."""
    return {"processes": int(os.environ.get("WORLD_SIZE", 1)), "model": model_identity(model),
            "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
            "fixed": dict(fixed)}


def changed_identity(saved, now, owner):
    """Why a resumed run would not be the saved run (run_identity's): one text per difference,
    owner the trainer's file; empty when none."""
    out = []
    if saved["processes"] != now["processes"]:
        how = f"torchrun --nproc_per_node {saved['processes']}"
        if saved["processes"] == 1:
            how = "one process, without torchrun"
        out.append(f"the run trained on {saved['processes']} process(es) and this one has "
                   f"{now['processes']}: resume it with {how}")
    if saved["model"]["hash"] != now["model"]["hash"] or (
            saved["model"]["hash"] is None and saved["model"]["path"] != now["model"]["path"]):
        out.append(f"--model is {now['model']['path']}, not the model the run trained "
                   f"({saved['model']['path']}): give that one")
    if saved["prompts"] != now["prompts"]:
        out.append("the prompts are not the run's (its --prompts file changed, or it is another "
                   "one): restore the run's")
    for key in sorted(set(saved["fixed"]) | set(now["fixed"])):
        if saved["fixed"].get(key) != now["fixed"].get(key):
            out.append(f"{owner}'s FIXED {key} is {now['fixed'].get(key)}, the run's "
                       f"{saved['fixed'].get(key)}: restore it")
    return out
