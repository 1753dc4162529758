"""The statistics the lab's tables use: t intervals, variance components, seeds needed.

Functions of plain numbers, no run files: lab/summarize.py reads the runs and prints these as
tables. Student's t needs scipy (pip install -e '.[lab]').
"""

import math


def sd_of(xs):
    """The sample standard deviation (0 for one number)."""
    if len(xs) < 2:
        return 0.0
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))


def ratio_interval(gains):
    """(R, half-width of its 95 % interval, per-seed sd) of the ratio of mean gains
    R = mean(JAGG's) / mean(exact's) over seeds [(exact, jagg), ...], by the ratio estimator's
    linearisation: R's error is that of mean(jagg - R exact) / mean(exact). Unlike the mean of
    per-seed ratios, a seed whose exact gain happens to be small does not blow it up."""
    n = len(gains)
    ratio = sum(j for _, j in gains) / sum(e for e, _ in gains)
    mean_exact = sum(e for e, _ in gains) / n
    sd = sd_of([(j - ratio * e) / mean_exact for e, j in gains])
    return ratio, (t95(n - 1) * sd / math.sqrt(n) if n > 1 else 0.0), sd


def seeds_for(sd, half):
    """The fewest seeds whose 95 % t interval is at most ±half at a per-seed spread sd
    (as measured)."""
    if sd == 0:
        return "-"
    n = 2
    while t95(n - 1) * sd / math.sqrt(n) > half and n < 10_000:
        n += 1
    return str(n)


# Student's t, two-sided 95 %, by degrees of freedom (the seeds of a table are few)
def t95(df):
    """Student's t, two-sided 95 %, at df degrees of freedom (scipy.stats:
    pip install -e '.[lab]')."""
    from scipy import stats

    return float(stats.t.ppf(0.975, df))


def mean_interval(xs):
    """(mean, half-width of its 95 % t interval) of a few numbers (0 for one)."""
    n, mean = len(xs), sum(xs) / len(xs)
    return mean, (t95(n - 1) * sd_of(xs) / math.sqrt(n) if n > 1 else 0.0)


def two_way(x):
    """Variance components of a table x[seed][draw] in which draw k may have the same noise for
    every seed (lab/eval_noise.py's --noise-seed + k, one noise seed for all files), so a draw's
    luck is partly common to all seeds:
    x = mean + run_s + draw_k + rest. By the two-way analysis of variance (method of moments,
    negative components set to 0): the runs' own variance, the draws' common part's and the rest's,
    and one draw's error within a seed (the root mean square of the seeds' spreads over draws);
    mean_variance turns them into the variance of the table's mean. A t interval over the seeds'
    means alone would miss the common part: averaging seeds does not shrink it."""
    n, k = len(x), len(x[0])
    grand = sum(map(sum, x)) / (n * k)
    rows = [sum(r) / k for r in x]
    cols = [sum(r[j] for r in x) / n for j in range(k)]
    ms_rows = k * sum((r - grand) ** 2 for r in rows) / (n - 1)
    ms_cols = n * sum((c - grand) ** 2 for c in cols) / (k - 1)
    ms_rest = sum((x[i][j] - rows[i] - cols[j] + grand) ** 2
                  for i in range(n) for j in range(k)) / ((n - 1) * (k - 1))
    return {"mean": grand, "runs": max(0.0, (ms_rows - ms_rest) / k),
            "common": max(0.0, (ms_cols - ms_rest) / n), "rest": ms_rest,
            "within": math.sqrt(sum(sd_of(r) ** 2 for r in x) / n)}


def mean_variance(comp, n, k):
    """(variance of the mean of n seeds x k draws, its Satterthwaite degrees of freedom) at the
    components of two_way. The variance is (MS_seeds + MS_draws - MS_rest) / (n k) with the mean
    squares these components give at n x k (the rest's has (n - 1)(k - 1) degrees of freedom);
    a component set to 0 drops its mean square and the rest's with it."""
    rest = comp["rest"]
    terms = []  # (mean square, its degrees of freedom, sign)
    if comp["runs"] > 0:
        terms.append((rest + k * comp["runs"], n - 1, 1))
    if comp["common"] > 0:
        terms.append((rest + n * comp["common"], k - 1, 1))
    # the rest's mean square: subtracted once for each component kept beyond the first,
    # added when none is
    terms.append((rest, (n - 1) * (k - 1), 1 - len(terms)))
    var = sum(sign * ms for ms, _, sign in terms) / (n * k)
    noise = sum((sign * ms) ** 2 / df for ms, df, sign in terms if sign and ms > 0)
    return var, (var * n * k) ** 2 / noise if noise > 0 else n - 1


def half_width(comp, n, k):
    """The 95 % half-width of the mean of n seeds x k draws at two_way's components."""
    var, df = mean_variance(comp, n, k)
    return t95(max(1, int(df))) * math.sqrt(var)


def needed(comp, half, seeds=None, draws=None):
    """The fewest seeds (at `draws` draws) or draws (at `seeds` seeds) whose 95 % half-width at
    two_way's components is at most `half`, as text: "-" when no spread is measured, "never" when
    the other count's part alone is wider (the runs' own for draws, the draws' common part for
    seeds)."""
    if comp["runs"] + comp["common"] + comp["rest"] == 0:
        return "-"
    for m in range(2, 10_001):
        if half_width(comp, m if seeds is None else seeds, draws if seeds is None else m) <= half:
            return str(m)
    return "never"

