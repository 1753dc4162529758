"""What the lab's tables read from a run's files, in the kept runs' layout or today's.

A run's summary.json (or a benchmark's benchmark.json) and its metrics.jsonl, as train_toy.py,
lab/sd_runner.py and the lab's drivers write them: lab/summarize.py builds its tables on these readers.
"""

import json
import os


def load(path):
    if os.path.isdir(path):  # a run folder (summary.json) or a benchmark's (benchmark.json)
        path = os.path.join(path, "summary.json"
                            if os.path.exists(os.path.join(path, "summary.json"))
                            else "benchmark.json")
    with open(path) as f:
        return json.load(f)


# The runs' files in both shapes: the kept runs' (lab/results/, written in an older layout) and
# today's train_toy.py's. Each reader takes either.
def side(s, key, method):
    """A compare summary's key for one method ("exact" or "jagg"): {key: {exact, jagg}} in the
    kept runs' files (and lab/sd_runner.py's), each method's own summary in train_toy.py's."""
    v = s.get(key)
    return v[method] if isinstance(v, dict) and method in v else s[method][key]


def initial_reward(s):
    """The base model's reward of a compare summary (today's toy keeps it in each method's
    summary)."""
    return s["initial_reward"] if "initial_reward" in s else s["exact"]["initial_reward"]


def probe_cosines(run):
    """A run's probe cosine per segment position: the kept runs' probe_cosine_by_position, or
    today's probe (probe.pool_probes' cosine); None without probes."""
    return run.get("probe_cosine_by_position") or (run.get("probe") or {}).get("cosine")


def grad_rows_per_step(run):
    """Network rows with grad per optimizer step: the run's total (grad_steps in the kept runs,
    grad_rows today) over its optimizer steps (epochs: the kept toy runs' steps)."""
    config = run["config"]
    total = run["grad_rows"] if "grad_rows" in run else run["grad_steps"]
    return total // ((config["epochs"] if "epochs" in config else config["steps"])
                     * config["minibatches"])


def routing_figures(path):
    """(route, reward gain, mean probe cosine of the segments routed to JAGG, of those kept exact,
    share routed per segment) of a routing run's folder: a single JAGG run or a compare's JAGG
    side. The kept runs' summaries hold the cosines; today's toy is read from its metrics.jsonl,
    each probe's cosine weighted by the share of its epoch's optimizer steps that routed the
    segment to JAGG (or kept it exact): with one step an epoch, the kept runs' figure."""
    s = load(path)
    config = s.get("config", {})
    if s.get("method") == "compare":
        s, path = s["jagg"], os.path.join(path, "jagg")
    if "cosine_routed" in s:
        return (s["route"], s["reward_gain"], s["cosine_routed"], s["cosine_kept_exact"],
                s["routed_frac_by_position"])
    with open(os.path.join(path, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    pairs = [(c, share) for r in rows if "probe/cosine" in r
             for c, share in zip(r["probe/cosine"], r["routing/routed"])]

    def mean_cosine(weight):
        total = sum(weight(share) for _, share in pairs)
        return sum(c * weight(share) for c, share in pairs) / total if total else None

    return (s.get("config", config)["route"], s["reward_gain"], mean_cosine(lambda share: share),
            mean_cosine(lambda share: 1 - share), s["routed_frac_by_position"])


def exact_gain(path):
    """Exact GRPO's reward gain: a compare run's exact side, or a single exact run's."""
    s = load(path)
    return (side(s, "reward_gain", "exact") if s.get("method") == "compare" or "exact" in s
            else s["reward_gain"])


def gain_along_run(run):
    """A lab/sd_runner.py run's reward gain along training: the mean of its evaluations after the start
    minus the start (None without an evaluation curve). It averages the whole run's evaluations,
    so one seed's late jitter weighs less than in the final reward's gain; a mode that falls behind
    late still shows, diluted by the epochs before."""
    later = [v for e, v in run.get("eval_curve", []) if e > 0]
    return sum(later) / len(later) - run["initial_reward"] if later else None


def strict_curve(path):
    """GenEval's strict accuracy at each evaluation of a lab/sd_runner.py run ([(epoch, value)], empty
    for other rewards), from its metrics.jsonl."""
    metrics = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(metrics):
        return []
    with open(metrics) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [(r["epoch"], r["eval/strict"]) for r in rows if "eval/strict" in r]


def timed_curve(run):
    """A run's evaluation curve against training time: [(seconds, reward)], the seconds the
    rollouts and optimizer steps took up to that evaluation (evaluation itself not counted). Runs
    from before summary.json kept each epoch's time spread the total evenly over the epochs."""
    per_epoch = run.get("epoch_seconds") or [run["train_seconds"] / run["epochs"]] * run["epochs"]
    return [(sum(per_epoch[:epoch]), reward) for epoch, reward in run["eval_curve"]]
