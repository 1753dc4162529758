"""What the lab's tables read from a run's files, fresh or kept, and the packing of kept runs.

A run's summary.json (or a benchmark's benchmark.json) and its metrics.jsonl, as train_toy.py,
lab/sd_runner.py and the lab's drivers write them: lab/summarize.py builds its tables on these readers.

The kept runs (lab/results/) are packed: a runs folder becomes one JSONL file, a line a run,

    {"run": "paper_seed0/exact", "summary": {...summary.json...}, "metrics": [...metrics.jsonl's rows...]}

("metrics" only where the run has one; a loose *.json file of the folder, such as lab/eval_noise.py's
--out, is a line of its own named by its file name, its content as "summary"). A packed file stands
for the folder it was packed from: FILE.jsonl/paper_seed0/exact names that run, and a shell-style
pattern after the file, FILE.jsonl/paper_seed[0-4], the runs it matches. A driver's fresh folder packs with

    python lab/run_files.py pack runs/toy_equal_cost lab/results/equal_cost/toy.jsonl
    python lab/run_files.py list lab/results/equal_cost/toy.jsonl      # the runs' names
"""

import fnmatch
import functools
import json
import os
import sys

PACKED = ".jsonl"  # a packed runs folder's suffix


def read_rows(path):
    """The rows of a JSONL file (a run's metrics.jsonl, a packed file), blank lines skipped."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def folder_records(folder, with_metrics=True):
    """A runs folder as packed records, sorted by name: every folder below it holding a summary.json
    (named by its path under folder; with its metrics.jsonl's rows where it has one, unless
    with_metrics is False) and every *.json file directly in it (named by its file name). Files in a
    run's folder beside these two, such as config.json and weights, are left out."""
    if os.path.isfile(os.path.join(folder, "summary.json")):
        raise SystemExit(f"error: {folder} is one run; give the folder that holds the runs")
    records = []
    for top, dirs, files in os.walk(folder):
        dirs.sort()
        name = os.path.relpath(top, folder).replace(os.sep, "/")
        if name == ".":  # the folder's own JSON files (lab/eval_noise.py's draws)
            records += [{"run": f, "summary": load(os.path.join(top, f))} for f in sorted(files) if f.endswith(".json")]
        elif "summary.json" in files:
            record = {"run": name, "summary": load(os.path.join(top, "summary.json"))}
            if with_metrics and "metrics.jsonl" in files:
                record["metrics"] = read_rows(os.path.join(top, "metrics.jsonl"))
            records.append(record)
    return sorted(records, key=lambda r: r["run"])


def pack(folder, path):
    """Write a runs folder's records (folder_records) into the packed file path, a line a run."""
    records = folder_records(folder)
    if not records:
        raise SystemExit(f"error: {folder} holds no finished run (no summary.json below it)")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    print(f"packed {len(records)} runs of {folder} into {path}")


@functools.lru_cache(maxsize=None)
def packed_lines(path):
    """A packed file's lines by run name, in the file's order. Each stays a string and is parsed
    on every read, so a reader gets a fresh object as from a file (nothing it changes is shared)."""
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    return {json.loads(line)["run"]: line for line in lines}


def in_packed(path):
    """(the packed file, the rest of the path: a run's name, a pattern or "") if path goes through
    a packed file, else None."""
    parts = path.rstrip("/").split("/")
    for i in range(len(parts), 0, -1):
        head = "/".join(parts[:i])
        if head.endswith(PACKED) and os.path.isfile(head):
            return head, "/".join(parts[i:])
    return None


def matches(name, pattern):
    """Whether a run's name matches a shell-style pattern, part by part, as a shell's glob matches
    paths (a * stays within one folder's name)."""
    names, patterns = name.split("/"), pattern.split("/")
    return len(names) == len(patterns) and all(fnmatch.fnmatchcase(n, p) for n, p in zip(names, patterns))


def expand(paths):
    """The runs that paths name: a path as given, but FILE.jsonl/PATTERN becomes FILE.jsonl/NAME for
    every run of the file whose name matches (in the file's order: sorted by name, as a shell lists
    folders), and FILE.jsonl alone every run of it."""
    runs = []
    for path in paths:
        packed = in_packed(path)
        if not packed:
            runs.append(path)
            continue
        file, pattern = packed
        found = [f"{file}/{name}" for name in packed_lines(file) if not pattern or matches(name, pattern)]
        if not found:
            raise SystemExit(f"error: no run of {file} matches {pattern!r} (python lab/run_files.py list {file})")
        runs += found
    return runs


def record(path):
    """The packed record that FILE.jsonl/NAME names."""
    file, name = in_packed(path)
    lines = packed_lines(file)
    if name not in lines:
        raise SystemExit(f"error: {file} holds no run {name!r} (python lab/run_files.py list {file})")
    return json.loads(lines[name])


def load(path):
    """A run's summary: a run folder's summary.json (a benchmark's folder: its benchmark.json), a
    JSON file, or a packed run (FILE.jsonl/NAME)."""
    if in_packed(path):
        return record(path)["summary"]
    if os.path.isdir(path):  # a run folder (summary.json) or a benchmark's (benchmark.json)
        path = os.path.join(path, "summary.json"
                            if os.path.exists(os.path.join(path, "summary.json"))
                            else "benchmark.json")
    with open(path) as f:
        return json.load(f)


def metrics(path):
    """A run's metrics.jsonl rows (a run folder's, or a packed run's); [] if it has none."""
    if in_packed(path):
        return record(path).get("metrics", [])
    path = os.path.join(path, "metrics.jsonl")
    return read_rows(path) if os.path.isfile(path) else []


def runs_by_mode(folder):
    """{mode: {seed: summary}} of a driver's runs OUT/<mode>/seed<S> (lab/toy_quality.sh,
    lab/toy_equal_cost.sh, lab/mini_equal_cost.sh): a fresh folder's finished runs (those with a
    summary.json), or its packed file's."""
    packed = in_packed(folder)
    if packed and packed[1]:
        raise SystemExit(f"error: give the packed file {packed[0]} itself, not a run inside it")
    records = ([json.loads(line) for line in packed_lines(folder).values()] if packed
               else folder_records(folder, with_metrics=False))
    runs = {}
    for r in records:
        mode, _, seed = r["run"].partition("/")
        if seed.startswith("seed") and seed[4:].isdigit():
            runs.setdefault(mode, {})[int(seed[4:])] = r["summary"]
    return runs


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
    rows = metrics(path)
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
    return [(r["epoch"], r["eval/strict"]) for r in metrics(path) if "eval/strict" in r]


def timed_curve(run):
    """A run's evaluation curve against training time: [(seconds, reward)], the seconds the
    rollouts and optimizer steps took up to that evaluation (evaluation itself not counted). Runs
    from before summary.json kept each epoch's time spread the total evenly over the epochs."""
    per_epoch = run.get("epoch_seconds") or [run["train_seconds"] / run["epochs"]] * run["epochs"]
    return [(sum(per_epoch[:epoch]), reward) for epoch, reward in run["eval_curve"]]


def main(argv):
    """pack FOLDER FILE.jsonl: a runs folder into a packed file; list FILE.jsonl: its runs' names."""
    if len(argv) == 3 and argv[0] == "pack":
        pack(argv[1], argv[2])
    elif len(argv) == 2 and argv[0] == "list":
        print("\n".join(packed_lines(argv[1])))
    else:
        raise SystemExit("usage: python lab/run_files.py pack FOLDER FILE.jsonl | list FILE.jsonl")


if __name__ == "__main__":
    main(sys.argv[1:])
