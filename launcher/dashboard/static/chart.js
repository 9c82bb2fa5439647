"use strict";
// Small hand-written SVG charts of a run's series (launcher/diagnose/series.py: times are seconds since the
// run's start): lines over time from zero (or on a log axis), epoch marks, and the timeline of phases, attempts
// and events. The time axis is the PNG report's: its start-ups compressed (the series' `axis` knots), shaded.

const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"];
const OUTCOME = { succeeded: "#4c9a2a", failed: "#c0392b", preempted: "#e67e22", shrunk: "#8e44ad",
                  regrouped: "#16a085", stopped: "#7f8c8d" };
const PHASE = { preflight: "#bdc3c7", setup: "#d5dbdb", spawn: "#f1c40f", "to first step": "#e67e22",
                training: "#27ae60", "first step": "#e67e22",
                teardown: "#7f8c8d" };
const EVENT = { failure: "#c0392b", restart: "#2471a3", preemption: "#e67e22", lost: "#8e44ad", back: "#16a085" };
const PAD = { left: 64, right: 12, top: 10, bottom: 24 };

function largest(values, start = -Infinity) {  // Math.max(...values) overflows the stack on a long array
  return values.reduce((a, b) => (b > a ? b : a), start);
}

function colour(i) {
  return PALETTE[Math.abs(i) % PALETTE.length];
}

function ticks(max, count) {
  if (!(max > 0)) return [0];
  const raw = max / count, base = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * base).find((s) => s >= raw);
  const out = [];
  for (let v = 0; v <= max + step * 1e-9; v += step) out.push(v);
  return out;
}

function clockTicks(until, count) {  // seconds, on whole seconds, minutes or hours
  const raw = until / count;
  const step = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600].find((s) => s >= raw) || 86400;
  const out = [];
  for (let v = 0; v <= until; v += step) out.push(v);
  return out;
}

function mmss(s) {
  const m = Math.floor(s / 60), sec = Math.round(s % 60);
  return m >= 60 ? `${Math.floor(m / 60)}h${String(m % 60).padStart(2, "0")}` : `${m}:${String(sec).padStart(2, "0")}`;
}

function short(y) {
  const a = Math.abs(y);
  return a >= 1e6 ? `${(y / 1e6).toFixed(1)}M` : a >= 1e4 ? `${(y / 1e3).toFixed(0)}k` : a >= 100 ? y.toFixed(0)
    : a >= 1 ? String(+y.toFixed(2)) : String(+y.toPrecision(2));
}

// The position of time t on a time axis of [0, until]: piecewise linear over the knots (report.knots), or to scale.
function squeezed(axis) {
  if (!axis || !axis[0] || axis[0].length < 2) return (t) => t;
  const [ts, xs] = axis;
  return (t) => {
    let i = 1;
    while (i < ts.length - 1 && t > ts[i]) i += 1;
    const span = ts[i] - ts[i - 1] || 1;
    return xs[i - 1] + ((t - ts[i - 1]) * (xs[i] - xs[i - 1])) / span;
  };
}

function logTicks(lo, hi) {  // 1, 2, 5 times the powers of ten between lo and hi (fewer when they are many)
  const out = [];
  for (let e = Math.floor(Math.log10(lo)); e <= Math.ceil(Math.log10(hi)); e += 1) {
    for (const m of hi / lo > 1e3 ? [1] : [1, 2, 5]) {
      const v = m * Math.pow(10, e);
      if (v >= lo && v <= hi) out.push(v);
    }
  }
  return out;
}

// Ticks over the stretches drawn to scale (between the compressed start-ups), about 80 px apart.
function stretchTicks(x, until, shaded) {
  const edges = [0, ...shaded.flatMap((s) => [s.start, Math.min(s.end, until)]), until], out = [];
  for (let i = 0; i + 1 < edges.length; i += 2) {
    const [a, b] = [edges[i], edges[i + 1]];
    if (!(b > a)) continue;
    const perSecond = (x(b) - x(a)) / (b - a);
    const step = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600]
      .find((s) => s * perSecond >= 80) || 86400;
    for (let t = Math.ceil(a / step) * step; t <= b; t += step) out.push(t);
  }
  return out;
}

// yscale: {max} from zero, or {log: true, lo, hi}; axis: the series' knots; startups: [{start, end}] shaded
function frame(width, height, until, yscale, axis = null, startups = []) {
  const w = width - PAD.left - PAD.right, h = height - PAD.top - PAD.bottom;
  const at = squeezed(axis);
  const x = (t) => PAD.left + (until > 0 ? (at(t) / until) * w : 0);
  let y = () => PAD.top + h;
  if (yscale && yscale.log) {
    const lo = Math.log10(yscale.lo), span = Math.log10(yscale.hi) - lo || 1;
    y = (v) => PAD.top + h - ((Math.log10(v) - lo) / span) * h;
  } else if (yscale) {
    y = (v) => PAD.top + h - (yscale.max > 0 ? (v / yscale.max) * h : 0);
  }
  const axes = svg("g", { class: "axes" });
  const shaded = axis ? startups.filter((s) => s.end > s.start && s.start < until) : [];
  for (const s of shaded) {
    const a = x(s.start), b = x(Math.min(s.end, until));
    axes.append(svg("rect", { x: a, y: PAD.top, width: Math.max(1, b - a), height: h, class: "startup" },
                    svg("title", { text: `start-up ${fmt.num(s.end - s.start, 1)} s (compressed)` })));
  }
  const times = axis ? [0, ...shaded.map((s) => Math.min(s.end, until)), ...stretchTicks(x, until, shaded)]
    : clockTicks(until, Math.max(2, Math.floor(w / 80)));
  const placed = [];
  for (const t of times) {
    if (placed.some((p) => Math.abs(x(p) - x(t)) < 44)) continue;  // a compressed start-up's ticks would crowd
    placed.push(t);
    axes.append(svg("line", { x1: x(t), x2: x(t), y1: PAD.top, y2: PAD.top + h, class: "grid" }),
                svg("text", { x: x(t), y: height - 6, "text-anchor": "middle", text: mmss(t) }));
  }
  if (yscale) {
    for (const v of yscale.log ? logTicks(yscale.lo, yscale.hi) : ticks(yscale.max, 4)) {
      axes.append(svg("line", { x1: PAD.left, x2: PAD.left + w, y1: y(v), y2: y(v), class: "grid" }),
                  svg("text", { x: PAD.left - 6, y: y(v) + 4, "text-anchor": "end", text: short(v) }));
    }
  }
  return { x, y, w, h, axes };
}

