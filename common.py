"""Plumbing shared by train_toy.py and train_sd.py; nothing here is part of the algorithm.

- a command line built from a dataclass of hyperparameters (each field's help is its --help),
  and the JAGG flags both scripts share (JaggConfig) with their checks,
- files written atomically (an interrupted run never leaves half a file),
- torch.distributed set-up for torchrun,
- the benchmarks (the training modes of jagg.py and jagg_options.py timed, interleaved, and their saved activations) and
  the reports both scripts print,
- small pillow drawing helpers (line and scatter charts, stacked bars), so that no plotting
  library is needed.
"""

import argparse
import dataclasses
import json
import math
import os
import statistics
import tempfile
import time
import weakref

import torch
import torch.distributed as dist
from PIL import Image, ImageDraw, ImageFont

import jagg
import jagg_options


# ------------------------------------------------------------------ command line


def arg(default, help, choices=None, valid=None):
    """A dataclass field that documents itself: its help becomes the flag's --help. valid: the
    flag's range, declared here once, shown in --help and checked by range_checks before any
    work: ">= 1", "> 0", "[0, 1)", "(0, 1]", or alternatives joined by " or " ("0 or >= 2")."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "valid": valid})


def _within(value, part):
    """value against one alternative of a valid spec: an interval, a comparison, or a number."""
    if part[0] in "[(":
        low, high = (float(x) for x in part[1:-1].split(","))
        return (value >= low if part[0] == "[" else value > low) and (value <= high if part[-1] == "]" else value < high)
    for op, test in ((">=", float.__ge__), ("<=", float.__le__), (">", float.__gt__), ("<", float.__lt__)):
        if part.startswith(op):
            return test(float(value), float(part[len(op):]))
    return float(value) == float(part)


def in_range(value, valid):
    """True when value meets the spec valid of arg() (None: anything)."""
    return valid is None or any(_within(value, part.strip()) for part in valid.split(" or "))


def describe_range(valid):
    """The spec as a sentence's end: "in [0, 1]", ">= 1", "0 or >= 2"."""
    return " or ".join(("in " if part.strip()[0] in "[(" else "") + part.strip() for part in valid.split(" or "))


def range_checks(cfg):
    """(ok, message) for fail_on, one per flag with a declared range: the flag, its value, what it must be."""
    checks = []
    for f in dataclasses.fields(cfg):
        valid, value = f.metadata.get("valid"), getattr(cfg, f.name)
        if valid is not None:
            checks.append((isinstance(value, (int, float)) and math.isfinite(value) and in_range(value, valid),
                           f"--{f.name.replace('_', '-')} must be {describe_range(valid)}, got {value} "
                           f"(default {f.default}; --help explains it)"))
    return checks


