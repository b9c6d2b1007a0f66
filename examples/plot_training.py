"""Draw the runs of examples/train_real_text.py into one SVG (no plotting library needed).

``python examples/plot_training.py RUN_DIR [RUN_DIR ...] --out plot.svg`` reads each run's
``steps.jsonl`` and ``summary.json`` and draws three panels:

1. loss against tokens trained: the train loss (a moving mean over ``--smooth`` steps) and the
   held-out loss of the periodic evaluations, one colour per run; a dashed line where an MSA
   run turns sparse;
2. held-out loss by position bucket (0-1K, 1-4K, ...): one bar per model and bucket: dense,
   MSA with the exact (``bf16``) selection, and MSA with the ``fp8`` selection where the
   summary has it (every precision its ``heldout_by_precision`` holds); the bar's value is
   written above it;
3. per layer of each MSA run: the proxy's recall and covered attention mass against the oracle
   selection, and the fp8 selection's recall and covered-mass ratio against the exact one.

It also prints a Markdown table of the runs (held-out loss per bucket with the difference to the
dense run, median step time per phase, mean proxy recall).

The SVG is written by hand: a few primitives (lines, polylines, rectangles, text) in user units.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
from xml.sax.saxutils import escape

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf")
WIDTH, PANEL_H, MARGIN, LEGEND_W = 1100, 300, 60, 260
PLOT_W = WIDTH - 2 * MARGIN - LEGEND_W  # the plot area of a panel; its legend is to the right


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values covering ``[lo, hi]``."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=10 * mag)
    first = math.ceil(lo / step) * step
    ticks, t = [], first
    while t <= hi + 1e-9 * step:
        ticks.append(round(t, 12))
        t += step
    return ticks


def fmt(v: float, step: float) -> str:
    """A tick label with as many decimals as the tick spacing ``step`` needs."""
    for scale, suffix in ((1e6, "M"), (1e3, "K")):
        if abs(v) >= scale and step >= scale / 10:
            return f"{v / scale:g}{suffix}"
    decimals = max(0, math.ceil(-math.log10(step) - 1e-9)) if step > 0 else 3
    return f"{v:.{decimals}f}"


class Panel:
    """One plot area: data ranges mapped to a ``w x h`` box at ``(x0, y0)``."""

    def __init__(self, svg: list, x0, y0, w, h, xr, yr, title, xlabel="", ylabel=""):
        self.svg, self.x0, self.y0, self.w, self.h = svg, x0, y0, w, h
        pad = 0.05 * (yr[1] - yr[0] or 1.0)
        self.xr, self.yr = xr, (yr[0] - pad, yr[1] + pad)
        svg.append(f'<text x="{x0 + w / 2}" y="{y0 - 12}" text-anchor="middle" '
                   f'font-weight="bold">{escape(title)}</text>')
        svg.append(f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#888"/>')
        if xlabel:
            svg.append(f'<text x="{x0 + w / 2}" y="{y0 + h + 36}" text-anchor="middle">'
                       f"{escape(xlabel)}</text>")
        if ylabel:
            svg.append(f'<text x="{x0 - 46}" y="{y0 + h / 2}" text-anchor="middle" '
                       f'transform="rotate(-90 {x0 - 46} {y0 + h / 2})">{escape(ylabel)}</text>')

    def px(self, x):
        lo, hi = self.xr
        return self.x0 + (x - lo) / ((hi - lo) or 1.0) * self.w

    def py(self, y):
        lo, hi = self.yr
        return self.y0 + self.h - (y - lo) / ((hi - lo) or 1.0) * self.h

    def yticks(self):
        ticks = nice_ticks(*self.yr)
        step = ticks[1] - ticks[0] if len(ticks) > 1 else 1.0
        for t in ticks:
            if self.yr[0] <= t <= self.yr[1]:
                y = self.py(t)
                self.svg.append(f'<line x1="{self.x0}" y1="{y:.1f}" x2="{self.x0 + self.w}" '
                                f'y2="{y:.1f}" stroke="#eee"/>')
                self.svg.append(f'<text x="{self.x0 - 4}" y="{y + 4:.1f}" text-anchor="end">'
                                f"{fmt(t, step)}</text>")

    def xticks(self):
        ticks = nice_ticks(*self.xr)
        step = ticks[1] - ticks[0] if len(ticks) > 1 else 1.0
        for t in ticks:
            if self.xr[0] <= t <= self.xr[1]:
                x = self.px(t)
                self.svg.append(f'<text x="{x:.1f}" y="{self.y0 + self.h + 16}" '
                                f'text-anchor="middle">{fmt(t, step)}</text>')

    def line(self, xs, ys, color, dash=False, width=1.5):
        pts = " ".join(f"{self.px(x):.1f},{self.py(y):.1f}" for x, y in zip(xs, ys)
                       if y is not None and math.isfinite(y))
        if pts:
            extra = ' stroke-dasharray="5,3"' if dash else ""
            self.svg.append(f'<polyline points="{pts}" fill="none" stroke="{color}" '
                            f'stroke-width="{width}"{extra}/>')

    def vline(self, x, color):
        X = self.px(x)
        self.svg.append(f'<line x1="{X:.1f}" y1="{self.y0}" x2="{X:.1f}" '
                        f'y2="{self.y0 + self.h}" stroke="{color}" stroke-dasharray="3,3"/>')

    def legend(self, entries):
        for i, (label, color, dash) in enumerate(entries):
            y = self.y0 + 10 + 15 * i
            x = self.x0 + self.w + 12  # right of the plot area
            extra = ' stroke-dasharray="5,3"' if dash else ""
            self.svg.append(f'<line x1="{x}" y1="{y - 4}" x2="{x + 20}" y2="{y - 4}" '
                            f'stroke="{color}" stroke-width="2"{extra}/>')
            self.svg.append(f'<text x="{x + 26}" y="{y}">{escape(label)}</text>')


def load_run(path: pathlib.Path) -> dict:
    steps = [json.loads(line) for line in (path / "steps.jsonl").read_text().splitlines()
             if line.strip()] if (path / "steps.jsonl").exists() else []
    summary = json.loads((path / "summary.json").read_text())
    return dict(name=path.name, steps=steps, summary=summary)


def moving_mean(xs, n):
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= n:
            acc -= xs[i - n]
        out.append(acc / min(i + 1, n))
    return out


def _finite(values):
    return [v for v in values if v is not None and math.isfinite(v)]


def loss_panel(svg, runs, y0, smooth):
    series = []
    for i, run in enumerate(runs):
        steps = run["steps"]
        if not steps:
            continue
        xs = [r["tokens_total"] for r in steps]
        series.append((run, COLORS[i % len(COLORS)], xs, moving_mean([r["loss"] for r in steps],
                                                                      smooth)))
    ys = _finite([y for *_, s in series for y in s])
    held = [(r.get("tokens_total"), r.get("heldout_loss")) for run, *_ in series
            for r in run["steps"]]
    ys += _finite([h for _, h in held])
    xmax = max((max(xs) for _, _, xs, _ in series), default=1)
    p = Panel(svg, MARGIN, y0, PLOT_W, PANEL_H - 70, (0, xmax),
              (min(ys, default=0), max(ys, default=1)), "Loss (nats per byte)",
              "tokens trained", "loss")
    p.yticks()
    p.xticks()
    entries = []
    for run, color, xs, ys_ in series:
        label = f"{run['summary'].get('attn', run['name'])} ({run['name']})"
        p.line(xs, ys_, color, width=1.0)
        hx = [r["tokens_total"] for r in run["steps"] if r.get("heldout_loss") is not None]
        hy = [r["heldout_loss"] for r in run["steps"] if r.get("heldout_loss") is not None]
        p.line(hx, hy, color, dash=True, width=2.0)
        sparse = [r["tokens_total"] for r in run["steps"] if r["phase"] == "sparse"]
        if sparse:
            p.vline(sparse[0], color)
        entries += [(f"{label} train", color, False), (f"{label} held-out", color, True)]
    p.legend(entries)


def bucket_series(runs):
    """``[(label, {bucket: loss}, overall loss)]``: each run's held-out loss, an MSA run's once
    per selection precision."""
    out = []
    for run in runs:
        s = run["summary"]
        if s.get("attn") == "msa" and "heldout_by_precision" in s:
            for prec, res in s["heldout_by_precision"].items():
                if "buckets" in res:
                    out.append((f"msa {prec} ({run['name']})", res["buckets"], res["loss"]))
        elif "heldout" in s:
            h = s["heldout"]
            out.append((f"{s.get('attn', 'run')} ({run['name']})", h["buckets"], h["loss"]))
    return out


def bucket_panel(svg, runs, y0):
    series = bucket_series(runs)
    buckets = list(dict.fromkeys(b for _, d, _ in series for b in d))
    values = _finite([v for _, d, _ in series for v in d.values()])
    lo, hi = min(values, default=0), max(values, default=1)
    span = hi - lo or abs(hi) or 1.0
    p = Panel(svg, MARGIN, y0, PLOT_W, PANEL_H - 70, (0, max(1, len(buckets))),
              (lo - 0.5 * span, hi + 0.3 * span), "Held-out loss by token position",
              "position bucket", "loss")
    p.yticks()
    group_w = p.w / max(1, len(buckets))
    bar_w = 0.8 * group_w / max(1, len(series))
    base = p.py(p.yr[0])
    for j, b in enumerate(buckets):
        svg.append(f'<text x="{p.px(j + 0.5):.1f}" y="{p.y0 + p.h + 16}" '
                   f'text-anchor="middle">{escape(b)}</text>')
        for i, (_, d, _) in enumerate(series):
            v = d.get(b)
            if v is None or not math.isfinite(v):
                continue
            x = p.px(j) + 0.1 * group_w + i * bar_w
            y = p.py(v)
            svg.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar_w * 0.9:.1f}" '
                       f'height="{max(0.0, base - y):.1f}" fill="{COLORS[i % len(COLORS)]}"/>')
            svg.append(f'<text x="{x + bar_w * 0.45:.1f}" y="{y - 3:.1f}" font-size="9" '
                       f'text-anchor="middle">{v:.4f}</text>')
    p.legend([(label, COLORS[i % len(COLORS)], False) for i, (label, *_) in enumerate(series)])


def recall_series(runs):
    """``[(label, [value per layer], dashed)]`` from the MSA runs' selection metrics."""
    out = []
    for run in runs:
        sel = run["summary"].get("selection")
        if not sel:
            continue
        proxy = sel["proxy_vs_oracle"]
        name = run["name"]
        out.append((f"proxy recall vs oracle ({name})", [m["recall"] for m in proxy], False))
        out.append((f"proxy covered mass ({name})", [m["covered_mass"] for m in proxy], True))
        for key, res in sel.items():  # "fp8_vs_exact": each approximate selection's
            prec = key.removesuffix("_vs_exact")
            if key != prec and isinstance(res, list):
                out.append((f"{prec} recall vs exact ({name})", [m["recall"] for m in res],
                            False))
                out.append((f"{prec} mass ratio ({name})", [m["mass_ratio"] for m in res],
                            True))
    return out


