"""The mini SD3's task, GenEval in miniature: a prompt grammar, its scenes, rewards that check them.

    python lab/mini_sd3_pipeline.py --out DIR  # the model for it; DIR/prompts.txt: 48 task prompts
    python lab/sd_runner.py --model DIR --prompts DIR/prompts.txt --reward lab.mini_sd3:geneval_reward
    python lab/sd_runner.py $(python lab/presets.py mini) --method compare   # the docs' setting

You do not need to read this file to learn JAGG: it is the task, not the algorithm. Real SD3.5
weights cannot be downloaded on the machines this project is built on, so lab/mini_sd3_pipeline.py
makes a small SD3.5 pipeline that `lab/sd_runner.py --model DIR` trains like any other, and this file
gives it images that mean something:

- A prompt grammar over 4 colours, 3 shapes, one or two objects, "left of" / "right of" and
  the count "two" (Flow-GRPO's GenEval task in miniature: objects, colours, counts, positions),
  and a renderer that draws a prompt with pillow at 32x32 with jitter in position and size.
- Checkers that score a decoded image against its prompt from its pixels alone, GenEval-style, as
  lab/sd_runner.py rewards (--reward lab.mini_sd3:NAME, run from the repository's root): geneval_reward
  (GenEval's graded reward, logging the strict accuracy per kind at evaluations), shapes_reward,
  cover_reward, shapes_cover_reward.
"""

import math
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

# =====================================================================================
# 1. The task: a prompt grammar and a renderer
# =====================================================================================

COLORS = {"red": (215, 45, 45), "green": (40, 165, 65), "blue": (45, 85, 215), "yellow": (235, 195, 35)}
SHAPES = ("circle", "square", "triangle")
BACKGROUND = (235, 235, 235)
RELATIONS = ("left of", "right of")
WORDS = ["a", "two", "of", "left", "right", *COLORS, *SHAPES, *(s + "s" for s in SHAPES)]


@dataclass(frozen=True)
class Spec:
    """What a prompt asks for: objects as (colour, shape), left to right as the prompt orders
    them; kind is 'single', 'count' (two alike) or a relation ('left of' / 'right of')."""
    objects: tuple
    kind: str


def parse(prompt):
    """The grammar's three forms:
        a {colour} {shape}                                 -> single
        two {colour} {shape}s                              -> count
        a {colour} {shape} {left|right} of a {colour} {shape} -> relation"""
    w = prompt.strip().lower().split()
    try:
        if len(w) == 3 and w[0] == "a" and w[1] in COLORS and w[2] in SHAPES:
            return Spec(((w[1], w[2]),), "single")
        if len(w) == 3 and w[0] == "two" and w[1] in COLORS and w[2].endswith("s") and w[2][:-1] in SHAPES:
            return Spec(((w[1], w[2][:-1]),) * 2, "count")
        if (len(w) == 8 and w[0] == w[5] == "a" and " ".join(w[3:5]) in RELATIONS and w[1] in COLORS and w[6] in COLORS
                and w[2] in SHAPES and w[7] in SHAPES and w[1] != w[6]):
            return Spec(((w[1], w[2]), (w[6], w[7])), " ".join(w[3:5]))
    except IndexError:
        pass
    raise ValueError(f"prompt {prompt!r} is not in the mini SD3 grammar: 'a red circle', 'two blue squares', "
                     f"'a red circle left of a green triangle' (colours {', '.join(COLORS)}; shapes {', '.join(SHAPES)})")


def all_prompts():
    """Every prompt of the grammar: 12 single, 12 count and 216 relation prompts."""
    pairs = [(c, s) for c in COLORS for s in SHAPES]
    single = [f"a {c} {s}" for c, s in pairs]
    count = [f"two {c} {s}s" for c, s in pairs]
    relation = [f"a {c1} {s1} {r} a {c2} {s2}" for c1, s1 in pairs for c2, s2 in pairs if c1 != c2 for r in RELATIONS]
    return single, count, relation


def training_prompts(seed=0):
    """The GRPO prompt list, balanced over the three kinds like GenEval's tasks: the 12 single and
    12 count prompts and 24 relation prompts drawn with a fixed seed (48 in all)."""
    single, count, relation = all_prompts()
    return single + count + random.Random(seed).sample(relation, 24)


def sample_prompt(rng):
    """A random prompt for pretraining: each kind a third of the time, then uniform within it."""
    return rng.choice(rng.choice(all_prompts()))


