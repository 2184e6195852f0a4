#!/usr/bin/env python3
"""The scale bench's chart, from a run's directory (e2e/scale.sh OUTDIR):

  e2e/scale_chart.py OUTDIR > OUTDIR/scale.svg

Three panels: total Pss and threads per contender and N, each relative to
Ceph's rbd-nbd (one process per device) at the same N; and, for the
contenders that are one daemon, Pss 60 s after the last unmap relative
to the daemon's start-up, in KiB from the run's diag files (the table
rounds to MiB), against issue 14's 10 % bound.
"""
import os
import re
import sys

out = sys.argv[1]
rows = [[c.strip() for c in l.strip().strip("|").split("|")]
        for l in open(os.path.join(out, "scale.md")) if l.startswith("| ") and l[2].isdigit()]
data = {(int(r[0]), r[1]): {"Pss": float(r[2]), "threads": float(r[4])} for r in rows}
ns = sorted({n for n, _ in data})
cs = list(dict.fromkeys(c for _, c in data))


def pss_kib(path):
    try:
        m = re.search(r"^Pss:\s+(\d+) kB", open(path).read(), re.M)
    except OSError:
        return None
    return int(m.group(1)) if m else None


# After unmap against start-up, where the run measured both.
after = {}
for (n, c) in data:
    a = pss_kib(os.path.join(out, f"diag-after-{n}-{c}.txt"))
    b = pss_kib(os.path.join(out, f"diag-start-{n}-{c}.txt"))
    if a and b:
        after[(n, c)] = (a / b, a / 1024)

colors = {c: ["#2b6cb0", "#dd6b20", "#38a169", "#718096", "#805ad5", "#d53f8c"][i % 6] for i, c in enumerate(cs)}
W, PH, top, left = 760, 220, 40, 60
gw = (W - left - 20) / len(ns)
bw = (gw - 30) / max(1, len(cs))
panels = [("Total Pss relative to rbd-nbd (one process per device); lower is better", "Pss", 1.0),
          ("Threads relative to rbd-nbd (one process per device); lower is better", "threads", 1.0)]
if after:
    panels.append(("Pss 60 s after the last unmap relative to the daemon's start-up; dashed: +10 %", "after", 1.1))
H = len(panels) * (PH + top + 30) + 40
svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
       '<rect width="100%" height="100%" fill="white"/>']
for pi, (title, m, line) in enumerate(panels):
    y0 = pi * (PH + top + 30) + top
    if m == "after":
        ratio = {k: v[0] for k, v in after.items()}
        label = {k: f"{(v[0] - 1) * 100:+.1f} %" for k, v in after.items()}
    else:
        ceph = {n: data[(n, "ceph")][m] for n in ns if (n, "ceph") in data}
        ratio = {(n, c): data[(n, c)][m] / ceph[n] for (n, c) in data if ceph.get(n)}
        label = {k: f"{v:.2f} ({data[k][m]:.0f})" for k, v in ratio.items()}
    if not ratio:
        continue
    top_v = max(max(ratio.values()), line) * 1.15
    svg.append(f'<text x="{left}" y="{y0 - 14}" font-weight="bold" font-size="13">{title}</text>')
    base = y0 + PH
    svg.append(f'<line x1="{left}" y1="{base}" x2="{W - 20}" y2="{base}" stroke="black"/>')
    for v in sorted({1.0, line}):
        y1 = base - PH * v / top_v
        svg.append(f'<line x1="{left}" y1="{y1:.1f}" x2="{W - 20}" y2="{y1:.1f}" stroke="#999" stroke-dasharray="4 3"/>'
                   f'<text x="{left - 6}" y="{y1 + 4:.1f}" text-anchor="end">{v:.1f}x</text>')
    for ni, n in enumerate(ns):
        gx = left + ni * gw + 15
        svg.append(f'<text x="{gx + len(cs) * bw / 2:.1f}" y="{base + 16}" text-anchor="middle">N = {n} images</text>')
        for ci, c in enumerate(cs):
            if (n, c) not in ratio:
                continue
            v = ratio[(n, c)]
            h = PH * v / top_v
            x = gx + ci * bw
            svg.append(f'<rect x="{x:.1f}" y="{base - h:.1f}" width="{bw - 4:.1f}" height="{h:.1f}" fill="{colors[c]}"/>')
            svg.append(f'<text x="{x + (bw - 4) / 2:.1f}" y="{base - h - 4:.1f}" text-anchor="middle" font-size="10">{label[(n, c)]}</text>')
ly = len(panels) * (PH + top + 30) + 20
for ci, c in enumerate(cs):
    svg.append(f'<rect x="{left + ci * 130}" y="{ly - 10}" width="12" height="12" fill="{colors[c]}"/>'
               f'<text x="{left + ci * 130 + 18}" y="{ly}">{c}</text>')
svg.append("</svg>")
print("\n".join(svg))
