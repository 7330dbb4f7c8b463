#!/usr/bin/env python3
"""e2e.serve_chromium: `capsnet serve` driven by headless Chromium.

Trains a checkpoint for 2 steps on generated IDX data, starts `capsnet serve` on a free port, loads
the page with ?selftest=1 (it draws a stroke, predicts, renders bars and the reconstruction, moves a
pose slider) and checks
  * the DOM marker "selftest: ok" and that its lengths equal the server's /api/predict answer for the
    same pixels, its slider reconstruction the server's /api/decode answer;
  * the screenshot (decoded here, stdlib zlib only): the bars have the widths the lengths say, and the
    28x28 input and reconstruction canvases show exactly the expected grey values.
Usage: serve_chromium.py PATH/TO/capsnet   (python3 stdlib only)
"""
import html
import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
import zlib

WINDOW = (1100, 1000)
BAR_BLUE, BAR_RED = (0x2F, 0x6F, 0xD0), (0xE0, 0x40, 0x2A)


def fail(msg):
    print("FAIL: " + msg, flush=True)
    sys.exit(1)


def find_chromium():
    for name in (os.environ.get("CHROMIUM", ""), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    fail("chromium not found: run scripts/setup.sh (it installs Debian's chromium), or set CHROMIUM=/path/to/it")


def write_idx(path, array_bytes, dims):
    code = 0x08  # uint8
    with open(path, "wb") as f:
        f.write(struct.pack(">BBBB", 0, 0, code, len(dims)))
        for d in dims:
            f.write(struct.pack(">I", d))
        f.write(array_bytes)


def fake_mnist(dirname, n):
    """Learnable-ish 28x28 digits: class k lights rows 2k+4..2k+6, plus noise."""
    os.makedirs(dirname, exist_ok=True)
    rng = random.Random(7)
    for prefix, count in (("train", n), ("t10k", n // 2)):
        images, labels = bytearray(), bytearray()
        for i in range(count):
            k = i % 10
            img = bytearray(rng.randrange(40) for _ in range(784))
            for y in range(2 * k + 4, 2 * k + 7):
                for x in range(6, 22):
                    img[y * 28 + x] = 255
            images += img
            labels.append(k)
        write_idx(os.path.join(dirname, prefix + "-images-idx3-ubyte"), bytes(images), (count, 28, 28))
        write_idx(os.path.join(dirname, prefix + "-labels-idx1-ubyte"), bytes(labels), (count,))


def read_png(path):
    """8-bit RGB/RGBA/grey, non-interlaced PNG -> (width, height, rows of (r, g, b) tuples)."""
    data = open(path, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        fail(path + " is not a PNG")
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            width, height, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", chunk)
            if depth != 8 or interlace or ctype not in (0, 2, 6):
                fail("unsupported PNG format depth=%d type=%d interlace=%d" % (depth, ctype, interlace))
            bpp = {0: 1, 2: 3, 6: 4}[ctype]
        elif kind == b"IDAT":
            idat += chunk
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        ftype = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if ftype == 1:
                line[i] = (line[i] + a) & 255
            elif ftype == 2:
                line[i] = (line[i] + b) & 255
            elif ftype == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append([tuple(line[x * bpp:x * bpp + 3]) if bpp >= 3 else (line[x],) * 3 for x in range(width)])
        prev = line
    return width, height, rows


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=20) as r:
        return json.load(r)


def chromium(browser, profile, url, *extra):
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
           "--user-data-dir=" + profile, "--force-device-scale-factor=1", "--hide-scrollbars",
           "--window-size=%d,%d" % WINDOW, "--virtual-time-budget=15000", *extra, url]
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=90, text=True)


def check_canvas(rows, rect, values, side, what):
    """The canvas at rect [x, y, w, h] shows `values` ([side*side] in [0,1]) as grey, pixelated."""
    x0, y0, w, h = rect
    cell = w / side
    bad = 0
    for j in range(side):
        for i in range(side):
            px = rows[int(y0 + (j + 0.5) * cell)][int(x0 + (i + 0.5) * cell)]
            want = round(255 * min(1.0, max(0.0, values[j * side + i])))
            if max(abs(c - want) for c in px) > 3:
                bad += 1
    print("%s canvas: %d of %d cells differ from the expected grey" % (what, bad, side * side))
    if bad > side * side // 50:
        fail("%s canvas in the screenshot does not show the expected image (%d cells off)" % (what, bad))


def main():
    if len(sys.argv) != 2:
        fail("usage: serve_chromium.py PATH/TO/capsnet")
    cli = sys.argv[1]
    browser = find_chromium()
    t_start = time.time()
    tmp = tempfile.mkdtemp(prefix="capsnet_e2e_serve_")
    server = None
    try:
        fake_mnist(os.path.join(tmp, "data"), 40)
        train = subprocess.run([cli, "train", "--data", os.path.join(tmp, "data"), "--out",
                                os.path.join(tmp, "runs", "tiny"), "--steps", "2", "--batch-size", "4",
                                "--log-every", "1", "--no-eval", "--no-progress", "--threads", "1"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
        if train.returncode != 0:
            fail("capsnet train failed:\n" + train.stdout)
        ckpt = os.path.join(tmp, "runs", "tiny", "checkpoint.pt")
        print("trained 2 steps (%.1f s)" % (time.time() - t_start), flush=True)

        server = subprocess.Popen([cli, "serve", "--checkpoint", ckpt, "--port", "0", "--runs",
                                   os.path.join(tmp, "runs"), "--threads", "1"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = server.stdout.readline()
        m = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
        if not m:
            fail("capsnet serve did not print its URL: " + line + server.stdout.read())
        base = m.group(1)
        print("server: " + line.strip(), flush=True)

        # One Chromium run for the DOM, one for the pixels (same window: same layout).
        profile = os.path.join(tmp, "profile")
        dom = chromium(browser, profile, base + "?selftest=1", "--dump-dom")
        found = re.search(r'<pre id="selftest"[^>]*>(.*?)</pre>', dom.stdout, re.S)
        if dom.returncode != 0 or not found or not found.group(1).strip():
            fail("no self-test marker in the DOM (chromium rc %d)\nstdout tail: %s\nstderr tail: %s" %
                 (dom.returncode, dom.stdout[-2000:], dom.stderr[-2000:]))
        result = json.loads(html.unescape(found.group(1)))
        print("selftest: status=%r class=%s lengths=%s" %
              (result["status"], result.get("class"), [round(x, 4) for x in result.get("lengths", [])]), flush=True)
        if result["status"] != "selftest: ok":
            fail("page self-test: " + result["status"])

        answer = post(base + "api/predict", {"pixels": result["pixels"]})
        if answer["class"] != result["class"]:
            fail("page shows class %s, /api/predict says %s" % (result["class"], answer["class"]))
        diff = max(abs(a - b) for a, b in zip(answer["lengths"], result["lengths"]))
        if len(answer["lengths"]) != len(result["lengths"]) or diff > 1e-6:
            fail("page lengths differ from /api/predict by %g" % diff)
        pose = [p + (0.25 if i == 0 else 0.0) for i, p in enumerate(answer["pose"])]
        moved = post(base + "api/decode", {"class": answer["class"], "pose": pose})["reconstruction"]
        if abs(sum(moved) - result["recon_after"]) > 1e-3:
            fail("page's slider reconstruction sum %g != /api/decode %g" % (result["recon_after"], sum(moved)))
        if result.get("runs") != ["tiny"] or not result.get("metrics_records"):
            fail("training panel did not list/load the run: %s" % result.get("runs"))
        print("DOM matches the API: max |length diff| %.2g, slider changed the reconstruction by up to %.4f" %
              (diff, result["recon_max_change"]), flush=True)

        shot = os.path.join(tmp, "serve.png")
        chromium(browser, profile, base + "?selftest=1", "--screenshot=" + shot)
        if not os.path.exists(shot):
            fail("chromium wrote no screenshot")
        width, height, rows = read_png(shot)
        if (width, height) != WINDOW:
            fail("screenshot is %dx%d, expected %dx%d" % (width, height, *WINDOW))
        x0, y0, w, h = result["rects"]["bars"]
        blue = red = 0
        for y in range(y0, y0 + h):
            for x in range(x0, x0 + w):
                px = rows[y][x]
                blue += max(abs(a - b) for a, b in zip(px, BAR_BLUE)) <= 2
                red += max(abs(a - b) for a, b in zip(px, BAR_RED)) <= 2
        lengths, k = answer["lengths"], answer["class"]
        want_red = round(200 * min(1, lengths[k])) * 16
        want_blue = sum(round(200 * min(1, v)) * 16 for i, v in enumerate(lengths) if i != k)
        print("bars: %d blue px (expected %d), %d red px (expected %d)" % (blue, want_blue, red, want_red))
        if abs(red - want_red) > 0.05 * want_red + 32 or abs(blue - want_blue) > 0.05 * want_blue + 160:
            fail("the bars in the screenshot do not have the widths of the capsule lengths")
        check_canvas(rows, result["rects"]["input"], result["pixels"], 28, "input")
        check_canvas(rows, result["rects"]["recon"], moved, 28, "reconstruction")
        keep = os.environ.get("CAPSNET_SERVE_SCREENSHOT")
        if keep:
            shutil.copy(shot, keep)
        print("PASS (%.1f s)" % (time.time() - t_start))
    finally:
        if server:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
