"""Exact vs JAGG measured: every training mode of jagg.py and beyond_paper/options.py timed interleaved (medians of
repeats; time_gradients: one batch's gradient on your model), the activations autograd saves for backward
weighed, and the tables the benchmarks print.
lab/sd_benchmark.py and lab/fsdp_memory.py use it on SD3 transformers; the modes' names derive from
their options (JaggOptions.mode_name)."""

import contextlib
import dataclasses
import itertools
import statistics
import os
import sys
import time
import weakref

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jagg  # noqa: E402
from beyond_paper import options  # noqa: E402

# The training modes the benchmarks compare, by name: (anchors, interior), every combination in
# beyond_paper/options.py; every JAGG mode interpolates every segment (jagg_frac = 1). exact: None.
TRAINING_MODES = {"exact": None, **{
    options.JaggOptions(anchors=a, interior=i).mode_name(): (a, i)
    for i, a in itertools.product(options.INTERIOR_MODES, options.ANCHOR_MODES)}}


def bench_modes(max_graph_rows):
    """The benchmarks' modes: TRAINING_MODES, and with a bound k > 0 again as "<mode>_rows<k>" each JAGG
    mode the bound changes: the shared modes, and the paper's 2-anchor windows at k = 1 (with forward
    interiors only: rollout interiors need k >= 2)."""
    modes = list(TRAINING_MODES)
    for m, settings in TRAINING_MODES.items():
        if max_graph_rows and settings is not None:
            anchors, interior = settings
            if (anchors == "shared" or max_graph_rows < 2) and (interior == "forward" or max_graph_rows >= 2):
                modes.append(f"{m}_rows{max_graph_rows}")
    return modes


# Timing: interleaved medians on a shared machine, and one batch's gradient exact against JAGG (the
# adopter's question "is it faster on my model?", docs/your_trainer.md)
def interleaved_medians(fns, repeats, warmup=1):
    """Call each fn() -> {key: seconds} warmup + repeats times, rotating which goes first so that
    drift on a shared machine hits all alike. Returns {name: {key: median over repeats}}."""
    names, runs = list(fns), {name: [] for name in fns}
    for r in range(warmup + repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            out = fns[name]()
            if r >= warmup:
                runs[name].append(out)
    return {name: {key: statistics.median(run[key] for run in rs) for key in rs[0]}
            for name, rs in runs.items()}


def clock(device):
    """time.perf_counter(), after the device's queued work (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def timed_velocity_fn(velocity_fn, seconds, key_graph="fwd_graph", key_no_graph="fwd_nograd"):
    """velocity_fn that adds each call's seconds to seconds[key_graph] or seconds[key_no_graph],
    as it builds a graph or not: the forwards of a gradient, apart from its backward passes."""
    def velocity(z, t):
        start = clock(z.device)
        v = velocity_fn(z, t)
        key = key_graph if torch.is_grad_enabled() else key_no_graph
        seconds[key] = seconds.get(key, 0.0) + clock(z.device) - start
        return v
    return velocity


def time_gradients(velocity_fn, params, traj, advantages, cfg, opts, ref_velocity_fn=None,
                   repeats=5):
    """Is JAGG faster on YOUR model? The batch's gradient (options.backward_batch)
    computed exactly (opts with jagg_frac 0) and with opts, each repeats times after a warm-up
    round, interleaved so that a shared machine's drift hits both alike. Returns {"exact": ...,
    "jagg": ...}, each {"backward_s": the seconds outside the network's forwards (the backward
    passes, and the losses' own derivatives), "step_s": the whole gradient, "grad_rows"}
    (medians). params' .grad are cleared before each call."""
    grad_rows, device = {}, traj.z.device

    def run(method, method_opts):
        def call():
            for p in params:
                p.grad = None
            seconds = {}
            fn = timed_velocity_fn(velocity_fn, seconds)
            ref_fn = None
            if ref_velocity_fn is not None:
                ref_fn = timed_velocity_fn(ref_velocity_fn, seconds, "fwd_ref", "fwd_ref")
            start = clock(device)
            stats = options.backward_batch(fn, traj, advantages, cfg, method_opts, ref_fn)[0]
            step = clock(device) - start
            grad_rows[method] = stats["grad_rows"]
            return {"backward_s": step - sum(seconds.values()), "step_s": step}
        return call
    # rounds run jagg then exact, exact then jagg, ...
    exact_opts = dataclasses.replace(opts, jagg_frac=0.0)
    times = interleaved_medians({"jagg": run("jagg", opts), "exact": run("exact", exact_opts)},
                                repeats)
    return {m: {**times[m], "grad_rows": grad_rows[m]} for m in ("exact", "jagg")}


def timed(timings, key, device):
    """A context that adds the seconds of its block to timings[key] (synchronised on CUDA)."""
    @contextlib.contextmanager
    def block():
        start = clock(device)
        yield
        timings[key] = timings.get(key, 0.0) + clock(device) - start
    return block()


def timed_backward(backward, velocity_fn, z, t, step_loss, timings):
    """backward(velocity_fn, z, t, step_loss), its seconds added to timings: the network's
    forwards with graph under "fwd_graph" (with the per-step losses, which run while the graph is
    alive), those without under "fwd_nograd", and the rest under "backward" (the backward passes,
    and each loss's own derivative g_k)."""
    parts = {}

    def velocity(z_, t_):
        with timed(parts, "fwd_graph" if torch.is_grad_enabled() else "fwd_nograd", z.device):
            return velocity_fn(z_, t_)

    def loss(k, v_k):
        with timed(parts, "fwd_graph", z.device):
            return step_loss(k, v_k)

    with timed(parts, "call", z.device):
        total = backward(velocity, z, t, loss)
    call = parts.pop("call")
    for key, seconds in parts.items():
        timings[key] = timings.get(key, 0.0) + seconds
    timings["backward"] = timings.get("backward", 0.0) + call - sum(parts.values())
    return total


def benchmark_window(velocity_fn, params, z, t, step_loss, repeats=5, warmup=1):
    """Time one window's gradient (z: [W, B, *D], t: [W, B]) both ways, interleaved; medians.

    Returns {method: {"fwd_graph", "fwd_nograd", "backward", "total"}} in seconds.
    """
    params = list(params)

    def timed_method(backward):
        def run():
            for p in params:
                p.grad = None
            timings = {"fwd_graph": 0.0, "fwd_nograd": 0.0, "backward": 0.0}
            timed_backward(backward, velocity_fn, z, t, step_loss, timings)
            timings["total"] = sum(timings.values())
            return timings
        return run

    out = interleaved_medians({"exact": timed_method(jagg.backward_exact), "jagg": timed_method(options.backward_jagg)}, repeats, warmup)
    for p in params:
        p.grad = None
    return out


class _Saved:
    """A tensor saved for backward, boxed so that its release can be seen (weakref.finalize)."""
    __slots__ = ("tensor", "__weakref__")


def saved_bytes_peak(fn):
    """Run fn() and return the peak of the bytes that autograd holds saved for backward at once:
    a device-independent memory figure. Storages are counted once however many operations save
    them; parameters (and views of them), which are allocated anyway, are not counted. Uses
    torch.autograd.graph.saved_tensors_hooks, so it is slower than fn() alone."""
    state, live = {"now": 0, "peak": 0}, {}  # live: storage address -> [saves alive, bytes]

    def release(key):
        live[key][0] -= 1
        if live[key][0] == 0:  # the last save of this storage was freed with its graph
            state["now"] -= live[key][1]
            del live[key]

    def pack(tensor):
        box = _Saved()
        box.tensor = tensor
        base = tensor if tensor._base is None else tensor._base
        if not (base.is_leaf and base.requires_grad):  # a parameter or a view of one: not an activation
            key = tensor.untyped_storage().data_ptr()
            if key not in live:
                live[key] = [0, tensor.untyped_storage().nbytes()]
                state["now"] += live[key][1]
                state["peak"] = max(state["peak"], state["now"])
            live[key][0] += 1
            weakref.finalize(box, release, key)
        return box

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.tensor):
        fn()
    return state["peak"]