def parse_config(cls, argv=None, description=None, presets=None):
    """Build an argparse parser from the dataclass cls, parse argv, return cls(**args). presets:
    {name: {field: value}}; --preset NAME (a field of cls) sets those defaults, and a flag given
    on the command line still wins over its preset value."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        help_, choices, valid = f.metadata.get("help", ""), f.metadata.get("choices"), f.metadata.get("valid")
        if valid is not None:
            help_ += f" [{describe_range(valid)}]"
        if f.type in (bool, "bool"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_)
        else:
            kind = {"int": int, "float": float, "str": str}.get(f.type, f.type)
            parser.add_argument(flag, type=kind, default=f.default, choices=choices, help=help_)
    if presets:
        known, _ = parser.parse_known_args(argv)
        parser.set_defaults(**presets.get(known.preset, {}))
    return cls(**vars(parser.parse_args(argv)))


def fail_on(checks):
    """checks: [(ok, message)]. Exit with the first failed message, before any work is done."""
    for ok, message in checks:
        if not ok:
            raise SystemExit(f"error: {message}")


@dataclasses.dataclass
class JaggConfig:
    """The JAGG flags of both training scripts; each script's Config extends it (and may change a
    default). The choices are jagg_options.py's own constants."""
    window: int = arg(4, "W, sampling steps per window (the paper's) or per segment between shared anchors", valid=">= 2")
    jagg_frac: float = arg(1.0, "fraction of windows (the best by --route) trained by JAGG; the rest exact", valid="[0, 1]")
    anchors: str = arg("window", "window: the paper's disjoint windows; shared (ours): adjacent windows share their end "
                                 "step, anchors every W - 1 steps, all in one forward with graph (more rows in memory "
                                 "at once)", choices=list(jagg_options.ANCHOR_MODES))
    interior: str = arg("forward", "velocities of the steps between anchors: forward (the paper: one no-graph forward, "
                                   "with CFG's and the reference's) or rollout (ours: the rollout's, corrected by the "
                                   "anchors' change; no network call, reference model included)",
                        choices=list(jagg_options.INTERIOR_MODES))
    weights: str = arg("time", "interpolation weights between anchors: time (the paper's abstract: alpha_k by t) or "
                               "index (the authors' early code: alpha_k = k / (W - 1))", choices=list(jagg_options.WEIGHTS))
    max_graph_rows: int = arg(0, "at most this many anchor rows (of B samples) in a graph at once (ours; the same "
                                 "gradient, less memory: shared anchors otherwise hold all theirs); 0: no bound. The "
                                 "benchmark adds every JAGG mode with this bound", valid="0 or >= 1")
    route: str = arg("velocity", "which windows JAGG takes: velocity (their velocities' linearity, free) or probe "
                                 "(ours: the probe's measured gradient cosines, averaged over probes)",
                     choices=list(jagg_options.ROUTES))
    probe_every: int = arg(0, "every N epochs (train_toy.py: GRPO steps, and at step 1), before training on the batch, "
                              "measure the cosine of JAGG's gradient to the exact one per window on --probe-batch "
                              "samples (0: off)", valid=">= 0")
    probe_batch: int = arg(2, "samples the probe measures on (per rank; the cosines are averaged over ranks); its two "
                              "halves give the batch's own noise, which error_to_noise is measured in", valid=">= 2")
    probe_decay: float = arg(0.5, "--route probe ranks windows by an exponential average of the probes: weight of the "
                                  "old average", valid="[0, 1)")
    min_cosine: float = arg(0.0, "--route probe never lets JAGG take a window whose averaged cosine is below this "
                                 "(0 keeps windows with a negative cosine exact; -1: no floor)", valid="[-1, 1]")
    max_drift: float = arg(jagg_options.JaggOptions.max_drift,
                           "--interior rollout: a segment with an anchor whose ratio has moved since the rollout "
                           "by more than this share of the clip range, max |ratio - 1| / clip, takes forward "
                           "interiors instead (ours; jagg_options.py section 2); -1: the rollout rule at any drift", valid=">= 0 or -1")

    def jagg_options(self, method="jagg"):
        """The jagg_options.JaggOptions these flags ask for; method "exact" trains every window exactly."""
        return jagg_options.JaggOptions(window=self.window, jagg_frac=0.0 if method == "exact" else self.jagg_frac,
                                anchors=self.anchors, interior=self.interior, weights=self.weights,
                                max_graph_rows=self.max_graph_rows or None,
                                max_drift=None if self.max_drift < 0 else self.max_drift,
                                route=self.route, min_cosine=self.min_cosine)


def trained_steps(cfg):
    """How many of a rollout's --num-steps steps training takes: an SDE window's (--sde-window), or
    Flow-GRPO's int(T * timestep_fraction), the first ones in order (0.99 at T = 10: steps 0-8)."""
    if getattr(cfg, "sde_window", 0):
        return cfg.sde_window
    return int(cfg.num_steps * cfg.timestep_fraction)  # as Flow-GRPO computes it, float rounding included


