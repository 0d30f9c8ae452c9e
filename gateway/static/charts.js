// Small hand-written canvas charts for /dashboard: line (time series), bars, CDF.
// No dependencies. Each draws into a <figure> holding a <canvas> and a <figcaption>, and
// writes what it drew into the figure's data attributes (data-points: points or bars drawn,
// data-series: how many series), which tests read back from the rendered DOM.
"use strict";
(function () {
  const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
                   "#17becf", "#7f7f7f", "#bcbd22"];
  const PAD = { left: 56, right: 12, top: 10, bottom: 34 };

  function setup(fig) {
    const canvas = fig.querySelector("canvas");
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth || 560, h = canvas.clientHeight || 240;
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    ctx.font = "11px system-ui, sans-serif";
    return { ctx, w, h, pw: w - PAD.left - PAD.right, ph: h - PAD.top - PAD.bottom };
  }

  // "Nice" tick values covering [lo, hi].
  function ticks(lo, hi, n) {
    if (!(hi > lo)) hi = lo + 1;
    const raw = (hi - lo) / Math.max(1, n);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toPrecision(12));
    return out;
  }

  function fmt(v) {
    const a = Math.abs(v);
    if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
    if (a >= 1e3) return (v / 1e3).toFixed(a >= 1e4 ? 0 : 1) + "k";
    if (a >= 10 || v === 0) return v.toFixed(0);
    if (a >= 1) return v.toFixed(1);
    return v.toPrecision(2);
  }

  function clock(t) {
    const d = new Date(t * 1000);
    return d.toTimeString().slice(0, 8);
  }

  function frame(g, xs, ys, xfmt, yfmt, xlabel, ylabel) {
    const { ctx, w, h, pw, ph } = g;
    ctx.strokeStyle = "#d8dde3"; ctx.fillStyle = "#68727f"; ctx.lineWidth = 1;
    ctx.textAlign = "right"; ctx.textBaseline = "middle";
    for (const v of ys.ticks) {
      const y = PAD.top + ph - (v - ys.lo) / (ys.hi - ys.lo) * ph;
      ctx.beginPath(); ctx.moveTo(PAD.left, y); ctx.lineTo(PAD.left + pw, y); ctx.stroke();
      ctx.fillText(yfmt(v), PAD.left - 4, y);
    }
    ctx.textAlign = "center"; ctx.textBaseline = "top";
    for (const v of xs.ticks) {
      const x = PAD.left + (v - xs.lo) / (xs.hi - xs.lo) * pw;
      ctx.fillText(xfmt(v), x, PAD.top + ph + 4);
    }
    if (xlabel) ctx.fillText(xlabel, PAD.left + pw / 2, h - 13);
    if (ylabel) {
      ctx.save(); ctx.translate(11, PAD.top + ph / 2); ctx.rotate(-Math.PI / 2);
      ctx.fillText(ylabel, 0, -6); ctx.restore();
    }
    ctx.strokeStyle = "#9aa3ad";
    ctx.strokeRect(PAD.left, PAD.top, pw, ph);
    void w;
  }

  function legend(fig, names) {
    const cap = fig.querySelector("figcaption");
    cap.textContent = "";
    names.forEach((n, i) => {
      const s = document.createElement("span");
      s.className = "key";
      s.textContent = "\u25A0 " + n + "  ";
      s.style.color = PALETTE[i % PALETTE.length];  // CSSOM, allowed under the page's CSP
      cap.appendChild(s);
    });
  }

  function empty(fig, g, message) {
    g.ctx.fillStyle = "#68727f"; g.ctx.textAlign = "center"; g.ctx.textBaseline = "middle";
    g.ctx.fillText(message, g.w / 2, g.h / 2);
    fig.dataset.points = "0"; fig.dataset.series = "0";
    fig.querySelector("figcaption").textContent = "";
    return 0;
  }

  // series: [{name, points: [[x, y|null], ...]}]; a null y breaks the line (no data there).
  function line(fig, series, opts) {
    opts = opts || {};
    const g = setup(fig);
    const all = series.flatMap((s) => s.points.filter((p) => p[1] !== null && isFinite(p[1])));
    if (!all.length) return empty(fig, g, opts.empty || "no data yet");
    let xlo = Math.min(...all.map((p) => p[0])), xhi = Math.max(...all.map((p) => p[0]));
    if (xhi === xlo) { xlo -= 1; xhi += 1; }
    let ylo = opts.yMin !== undefined ? opts.yMin : Math.min(0, ...all.map((p) => p[1]));
    let yhi = opts.yMax !== undefined ? opts.yMax : Math.max(...all.map((p) => p[1]));
    if (!(yhi > ylo)) yhi = ylo + 1;
    const yt = ticks(ylo, yhi, 4);
    const ys = { lo: ylo, hi: Math.max(yhi, yt[yt.length - 1]), ticks: yt };
    const xs = { lo: xlo, hi: xhi, ticks: ticks(xlo, xhi, 5) };
    frame(g, xs, ys, opts.time ? clock : fmt, opts.yfmt || fmt, opts.xlabel, opts.ylabel);
    const { ctx, pw, ph } = g;
    const X = (x) => PAD.left + (x - xs.lo) / (xs.hi - xs.lo) * pw;
    const Y = (y) => PAD.top + ph - (y - ys.lo) / (ys.hi - ys.lo) * ph;
    let drawn = 0;
    series.forEach((s, i) => {
      ctx.strokeStyle = ctx.fillStyle = PALETTE[i % PALETTE.length];
      ctx.lineWidth = 1.6;
      ctx.beginPath();
      let pen = false;
      for (const [x, y] of s.points) {
        if (y === null || !isFinite(y)) { pen = false; continue; }
        if (pen) ctx.lineTo(X(x), Y(y)); else ctx.moveTo(X(x), Y(y));
        pen = true; drawn++;
      }
      ctx.stroke();
      // a lone point between gaps would not show as a line: dot every point
      for (const [x, y] of s.points) {
        if (y === null || !isFinite(y)) continue;
        ctx.beginPath(); ctx.arc(X(x), Y(y), 1.8, 0, 2 * Math.PI); ctx.fill();
      }
    });
    legend(fig, series.map((s) => s.name));
    fig.dataset.points = String(drawn);
    fig.dataset.series = String(series.length);
    return drawn;
  }

  // bars: [{label, value}]
  function bars(fig, items, opts) {
    opts = opts || {};
    const g = setup(fig);
    if (!items.length) return empty(fig, g, opts.empty || "no data yet");
    const hi = Math.max(1, ...items.map((b) => b.value)) * 1.12;  // headroom for the value labels
    const yt = ticks(0, hi, 4);
    const ys = { lo: 0, hi: Math.max(hi, yt[yt.length - 1]), ticks: yt };
    const { ctx, pw, ph } = g;
    frame(g, { lo: 0, hi: 1, ticks: [] }, ys, fmt, fmt, "", opts.ylabel);
    const slot = pw / items.length;
    ctx.textAlign = "center"; ctx.textBaseline = "top";
    items.forEach((b, i) => {
      const bh = b.value / ys.hi * ph;
      const x = PAD.left + i * slot + slot * 0.15;
      ctx.fillStyle = b.color || PALETTE[i % PALETTE.length];
      ctx.fillRect(x, PAD.top + ph - bh, slot * 0.7, bh);
      ctx.fillStyle = "#1d232b";
      ctx.textBaseline = "bottom";
      ctx.fillText(String(b.value), x + slot * 0.35, PAD.top + ph - bh - 1);
      ctx.textBaseline = "top"; ctx.fillStyle = "#68727f";
      ctx.fillText(b.label.length > 18 ? b.label.slice(0, 17) + "\u2026" : b.label, x + slot * 0.35, PAD.top + ph + 4);
    });
    fig.querySelector("figcaption").textContent = "";
    fig.dataset.points = String(items.length);
    fig.dataset.series = "1";
    return items.length;
  }

  // series: [{name, values: [number]}], refs: [{x, label}] (vertical dashed lines, e.g. SLOs).
  // Log x axis: latencies span decades.
  function cdf(fig, series, refs, opts) {
    opts = opts || {};
    const g = setup(fig);
    const live = series.filter((s) => s.values.length);
    if (!live.length) return empty(fig, g, opts.empty || "no requests yet");
    const vals = live.flatMap((s) => s.values).filter((v) => v > 0);
    const refx = refs.map((r) => r.x).filter((v) => v > 0);
    let lo = Math.min(...vals, ...refx), hi = Math.max(...vals, ...refx);
    if (!(lo > 0)) lo = 1e-4;
    let llo = Math.floor(Math.log10(lo)), lhi = Math.ceil(Math.log10(hi));
    if (lhi <= llo) lhi = llo + 1;
    const xs = { lo: llo, hi: lhi, ticks: ticks(llo, lhi, lhi - llo).filter((t) => Number.isInteger(t)) };
    const ys = { lo: 0, hi: 1, ticks: [0, 0.25, 0.5, 0.75, 1] };
    const unit = opts.unit || "s";
    frame(g, xs, ys, (e) => fmt(Math.pow(10, e)) + unit, (v) => Math.round(v * 100) + "%", opts.xlabel, "fraction");
    const { ctx, pw, ph } = g;
    const X = (v) => PAD.left + (Math.log10(Math.max(v, Math.pow(10, llo))) - llo) / (lhi - llo) * pw;
    const Y = (y) => PAD.top + ph - y * ph;
    ctx.setLineDash([4, 3]); ctx.strokeStyle = "#7f7f7f"; ctx.fillStyle = "#7f7f7f"; ctx.lineWidth = 1;
    ctx.textAlign = "left"; ctx.textBaseline = "top";
    refs.forEach((r, i) => {
      if (!(r.x > 0)) return;
      ctx.beginPath(); ctx.moveTo(X(r.x), PAD.top); ctx.lineTo(X(r.x), PAD.top + ph); ctx.stroke();
      ctx.fillText(r.label, X(r.x) + 2, PAD.top + 2 + 12 * (i % 4));
    });
    ctx.setLineDash([]);
    let drawn = 0;
    live.forEach((s, i) => {
      const v = s.values.slice().sort((a, b) => a - b);
      ctx.strokeStyle = PALETTE[i % PALETTE.length]; ctx.lineWidth = 1.6;
      ctx.beginPath(); ctx.moveTo(X(v[0]), Y(0));
      v.forEach((x, k) => { ctx.lineTo(X(x), Y(k / v.length)); ctx.lineTo(X(x), Y((k + 1) / v.length)); });
      ctx.stroke();
      drawn += v.length;
    });
    legend(fig, live.map((s) => s.name + " (" + s.values.length + ")"));
    fig.dataset.points = String(drawn);
    fig.dataset.series = String(live.length);
    return drawn;
  }

  window.TFCharts = { line, bars, cdf, PALETTE };
})();