def mode_settings(name):
    """(anchors, interior, max_graph_rows) of a benchmark mode name: TRAINING_MODES' names, or one
    of them with "_rows<k>" appended (OURS: at most k anchor rows in a graph at once)."""
    base, _, rows = name.partition("_rows")
    anchors, interior = TRAINING_MODES[base] or ("window", "forward")
    return anchors, interior, int(rows) if rows else None


def benchmark_trajectory(velocity_fn, params, traj, advantages, cfg, window, ref_velocity_fn=None,
                         rollout_fn=None, modes=tuple(TRAINING_MODES), repeats=3, warmup=1):
    """Time the gradient of one whole trajectory (options.backward_batch, as training runs it: the KL
    reference included when cfg.beta > 0) in each mode, and rollout_fn() if given, interleaved;
    medians. modes: names of TRAINING_MODES, or "<name>_rows<k>" with a bound on the rows in a
    graph (mode_settings). Returns {mode: {"train_s", "fwd_graph", "fwd_nograd", "fwd_ref",
    "backward", "backward_rows", "saved_gb"[, "peak_mem_gb" on CUDA]}, "rollout": {"rollout_s"}}
    (times in seconds; saved_gb from one more, untimed run under saved_bytes_peak)."""
    params = list(params)
    device = traj.z.device
    cuda = device.type == "cuda"

    def timed_mode(name):
        anchors, interior, max_graph_rows = mode_settings(name)

        def run():
            for p in params:
                p.grad = None
            timings = dict.fromkeys(("fwd_graph", "fwd_nograd", "fwd_ref", "backward"), 0.0)
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            opts = options.JaggOptions(window, 0.0 if name == "exact" else 1.0, anchors=anchors, interior=interior,
                                    max_graph_rows=max_graph_rows)
            fn = timed_velocity_fn(velocity_fn, timings)
            ref_fn = None
            if ref_velocity_fn is not None:
                ref_fn = timed_velocity_fn(ref_velocity_fn, timings, "fwd_ref", "fwd_ref")
            stats, _ = options.backward_batch(fn, traj, advantages, cfg, opts, ref_fn)
            if cuda:
                torch.cuda.synchronize(device)
                timings["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
            timings["train_s"] = time.perf_counter() - start
            # the rest: the backward passes, and the losses (timed with the forwards before)
            timings["backward"] = timings["train_s"] - sum(timings[k] for k in ("fwd_graph", "fwd_nograd", "fwd_ref"))
            timings["backward_rows"] = stats["grad_rows"]
            return timings
        return run

    def rollout():
        timings = {}
        with timed(timings, "rollout_s", device):
            rollout_fn()
        return timings

    fns = {name: timed_mode(name) for name in modes}
    if rollout_fn is not None:
        fns["rollout"] = rollout
    out = interleaved_medians(fns, repeats, warmup)
    for name in modes:  # the memory figure, outside the timed runs (the hooks cost time)
        out[name]["saved_gb"] = saved_bytes_peak(fns[name]) / 2**30
    for p in params:
        p.grad = None
    return out


def report_benchmark(t, W, scale=1.0, unit="s"):
    """Print benchmark_window's medians t as a table (times times scale, in unit) and the
    two speedups; return the speedups."""
    parts = ("fwd_graph", "fwd_nograd", "backward", "total")
    print(f"{'method':>6} " + " ".join(f"{k:>10}" for k in parts) + f"   ({unit})")
    for name in ("exact", "jagg"):
        print(f"{name:>6} " + " ".join(f"{scale * t[name][k]:>10.3f}" for k in parts))
    speedups = {"backward_speedup": t["exact"]["backward"] / t["jagg"]["backward"],
                "step_speedup": t["exact"]["total"] / t["jagg"]["total"]}
    print(f"W = {W}: backward speedup {speedups['backward_speedup']:.2f}x (ideal {W / 2:.1f}x), "
          f"whole window-gradient speedup {speedups['step_speedup']:.2f}x")
    return speedups


TRAIN_PARTS = {  # benchmark_trajectory's keys -> what they are, for tables and the stacked bars
    "fwd_graph": "forward with graph",
    "fwd_nograd": "interior forwards (no graph)",
    "fwd_ref": "reference forwards (KL)",
    "backward": "backward",
    "other": "loss and the rest",
}


def report_trajectory(t, W, scale=1.0, unit="s"):
    """Print benchmark_trajectory's medians t as a table, one row per mode, with the
    training-step and epoch (rollout + training) speedups over exact; return them as the
    objects keyed by mode that the benchmarks' JSON carries."""
    modes = [m for m in t if m != "rollout"]
    rollout_s = t["rollout"]["rollout_s"] if "rollout" in t else 0.0
    out = {"rollout_s": rollout_s, "train_s": {}, "train_speedup": {}, "epoch_speedup": {}, "backward_rows": {},
           "train_parts_s": {}}
    for m in modes:
        parts = {k: t[m][k] for k in TRAIN_PARTS if k != "other"}
        parts["other"] = max(t[m]["train_s"] - sum(parts.values()), 0.0)
        out["train_s"][m], out["train_parts_s"][m] = t[m]["train_s"], parts
        out["backward_rows"][m] = int(t[m]["backward_rows"])
        out["train_speedup"][m] = t["exact"]["train_s"] / t[m]["train_s"]
        out["epoch_speedup"][m] = (rollout_s + t["exact"]["train_s"]) / (rollout_s + t[m]["train_s"])
        if "peak_mem_gb" in t[m]:
            out.setdefault("peak_mem_gb", {})[m] = t[m]["peak_mem_gb"]
        if "saved_gb" in t[m]:  # activations saved for backward at the peak: the same on any device
            out.setdefault("saved_gb", {})[m] = t[m]["saved_gb"]
    cols = tuple(TRAIN_PARTS)
    mem, saved = "peak_mem_gb" in out, "saved_gb" in out
    print(f"{'mode':>26} {'rows':>5} " + " ".join(f"{c:>10}" for c in cols) + f" {'train':>9} {'x train':>8} {'x epoch':>8}"
          + (f" {'saved MiB':>10}" if saved else "") + (f" {'peak GiB':>9}" if mem else "") + f"   ({unit})")
    for m in modes:
        print(f"{m:>26} {out['backward_rows'][m]:>5} " + " ".join(f"{scale * out['train_parts_s'][m][c]:>10.3f}" for c in cols)
              + f" {scale * out['train_s'][m]:>9.3f} {out['train_speedup'][m]:>7.2f}x {out['epoch_speedup'][m]:>7.2f}x"
              + (f" {1024 * out['saved_gb'][m]:>10.1f}" if saved else "") + (f" {out['peak_mem_gb'][m]:>9.1f}" if mem else ""))
    print(f"W = {W}: one rollout {scale * rollout_s:.3f} {unit}; epoch = rollout + training of the same batch")
    return out
