// Line charts drawn as SVG from the broker's samples (no library: a few dozen lines do).
// Every label is set with textContent, never parsed as markup.
"use strict";

const SVG = "http://www.w3.org/2000/svg";

function svg(tag, attrs) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  return el;
}

// A stable hue for a name (a provider, a model), so it has the same colour everywhere.
function hueOf(name) {
  let h = 0;
  for (const c of String(name)) h = (h * 31 + c.codePointAt(0)) % 360;
  return h;
}

function fmt(v) {
  if (v == null || !isFinite(v)) return "–";
  const a = Math.abs(v);
  if (a >= 100) return v.toFixed(0);
  if (a >= 10) return v.toFixed(1);
  return v.toFixed(2);
}

// Draw `series` ({name: [[unix_s, value|null], ...]}) into `box` (replacing what was there).
// The chart keeps its newest values in data attributes, so tests and scripts can read them.
// `zero`: the y axis starts at 0 (else at the lowest value); `ends`: the x axis' two labels.
// `end`: the x axis' right end (default: now, in Unix seconds).
function lineChart(box, { title, unit, series, span, label = (n) => n, zero = true, ends = null, end = null }) {
  box.replaceChildren();
  box.classList.add("chart");
  const head = document.createElement("h3");
  head.textContent = title;
  box.append(head);
  const names = Object.keys(series).sort();
  const W = 320, H = 120, L = 34, B = 14;
  const now = end == null ? Date.now() / 1000 : end;
  const t0 = now - span;
  let top = zero ? 0 : -Infinity;
  let low = zero ? 0 : Infinity;
  for (const n of names) {
    for (const [, v] of series[n]) {
      if (v == null) continue;
      top = Math.max(top, v);
      low = Math.min(low, v);
    }
  }
  if (!isFinite(top)) { top = 1; low = 0; }
  const pad = (top - low) * 0.1 || Math.abs(top) * 0.1 || 1;
  top += pad;
  if (!zero) low -= pad;
  const x = (t) => L + ((t - t0) / span) * (W - L - 2);
  const y = (v) => H - B - ((v - low) / (top - low)) * (H - B - 4);
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
  const titleEl = svg("title");
  titleEl.textContent = `${title} (${unit})`;
  root.append(titleEl);
  root.append(svg("line", { class: "axis", x1: L, y1: H - B, x2: W, y2: H - B }));
  root.append(svg("line", { class: "axis", x1: L, y1: 4, x2: L, y2: H - B }));
  const mid = (top + low) / 2;
  for (const [v, yy] of [[top, 12], [mid, y(mid) + 3], [low, H - B]]) {
    const t = svg("text", { class: "tick", x: 2, y: yy });
    t.textContent = fmt(v);
    root.append(t);
  }
  const ago = svg("text", { class: "tick", x: L, y: H - 2 });
  ago.textContent = ends ? ends[0] : `${Math.round(span / 60) || 1} min ago`;
  root.append(ago);
  const nowLabel = svg("text", { class: "tick", x: W - 2, y: H - 2, "text-anchor": "end" });
  nowLabel.textContent = ends ? ends[1] : "now";
  root.append(nowLabel);
  const legend = document.createElement("div");
  legend.className = "legend";
  box.dataset.chart = box.dataset.chart || title;
  for (const n of names) {
    const points = series[n].filter(([t]) => t >= t0);
    let d = "";
    let pen = "M";
    let drawn = 0;
    for (const [t, v] of points) {
      if (v == null) { pen = "M"; continue; }
      d += `${pen}${x(t).toFixed(1)},${y(v).toFixed(1)}`;
      pen = "L";
      drawn += 1;
    }
    const latest = points.length ? points[points.length - 1][1] : null;
    const path = svg("path", { class: "series", d: d || "M0,0" });
    path.style.setProperty("--hue", hueOf(n));
    path.dataset.series = n;
    path.dataset.latest = latest == null ? "" : String(latest);
    path.dataset.points = String(drawn);
    root.append(path);
    const item = document.createElement("span");
    item.style.setProperty("--hue", hueOf(n));
    item.dataset.series = n;
    item.dataset.latest = latest == null ? "" : String(latest);
    item.textContent = `${label(n)}: ${fmt(latest)} ${unit}`;
    legend.append(item);
  }
  box.append(root);
  if (!names.length) {
    const empty = document.createElement("div");
    empty.className = "empty";
    empty.textContent = "nothing to show yet";
    box.append(empty);
  }
  box.append(legend);
}
