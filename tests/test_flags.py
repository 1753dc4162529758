"""Every numeric flag of train_sd.py and train_toy.py has a declared range, and a value outside it
is refused in one line that names the flag, before any model is loaded, built or pretrained."""

import dataclasses
import os
import subprocess
import sys
import time

import pytest

import common
import train_toy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def numeric_fields(cls):
    return [f for f in dataclasses.fields(cls) if f.type in (int, float, "int", "float")]


def out_of_range(f):
    """The first of a few probing values that the field's declared range refuses."""
    kind = int if f.type in (int, "int") else float
    for value in (-10**6, -2, -1, 0, 1, 2, 10**6) if kind is int else (-1e6, -1.5, -1.0, 0.0, 0.5, 1.0, 1.5, 1e6):
        if not common.in_range(value, f.metadata["valid"]):
            return kind(value)
    raise AssertionError(f"--{f.name}: no probing value is out of its range {f.metadata['valid']!r}")


def test_range_specs_read_as_declared():
    assert common.in_range(0, "0 or >= 16") and common.in_range(32, "0 or >= 16") and not common.in_range(8, "0 or >= 16")
    assert common.in_range(1.0, "(0, 1]") and not common.in_range(0.0, "(0, 1]") and not common.in_range(1.01, "(0, 1]")
    assert common.in_range(0.0, "[0, 1)") and not common.in_range(1.0, "[0, 1)")
    assert common.in_range(-1, ">= 0 or -1") and not common.in_range(-0.5, ">= 0 or -1")
    assert common.in_range(1e-9, "> 0") and not common.in_range(0, "> 0") and common.in_range(5, None)
    assert common.describe_range("0 or >= 1") == "0 or >= 1" and common.describe_range("(0, 1]") == "in (0, 1]"


def sweep(module, cls, base_args, tmp_path):
    fields = numeric_fields(cls)
    assert len(fields) >= 20
    for f in fields:
        assert f.metadata.get("valid"), f"--{f.name} declares no range: add valid=... beside its arg()"
        assert common.in_range(f.default, f.metadata["valid"]), f"--{f.name}'s default {f.default} is out of its range"
        flag, bad = "--" + f.name.replace("_", "-"), out_of_range(f)
        out = tmp_path / f.name
        start = time.perf_counter()
        with pytest.raises(SystemExit) as e:
            module.main([*base_args, "--out", str(out), flag, str(bad)])
        message = str(e.value.code)
        assert message.startswith(f"error: {flag} must be") and f"got {bad}" in message and "\n" not in message, message
        assert time.perf_counter() - start < 5 and not out.exists(), f.name


def test_every_numeric_flag_of_train_sd_is_range_checked(tmp_path):
    pytest.importorskip("diffusers", reason="the optional extra: pip install -e '.[sd]'")
    import train_sd

    sweep(train_sd, train_sd.Config, ["--model", "mini"], tmp_path)


@pytest.mark.parametrize("script, args", [
    ("train_sd.py", ["--model", "mini", "--noise-level", "3"]),
    ("train_sd.py", ["--model", "mini", "--resolution", "7"]),
    ("train_toy.py", ["--clip-range", "0"]),
])
def test_a_bad_flag_is_one_line_without_traceback_and_starts_nothing(tmp_path, script, args):
    """As a user meets it: the process ends in seconds with one line on stderr, and neither the
    mini SD3's nor the toy's pretraining (cached under runs/cache of the working directory) starts."""
    if script == "train_sd.py":
        pytest.importorskip("diffusers", reason="the optional extra: pip install -e '.[sd]'")
    start = time.perf_counter()
    run = subprocess.run([sys.executable, os.path.join(ROOT, script), "--out", str(tmp_path / "out"), *args],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    lines = run.stderr.strip().splitlines()
    assert run.returncode != 0 and len(lines) == 1 and lines[0].startswith(f"error: {args[-2]} ") and args[-1] in lines[0]
    assert "Traceback" not in run.stderr and time.perf_counter() - start < 60
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)  # no runs/cache, no out folder


@pytest.mark.parametrize("env, message", [
    ({"TABLE": "windows"}, "TABLE must be retention or window, got 'windows'"),
    ({"TABLE": "window", "WINDOW": "0"}, "WINDOW must be a whole number above 0, got '0'"),
    ({"TABLE": "window", "WINDOW": "4", "WINDOW_RANGE_END": "3"}, "WINDOW_RANGE_END (3) must be at least WINDOW (4)"),
    ({"TABLE": "window", "LR_CONTROL": "fast"}, "LR_CONTROL must be a learning rate above 0"),
])
def test_mini_quality_refuses_bad_settings_before_any_run(tmp_path, env, message):
    out = tmp_path / "table"
    done = subprocess.run(["bash", os.path.join(ROOT, "tools", "mini_quality.sh"), "darkness", str(out)],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and message in done.stdout
    assert not out.exists()
