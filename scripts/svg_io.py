"""What the figure scripts share (run as `python3 scripts/NAME.py`, so this folder is on sys.path):
reading a metrics.jsonl file and writing an SVG."""
import json


def records(path):
    """The JSON objects of a JSON-lines file, in order; lines that are not JSON objects (a line cut
    short by an interrupted run) are skipped."""
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if isinstance(r, dict):
                yield r


def write_svg(parts, out):
    """Closes the <svg> element opened by parts[0] and writes the parts to `out`, one per line."""
    with open(out, "w") as f:
        f.write("\n".join(parts + ["</svg>"]) + "\n")


def plot_frame(W, H, L, R, T, B):
    """The opening of a W x H plot whose axes leave margins L, R, T, B: the <svg> element, a white
    background and the two axis lines."""
    return [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
            f'<rect x="0" y="0" width="{W}" height="{H}" fill="white"/>',
            f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="#333"/>',
            f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="#333"/>']