def _draw_shape(d, shape, cx, cy, size, color):
    r = size / 2
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=color)
    elif shape == "square":
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=color)
    else:  # an upright triangle
        d.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=color)


def render(prompt, rng, size=32):
    """Draw the prompt: objects of side 8-14 px (at 32 px) with jitter in position and size,
    drawn at 4x and downsampled so that edges are smooth. 'A left of B' puts A in the left
    half, 'two ...' puts one object in each half."""
    spec, s = parse(prompt), 4
    big = Image.new("RGB", (size * s, size * s), BACKGROUND)
    d = ImageDraw.Draw(big)
    u = size / 32  # unit: one pixel at 32 px
    if spec.kind == "single":
        side = rng.uniform(10, 14) * u
        placed = [(spec.objects[0], rng.uniform(side / 2 + u, size - side / 2 - u), rng.uniform(side / 2 + u, size - side / 2 - u), side)]
    else:
        left, right = spec.objects if spec.kind != "right of" else spec.objects[::-1]
        placed = []
        for obj, (lo, hi) in ((left, (0, size / 2)), (right, (size / 2, size))):
            side = rng.uniform(8, 11) * u
            placed.append((obj, rng.uniform(lo + side / 2 + u, hi - side / 2 - 0.5 * u), rng.uniform(side / 2 + u, size - side / 2 - u), side))
    for (color, shape), cx, cy, side in placed:
        _draw_shape(d, shape, cx * s, cy * s, side * s, COLORS[color])
    return big.resize((size, size), Image.BOX)


# =====================================================================================
# 2. The checker: a GenEval-like score from pixels alone (lab/sd_runner.py --reward shapes)
# =====================================================================================

# Fraction of its bounding box a shape fills: a disc pi/4, a square 1, a triangle 1/2 (measured
# on rendered ground truth at 32 px: 0.79 +- 0.035, 1.00 and 0.55 +- 0.025 after pixelisation).
FILL = {"circle": 0.79, "square": 0.99, "triangle": 0.55}
FILL_WIDTH = 0.06  # how sharply the shape check separates the three fills
MIN_AREA = 6  # pixels: smaller specks of a colour are noise
FULL_AREA = 30  # pixels: an object this large counts as fully present (ground truth has 40-200)


def colour_labels(image):
    """[H, W] labels: the index of the nearest colour in COLORS, or -1 for background (or a
    pixel that is near none of them)."""
    x = np.asarray(image.convert("RGB"), dtype=np.float32)  # [H, W, 3]
    palette = np.array([BACKGROUND, *COLORS.values()], dtype=np.float32)  # [1 + C, 3]
    dist = np.linalg.norm(x[:, :, None, :] - palette[None, None], axis=-1)  # [H, W, 1 + C]
    labels = dist.argmin(-1) - 1
    labels[dist.min(-1) > 100] = -1
    return labels


def components(mask):
    """Connected regions (4-neighbours) of a boolean [H, W] mask, largest first: dicts with
    area, centroid (cx, cy) and fill (area over bounding-box area)."""
    H, W = mask.shape
    seen = np.zeros_like(mask, dtype=bool)
    found = []
    for y0, x0 in zip(*np.nonzero(mask)):
        if seen[y0, x0]:
            continue
        stack, pixels = [(y0, x0)], []
        seen[y0, x0] = True
        while stack:
            y, x = stack.pop()
            pixels.append((y, x))
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < H and 0 <= nx < W and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
        ys, xs = np.array(pixels).T
        box = (ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1)
        found.append({"area": len(pixels), "cx": xs.mean(), "cy": ys.mean(), "fill": len(pixels) / box})
    return sorted(found, key=lambda c: -c["area"])


def object_score(comp, shape):
    """How well one region is the object: present (by area, 0 at MIN_AREA, 1 at FULL_AREA) times
    the probability that its fill says `shape` rather than another shape (a soft classifier)."""
    if comp is None:
        return 0.0
    present = min(1.0, max(0.0, (comp["area"] - MIN_AREA) / (FULL_AREA - MIN_AREA)))
    logits = {s: -((comp["fill"] - f) ** 2) / (2 * FILL_WIDTH**2) for s, f in FILL.items()}
    top = max(logits.values())
    prob = math.exp(logits[shape] - top) / sum(math.exp(v - top) for v in logits.values())
    return present * prob