def jagg_flag_checks(cfg):
    """Every flag's declared range (range_checks), then the checks of the JAGG flags that depend on
    other flags, both training scripts' (cfg: either script's Config)."""
    return range_checks(cfg) + [
        (trained_steps(cfg) >= 1,
         f"--timestep-fraction {cfg.timestep_fraction} must train at least one of the --num-steps {cfg.num_steps} "
         f"steps: raise it"),
        (cfg.window <= max(trained_steps(cfg), 2),
         f"--window {cfg.window} is longer than the {trained_steps(cfg)} trained steps ("
         + ("--sde-window" if getattr(cfg, "sde_window", 0) else
            f"--num-steps {cfg.num_steps} x --timestep-fraction {cfg.timestep_fraction}")
         + f"); use --window <= {trained_steps(cfg)}"),
        (cfg.route != "probe" or cfg.probe_every >= 1,
         "--route probe routes by the probe's measurements: give it --probe-every N >= 1"),
        (cfg.max_graph_rows == 0 or cfg.max_graph_rows >= jagg_options.min_graph_rows(cfg.interior),
         f"--max-graph-rows must be 0 (no bound) or >= {jagg_options.min_graph_rows(cfg.interior)}"
         f"{' with --interior rollout (a segment needs both its anchors at once)' if cfg.interior == 'rollout' else ''}, "
         f"got {cfg.max_graph_rows}"),
    ]


def bench_modes(max_graph_rows):
    """The benchmarks' modes: TRAINING_MODES, and with a bound k > 0 again as "<mode>_rows<k>"
    each JAGG mode the bound changes: the shared modes, and the paper's 2-anchor windows at k = 1
    (with forward interiors only: rollout interiors need k >= 2)."""
    modes = list(TRAINING_MODES)
    for m, settings in TRAINING_MODES.items():
        if max_graph_rows and settings is not None:
            anchors, interior = settings
            if (anchors == "shared" or max_graph_rows < 2) and (interior == "forward" or max_graph_rows >= 2):
                modes.append(f"{m}_rows{max_graph_rows}")
    return modes


def mode_name(method, anchors, interior):
    """The name of a training mode, as TRAINING_MODES and the benchmarks' JSON spell it."""
    if method == "exact":
        return "exact"
    return "jagg" + ("_shared" if anchors == "shared" else "") + ("_rollout" if interior == "rollout" else "")


def writable_folder_check(path, flag="--out"):
    """(ok, message) for fail_on: could the folder be created and written to? Tried with a
    temporary entry in the folder, or in its nearest existing parent, that is removed at once:
    nothing is left behind, so a later check may still fail cleanly."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(f"{existing} is not a folder")
        with tempfile.TemporaryDirectory(dir=existing, prefix=".write-check-"):
            pass
        return True, ""
    except OSError as e:
        return False, f"{flag} {path!r} cannot be created or written to ({e.strerror or e}); pass a writable folder"


# ------------------------------------------------------------------ files


def atomic_write(path, write_fn, mode="w"):
    """Write path through write_fn(file) into a temporary file beside it, then rename: readers
    see the old file or the new one, never a half-written one."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".tmp-")
    try:
        with os.fdopen(fd, mode) as f:
            write_fn(f)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_json(path, obj):
    atomic_write(path, lambda f: json.dump(obj, f, indent=2, sort_keys=True))


def write_jsonl(path, rows):
    atomic_write(path, lambda f: f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in rows))


def save_png(path, image):
    atomic_write(path, lambda f: image.save(f, format="PNG"), mode="wb")


def torch_save(path, obj):
    atomic_write(path, lambda f: torch.save(obj, f), mode="wb")


# ------------------------------------------------------------------ distributed


def init_distributed(always=False):
    """(rank, world_size), starting torch.distributed when run under torchrun (gloo on CPU); with
    always, for one rank too (FSDP shards over a process group)."""
    if "WORLD_SIZE" not in os.environ or (int(os.environ["WORLD_SIZE"]) == 1 and not always):
        return 0, 1
    if dist.is_initialized():  # a second run in the same process (train_sd.py --method compare)
        return dist.get_rank(), dist.get_world_size()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def finish_distributed():
    """Close the process group: a script's last call, on every rank, after a run that succeeded.
    A rank that exits with gloo's threads still running can abort ("terminate called without an
    active exception") and fail the whole torchrun after its work is done. No barrier: rank 0 may
    still be drawing pictures or redrawing an evaluation, longer than a collective's timeout."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def mean_over_ranks(values, device="cpu"):
    """The mean of a list of floats over all ranks (itself, alone): so every rank routes alike.
    device: where the collective runs (a CUDA device under NCCL)."""
    x = torch.tensor(values, dtype=torch.float64, device=device)
    return all_gather_cat(x[None]).mean(0).tolist()


def all_gather_cat(x):
    """Concatenate a tensor's copies from every rank along dim 0 (the tensor itself alone)."""
    if not (dist.is_available() and dist.is_initialized()):
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


