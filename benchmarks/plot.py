#!/usr/bin/env python3
"""Bar chart of FLA / flashqla time ratios from a bench_gpu.py results JSON.

    python3 benchmarks/plot.py benchmarks/results/h200_<date>.json [--out file.png]

One bar per row (forward, backward, decode in three colours), height = FLA ms / flashqla ms
(above 1.0: flashqla is faster), a line at 1.0; where ANCHORS.md has a published FlashQLA
time, a black diamond marks FlashQLA-published / flashqla (above 1.0: faster than FlashQLA's
own published figure). Rows without a ratio show "n/a". Saved next to the JSON by default.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

COLORS = {"fwd": "#1f77b4", "bwd": "#d62728", "decode": "#2ca02c"}


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


def _ratio(r):
    x = r.get("ratio")
    if x is None and r.get("flashqla_ms") and r.get("fla_ms"):
        x = r["fla_ms"] / r["flashqla_ms"]
    return x


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
    ratios = [_ratio(r) for r in rows]
    pub = []
    for r in rows:
        a = (r.get("anchor_ms") or {}).get("flashqla_pub")
        pub.append(a / r["flashqla_ms"] if (a and r.get("flashqla_ms")) else None)

    n = max(len(rows), 1)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.55 * n + 2), 5.5))
    xs = list(range(len(rows)))
    top = max([x for x in ratios + pub if x is not None] + [1.2])
    for x, r, v in zip(xs, rows, ratios):
        color = COLORS.get(r.get("pass"), "gray")
        if v is None:
            ax.text(x, 0.05 * top, "n/a", ha="center", va="bottom", rotation=90, fontsize=8, color="gray")
            continue
        ax.bar(x, v, color=color, width=0.7)
        ax.text(x, v, "%.2f" % v, ha="center", va="bottom", fontsize=7)
    px = [x for x, p in zip(xs, pub) if p is not None]
    py = [p for p in pub if p is not None]
    if px:
        ax.scatter(px, py, marker="D", color="black", s=18, zorder=3,
                   label="FlashQLA published / flashqla")
    ax.axhline(1.0, color="black", linewidth=1.0, linestyle="--")
    handles = [Patch(color=c, label={"fwd": "forward", "bwd": "backward (alone)",
                                     "decode": "decode step"}[p] + ": FLA / flashqla")
               for p, c in COLORS.items() if any(r.get("pass") == p for r in rows)]
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("time ratio (> 1: flashqla faster)")
    ax.set_ylim(0, top * 1.15)
    v = res.get("versions") or {}
    ax.set_title("%s, %s: flashqla %s vs FLA %s (torch %s, triton %s)" % (
        res.get("gpu"), res.get("date"), v.get("flashqla"), v.get("fla"), v.get("torch"), v.get("triton")),
        fontsize=9)
    h, _ = ax.get_legend_handles_labels()
    ax.legend(handles=handles + h, fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return png_path


def main(argv=None):
    p = argparse.ArgumentParser(description="plot FLA/flashqla ratios from a results JSON")
    p.add_argument("json")
    p.add_argument("--out", default=None, help="PNG path (default: next to the JSON)")
    a = p.parse_args(argv)
    print(plot_results(a.json, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
