"""The plumbing: atomic files and the dataclass command line."""

import dataclasses
import math
import os

import pytest

import common


def test_atomic_write_leaves_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "summary.json"
    common.write_json(path, {"reward": 1.0})

    def half_then_crash(f):
        f.write('{"reward": ')
        raise KeyboardInterrupt  # an interrupted run

    with pytest.raises(KeyboardInterrupt):
        common.atomic_write(path, half_then_crash)
    assert path.read_text() == '{\n  "reward": 1.0\n}'
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary file left behind
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600


def test_parse_config_builds_flags_with_help_and_types():
    @dataclasses.dataclass
    class Cfg:
        window: int = common.arg(4, "W, steps per window")
        jagg_frac: float = common.arg(1.0, "fraction of windows")
        method: str = common.arg("jagg", "which method", choices=["exact", "jagg"])
        ema: bool = common.arg(False, "keep an EMA")

    cfg = common.parse_config(Cfg, ["--window", "8", "--jagg-frac", "0.5", "--method", "exact", "--ema"])
    assert cfg == Cfg(window=8, jagg_frac=0.5, method="exact", ema=True)
    assert common.parse_config(Cfg, ["--no-ema"]).ema is False
    with pytest.raises(SystemExit):
        common.parse_config(Cfg, ["--method", "other"])


def test_writable_folder_check_leaves_nothing_behind(tmp_path):
    assert common.writable_folder_check(str(tmp_path / "new" / "run")) == (True, "")
    assert list(tmp_path.iterdir()) == []  # neither the folder nor the probe entry
    blocker = tmp_path / "file"
    blocker.write_text("")
    ok, message = common.writable_folder_check(str(blocker / "run"), "--out")
    assert not ok and "--out" in message and "is not a folder" in message
    assert not common.writable_folder_check("/proc/jagg-run")[0]  # a folder that cannot be created


def test_mode_names_match_the_benchmark_modes():
    names = {common.mode_name(method, anchors, interior) for method in ("exact", "jagg")
             for anchors in ("window", "shared") for interior in ("forward", "rollout")}
    assert names == set(common.TRAINING_MODES)


@pytest.mark.parametrize("low, high", [(0.181, 0.733), (0, 80), (0, 48), (20.8, 80.2), (0.75, 0.97), (-0.02, 0.3),
                                       (3.2, 3.9), (0, 250), (1e-4, 7e-4)])
def test_chart_ticks_are_round_and_cover_the_data(low, high):
    ticks, lo, hi = common.nice_ticks(low, high)
    step = ticks[1] - ticks[0]
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert any(abs(mantissa - m) < 1e-6 for m in (1, 2, 5)), ticks
    assert all(abs(t / step - round(t / step)) < 1e-6 for t in ticks), ticks  # multiples of the step
    assert lo <= low and hi >= high and 3 <= len(ticks) <= 7
    labels = [common.tick_label(t, ticks) for t in ticks]
    assert len(set(labels)) == len(labels) and all(float(s) == pytest.approx(t) for s, t in zip(labels, ticks))
    assert (low, high) != (0, 80) or labels == ["0", "20", "40", "60", "80"]
    assert (low, high) != (0.181, 0.733) or labels == ["0.0", "0.2", "0.4", "0.6", "0.8"]
    assert (low, high) != (0, 48) or labels == ["0", "10", "20", "30", "40", "50"]  # not 0-60: the tightest round axis


# ------------------------------------------------------------------ tools/gradient_signal.py


def _gradient_signal():
    import importlib.util
    import sys

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "gradient_signal.py")
    sys.path.insert(0, os.path.dirname(path))
    spec = importlib.util.spec_from_file_location("gradient_signal", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gradient_signal_stats_on_known_gradients():
    """Batches g_k = s + noise with a known signal s: JAGG equal to exact keeps everything with no
    error; half of exact keeps half; exact plus independent noise of a known size keeps the signal
    (about 1) and reports that noise's share of the batch's own."""
    import torch

    signal_stats = _gradient_signal().signal_stats
    g = torch.Generator().manual_seed(0)
    P, K = 20000, 12
    s = torch.randn(P, generator=g, dtype=torch.float64) * 0.5  # |s|^2 = P / 4
    exact = [s + torch.randn(P, generator=g, dtype=torch.float64) for _ in range(K)]  # noise variance P
    same = signal_stats(exact, exact)
    assert same["probe_cosine"] == pytest.approx(1.0) and same["error_to_noise"] == 0.0
    assert same["signal_kept"] == pytest.approx(1.0)
    assert same["batch_agreement"] == pytest.approx(0.25 / 1.25, abs=0.02)  # |s|^2 / (|s|^2 + noise)
    half = signal_stats(exact, [0.5 * x for x in exact])
    assert half["signal_kept"] == pytest.approx(0.5) and half["probe_cosine"] == pytest.approx(1.0)
    noisy = signal_stats(exact, [x + 0.5 * torch.randn(P, generator=g, dtype=torch.float64) for x in exact])
    assert noisy["error_to_noise"] == pytest.approx(0.25, rel=0.05)  # (0.5^2 P) / P
    assert noisy["signal_kept"] == pytest.approx(1.0, abs=0.1)
    assert noisy["signal_kept_stderr"] < 0.1 and 0 < noisy["batch_agreement_stderr"] < 0.05
    wrong = signal_stats(exact, [-x for x in exact])  # the opposite direction loses the signal
    assert wrong["signal_kept"] == pytest.approx(-1.0)
