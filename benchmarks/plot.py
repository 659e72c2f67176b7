#!/usr/bin/env python3
"""Bar chart of the time ratios in a bench_gpu.py results JSON.

    python3 benchmarks/plot.py benchmarks/results/h200_<date>.json [--out file.png]

One bar per row (forward, backward alone, training step, decode in four colours), height =
FlashQLA ms / flashqla ms (above 1.0: flashqla is faster; the dashed line at 1.15 is the floor of
issues 7 and 8); a black dot marks FLA ms / flashqla ms. Rows without a FlashQLA ratio show
"n/a" (decode: FlashQLA has none). Older results files (FLA only, key "ratio") plot their FLA
ratio as the dot. Saved next to the JSON by default.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

COLORS = {"fwd": "#1f77b4", "bwd": "#d62728", "train": "#9467bd", "decode": "#2ca02c",
          "verify": "#8c564b"}
NAMES = {"fwd": "forward", "bwd": "backward (alone)", "train": "training step", "decode": "decode step",
         "verify": "verify (intermediate states)"}
FLOOR = 1.15


def _label(r):
    if r.get("pass") == "decode":
        return "dec %s/%s N=%s T=%s" % (r.get("H"), r.get("HV"), r.get("N"), r.get("T"))
    s = r.get("seqlens") or []
    if r.get("layout") == "varlen":
        seq = "+".join(str(x) for x in s)
    elif s:
        seq = "%dx%d" % (len(s), s[0])
    else:
        seq = "?"
    return "%s %s/%s %s" % (r.get("pass"), r.get("H"), r.get("HV"), seq)


def _ratio(r, key):
    fq, other = r.get("flashqla_ms"), r.get(key)
    return other / fq if (fq and other) else None


def plot_results(json_path, png_path=None):
    """Draw the chart for json_path; returns the PNG path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    with open(json_path) as f:
        res = json.load(f)
    rows = res.get("rows") or []
    if png_path is None:
        png_path = os.path.splitext(json_path)[0] + ".png"
    labels = [_label(r) for r in rows]
    bars = [_ratio(r, "flash_qla_ms") for r in rows]
    dots = [_ratio(r, "fla_ms") for r in rows]
    n = max(len(rows), 1)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.45 * n + 2), 5.5))
    xs = list(range(len(rows)))
    top = max([x for x in bars + dots if x is not None] + [1.3])
    for x, r, v in zip(xs, rows, bars):
        if v is None:
            ax.text(x, 0.05 * top, "n/a", ha="center", va="bottom", rotation=90, fontsize=8, color="gray")
            continue
        ax.bar(x, v, color=COLORS.get(r.get("pass"), "gray"), width=0.7)
        ax.text(x, v, "%.2f" % v, ha="center", va="bottom", fontsize=7)
    px = [x for x, d in zip(xs, dots) if d is not None]
    if px:
        ax.scatter(px, [d for d in dots if d is not None], marker="o", color="black", s=14, zorder=3,
                   label="FLA / flashqla")
    ax.axhline(1.0, color="black", linewidth=1.0)
    ax.axhline(FLOOR, color="black", linewidth=0.8, linestyle="--", label="floor %.2f (issues 7, 8)" % FLOOR)
    handles = [Patch(color=c, label=NAMES[p] + ": FlashQLA / flashqla")
               for p, c in COLORS.items() if any(r.get("pass") == p for r in rows)]
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("time ratio (> 1: flashqla faster)")
    ax.set_ylim(0, top * 1.15)
    v = res.get("versions") or {}
    ax.set_title("%s, %s, commit %s: flashqla %s vs FlashQLA %s vs FLA %s (torch %s)" % (
        res.get("gpu"), res.get("date"), res.get("commit"), v.get("flashqla"), v.get("flash_qla"),
        v.get("fla"), v.get("torch")), fontsize=9)
    h, _ = ax.get_legend_handles_labels()
    ax.legend(handles=handles + h, fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return png_path


def main(argv=None):
    p = argparse.ArgumentParser(description="plot FlashQLA/flashqla and FLA/flashqla ratios from a results JSON")
    p.add_argument("json")
    p.add_argument("--out", default=None, help="PNG path (default: next to the JSON)")
    a = p.parse_args(argv)
    print(plot_results(a.json, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