def recall_panel(svg, runs, y0):
    series = recall_series(runs)
    layers = max((len(v) for _, v, _ in series), default=1)
    values = _finite([x for _, v, _ in series for x in v])
    p = Panel(svg, MARGIN, y0, PLOT_W, PANEL_H - 70, (0, max(1, layers - 1)),
              (min(values + [1.0]), 1.0), "Selection per layer (held-out)", "layer",
              "fraction")
    p.yticks()
    for layer in range(layers):
        svg.append(f'<text x="{p.px(layer):.1f}" y="{p.y0 + p.h + 16}" '
                   f'text-anchor="middle">{layer}</text>')
    entries = []
    for i, (label, vals, dash) in enumerate(series):
        color = COLORS[(i // 2) % len(COLORS)]
        p.line(list(range(len(vals))), vals, color, dash=dash, width=2.0)
        entries.append((label, color, dash))
    if not series:
        svg.append(f'<text x="{p.x0 + p.w / 2}" y="{p.y0 + p.h / 2}" text-anchor="middle">'
                   "no MSA run with selection metrics</text>")
    p.legend(entries)


def plot(run_dirs, out: pathlib.Path, smooth: int = 20) -> None:
    runs = [load_run(pathlib.Path(d)) for d in run_dirs]
    svg = []
    loss_panel(svg, runs, 40, smooth)
    bucket_panel(svg, runs, 40 + PANEL_H)
    recall_panel(svg, runs, 40 + 2 * PANEL_H)
    height = 40 + 3 * PANEL_H
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="11">')
    body = "\n".join([head, f'<rect width="{WIDTH}" height="{height}" fill="white"/>', *svg,
                      "</svg>"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(body + "\n")


def table(run_dirs) -> str:
    """A Markdown table of the runs: held-out loss overall and per bucket (with the relative
    difference to the first dense run), median step seconds per phase, mean proxy recall."""
    runs = [load_run(pathlib.Path(d)) for d in run_dirs]
    series = bucket_series(runs)
    buckets = list(dict.fromkeys(b for _, d, _ in series for b in d))
    base_i = next((i for i, (label, *_) in enumerate(series) if label.startswith("dense")), None)
    head = ["model", "held-out", *buckets]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, (label, d, loss) in enumerate(series):
        cells = [label, f"{loss:.4f}"]
        for b in buckets:
            v = d.get(b)
            cell = "" if v is None else f"{v:.4f}"
            if v is not None and base_i is not None and i != base_i:
                ref = series[base_i][1].get(b)
                cell += "" if not ref else f" ({100 * (v / ref - 1):+.2f}%)"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("| run | attention | steps | tokens | step s (median per phase) | proxy recall |")
    lines.append("|---|---|---|---|---|---|")
    for run in runs:
        s = run["summary"]
        phases = ", ".join(f"{k} {v:.3f}" for k, v in s.get("step_seconds_median", {}).items())
        sel = (s.get("selection") or {}).get("proxy_vs_oracle")
        rec = f"{sum(m['recall'] for m in sel) / len(sel):.3f}" if sel else ""
        lines.append(f"| {run['name']} | {s.get('attn')} | {s.get('steps_done')} | "
                     f"{s.get('tokens_trained')} | {phases} | {rec} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="run folders (--out of train_real_text.py)")
    p.add_argument("--out", required=True, help="the SVG file to write")
    p.add_argument("--smooth", type=int, default=20, help="train-loss moving mean, in steps")
    args = p.parse_args(argv)
    if args.smooth < 1:
        p.error("--smooth must be >= 1")
    plot(args.runs, pathlib.Path(args.out), args.smooth)
    print(table(args.runs), end="")


if __name__ == "__main__":
    main()