def score(image, prompt):
    """GenEval in miniature, graded so that GRPO sees differences within a group:
        single:   object_score(largest region of the colour, shape)
        relation: mean of the two objects' scores x sigmoid(centroid gap in the asked direction)
        count:    mean of the colour's two largest regions' scores x (1 if it has exactly two regions, else 0.3)
    Ground truth scores about 1; a wrong colour, shape, order or count scores low."""
    spec = parse(prompt)
    labels = colour_labels(image)
    names = list(COLORS)

    def regions(color):
        return [c for c in components(labels == names.index(color)) if c["area"] >= MIN_AREA]

    if spec.kind == "single":
        (color, shape), = spec.objects
        found = regions(color)
        return object_score(found[0] if found else None, shape)
    if spec.kind == "count":
        (color, shape), _ = spec.objects
        found = regions(color)
        pair = (found + [None, None])[:2]
        return 0.5 * sum(object_score(c, shape) for c in pair) * (1.0 if len(found) == 2 else 0.3)
    (ca, sa), (cb, sb) = spec.objects
    a, b = regions(ca), regions(cb)
    a, b = (a[0] if a else None), (b[0] if b else None)
    objects = 0.5 * (object_score(a, sa) + object_score(b, sb))
    if a is None or b is None:
        return objects * 0.5  # the relation cannot be checked; half credit for it
    gap = (b["cx"] - a["cx"]) if spec.kind == "left of" else (a["cx"] - b["cx"])  # > 0 when right
    gap *= 32 / labels.shape[1]  # in pixels at 32 px
    return objects / (1 + math.exp(-(gap - 3) / 1.5))


COVER = 0.35  # the fraction of the image the prompt's colours should cover for full credit


def coverage(image, prompt):
    """How much of the image the prompt's colours cover, up to COVER: min(1, fraction / COVER).
    Layout and colour, which GRPO moves at the early, noisy steps of sampling."""
    labels = colour_labels(image)
    colors = {list(COLORS).index(c) for c, _ in parse(prompt).objects}
    return min(1.0, float(np.isin(labels, list(colors)).mean()) / COVER)


def score_cover(image, prompt):
    """lab/sd_runner.py --reward shapes_cover: the mean of score (GenEval-like: colours, shapes,
    counts, order) and coverage (the asked colours drawn boldly). Both in [0, 1].

    Why a mix: fine structure is the hard part at this size. GRPO moves what the first, noisy
    sampling steps decide (where and how large the colours are) much more than the last, nearly
    noiseless steps that sharpen a square's corners: score alone fell where coverage rose
    (lab/reports/mini_sd3.md)."""
    return 0.5 * score(image, prompt) + 0.5 * coverage(image, prompt)


# --- geneval: Flow-GRPO's GenEval reward in miniature, shapes scored by template overlap ------
#
# `score` decides a shape by a steep threshold on how much of its bounding box the colour fills:
# a square whose corners GRPO's noisy steps round off, or a lumpy triangle, falls between two
# fills and scores near 0 (0.00-0.09 on a run's samples, lab/reports/mini_sd3.md), and training fell
# under it. GenEval asks a detector, which is tolerant of soft edges; the stand-in here is
# overlap: each region of an asked colour is matched against the asked shape's template, fitted
# to the region's centroid and size, and credited by their IoU. A rounded or blurred square
# still overlaps a square at 0.92-0.97, while a disc overlaps its best square at 0.81-0.87 and
# a triangle its best disc or square at 0.70-0.78 (rendered ground truth at 32 px), so the
# shapes are still told apart. Objects are found before their colour is asked (object_regions),
# as GenEval's detector finds an object and then classifies its colour: a shaded object is one
# object. geneval scores as Flow-GRPO's GenEval reward: partial credit per
# object, 1 - |N - N_ref| / N_ref for counts; geneval_strict is GenEval's all-correct accuracy.

