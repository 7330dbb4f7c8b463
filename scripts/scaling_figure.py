#!/usr/bin/env python3
"""Draws docs/figures/scaling.svg (training img/s vs processes) from the summary lines of
`capsnet train` logs. Usage: scaling_figure.py OUT.svg LABEL=LOG [LABEL=LOG ...]
where each LOG holds one run's output and LABEL is the number of processes."""
import re
import sys


def throughput(path):
    with open(path) as f:
        m = re.findall(r"trained steps \d+\.\.\d+ in [\d.]+ s \(([\d.]+) img/s\)", f.read())
    if not m:
        sys.exit(f"{path}: no 'trained steps ... img/s' line")
    return float(m[-1])


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    points = sorted((int(k), throughput(v)) for k, v in (a.split("=", 1) for a in sys.argv[2:]))
    w, h, left, bottom, top, right = 420, 260, 60, 40, 20, 20
    xmax = max(p for p, _ in points)
    ideal = [(p, points[0][1] * p) for p, _ in points]
    ymax = max(t for _, t in points + ideal) * 1.15
    sx = lambda x: left + (x - 1) / max(1, xmax - 1) * (w - left - right) if xmax > 1 else left
    sy = lambda y: h - bottom - y / ymax * (h - top - bottom)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<line x1="{left}" y1="{h-bottom}" x2="{w-right}" y2="{h-bottom}" stroke="black"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h-bottom}" stroke="black"/>']
    for p, _ in points:
        out.append(f'<text x="{sx(p):.1f}" y="{h-bottom+14}" text-anchor="middle">{p}</text>')
    for frac in (0, 0.5, 1):
        y = ymax * frac
        out.append(f'<text x="{left-6}" y="{sy(y)+4:.1f}" text-anchor="end">{y:.1f}</text>')
    out.append(f'<text x="{(left+w-right)/2}" y="{h-6}" text-anchor="middle">processes (1 intra-op thread each)</text>')
    out.append(f'<text x="14" y="{(top+h-bottom)/2}" text-anchor="middle" '
               f'transform="rotate(-90 14 {(top+h-bottom)/2})">training img/s</text>')
    out.append('<polyline fill="none" stroke="#999" stroke-dasharray="4 3" points="' +
               " ".join(f"{sx(p):.1f},{sy(t):.1f}" for p, t in ideal) + '"/>')
    out.append('<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="' +
               " ".join(f"{sx(p):.1f},{sy(t):.1f}" for p, t in points) + '"/>')
    for p, t in points:
        out.append(f'<circle cx="{sx(p):.1f}" cy="{sy(t):.1f}" r="3" fill="#1f77b4"/>')
        anchor = "end" if p == xmax and xmax > 1 else "start"
        dx = -6 if anchor == "end" else 6
        out.append(f'<text x="{sx(p)+dx:.1f}" y="{sy(t)-8:.1f}" text-anchor="{anchor}">{t:.1f} img/s</text>')
    out.append(f'<text x="{w-right}" y="{top+4}" text-anchor="end" fill="#999">dashed: linear scaling</text>')
    out.append("</svg>")
    with open(sys.argv[1], "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
