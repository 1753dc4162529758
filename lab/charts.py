"""Pictures for the lab's reports, drawn with pillow (no plotting library): line and scatter charts
with round ticks and the legend beside the data, and stacked bars of where a training step's time goes."""

import math
import os
import sys

from PIL import Image, ImageDraw, ImageFont

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import run_folder  # noqa: E402

COLORS = {"exact": (40, 90, 200), "jagg": (230, 120, 20), "base": (150, 150, 150)}
PALETTE = [(40, 90, 200), (230, 120, 20), (40, 160, 80), (200, 50, 50), (140, 80, 180), (120, 120, 120),
           (0, 170, 190), (190, 160, 0), (120, 70, 30), (230, 100, 180)]


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


def interval_scatter(points, title, x_label, y_label, size=(900, 520), reference=None, frontier=None, colours=None):
    """Points with 95 % intervals: points {name: (x, y, y_low, y_high, group)}, a dot each with its
    vertical interval, coloured by group (the legend beside the plot names the groups) and labelled
    with its name; reference: a y drawn as a dashed line (100 %, say); frontier: names of points to
    join, in order, by a grey line beneath them (the Pareto frontier); colours: every group a picture
    of the kind could hold, in order, so that a group keeps its colour across pictures."""
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    small, large = font(12), font(15)
    groups = list(dict.fromkeys(p[4] for p in points.values()))
    colours = list(colours or [])  # a group's colour: its place in colours, else after them
    colour = {g: PALETTE[(colours.index(g) if g in colours else len(colours) + i) % len(PALETTE)]
              for i, g in enumerate(groups)}
    left, right, top, bottom = 70, size[0] - 270, 54, size[1] - 52
    xs = [p[0] for p in points.values()]
    xs.append(max(xs) + 0.12 * (max(xs) - min(xs) + 1e-9))  # room for the rightmost label
    ys = [v for p in points.values() for v in p[1:4]] + ([reference] if reference is not None else [])
    x_ticks, x0, x1 = nice_ticks(min(xs), max(xs))
    y_ticks, y0, y1 = nice_ticks(min(ys), max(ys))

    def px(x, y):
        return (left + (x - x0) / (x1 - x0) * (right - left), bottom - (y - y0) / (y1 - y0) * (bottom - top))

    d.rectangle([left, top, right, bottom], outline="black")
    for yv in y_ticks:
        _, yp = px(x0, yv)
        d.line([left + 1, yp, right - 1, yp], fill=(232, 232, 232))
        d.text((left - 8, yp), tick_label(yv, y_ticks), fill="black", font=small, anchor="rm")
    for xv in x_ticks:
        xp, _ = px(xv, y0)
        d.line([xp, bottom, xp, bottom + 4], fill="black")
        d.text((xp, bottom + 8), tick_label(xv, x_ticks), fill="black", font=small, anchor="mt")
    if reference is not None:
        _, yp = px(x0, reference)
        for xp in range(left, right, 12):
            d.line([xp, yp, min(xp + 6, right), yp], fill=(120, 120, 120))
    d.text(((left + right) / 2, 8), title, fill="black", font=large, anchor="mt")
    d.text(((left + right) / 2, size[1] - 8), x_label, fill="black", font=small, anchor="md")
    d.text((8, top - 22), y_label, fill="black", font=small)
    if frontier:
        d.line([px(points[m][0], points[m][1]) for m in frontier], fill=(160, 160, 160), width=3)
        d.text((right - 6, bottom - 6), "grey line: the Pareto frontier", fill=(110, 110, 110), font=small,
               anchor="rd")
    taken = []  # the boxes of the labels and dots drawn so far: a label goes where none is
    for name, (x, y, low, high, group) in points.items():
        color = colour[group]
        (cx, cy), (_, ly), (_, hy) = px(x, y), px(x, low), px(x, high)
        d.line([cx, ly, cx, hy], fill=color, width=2)
        d.line([cx - 4, ly, cx + 4, ly], fill=color, width=2)
        d.line([cx - 4, hy, cx + 4, hy], fill=color, width=2)
        d.ellipse([cx - 4, cy - 4, cx + 4, cy + 4], fill=color)
        taken.append((cx - 5, cy - 5, cx + 5, cy + 5))
    for name, (x, y, low, high, group) in points.items():
        (cx, cy) = px(x, y)
        width = d.textlength(name, font=small)
        shifts = (0, -13, 13, -26, 26, -39, 39, -52, 52)
        spots = [(cx + 7, cy + dy) for dy in shifts[:5]] + [(cx - 7 - width, cy + dy) for dy in shifts[:5]]
        spots += [(cx + 7, cy + dy) for dy in shifts[5:]]  # then on the left, then further off
        for sx, sy in spots + [spots[0]]:  # where every spot is taken, the first anyway
            box = (sx, sy - 7, sx + width, sy + 7)
            free = all(box[2] < b[0] or box[0] > b[2] or box[3] < b[1] or box[1] > b[3] for b in taken)
            if free and box[0] > left and box[2] < right:
                break
        taken.append(box)
        if abs(sy - cy) > 8:  # a label moved off its dot: a thin line back to it
            d.line([cx, cy, sx if sx > cx else sx + width, sy], fill=(170, 170, 170))
        d.text((sx, sy), name, fill="black", font=small, anchor="lm")
    for i, group in enumerate(groups):
        ly = top + 6 + 22 * i
        d.rectangle([right + 16, ly + 2, right + 30, ly + 14], fill=colour[group])
        d.text((right + 36, ly), group, fill="black", font=small)
    return img


def training_step_bars(results, scale, unit, title):
    """Stacked bars of where one training step's time goes, per W and mode: results {W: a
    bench.report_trajectory dict}, times times scale, in unit."""
    import bench

    bars = {f"W={W}  {m}": {k: scale * v for k, v in r["train_parts_s"][m].items()}
            for W, r in results.items() for m in r["train_parts_s"]}
    return stacked_bars(bars, bench.TRAIN_PARTS, title, unit)


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


def compare_grid(prompts, columns, cell=96, gap=12):
    """Rows of prompts, one column per model: {name: (images, rewards)}; each image with its score."""
    label_w, head = 300, 44
    img = Image.new("RGB", (label_w + (cell + gap) * len(columns), head + len(prompts) * (cell + 22)), "white")
    d = ImageDraw.Draw(img)
    small = font(13)
    for j, name in enumerate(columns):
        d.multiline_text((label_w + j * (cell + gap) + cell / 2, 6), name.replace(" (", "\n("), fill="black", font=small,
                         anchor="ma", align="center")
    for i, p in enumerate(prompts):
        y = head + i * (cell + 22)
        d.text((8, y + cell / 2), p, fill="black", font=small, anchor="lm")
        for j, (images, rewards) in enumerate(columns.values()):
            x = label_w + j * (cell + gap)
            img.paste(images[i].resize((cell, cell), Image.NEAREST), (x, y))
            d.text((x + cell / 2, y + cell + 3), f"{rewards[i]:.2f}", fill="black", font=small, anchor="mt")
    return img


def save_png(path, image):
    run_folder.atomic_write(path, lambda f: image.save(f, format="PNG"), mode="wb")