SHAPE_AREA = {"circle": math.pi / 4, "square": 1.0, "triangle": 0.5}  # a shape's area over its side squared
GENEVAL_SIDE = (5.0, 18.0)  # px at 32 px: the plausible sides a template is fitted at (the renderer draws 8-14)
FIT_SCALES = (0.86, 0.93, 1.0, 1.07, 1.14)  # sides tried, times the side the region's area implies
FIT_OFFSETS = (-0.5, 0.0, 0.5)  # px at 32 px, on each axis, around the region's centroid
# Shape credit, per asked shape: 0 at the first IoU, 1 from the second, linear between. The zero is
# about what the asked shape's template reaches on the nearest other shape (a square's best disc:
# 0.84-0.94, small squares being pixelated discs; a disc's best square: 0.81-0.87; a disc's or a
# square's best triangle: 0.68-0.78), full credit about ground truth's when blurred (10th percentile:
# disc 0.97, square 0.96, triangle 0.92; 0.98-1.0 sharp).
IOU_CREDIT = {"circle": (0.85, 0.97), "square": (0.82, 0.95), "triangle": (0.75, 0.93)}
STRICT_IOU, STRICT_MARGIN = 0.88, 0.02  # strict: IoU at least 0.88 and 0.02 above every other shape's
STRICT_AREA = 20  # pixels at 32 px: strict presence (an 8 px triangle, the smallest drawn, has 28-32)
RELATION_GAP, RELATION_WIDTH = 3.0, 1.5  # px at 32 px: score's sigmoid on the centroid gap
MAX_REGIONS = 6  # regions of one colour fitted, largest first (the rest only counted)


def mask_regions(mask):
    """Connected regions (4-neighbours) of a boolean [H, W] mask, largest first: dicts with area,
    centroid (cx, cy, in pixel indices), bounding box (x0, y0, x1, y1, inclusive) and the region's
    own boolean mask. The same regions as `components`, found without a Python loop over pixels
    (a flat fill of 1024 pixels takes `components` about 6 ms): every pixel takes the smallest
    pixel index among its neighbours' labels and then its label's label (pointer jumping), until
    nothing changes; each label is then the smallest index in its region."""
    H, W = mask.shape
    n = H * W
    p = np.full((H + 2, W + 2), n)  # labels with a border of background (n) around them
    lab = p[1:-1, 1:-1]
    lab[mask] = np.flatnonzero(mask)
    flat = np.full(n + 1, n)  # flat[i]: pixel i's label; flat[n] = n for the background
    while True:
        new = np.minimum(np.minimum(np.minimum(lab, p[:-2, 1:-1]), np.minimum(p[2:, 1:-1], p[1:-1, :-2])), p[1:-1, 2:])
        flat[:n] = np.where(mask, new, n).ravel()
        for _ in range(4):
            flat = flat[flat]
        new = flat[:n].reshape(H, W)
        if np.array_equal(new, lab):
            break
        lab[...] = new
    ys, xs = np.nonzero(mask)
    ids, inv, area = np.unique(lab[ys, xs], return_inverse=True, return_counts=True)
    cx, cy = np.bincount(inv, xs) / area, np.bincount(inv, ys) / area
    found = []
    for k in np.argsort(-area, kind="stable"):
        own = inv == k
        found.append({"area": int(area[k]), "cx": float(cx[k]), "cy": float(cy[k]), "mask": lab == ids[k],
                      "box": (int(xs[own].min()), int(ys[own].min()), int(xs[own].max()), int(ys[own].max()))})
    return found


def fit_shapes(region):
    """{shape: IoU} of the region's mask with each shape's template at its best fit: the template
    (a disc, an axis-aligned square, an upright triangle, as the renderer draws them) is centred
    on the region's centroid (a triangle's centroid is a third of its height above its base), its
    side taken from the region's area and tried at FIT_SCALES times that and FIT_OFFSETS around the
    centroid, the best IoU kept. A template pixel is one whose centre falls inside the shape.

    The side is capped to GENEVAL_SIDE: a flat fill or one big disc of an asked colour cannot be
    matched by a template of plausible object size, and scores low (a 28 px disc overlaps an 18 px
    disc at 0.41)."""
    mask = region["mask"]
    H, W = mask.shape
    u = W / 32
    gx, gy = region["cx"] + 0.5, region["cy"] + 0.5  # pixel (i, j) covers [j, j + 1] x [i, i + 1]
    sides = {shape: np.clip(math.sqrt(region["area"] / k) * np.array(FIT_SCALES), GENEVAL_SIDE[0] * u, GENEVAL_SIDE[1] * u)
             for shape, k in SHAPE_AREA.items()}
    reach = int(2 / 3 * max(s.max() for s in sides.values()) + max(FIT_OFFSETS) * u) + 2  # a triangle's apex is 2/3 of its side away
    y0, y1, x0, x1 = max(0, int(gy) - reach), min(H, int(gy) + reach + 1), max(0, int(gx) - reach), min(W, int(gx) + reach + 1)
    inside = mask[y0:y1, x0:x1].ravel().astype(np.float32)  # [P]: every pixel a fitted template can reach
    ys, xs = np.mgrid[y0:y1, x0:x1]
    off = np.array(FIT_OFFSETS) * u
    X = ((xs.ravel() + 0.5 - gx)[None, None, None, :] - off[None, :, None, None]).astype(np.float32)  # [1, Ox, 1, P]
    Y = ((ys.ravel() + 0.5 - gy)[None, None, None, :] - off[None, None, :, None]).astype(np.float32)  # [1, 1, Oy, P]
    ious = {}
    for shape, side in sides.items():
        s = side.astype(np.float32)[:, None, None, None]  # [S, 1, 1, 1]
        if shape == "circle":
            t = X**2 + Y**2 <= (s / 2) ** 2
        elif shape == "square":
            t = (np.abs(X) <= s / 2) & (np.abs(Y) <= s / 2)
        else:  # depth below the apex, which is 2/3 of the side above the centroid
            depth = Y + 2 * s / 3
            t = (depth >= 0) & (depth <= s) & (np.abs(X) <= depth / 2)
        t = t.reshape(-1, inside.size).astype(np.float32)  # [candidates, P]
        inter = t @ inside
        ious[shape] = float((inter / (t.sum(-1) + region["area"] - inter)).max())
    return ious


