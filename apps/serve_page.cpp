// The page of `capsnet serve`: HTML, CSS and JS in one string so the binary needs no files and the
// browser no network beyond this server. It is written in parts, one per concern, joined in order.
#include "apps/serve.h"

namespace capsnet::apps {
namespace {

// The document head: title and the stylesheet.
constexpr const char* kHead = R"PAGE(<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>capsnet serve</title>
<style>
  body { font: 14px/1.35 system-ui, sans-serif; margin: 0; background: #eef0f3; color: #1d2330; }
  header { padding: 8px 16px; background: #1d2330; color: #fff; }
  header b { font-size: 16px; } header span { opacity: .75; margin-left: 12px; }
  main { display: grid; grid-template-columns: 312px 330px 360px; gap: 12px; padding: 12px; align-items: start; }
  section { background: #fff; border-radius: 6px; padding: 10px 12px; box-shadow: 0 1px 2px rgba(0,0,0,.12); }
  section.wide { grid-column: 1 / span 3; }
  h2 { font-size: 15px; margin: 0 0 8px; }
  #draw { background: #000; cursor: crosshair; touch-action: none; display: block; }
  canvas.px { image-rendering: pixelated; background: #000; display: block; }
  .row { display: flex; gap: 8px; align-items: center; margin-top: 8px; flex-wrap: wrap; }
  .bar { display: flex; align-items: center; height: 22px; margin: 3px 0; }
  .bar .k { width: 22px; font-weight: bold; }
  .bar .track { width: 200px; height: 16px; background: #eef0f3; position: relative; }
  .bar .fill { position: absolute; left: 0; top: 0; height: 16px; background: #2f6fd0; }
  .bar.win .fill { background: #e0402a; }
  .bar .v { width: 70px; text-align: right; font-variant-numeric: tabular-nums; }
  .slider { display: flex; align-items: center; gap: 6px; height: 19px; }
  .slider label { width: 52px; white-space: nowrap; } .slider input { width: 170px; margin: 0; }
  .slider output { width: 92px; font-variant-numeric: tabular-nums; font-size: 12px; }
  .note { color: #5b6475; font-size: 12px; }
  .charts { display: flex; gap: 16px; flex-wrap: wrap; }
  #selftest { font-size: 11px; white-space: pre-wrap; word-break: break-all; max-height: 60px; overflow: hidden; }
  .err { color: #b00020; }
</style></head>
)PAGE";

// The four panels: input, capsule lengths, pose, training run (and the self-test's output).
constexpr const char* kPanels = R"PAGE(<body>
<header><b>capsnet serve</b><span id="model"></span></header>
<main>
  <section id="input-panel">
    <h2>Input</h2>
    <canvas id="draw" width="280" height="280" title="draw a digit with the mouse"></canvas>
    <div class="row">
      <button id="clear">Clear</button>
      <label>Upload <input type="file" id="file" accept="image/*"></label>
    </div>
    <div class="row"><canvas id="input" class="px" width="28" height="28" style="width:84px;height:84px"></canvas>
      <span class="note">what the model sees: the stroke's box scaled to 20 px, centred by mass in 28&times;28 (the MNIST way)</span></div>
  </section>
  <section id="caps-panel">
    <h2>Capsule lengths |v<sub>k</sub>|</h2>
    <div id="bars"></div>
    <div class="note" id="verdict">draw a digit</div>
  </section>
  <section id="pose-panel">
    <h2>Pose of the winning capsule <span id="posek"></span></h2>
    <div class="row" style="margin-top:0"><canvas id="recon" class="px" width="28" height="28" style="width:140px;height:140px"></canvas>
      <span class="note">decoder(v<sub>k</sub> + &delta;): move a dimension by &plusmn;0.25 as in the paper's Fig. 4</span></div>
    <div id="sliders" style="margin-top:6px"></div>
    <div class="row"><button id="reset">Reset pose</button></div>
  </section>
  <section id="train-panel" class="wide">
    <h2>Training run</h2>
    <div class="row" style="margin-top:0"><select id="run"></select>
      <label><input type="checkbox" id="follow" checked> follow (poll every 2 s)</label>
      <span class="note" id="runstatus"></span></div>
    <div class="charts"><canvas id="loss" width="480" height="220"></canvas><canvas id="acc" width="480" height="220"></canvas></div>
  </section>
  <section class="wide"><pre id="selftest"></pre></section>
</main>
)PAGE";

// The script's start: state and the JSON API helper.
constexpr const char* kApi = R"PAGE(<script>
"use strict";
const $ = id => document.getElementById(id);
const state = { info: null, pred: null, delta: [], decodeBusy: false, decodePending: false, lastRecon: null };
const waiters = [];  // resolved after each finished decode (self-test)

async function api(path, body) {
  const init = body === undefined ? {} :
    { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) };
  const r = await fetch(path, init);
  const j = await r.json();
  if (!r.ok) throw new Error(path + ": " + r.status + " " + (j.error || ""));
  return j;
}

)PAGE";

// Drawing with the mouse and reading the drawing as a 28x28 input.
constexpr const char* kDrawing = R"PAGE(// ---- drawing -------------------------------------------------------------------------------------
const draw = $("draw"), dctx = draw.getContext("2d");
function clearDraw() { dctx.fillStyle = "#000"; dctx.fillRect(0, 0, 280, 280); }
clearDraw();
dctx.lineCap = "round"; dctx.lineJoin = "round";
let drawing = false, last = null, predictTimer = null;
function pos(e) { const r = draw.getBoundingClientRect(); return [e.clientX - r.left, e.clientY - r.top]; }
function strokeTo(p) {
  dctx.strokeStyle = "#fff"; dctx.lineWidth = 20;
  dctx.beginPath(); dctx.moveTo(last[0], last[1]); dctx.lineTo(p[0], p[1]); dctx.stroke(); last = p;
}
draw.addEventListener("pointerdown", e => { drawing = true; last = pos(e); strokeTo(pos(e)); draw.setPointerCapture(e.pointerId); });
draw.addEventListener("pointermove", e => {
  if (!drawing) return; strokeTo(pos(e));
  if (!predictTimer) predictTimer = setTimeout(() => { predictTimer = null; runPredict(); }, 150);
});
draw.addEventListener("pointerup", () => { drawing = false; runPredict(); });
$("clear").onclick = () => { clearDraw(); runPredict(); };

// The drawing as grey values in [0,1] (red channel: white ink on black).
function greyOf(ctx, w, h) {
  const d = ctx.getImageData(0, 0, w, h).data, g = new Float32Array(w * h);
  for (let i = 0; i < w * h; ++i) g[i] = d[4 * i] / 255;
  return g;
}
// Area-average resampling of the box (sx, sy, sw, sh) of grey [H][W] into dw x dh cells (8x8 samples each).
function resample(g, W, H, sx, sy, sw, sh, dw, dh) {
  const out = new Float32Array(dw * dh), n = 8;
  for (let y = 0; y < dh; ++y) for (let x = 0; x < dw; ++x) {
    let s = 0;
    for (let j = 0; j < n; ++j) for (let i = 0; i < n; ++i) {
      const px = Math.floor(sx + (x + (i + 0.5) / n) * sw / dw), py = Math.floor(sy + (y + (j + 0.5) / n) * sh / dh);
      if (px >= 0 && py >= 0 && px < W && py < H) s += g[py * W + px];
    }
    out[y * dw + x] = s / (n * n);
  }
  return out;
}
// MNIST preprocessing: bounding box -> 20x20 keeping the aspect ratio -> centre of mass at the centre of 28x28.
function mnistWay(g, W, H) {
  let x0 = W, y0 = H, x1 = -1, y1 = -1;
  for (let y = 0; y < H; ++y) for (let x = 0; x < W; ++x) if (g[y * W + x] > 0.1) {
    x0 = Math.min(x0, x); x1 = Math.max(x1, x); y0 = Math.min(y0, y); y1 = Math.max(y1, y);
  }
  const out = new Float32Array(28 * 28);
  if (x1 < 0) return out;
  const bw = x1 - x0 + 1, bh = y1 - y0 + 1, side = Math.max(bw, bh);
  const tw = Math.max(1, Math.round(20 * bw / side)), th = Math.max(1, Math.round(20 * bh / side));
  const small = resample(g, W, H, x0, y0, bw, bh, tw, th);
  let m = 0, cx = 0, cy = 0;
  for (let y = 0; y < th; ++y) for (let x = 0; x < tw; ++x) { const v = small[y * tw + x]; m += v; cx += v * (x + 0.5); cy += v * (y + 0.5); }
  const ox = Math.round(14 - cx / m), oy = Math.round(14 - cy / m);
  for (let y = 0; y < th; ++y) for (let x = 0; x < tw; ++x) {
    const X = x + ox, Y = y + oy;
    if (X >= 0 && Y >= 0 && X < 28 && Y < 28) out[Y * 28 + X] = Math.min(1, small[y * tw + x]);
  }
  return out;
}
function modelInput() {
  let px = mnistWay(greyOf(dctx, 280, 280), 280, 280);
  const S = state.info.image_size;
  if (S !== 28) px = resample(px, 28, 28, 0, 0, 28, 28, S, S);
  paint($("input"), px, S);
  return Array.from(px, v => Math.min(1, Math.max(0, v)));
}
function paint(canvas, values, S) {
  canvas.width = S; canvas.height = S;
  const ctx = canvas.getContext("2d"), im = ctx.createImageData(S, S);
  for (let i = 0; i < S * S; ++i) {
    const v = Math.round(255 * Math.min(1, Math.max(0, values[i])));
    im.data[4 * i] = im.data[4 * i + 1] = im.data[4 * i + 2] = v; im.data[4 * i + 3] = 255;
  }
  ctx.putImageData(im, 0, 0);
}

// Uploads: decoded by the browser, made grey, inverted when the background is light, fitted into the pad.
$("file").onchange = e => {
  const f = e.target.files[0]; if (!f) return;
  const url = URL.createObjectURL(f), img = new Image();
  img.onload = () => {
    const c = document.createElement("canvas"); c.width = 280; c.height = 280;
    const x = c.getContext("2d"), s = Math.min(280 / img.width, 280 / img.height);
    x.fillStyle = "#fff"; x.fillRect(0, 0, 280, 280);
    const w = img.width * s, h = img.height * s;
    x.drawImage(img, (280 - w) / 2, (280 - h) / 2, w, h);
    const d = x.getImageData(0, 0, 280, 280), n = 280 * 280, grey = new Float32Array(n);
    let border = 0, nb = 0;
    for (let i = 0; i < n; ++i) {
      grey[i] = (0.299 * d.data[4 * i] + 0.587 * d.data[4 * i + 1] + 0.114 * d.data[4 * i + 2]) / 255;
      const X = i % 280, Y = (i / 280) | 0;
      const inImg = X >= (280 - w) / 2 && X < (280 + w) / 2 && Y >= (280 - h) / 2 && Y < (280 + h) / 2;
      const edge = inImg && (X < (280 - w) / 2 + 3 || X >= (280 + w) / 2 - 3 || Y < (280 - h) / 2 + 3 || Y >= (280 + h) / 2 - 3);
      if (edge) { border += grey[i]; ++nb; }
    }
    const invert = nb > 0 && border / nb > 0.5;
    for (let i = 0; i < n; ++i) {
      const X = i % 280, Y = (i / 280) | 0;
      const inImg = X >= (280 - w) / 2 && X < (280 + w) / 2 && Y >= (280 - h) / 2 && Y < (280 + h) / 2;
      const v = inImg ? Math.round(255 * (invert ? 1 - grey[i] : grey[i])) : 0;
      d.data[4 * i] = d.data[4 * i + 1] = d.data[4 * i + 2] = v; d.data[4 * i + 3] = 255;
    }
    dctx.putImageData(d, 0, 0); URL.revokeObjectURL(url); runPredict();
  };
  img.src = url;
};

)PAGE";

// Prediction, capsule-length bars, pose sliders and the decoder's image.
constexpr const char* kPrediction = R"PAGE(// ---- prediction, bars, pose sliders ----------------------------------------------------------------
function buildBars() {
  const K = state.info.num_classes, bars = $("bars"); bars.innerHTML = "";
  for (let k = 0; k < K; ++k) {
    const row = document.createElement("div"); row.className = "bar"; row.id = "bar" + k;
    row.innerHTML = '<span class="k"></span><span class="track"><span class="fill"></span></span><span class="v"></span>';
    row.querySelector(".k").textContent = state.info.classes ? state.info.classes[k] : k;  // text: names come from directories
    bars.appendChild(row);
  }
}
function buildSliders() {
  const D = state.info.digit_dim, box = $("sliders"); box.innerHTML = ""; state.delta = new Array(D).fill(0);
  for (let i = 0; i < D; ++i) {
    const row = document.createElement("div"); row.className = "slider";
    row.innerHTML = '<label>dim ' + i + '</label><input type="range" min="-0.25" max="0.25" step="0.01" value="0" id="s' + i +
      '"><output id="o' + i + '"></output>';
    box.appendChild(row);
    row.querySelector("input").addEventListener("input", ev => { state.delta[i] = parseFloat(ev.target.value); showPose(); requestDecode(); });
  }
}
function showBars(r) {
  for (let k = 0; k < r.lengths.length; ++k) {
    const row = $("bar" + k); row.className = "bar" + (k === r.class ? " win" : "");
    row.querySelector(".fill").style.width = Math.round(200 * Math.min(1, r.lengths[k])) + "px";
    row.querySelector(".v").textContent = r.lengths[k].toFixed(4);
  }
  $("verdict").textContent = "class " + r.class + " (|v| = " + r.lengths[r.class].toFixed(3) + ")";
  $("posek").textContent = "k = " + r.class;
}
function showPose() {
  if (!state.pred) return;
  for (let i = 0; i < state.delta.length; ++i)
    $("o" + i).textContent = (state.pred.pose[i] + state.delta[i]).toFixed(3) + (state.delta[i] ? " (" + (state.delta[i] > 0 ? "+" : "") + state.delta[i].toFixed(2) + ")" : "");
}
let predictSeq = 0;
async function runPredict() {
  const seq = ++predictSeq, pixels = modelInput();
  const r = await api("/api/predict", { pixels });
  if (seq !== predictSeq) return r;  // a newer drawing is on its way
  state.pred = r;
  for (let i = 0; i < state.delta.length; ++i) { state.delta[i] = 0; $("s" + i).value = "0"; }
  showBars(r); showPose();
  state.lastRecon = r.reconstruction; paint($("recon"), r.reconstruction, state.info.image_size);
  return r;
}
// Slider moves coalesce: one decode in flight, the latest position queued.
async function requestDecode() {
  if (!state.pred) return;
  if (state.decodeBusy) { state.decodePending = true; return; }
  state.decodeBusy = true;
  try {
    do {
      state.decodePending = false;
      const pose = state.pred.pose.map((v, i) => v + state.delta[i]);
      const r = await api("/api/decode", { class: state.pred.class, pose });
      state.lastRecon = r.reconstruction; paint($("recon"), r.reconstruction, state.info.image_size);
    } while (state.decodePending);
  } finally {
    state.decodeBusy = false;
    while (waiters.length) waiters.shift()();
  }
}
$("reset").onclick = () => { for (let i = 0; i < state.delta.length; ++i) { state.delta[i] = 0; $("s" + i).value = "0"; } showPose(); requestDecode(); };

)PAGE";

// The training panel: the run list and the loss and accuracy charts.
constexpr const char* kTraining = R"PAGE(// ---- training panel ----------------------------------------------------------------------------------
const palette = ["#2f6fd0", "#e0402a", "#2a9d5b", "#8e44ad", "#d98e04", "#16a2b8", "#6c757d", "#c2185b"];
function chart(canvas, title, series) {
  const c = canvas.getContext("2d"), W = canvas.width, H = canvas.height, L = 52, R = 10, T = 22, B = 28;
  c.clearRect(0, 0, W, H); c.fillStyle = "#fff"; c.fillRect(0, 0, W, H);
  c.fillStyle = "#1d2330"; c.font = "bold 13px system-ui, sans-serif"; c.fillText(title, L, 15);
  const pts = series.flatMap(s => s.pts);
  c.strokeStyle = "#9aa3b2"; c.strokeRect(L, T, W - L - R, H - T - B);
  if (!pts.length) { c.font = "12px system-ui, sans-serif"; c.fillText("no data", L + 10, T + 20); return; }
  let x0 = Math.min(...pts.map(p => p[0])), x1 = Math.max(...pts.map(p => p[0]));
  let y0 = Math.min(...pts.map(p => p[1])), y1 = Math.max(...pts.map(p => p[1]));
  if (x1 === x0) x1 = x0 + 1; if (y1 === y0) { y1 += 0.5; y0 -= 0.5; }
  const X = x => L + (x - x0) / (x1 - x0) * (W - L - R), Y = y => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  c.font = "11px system-ui, sans-serif"; c.fillStyle = "#5b6475";
  c.fillText(y1.toPrecision(3), 4, T + 8); c.fillText(y0.toPrecision(3), 4, H - B);
  c.fillText("step " + x0, L, H - 10); const t = "step " + x1; c.fillText(t, W - R - c.measureText(t).width, H - 10);
  series.forEach((s, i) => {
    c.strokeStyle = c.fillStyle = palette[i % palette.length]; c.lineWidth = 1.5; c.beginPath();
    s.pts.forEach((p, j) => j ? c.lineTo(X(p[0]), Y(p[1])) : c.moveTo(X(p[0]), Y(p[1]))); c.stroke();
    if (s.pts.length === 1) c.fillRect(X(s.pts[0][0]) - 2, Y(s.pts[0][1]) - 2, 4, 4);
    c.fillText(s.label, L + 8 + 150 * (i % 3), T + 14 + 13 * Math.floor(i / 3));
  });
}
function seriesOf(records, key) {
  const by = new Map();
  for (const r of records) {
    if (typeof r.step !== "number" || typeof r[key] !== "number") continue;
    const label = [r.event, r.model, r.split].filter(x => typeof x === "string").join(" ") || key;
    if (!by.has(label)) by.set(label, []);
    by.get(label).push([r.step, r[key]]);
  }
  return [...by].map(([label, pts]) => ({ label, pts }));
}
async function loadRuns() {
  const r = await api("/api/runs"), sel = $("run"), keep = sel.value;
  sel.innerHTML = "";
  for (const name of r.runs) { const o = document.createElement("option"); o.value = o.textContent = name; sel.appendChild(o); }
  const wanted = new URLSearchParams(location.search).get("run");  // ?run=NAME preselects a run
  if (r.runs.includes(keep)) sel.value = keep; else if (r.runs.includes(wanted)) sel.value = wanted;
  if (!r.runs.length) $("runstatus").textContent = "no metrics.jsonl under " + state.info.runs_dir;
  return r.runs;
}
async function loadMetrics() {
  const run = $("run").value; if (!run) return null;
  const m = await api("/api/metrics?run=" + encodeURIComponent(run));
  chart($("loss"), "loss", seriesOf(m.records, "loss"));
  chart($("acc"), "accuracy", seriesOf(m.records, "accuracy"));
  const steps = m.records.filter(r => typeof r.step === "number").map(r => r.step);
  $("runstatus").textContent = m.records.length + " records" + (steps.length ? ", last step " + Math.max(...steps) : "") + (m.truncated ? " (file tail only)" : "");
  return m;
}
$("run").onchange = () => loadMetrics().catch(showError);
setInterval(() => { if ($("follow").checked) loadMetrics().catch(showError); }, 2000);
function showError(e) { const p = $("selftest"); p.className = "err"; p.textContent = String(e); }

)PAGE";

// The self-test (?selftest=1) and the page's start.
constexpr const char* kSelfTestAndStart = R"PAGE(// ---- self-test (?selftest=1): a scripted session whose outcome the browser test reads from the DOM ---
async function selftest() {
  const out = { status: "selftest: running" };
  try {
    clearDraw(); dctx.strokeStyle = "#fff"; dctx.lineWidth = 20;  // a "7"
    dctx.beginPath(); dctx.moveTo(70, 60); dctx.lineTo(210, 60); dctx.lineTo(120, 235); dctx.stroke();
    const r = await runPredict();
    out.pixels = modelInput(); out.lengths = r.lengths; out.class = r.class; out.pose = r.pose;
    out.recon_before = r.reconstruction.reduce((a, b) => a + b, 0);
    const done = new Promise(res => waiters.push(res));
    const s = $("s0"); s.value = "0.25"; s.dispatchEvent(new Event("input"));
    await done;
    out.slider = { dim: 0, value: state.delta[0] };
    out.recon_after = state.lastRecon.reduce((a, b) => a + b, 0);
    out.recon_max_change = Math.max(...state.lastRecon.map((v, i) => Math.abs(v - r.reconstruction[i])));
    const rect = id => { const b = $(id).getBoundingClientRect(); return [b.left, b.top, b.width, b.height].map(Math.round); };
    out.rects = { bars: rect("bars"), recon: rect("recon"), input: rect("input"), draw: rect("draw") };
    out.runs = await loadRuns();
    if (out.runs.length) out.metrics_records = (await loadMetrics()).records.length;
    if (!(out.recon_max_change > 0)) throw new Error("moving the slider did not change the reconstruction");
    out.status = "selftest: ok";
  } catch (e) { out.status = "selftest: error: " + e; }
  $("selftest").textContent = JSON.stringify(out);
}

(async () => {
  try {
    state.info = await api("/api/info");
    $("model").textContent = state.info.model + "  (" + state.info.image_size + "x" + state.info.image_size + ", " +
      state.info.num_classes + " capsules of " + state.info.digit_dim + "D)";
    buildBars(); buildSliders();
    if (new URLSearchParams(location.search).get("selftest") === "1") { await selftest(); return; }
    await loadRuns(); await loadMetrics();
  } catch (e) { showError(e); }
})();
</script>
</body></html>
)PAGE";

}  // namespace

const std::string& live_viewer_page() {
  static const std::string page = std::string(kHead) + kPanels + kApi + kDrawing + kPrediction + kTraining +
                                  kSelfTestAndStart;
  return page;
}

}  // namespace capsnet::apps
