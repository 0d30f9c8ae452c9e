// /dashboard: fetches /admin/v1/dashboard with the admin key (kept in this tab's sessionStorage,
// sent as a bearer header, never in a URL) and draws it with charts.js. Everything from the
// server is written with textContent (never innerHTML): tenant names and planner reasons are data.
"use strict";
(function () {
  const KEY = "tokenfleet-admin-key";
  const FETCH_TIMEOUT_MS = 10000;  // every wait has a bound: a hung gateway shows as an error
  const $ = (id) => document.getElementById(id);
  let timer = null;

  function storedKey() {
    try { return sessionStorage.getItem(KEY); } catch (e) { return null; }
  }

  function showLogin(message) {
    document.body.dataset.state = "login";
    $("dash").hidden = true; $("logout").hidden = true;
    $("login").hidden = false;
    $("login-error").textContent = message || "";
    $("status").textContent = "admin key needed";
    $("key").focus();
  }

  async function load() {
    clearTimeout(timer);
    const headers = { Accept: "application/json" };
    const key = storedKey();
    if (key) headers.Authorization = "Bearer " + key;
    const ctl = new AbortController();
    const guard = setTimeout(() => ctl.abort(), FETCH_TIMEOUT_MS);
    let data;
    try {
      const r = await fetch("/admin/v1/dashboard", { headers, signal: ctl.signal, cache: "no-store",
                                                      credentials: "omit" });
      if (r.status === 401 || r.status === 403) {
        try { sessionStorage.removeItem(KEY); } catch (e) { /* storage off: nothing kept */ }
        showLogin(key ? (r.status === 403 ? "That key is not an admin key." : "That key was not accepted.") : "");
        return;
      }
      if (!r.ok) throw new Error("HTTP " + r.status);
      data = await r.json();
    } catch (e) {
      $("status").textContent = "cannot load data (" + (e.name === "AbortError" ? "timed out" : e.message) + "); retrying";
      document.body.dataset.error = String(e.message || e.name);
      timer = setTimeout(load, 5000);
      return;
    } finally {
      clearTimeout(guard);
    }
    $("login").hidden = true;
    $("dash").hidden = false;
    $("logout").hidden = !key;
    render(data);
    timer = setTimeout(load, Math.max(2, data.interval_s) * 1000);
  }

  function groupSeries(samples, field, fn) {
    // {name: [[t, value|null], ...]} for each tenant or class seen in the samples
    const names = new Set();
    samples.forEach((s) => s.by_key.forEach((k) => names.add(k[field])));
    const out = {};
    [...names].sort().forEach((n) => {
      out[n] = samples.map((s) => [s.t, fn(s.by_key.filter((k) => k[field] === n), s)]);
    });
    return Object.entries(out).map(([name, points]) => ({ name, points }));
  }
  const sum = (keys, f) => keys.reduce((a, k) => a + k[f], 0);
  const goodput = (keys, s) => sum(keys, "goodput_tokens") / s.dt;
  const attainment = (keys) => { const e = sum(keys, "ended"); return e ? sum(keys, "met_slo") / e : null; };

  function render(d) {
    const C = window.TFCharts;
    const S = d.samples;
    const pct = (v) => Math.round(v * 100) + "%";
    C.line($("goodput-class"), groupSeries(S, "class", goodput), { time: true, ylabel: "tok/s" });
    C.line($("attainment-class"), groupSeries(S, "class", attainment), { time: true, yMin: 0, yMax: 1, yfmt: pct });
    C.line($("goodput-tenant"), groupSeries(S, "tenant", goodput), { time: true, ylabel: "tok/s" });
    C.line($("attainment-tenant"), groupSeries(S, "tenant", attainment), { time: true, yMin: 0, yMax: 1, yfmt: pct });
    const sites = [...new Set([...d.sites, ...S.flatMap((s) => Object.keys(s.sites))])];
    C.line($("output-site"), sites.map((site) => ({
      name: site, points: S.map((s) => [s.t, s.sites[site] ? s.sites[site].output_tokens / s.dt : 0]) })),
      { time: true, ylabel: "tok/s" });
    // Per site: admitted requests whose final attempt ended there, judged as the ledger judges them.
    // A site absent from a sample served nothing then: no goodput, and no attainment to show.
    const perSite = (fn, none) => sites.map((site) => ({
      name: site, points: S.map((s) => [s.t, s.sites[site] ? fn(s.sites[site], s) : none]) }));
    C.line($("goodput-site"), perSite((c, s) => (c.goodput_tokens || 0) / s.dt, 0), { time: true, ylabel: "tok/s" });
    C.line($("attainment-site"), perSite((c) => (c.ended ? c.met_slo / c.ended : null), null),
      { time: true, yMin: 0, yMax: 1, yfmt: pct });
    const a = d.admission;
    const bars = [{ label: "admitted", value: a.admitted, color: "#2ca02c" },
                  { label: "queued", value: a.queued, color: "#ff7f0e" }];
    Object.entries(a.rejected_by).sort().forEach(([reason, n]) =>
      bars.push({ label: "rejected: " + reason, value: n, color: "#d62728" }));
    C.bars($("admission"), bars, { ylabel: "requests" });
    const lat = d.latency;
    const bySite = (field) => [...new Set(lat.site)].sort().map((site) => ({
      name: site, values: lat[field].filter((v, i) => lat.site[i] === site && v !== null) }));
    const refs = (field) => Object.entries(d.slos).filter(([, s]) => s[field] !== null)
      .map(([name, s]) => ({ x: s[field], label: name + " SLO" }));
    C.cdf($("ttft-cdf"), bySite("ttft_s"), refs("ttft_s"), { xlabel: "TTFT (log scale)" });
    C.cdf($("tpot-cdf"), bySite("tpot_s"), refs("tpot_s"), { xlabel: "TPOT (log scale)" });
    renderPlanner(d.planner);
    document.body.dataset.samples = String(S.length);
    document.body.dataset.state = "ready";
    $("status").textContent = d.policy + " \u00B7 " + S.length + " samples every " + d.interval_s + " s \u00B7 " +
      "updated " + d.generated_at;
  }

  function renderPlanner(p) {
    const table = $("planner");
    const body = table.querySelector("tbody");
    body.textContent = "";
    $("planner-mode").textContent = p.enabled ? "mode " + p.mode + ", every " + p.cycle_s + " s" : "off";
    $("placement").textContent = p.enabled
      ? "replicas: " + p.placement.map((x) => x.site + "/" + x.model + " " + x.replicas).join(", ") : "";
    const rows = p.entries.slice().reverse();  // newest first
    rows.forEach((e) => {
      const tr = document.createElement("tr");
      [e.at.toFixed(1), e.kind, e.move || "", e.reason || ""].forEach((v) => {
        const td = document.createElement("td"); td.textContent = v; tr.appendChild(td);
      });
      body.appendChild(tr);
    });
    table.dataset.entries = String(rows.length);
    table.dataset.enabled = String(!!p.enabled);
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("login").addEventListener("submit", (ev) => {
      ev.preventDefault();  // never submitted: the key stays out of URLs and server logs
      const input = $("key");
      const k = input.value.trim();
      input.value = "";
      if (!k) return;
      try { sessionStorage.setItem(KEY, k); } catch (e) { $("login-error").textContent = "sessionStorage is off"; return; }
      $("status").textContent = "loading…";
      load();
    });
    $("logout").addEventListener("click", () => {
      try { sessionStorage.removeItem(KEY); } catch (e) { /* nothing kept */ }
      clearTimeout(timer);
      showLogin("");
    });
    load();
  });
})();