def object_regions(image):
    """The image's objects as a detector would find them, before asking what colour they are: the
    connected regions of foreground (pixels with a colour label, or far from the background), each
    with its colour, the plurality of its pixels' colour_labels (None if none is labelled). A shaded
    object (a yellow disc whose centre the VAE tints orange, labelled red pixel by pixel) stays one
    region of its main colour, as a detector's box stays one object whatever its shading; labelling
    pixels first and taking regions per colour cut such an object into a ring and a blob.
    Objects that touch merge into one region, as ground truth never draws them."""
    labels = colour_labels(image)
    x = np.asarray(image.convert("RGB"), dtype=np.float32)
    foreground = (labels >= 0) | (np.linalg.norm(x - np.array(BACKGROUND, np.float32), axis=-1) > 100)  # [H, W]
    names = list(COLORS)
    regions = mask_regions(foreground)
    for r in regions:
        votes = np.bincount(labels[r["mask"]] + 1, minlength=len(names) + 1)[1:]  # [C]: pixels of each colour
        r["color"] = names[int(votes.argmax())] if votes.any() else None
    return regions


def _geneval_objects(regions, color, shape, width):
    """The regions of one colour at least MIN_AREA large (scaled with the image width), each with its
    graded quality (present by area x shape credit by IoU) and whether it passes the strict check
    (at least STRICT_AREA large, IoU at least STRICT_IOU and STRICT_MARGIN above every other shape's), best
    quality first; and how many there are (the count)."""
    u2 = (width / 32) ** 2
    found = [r for r in regions if r["color"] == color and r["area"] >= MIN_AREA * u2]
    scored = []
    for r in found[:MAX_REGIONS]:
        ious = fit_shapes(r)
        present = min(1.0, max(0.0, (r["area"] - MIN_AREA * u2) / ((FULL_AREA - MIN_AREA) * u2)))
        zero, full = IOU_CREDIT[shape]
        credit = min(1.0, max(0.0, (ious[shape] - zero) / (full - zero)))
        other = max(v for s, v in ious.items() if s != shape)
        ok = r["area"] >= STRICT_AREA * u2 and ious[shape] >= STRICT_IOU and ious[shape] >= other + STRICT_MARGIN
        scored.append({"quality": present * credit, "strict": ok, "cx": r["cx"], "iou": ious, "area": r["area"]})
    return sorted(scored, key=lambda o: -o["quality"]), len(found)


