"""The probe's pictures of a toy run (lab/reports/routing.md), from its metrics.jsonl.

    python lab/toy_options.py --method jagg --route probe --probe-every 1 --jagg-frac 0.5 --out runs/toy_route
    python lab/toy_pictures.py runs/toy_route            # probe.png and score_vs_cosine.png beside its files

probe.png: the probe's cosine per window over the epochs, a filled circle where the window was routed to
JAGG in most of that epoch's optimizer steps. score_vs_cosine.png: the free velocity linearity score
(routing/window_scores, the epoch's first optimizer step) against the measured cosine, a dot per window
and probe. A compare run's folder: its JAGG run's.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from charts import chart, save_png  # noqa: E402


def probe_pictures(rows):
    """(probe.png, score_vs_cosine.png) from metrics rows with probes (today's keys: epoch, probe/cosine,
    routing/routed as each window's share of the epoch's optimizer steps, routing/window_scores)."""
    probes = [r for r in rows if "probe/cosine" in r]
    windows = range(len(probes[0]["probe/cosine"]))
    over_time = chart(
        {f"window {j}": [(r["epoch"], r["probe/cosine"][j]) for r in probes] for j in windows},
        "probe: gradient cosine, JAGG vs exact, per window (filled: routed to JAGG)", "GRPO epoch", "cosine",
        marks={f"window {j}": [(r["epoch"], r["probe/cosine"][j], r["routing/routed"][j] >= 0.5) for r in probes]
               for j in windows})
    scatter = chart(
        {f"window {j}": [(r["routing/window_scores"][j], r["probe/cosine"][j]) for r in probes] for j in windows},
        "does the free velocity score predict the measured cosine?", "velocity linearity score (free, from the rollout)",
        "measured gradient cosine", lines=False)
    return over_time, scatter


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", help="an lab/toy_options.py --out folder (a compare's: its jagg/ run) run with --probe-every N")
    parser.add_argument("--out", default="", help="where the pictures go (default: the run's folder)")
    args = parser.parse_args(argv)
    folder = os.path.join(args.run, "jagg") if os.path.isfile(os.path.join(args.run, "jagg", "metrics.jsonl")) else args.run
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"error: {args.run!r} holds no metrics.jsonl (nor jagg/metrics.jsonl); give an lab/toy_options.py --out")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not any("probe/cosine" in r for r in rows):
        raise SystemExit(f"error: {path} has no probes; run lab/toy_options.py with --probe-every N")
    over_time, scatter = probe_pictures(rows)
    out = args.out or args.run
    save_png(os.path.join(out, "probe.png"), over_time)
    save_png(os.path.join(out, "score_vs_cosine.png"), scatter)
    print(f"wrote {out}/probe.png and score_vs_cosine.png")


if __name__ == "__main__":
    main(sys.argv[1:])