// lines: [{name, colour, points: [[t, y], ...], dots, dashed}]; marks: [{t, label}] (epoch ends); log: a log
// y axis (values above zero only); axis, startups: the compressed start-up (frame())
function timeChart({ width, height = 190, until, lines, marks = [], log = false, axis = null, startups = [] }) {
  if (log) lines = lines.map((l) => ({ ...l, points: l.points.filter((p) => p[1] > 0) }));
  const values = lines.flatMap((l) => l.points.map((p) => p[1]));
  const hi = values.length ? largest(values) : 1;
  const lo = values.length ? -largest(values.map((v) => -v)) : 1;
  const yscale = log ? { log: true, lo: lo / 1.2, hi: hi * 1.2 } : { max: values.length ? hi * 1.08 : 1 };
  const { x, y, axes } = frame(width, height, until, yscale, axis, startups);
  const chart = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img", class: "chart" }, axes);
  for (const m of marks) {  // an event (a restart, a failure) in its colour, as in the PNG; an epoch's end grey
    const line = svg("line", { x1: x(m.t), x2: x(m.t), y1: PAD.top, y2: height - PAD.bottom,
                               class: m.kind ? "mark event-mark" : "mark" }, svg("title", { text: m.label }));
    if (m.kind) line.style.stroke = EVENT[m.kind] || "#c0392b";  // CSSOM, allowed by the page's style policy
    chart.append(line);
  }
  for (const line of lines) {
    const pts = line.points.filter((p) => p[0] >= 0 && p[0] <= until);
    if (!pts.length) continue;
    // p[2]: the first point of a new attempt: the stroke starts again (nothing drawn across a restart)
    const d = pts.map((p, i) => `${i && !p[2] ? "L" : "M"}${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join("");
    if (pts.length > 1 || !line.dots) {
      const dash = line.dashed ? "5 3" : null;
      chart.append(svg("path", { d, class: "line", stroke: line.colour, "stroke-dasharray": dash },
                       svg("title", { text: line.name })));
    }
    if (line.dots) {
      for (const p of pts) {
        chart.append(svg("circle", { cx: x(p[0]), cy: y(p[1]), r: 3.5, fill: line.colour, class: "dot" },
                         svg("title", { text: `${line.name}: ${short(p[1])} at ${mmss(p[0])}` })));
      }
    }
  }
  return chart;
}

function legend(lines) {
  return el("ul", { class: "legend" }, lines.map((l) => {
    const swatch = el("span", { class: l.dashed ? "swatch dashed" : "swatch" });
    swatch.style.borderColor = l.colour;  // CSSOM, allowed by the page's style policy
    return el("li", {}, swatch, l.name);
  }));
}

// Phases, attempts (coloured by outcome, the reason on hover and listed below) and events on one time axis.
function timeline({ width, until, phases, attempts, events, axis = null, startups = [] }) {
  const rows = [["phases", phases], ["attempts", attempts], ["events", events]];
  const rowH = 22, height = PAD.top + rows.length * (rowH + 6) + PAD.bottom;
  const { x, axes } = frame(width, height, until, null, axis, startups);
  const chart = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img", class: "chart timeline" },
                    axes);
  rows.forEach(([name, items], row) => {
    const top = PAD.top + row * (rowH + 6);
    chart.append(svg("text", { x: PAD.left - 6, y: top + 15, "text-anchor": "end", text: name }));
    for (const item of items) {
      if (name === "events") {
        const mark = `M${x(item.t)},${top + 2}l-5,${rowH - 6}h10z`;
        chart.append(svg("path", { d: mark, class: "event", fill: EVENT[item.kind] || "#c0392b" },
                         svg("title", { text: `${mmss(item.t)} ${item.label || item.kind}` })));
        continue;
      }
      const start = Math.max(0, item.start ?? 0), end = Math.min(until, item.end ?? until);
      const fill = name === "phases" ? PHASE[item.name] || "#95a5a6" : OUTCOME[item.outcome] || "#95a5a6";
      const label = name === "phases" ? item.name : `attempt ${item.index}: ${item.outcome || "running"}`;
      const box = svg("rect", { x: x(start), y: top, width: Math.max(2, x(end) - x(start)), height: rowH, fill, rx: 3 },
                      svg("title", { text: item.reason ? `${label}: ${item.reason}` : label }));
      chart.append(box);
      if (x(end) - x(start) > label.length * 6.5) {
        chart.append(svg("text", { x: x(start) + 4, y: top + 15, class: "inbox", text: label }));
      }
    }
  });
  return chart;
}