def geneval_details(image, prompt):
    """GenEval's reward as Flow-GRPO trains on it, from pixels alone: {'score': graded in [0, 1],
    'strict': 0 or 1, 'kind': 'single' | 'count' | 'relation'}, so that a trainer can log the
    graded reward and GenEval's all-correct accuracy per task.

    Each asked object is the region of its colour that scores best: quality = present (by area,
    0 at MIN_AREA, 1 at FULL_AREA) x shape credit (the IoU of its best-fitting template of the
    asked shape, graded between the IOU_CREDIT of that shape; see fit_shapes). Then, per kind:
        single:   the object's quality
        count:    (1 - |N - 2| / 2, floored at 0) x the mean quality of the two best regions, with
                  N the number of regions of the colour at least MIN_AREA large: Flow-GRPO's
                  partial credit for counting, 1 - |N - N_ref| / N_ref
        relation: the two objects' mean quality x sigmoid((gap - 3 px) / 1.5 px), the gap between
                  their centroids in the asked direction (as `score`); half of the mean if one
                  object is missing, as the relation cannot be checked
    strict is GenEval's correct/incorrect: every object present (STRICT_AREA) with the asked shape by a
    clear margin (IoU at least STRICT_IOU, STRICT_MARGIN above every other shape's), exactly two
    regions for a count, and the gap beyond RELATION_GAP (where the sigmoid passes 1/2)."""
    spec = parse(prompt)
    regions, width = object_regions(image), image.size[0]
    if spec.kind == "single":
        (color, shape), = spec.objects
        found, _ = _geneval_objects(regions, color, shape, width)
        best = found[0] if found else None
        return {"score": best["quality"] if best else 0.0, "strict": int(bool(best and any(o["strict"] for o in found))),
                "kind": "single"}
    if spec.kind == "count":
        (color, shape), _ = spec.objects
        found, n = _geneval_objects(regions, color, shape, width)
        want = len(spec.objects)
        quality = sum(o["quality"] for o in found[:want]) / want
        strict = n == want and sum(o["strict"] for o in found) == want
        return {"score": max(0.0, 1 - abs(n - want) / want) * quality, "strict": int(strict), "kind": "count"}
    (ca, sa), (cb, sb) = spec.objects
    a, b = _geneval_objects(regions, ca, sa, width)[0], _geneval_objects(regions, cb, sb, width)[0]
    a, b = (a[0] if a else None), (b[0] if b else None)
    objects = 0.5 * ((a["quality"] if a else 0.0) + (b["quality"] if b else 0.0))
    if a is None or b is None:
        return {"score": 0.5 * objects, "strict": 0, "kind": "relation"}
    gap = (b["cx"] - a["cx"]) if spec.kind == "left of" else (a["cx"] - b["cx"])  # > 0 when right
    gap *= 32 / width  # in pixels at 32 px
    strict = a["strict"] and b["strict"] and gap > RELATION_GAP
    return {"score": objects / (1 + math.exp(-(gap - RELATION_GAP) / RELATION_WIDTH)), "strict": int(strict),
            "kind": "relation"}


def geneval(image, prompt):
    """The graded GenEval reward in [0, 1] (geneval_details' score): the reward to train on.
    Ground truth scores about 1, also blurred or with rounded corners (a small VAE decodes soft
    images); a wrong colour, order, count or shape, a flat fill or one big blob scores low."""
    return geneval_details(image, prompt)["score"]


def geneval_strict(image, prompt):
    """GenEval's strict accuracy, 0 or 1 (geneval_details' strict): every object present with the
    right shape by a clear margin, the exact count, the relation satisfied."""
    return geneval_details(image, prompt)["strict"]


# --- the checkers as lab/sd_runner.py rewards: reward_fn(images, prompts) -> B numbers (--reward lab.mini_sd3:NAME)


def geneval_reward(images, prompts):
    """GenEval's graded reward (geneval); evaluations also log its strict accuracy per kind."""
    return [geneval(im, p) for im, p in zip(images, prompts)]


def strict_accuracy(images, prompts):
    """{"strict": ..., "strict_<kind>": ...}: the share of images geneval_strict counts all correct,
    overall and per kind of prompt (single, count, relation); lab/sd_runner.py logs them as eval/<name>."""
    details = [geneval_details(im, p) for im, p in zip(images, prompts)]
    out = {"strict": sum(d["strict"] for d in details) / len(details)}
    for kind in ("single", "count", "relation"):
        of_kind = [d["strict"] for d in details if d["kind"] == kind]
        if of_kind:
            out[f"strict_{kind}"] = sum(of_kind) / len(of_kind)
    return out


geneval_reward.eval_metrics = strict_accuracy


def shapes_reward(images, prompts):
    """The GenEval-like checker by fill thresholds (score)."""
    return [score(im, p) for im, p in zip(images, prompts)]


def cover_reward(images, prompts):
    """How much of the image the asked colours cover (coverage): dense, layout and colour."""
    return [coverage(im, p) for im, p in zip(images, prompts)]


def shapes_cover_reward(images, prompts):
    """The mean of score and coverage (score_cover)."""
    return [score_cover(im, p) for im, p in zip(images, prompts)]
