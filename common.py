"""Plumbing shared by train_toy.py and train_sd.py; nothing here is part of the algorithm.

- a command line built from a dataclass of hyperparameters (each field's help is its --help),
- files written atomically (an interrupted run never leaves half a file),
- torch.distributed set-up for torchrun,
- small pillow drawing helpers (line charts), so that no plotting library is needed.
"""

import argparse
import dataclasses
import json
import os
import tempfile

import torch
import torch.distributed as dist
from PIL import Image, ImageDraw


# ------------------------------------------------------------------ command line


def arg(default, help, choices=None):
    """A dataclass field that documents itself: its help becomes the flag's --help."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


def parse_config(cls, argv=None, description=None):
    """Build an argparse parser from the dataclass cls, parse argv, return cls(**args)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        help_, choices = f.metadata.get("help", ""), f.metadata.get("choices")
        if f.type in (bool, "bool"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_)
        else:
            kind = {"int": int, "float": float, "str": str}.get(f.type, f.type)
            parser.add_argument(flag, type=kind, default=f.default, choices=choices, help=help_)
    return cls(**vars(parser.parse_args(argv)))


def fail_on(checks):
    """checks: [(ok, message)]. Exit with the first failed message, before any work is done."""
    for ok, message in checks:
        if not ok:
            raise SystemExit(f"error: {message}")


def jagg_flag_checks(window, num_steps, jagg_frac):
    """The checks of --window and --jagg-frac that both training scripts make."""
    return [
        (window >= 2, f"--window must be >= 2 (JAGG interpolates between 2 endpoints), got {window}"),
        (window <= num_steps,
         f"--window {window} is longer than the trajectory (--num-steps {num_steps}); use --window <= {num_steps}"),
        (0.0 <= jagg_frac <= 1.0, f"--jagg-frac must be in [0, 1], got {jagg_frac}"),
    ]


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


def init_distributed():
    """(rank, world_size), starting torch.distributed when run under torchrun (gloo on CPU)."""
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1:
        return 0, 1
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def all_gather_cat(x):
    """Concatenate a tensor's copies from every rank along dim 0 (the tensor itself alone)."""
    if not (dist.is_available() and dist.is_initialized()):
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


# ------------------------------------------------------------------ metrics


def step_metrics(step_stats):
    """One metrics row from the stats of a batch's optimizer steps (jagg.train_step's dicts):
    averages of the per-step diagnostics, sums of the counts and times, grouped by prefix."""
    row = {f"train/{k}": sum(s[k] for s in step_stats) / len(step_stats)
           for k in ("loss", "clipfrac", "approx_kl", "kl", "routed_frac", "grad_norm")}
    row["train/grad_steps"] = sum(s["grad_steps"] for s in step_stats)
    row["time/backward_seconds"] = sum(s["backward_seconds"] for s in step_stats)
    row["time/grad_seconds"] = sum(s["grad_seconds"] for s in step_stats)
    return row


def param_checksums(params):
    """Each rank's sum of its parameters, gathered: equal values show the ranks stayed in sync."""
    return all_gather_cat(torch.stack([p.detach().double().sum() for p in params]).sum()[None]).tolist()


# ------------------------------------------------------------------ benchmark report


def report_benchmark(t, W, scale=1.0, unit="s"):
    """Print jagg.benchmark_window's medians t as a table (times times scale, in unit) and the
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


# ------------------------------------------------------------------ pictures

COLORS = {"exact": (40, 90, 200), "jagg": (230, 120, 20), "base": (150, 150, 150)}


def line_chart(series, title, x_label, y_label, size=(640, 400)):
    """A line chart of {name: [(x, y), ...]} with axes, ticks and a legend, drawn with pillow."""
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    left, right, top, bottom = 60, size[0] - 20, 30, size[1] - 45
    points = [p for s in series.values() for p in s]
    if not points:
        return img
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1
    pad = 0.05 * (y1 - y0)
    y0, y1 = y0 - pad, y1 + pad

    def px(x, y):
        return (left + (x - x0) / (x1 - x0) * (right - left), bottom - (y - y0) / (y1 - y0) * (bottom - top))

    d.rectangle([left, top, right, bottom], outline="black")
    for i in range(5):
        yv = y0 + i * (y1 - y0) / 4
        _, yp = px(x0, yv)
        d.line([left - 4, yp, left, yp], fill="black")
        d.text((4, yp - 6), f"{yv:.3g}", fill="black")
        xv = x0 + i * (x1 - x0) / 4
        xp, _ = px(xv, y0)
        d.line([xp, bottom, xp, bottom + 4], fill="black")
        d.text((xp - 10, bottom + 8), f"{xv:.3g}", fill="black")
    d.text((left + 100, 8), title, fill="black")
    d.text(((left + right) // 2 - 30, size[1] - 18), x_label, fill="black")
    d.text((4, top - 22), y_label, fill="black")
    for i, (name, s) in enumerate(series.items()):
        color = COLORS.get(name, (60 + 60 * i % 200, 160, 60))
        if len(s) > 1:
            d.line([px(x, y) for x, y in s], fill=color, width=2)
        d.rectangle([right - 120, top + 10 + 16 * i, right - 108, top + 22 + 16 * i], fill=color)
        d.text((right - 102, top + 10 + 16 * i), name, fill="black")
    return img