# ------------------------------------------------------------------ metrics


def probe_counts_as_training(method, route):
    """The probe's time is training time only where it routes (a JAGG run with --route probe);
    anywhere else it is a diagnostic, and the training time leaves it out."""
    return method == "jagg" and route == "probe"


def probe_report(summary):
    """The probe's means per segment position as a run ends: the cosine, and JAGG's error against
    the optimizer step's own noise (about 0.1 or less: lost in the batch's noise; 1: as large),
    with the half-width of its 95 % interval over the run's probes."""
    errors = summary["probe_error_to_noise_by_position"]
    stderrs = summary.get("probe_error_to_noise_stderr_by_position") or [None] * len(errors)  # older runs: none
    return ("gradient cosine JAGG vs exact per segment: " + " ".join(f"{c:.3f}" for c in summary["probe_cosine_by_position"])
            + "\nerror against the batch's own noise per segment (JAGG's squared error in a step over the step's noise; "
            "0.05 weighs as a 5 % smaller batch; ± a 95 % interval over the probes): "
            + " ".join(f"{e:.3f}" + (f" ±{1.96 * se:.3f}" if se is not None else "") for e, se in zip(errors, stderrs)))


def probes_of(rows):
    """The probes recorded in metrics rows, as jagg_options.pool_probes takes them."""
    return [{"cosine": r["probe/grad_cosine"], "error": r["probe/error"], "noise": r["probe/noise"]}
            for r in rows if "probe/error" in r]


def probe_cosine_by_position(rows):
    """The mean of the probes' cosines per segment position over the metrics rows; None without probes."""
    pooled = jagg_options.pool_probes(probes_of(rows))
    return None if pooled is None else pooled["cosine"]


def probe_error_to_noise_by_position(rows):
    """jagg_options.pool_probes' error_to_noise over the run's metrics rows; None without probes."""
    pooled = jagg_options.pool_probes(probes_of(rows))
    return None if pooled is None else pooled["error_to_noise"]


def probe_error_to_noise_stderr_by_position(rows):
    """jagg_options.pool_probes' stderr over the run's metrics rows; None without probes."""
    pooled = jagg_options.pool_probes(probes_of(rows))
    return None if pooled is None else pooled["stderr"]


def step_metrics(step_stats):
    """One metrics row from the stats of a batch's optimizer steps (jagg_options.train_step's dicts, or
    jagg_options.accumulate_gradients' per micro-batch with optimizer_step's grad_norm and skipped on each
    step's last): averages of the diagnostics, sums of the counts and times, grouped by prefix."""
    if not step_stats:  # an epoch with nothing to train on (every advantage zero, Flow-GRPO drops them all)
        return {"train/skipped_steps": 0, "train/grad_rows": 0, "time/backward_seconds": 0.0, "time/grad_seconds": 0.0,
                **{f"train/{k}": float("nan") for k in ("loss", "clipfrac", "approx_kl", "kl", "routed_frac", "grad_norm")}}
    row = {f"train/{k}": sum(s[k] for s in step_stats) / len(step_stats)
           for k in ("loss", "clipfrac", "approx_kl", "kl", "routed_frac")}
    steps = [s for s in step_stats if "grad_norm" in s]  # one per optimizer step
    row["train/grad_norm"] = sum(s["grad_norm"] for s in steps) / max(len(steps), 1)
    row["train/grad_rows"] = sum(s["grad_rows"] for s in step_stats)
    for key in ("rollout_refreshed", "anchor_drift"):  # the drift guard of rollout interiors, when it ran
        if key in step_stats[0]:
            row[f"train/{key}"] = sum(s[key] for s in step_stats) / len(step_stats)
    row["train/skipped_steps"] = sum(s["skipped"] for s in steps)
    row["time/backward_seconds"] = sum(s["backward_seconds"] for s in step_stats)
    row["time/grad_seconds"] = sum(s["grad_seconds"] for s in step_stats)
    return row


def compare_summary(ex, jg, config):
    """summary.json of a compare run (both scripts): exact's and JAGG's run summaries side by side,
    the share of exact's reward gain JAGG kept, and the speedups."""
    return {
        "method": "compare", "mode": jg["mode"], "weights": config["weights"],
        "initial_reward": ex["initial_reward"],  # the same model and evaluation noise for both
        **{key: {"exact": ex[key], "jagg": jg[key]}
           for key in ("final_reward", "reward_gain", "backward_seconds", "grad_seconds", "train_seconds", "grad_steps")},
        "reward_gain_ratio": jg["reward_gain"] / ex["reward_gain"] if ex["reward_gain"] != 0 else None,
        "backward_speedup": ex["backward_seconds"] / jg["backward_seconds"],
        "grad_speedup": ex["grad_seconds"] / jg["grad_seconds"],
        "train_speedup": ex["train_seconds"] / jg["train_seconds"],
        "grad_steps_ratio": ex["grad_steps"] / jg["grad_steps"],
        "exact": ex, "jagg": jg, "config": config,
    }


def param_checksums(params):
    """Each rank's sum of its parameters (FSDP's shards gathered whole), gathered: equal values
    show the ranks stayed in sync."""
    whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in params]
    return all_gather_cat(torch.stack([p.detach().double().sum() for p in whole]).sum()[None]).tolist()


# ------------------------------------------------------------------ benchmark reports


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


# ------------------------------------------------------------------ pictures

COLORS = {"exact": (40, 90, 200), "jagg": (230, 120, 20), "base": (150, 150, 150)}
PALETTE = [(40, 90, 200), (230, 120, 20), (40, 160, 80), (200, 50, 50), (140, 80, 180), (120, 120, 120),
           (0, 170, 190), (190, 160, 0)]


def font(size=14):
    return ImageFont.load_default(size=size)


def color_of(name, i):
    return COLORS.get(name, PALETTE[i % len(PALETTE)])


def nice_ticks(low, high, max_ticks=7):
    """Round tick values covering [low, high]: the smallest step of 1, 2 or 5 times a power of ten
    that needs at most max_ticks ticks (0.2, 0.4, 0.6 or 0, 20, 40, not 0.181, 0.319). Returns
    (ticks, lo, hi): the axis range widened to the first and last tick."""
    if high <= low:
        high = low + 1.0
    e = math.floor(math.log10(high - low))
    for step in sorted(m * 10.0**k for k in range(e - 2, e + 2) for m in (1, 2, 5)):
        first, last = math.floor(low / step + 1e-9), math.ceil(high / step - 1e-9)
        if last - first + 1 <= max_ticks:
            break
    ticks = [round(i * step, 10) for i in range(first, last + 1)]
    return ticks, ticks[0], ticks[-1]


def tick_label(v, ticks):
    """A tick's text with as many decimals as the step needs (step 0.05: '0.75'; step 20: '20')."""
    step = ticks[1] - ticks[0] if len(ticks) > 1 else 1.0
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    return f"{v:.{decimals}f}"


def chart(series, title, x_label, y_label, size=(780, 420), lines=True, marks=None, y_range=None):
    """A chart of {name: [(x, y), ...]} with axes, ticks and a legend beside the plot, drawn with
    pillow: lines (or, lines=False, dots: a scatter). marks: {name: [(x, y, filled)]}, circles
    drawn filled or hollow on top of the series of that name. y_range: (low, high) or None."""
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    small, large = font(13), font(15)
    names = list(dict.fromkeys(list(series) + list(marks or {})))
    legend = max([200] + [int(d.textlength(str(name), font=small)) + 50 for name in names])  # wide enough for its names
    left, right, top, bottom = 70, size[0] - legend, 54, size[1] - 52
    points = [p[:2] for s in series.values() for p in s] + [p[:2] for s in (marks or {}).values() for p in s]
    if not points:
        return img
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    # Axes run between round ticks that cover the data (y_range, if given, is kept as it is).
    x_ticks, x0, x1 = nice_ticks(min(xs), max(xs))
    if y_range is None:
        y_ticks, y0, y1 = nice_ticks(min(ys), max(ys))
    else:
        (y0, y1), y_ticks = y_range, [v for v in nice_ticks(*y_range)[0] if y_range[0] <= v <= y_range[1]]

    def px(x, y):
        return (left + (x - x0) / (x1 - x0) * (right - left), bottom - (y - y0) / (y1 - y0) * (bottom - top))

    d.rectangle([left, top, right, bottom], outline="black")
    for yv in y_ticks:
        _, yp = px(x0, yv)
        d.line([left - 4, yp, left, yp], fill="black")
        d.line([left + 1, yp, right - 1, yp], fill=(232, 232, 232))  # a light grid line
        d.text((left - 8, yp), tick_label(yv, y_ticks), fill="black", font=small, anchor="rm")
    for xv in x_ticks:
        xp, _ = px(xv, y0)
        d.line([xp, bottom, xp, bottom + 4], fill="black")
        d.text((xp, bottom + 8), tick_label(xv, x_ticks), fill="black", font=small, anchor="mt")
    d.text(((left + right) / 2, 8), title, fill="black", font=large, anchor="mt")
    d.text(((left + right) / 2, size[1] - 8), x_label, fill="black", font=small, anchor="md")
    d.text((8, top - 22), y_label, fill="black", font=small)
    for i, name in enumerate(names):
        color = color_of(name, i)
        s = series.get(name, [])
        if lines and len(s) > 1:
            d.line([px(x, y) for x, y in s], fill=color, width=2)
        elif not lines:
            for x, y in s:
                cx, cy = px(x, y)
                d.ellipse([cx - 3, cy - 3, cx + 3, cy + 3], fill=color)
        for x, y, filled in (marks or {}).get(name, []):
            cx, cy = px(x, y)
            d.ellipse([cx - 5, cy - 5, cx + 5, cy + 5], fill=color if filled else "white", outline=color, width=2)
        ly = top + 6 + 22 * i  # the legend, beside the plot
        d.rectangle([right + 16, ly + 2, right + 30, ly + 14], fill=color)
        d.text((right + 36, ly), str(name), fill="black", font=small)
    return img


def training_step_bars(results, scale, unit, title):
    """Stacked bars of where one training step's time goes, per W and mode: results {W:
    report_trajectory's dict}, times times scale, in unit."""
    bars = {f"W={W}  {m}": {k: scale * v for k, v in r["train_parts_s"][m].items()}
            for W, r in results.items() for m in r["train_parts_s"]}
    return stacked_bars(bars, TRAIN_PARTS, title, unit)


def stacked_bars(bars, parts, title, unit, size=(900, 80)):
    """Horizontal stacked bars: bars {label: {part: value}}, parts {part: legend text} in stacking
    order; each bar's total is written at its end, the legend stands below the bars."""
    small, large = font(13), font(15)
    height = size[1] + 34 * len(bars) + 22 * ((len(parts) + 2) // 3)
    img = Image.new("RGB", (size[0], height), "white")
    d = ImageDraw.Draw(img)
    left, right, top = 190, size[0] - 90, 40
    total_max = max(sum(v.values()) for v in bars.values()) or 1.0
    d.text(((left + right) / 2, 10), title, fill="black", font=large, anchor="mt")
    for i, (label, values) in enumerate(bars.items()):
        y = top + 34 * i
        d.text((left - 8, y + 12), label, fill="black", font=small, anchor="rm")
        x = left
        for j, part in enumerate(parts):
            w = values.get(part, 0.0) / total_max * (right - left)
            d.rectangle([x, y, x + w, y + 24], fill=PALETTE[j % len(PALETTE)])
            x += w
        d.text((x + 6, y + 12), f"{sum(values.values()):.3g} {unit}", fill="black", font=small, anchor="lm")
    y = top + 34 * len(bars) + 10
    for j, text in enumerate(parts.values()):
        lx, ly = left + (j % 3) * ((right - left) // 3), y + 22 * (j // 3)
        d.rectangle([lx, ly + 2, lx + 14, ly + 14], fill=PALETTE[j % len(PALETTE)])
        d.text((lx + 20, ly), text, fill="black", font=small)
    return img


# =====================================================================================
# Measuring it: exact vs JAGG, interleaved (the algorithm's modes, timed and weighed)
# =====================================================================================


def _interleaved(fns, repeats, warmup):
    """Call each fn() -> {key: seconds} warmup + repeats times, rotating which goes first so that
    drift on a shared machine hits all alike. Returns {name: {key: median over repeats}}."""
    names, runs = list(fns), {name: [] for name in fns}
    for r in range(warmup + repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            out = fns[name]()
            if r >= warmup:
                runs[name].append(out)
    return {name: {key: statistics.median(run[key] for run in rs) for key in rs[0]} for name, rs in runs.items()}


def benchmark_window(velocity_fn, params, z, t, step_loss, repeats=5, warmup=1):
    """Time one window's gradient (z: [W, B, *D], t: [W, B]) both ways, interleaved; medians.

    Returns {method: {"fwd_graph", "fwd_nograd", "backward", "total"}} in seconds.
    """
    params = list(params)

    def timed(backward):
        def run():
            for p in params:
                p.grad = None
            timings = {"fwd_graph": 0.0, "fwd_nograd": 0.0, "backward": 0.0}
            jagg_options.timed_backward(backward, velocity_fn, z, t, step_loss, timings)
            timings["total"] = sum(timings.values())
            return timings
        return run

    out = _interleaved({"exact": timed(jagg.backward_exact), "jagg": timed(jagg_options.backward_jagg)}, repeats, warmup)
    for p in params:
        p.grad = None
    return out


# The training modes the benchmarks compare: (anchors, interior); every JAGG mode interpolates
# every segment (jagg_frac = 1).
TRAINING_MODES = {
    "exact": None,  # Flow-GRPO: one forward with graph and one backward per step
    "jagg": ("window", "forward"),  # the paper
    "jagg_shared": ("shared", "forward"),
    "jagg_rollout": ("window", "rollout"),
    "jagg_shared_rollout": ("shared", "rollout"),
}


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
    """Time the gradient of one whole trajectory (jagg_options.window_gradients, as training runs it: the KL
    reference included when cfg.beta > 0) in each mode, and rollout_fn() if given, interleaved;
    medians. modes: names of TRAINING_MODES, or "<name>_rows<k>" with a bound on the rows in a
    graph (mode_settings). Returns {mode: {"train_s", "fwd_graph", "fwd_nograd", "fwd_ref",
    "backward", "backward_rows", "saved_gb"[, "peak_mem_gb" on CUDA]}, "rollout": {"rollout_s"}}
    (times in seconds; saved_gb from one more, untimed run under saved_bytes_peak)."""
    params = list(params)
    device = traj.z.device
    cuda = device.type == "cuda"

    def timed(name):
        anchors, interior, max_graph_rows = mode_settings(name)

        def run():
            for p in params:
                p.grad = None
            timings = dict.fromkeys(("fwd_graph", "fwd_nograd", "fwd_ref", "backward"), 0.0)
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            opts = jagg_options.JaggOptions(window, 0.0 if name == "exact" else 1.0, anchors=anchors, interior=interior,
                                    max_graph_rows=max_graph_rows)
            stats, _ = jagg_options.window_gradients(velocity_fn, traj, advantages, cfg, opts, ref_velocity_fn, timings)
            if cuda:
                torch.cuda.synchronize(device)
                timings["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
            timings["train_s"] = time.perf_counter() - start
            timings["backward_rows"] = stats["grad_rows"]
            return timings
        return run

    def rollout():
        timings = {}
        with jagg_options.timed(timings, "rollout_s", device):
            rollout_fn()
        return timings

    fns = {name: timed(name) for name in modes}
    if rollout_fn is not None:
        fns["rollout"] = rollout
    out = _interleaved(fns, repeats, warmup)
    for name in modes:  # the memory figure, outside the timed runs (the hooks cost time)
        out[name]["saved_gb"] = saved_bytes_peak(fns[name]) / 2**30
    for p in params:
        p.grad = None
    return out
