// The pages of `ray-profiler serve`: one script, no build step, Chart.js from /static/vendor.
// Every value from the coordinator goes into the page as text (never as HTML).
"use strict";

const POLL_MS = 2000;
const state = { token: sessionStorage.getItem("rayProfilerToken") || "", status: null,
                charts: [], route: null, shown: null, viewer: { perfetto: null, install: null, read_only: null } };

// ------------------------------------------------------------------ helpers

function el(tag, attrs, ...kids) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const kid of kids.flat()) {
    if (kid === null || kid === undefined) continue;
    node.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return node;
}

function num(x, digits = 0) {
  if (x === null || x === undefined) return "";
  return Number(x).toLocaleString("en-US", { maximumFractionDigits: digits,
                                              minimumFractionDigits: digits });
}

function pct(x) { return x === null || x === undefined ? "" : (100 * x).toFixed(1) + "%"; }

function table(headers, rows, rowClass) {
  const head = el("tr", {}, headers.map(h => el("th", { class: h.num ? "num" : null }, h.label)));
  const body = rows.map(r => el("tr", { class: rowClass ? rowClass(r) : null },
    headers.map(h => {
      const v = h.get(r);
      return el("td", { class: h.cls ?? (h.num ? "num" : null), title: h.title ? h.title(r) : null },
        v instanceof Node ? v : String(v ?? ""));
    })));
  return el("table", {}, el("thead", {}, head), el("tbody", {}, body));
}

async function api(path, opts = {}) {
  const headers = Object.assign({}, opts.headers || {});
  if (opts.auth && state.token) headers.Authorization = "Bearer " + state.token;
  if (opts.json !== undefined) {
    headers["Content-Type"] = "application/json";
    opts.body = JSON.stringify(opts.json);
  }
  const r = await fetch(path, { method: opts.method || "GET", headers, body: opts.body });
  // a read refused for want of the token: sign in (the cookie then carries it)
  if (r.status === 401 && !opts.method) window.location.assign("/login");
  let body = null;
  try { body = await r.json(); } catch (e) { body = { error: "no JSON in the answer" }; }
  return { ok: r.ok, status: r.status, body };
}

// A chart drawn in ``box`` (replacing what it held), kept on it as ``box.chart``.
function mount(box, config) {
  const canvas = el("canvas", {});
  box.replaceChildren(canvas);
  config.options = Object.assign({ responsive: true, maintainAspectRatio: false,
                                   animation: false }, config.options || {});
  const made = new Chart(canvas, config);
  state.charts.push(made);
  box.chart = made;
  return made;
}

function chart(parent, config, tall) {
  const box = el("div", { class: tall ? "chart tall" : "chart" });
  parent.append(box);
  return mount(box, config);
}

function clear() {
  for (const c of state.charts) c.destroy();
  state.charts = [];
  const main = document.getElementById("main");
  main.replaceChildren();
  return main;
}

function fail(main, what, res) {
  main.append(el("p", { class: "error" }, `${what}: ${res.status} ${res.body?.error ?? ""}`));
}

function regressionText(r) {
  if (!r) return "";
  const parts = [];
  if (r.step_regressed) parts.push(`step x${num(r.step_ratio, 2)}`);
  for (const k of r.kernels.slice(0, 3)) parts.push(`${k.name} x${num(k.ratio, 2)}`);
  if (!parts.length) return "";
  const ref = r.reference || [];
  return `SLOWER than windows ${ref[0]}-${ref[ref.length - 1]} (${ref.length}): ${parts.join(", ")}`;
}

// Each role's marks of a window ("role: ..." when it has several roles).
// A long path or URL folded to its last two parts (the whole of it in the cell's title).
function folded(path) {
  if (!path || path.length <= 48) return path ?? "";
  return "…/" + path.replace(/\/+$/, "").split("/").slice(-2).join("/");
}

// A merged timeline (``path``: this server's timeline.json.gz URL) opened in the Perfetto this
// server serves; where it serves none, the download itself, and how to get Perfetto here.
function traceLink(path, text, title) {
  const ui = state.viewer.perfetto;
  if (!ui) return el("a", { href: path, class: "perfetto download", title:
    `download, then open it at https://ui.perfetto.dev; to serve Perfetto here: ${state.viewer.install}` }, text);
  const url = `${ui}#!/?url=${encodeURIComponent(location.origin + path)}`;
  return el("a", { href: url, class: "perfetto", target: "_blank", rel: "noopener", title }, text);
}

function perfettoHint() {
  return state.viewer.perfetto ? null : el("p", { class: "muted", id: "perfetto-hint" },
    `Perfetto is not served here: timelines download instead (open them at https://ui.perfetto.dev). ` +
    `To view them here, with no internet: ${state.viewer.install}, then restart ray-profiler serve.`);
}

function marksText(w) {
  const parts = Object.values(w.roles || {});
  const texts = parts.map(p => [p.role, regressionText(p.regression)]).filter(([, t]) => t);
  return texts.map(([role, t]) => parts.length > 1 ? `${role}: ${t}` : t).join("; ");
}

// ------------------------------------------------------------------- pages

function runPage(main, st) {
  const run = st.run;
  main.append(el("h2", {}, `Run ${run.name}`));
  const counts = Object.entries(st.rank_counts || {}).map(([k, v]) => `${v} ${k}`).join(", ");
  main.append(table(
    [{ label: "lifecycle", get: () => run.lifecycle }, { label: "phase", get: () => st.phase },
     { label: "global step", get: () => st.global_step ?? "" },
     { label: "current window", get: () => st.current_window ? st.current_window.index : "" },
     { label: "next window", get: () => st.next_window
         ? `${st.next_window.index} (${st.next_window.kind}, ${st.next_window.first}-${st.next_window.last})` : "" },
     { label: "ranks", get: () => counts }, { label: "run dir", get: () => st.run_dir ?? "" }],
    [st]));
  latestFindings(main, st);
  main.append(el("h2", {}, "Trainers"));
  main.append(table(
    [{ label: "trainer", get: t => t.trainer_id }, { label: "role", get: t => t.role },
     { label: "world", get: t => t.world_size, num: true },
     { label: "steps", get: t => t.advances_step ? "advances the step" : "" }],
    st.trainers));
  main.append(el("h2", {}, "Step time over the run"));
  const box = el("div", { class: "chart", id: "run-chart" });
  main.append(box, el("p", { class: "muted legend" }, "bands: windows (",
    ...Object.keys(BAND_COLORS).map(k => el("span", { class: `kind-${k}` }, `${k} `)),
    "), ▼ marked slower, red line: a stall; click a band to open its window"));
  runChart(box);
  memoryCharts(main);
  main.append(el("h2", {}, "Windows"));
  if (!st.windows.length) { main.append(el("p", { class: "muted" }, "no closed window yet")); return; }
  main.append(table(
    [{ label: "window", get: w => el("a", { href: `#/window/${w.index}` }, String(w.index)) },
     { label: "kind", get: w => w.kind },
     { label: "steps", get: w => w.steps ? `${w.steps[0]}-${w.steps[1]}` : "(none)" },
     { label: "roles", cls: "roles", get: w => Object.values(w.roles || {}).map(p =>
         `${p.role}: ${p.rank_count} ranks` + (p.busy_ms_per_step !== null
           ? `, ${num(p.busy_ms_per_step, 1)} ms busy/step` : "")).join("; ") },
     { label: "stragglers", get: w => w.stragglers.join(", ") + (w.last_arriver ? ` (waited for: ${w.last_arriver})` : "") },
     { label: "partial", get: w => w.partial ? "partial" : "" },
     { label: "regression", cls: "marks", get: w => el("span", { class: "slower" }, marksText(w)) },
     { label: "traces", get: w => w.steps && !st.config.export_type.startsWith("none")
         ? el("span", { class: "pills" }, Object.values(w.roles || {}).map(p =>
             el("a", { href: `/api/windows/${w.index}/traces.tar.gz?role=${encodeURIComponent(p.role)}` },
                `${p.role}.tar.gz`)),
             traceLink(`/api/windows/${w.index}/timeline.json.gz`, "Perfetto",
                       "every rank of the window on one timeline, in Perfetto"),
             el("a", { href: `/api/windows/${w.index}/timeline.json.gz`, class: "timeline",
                       title: "every rank of the window in one trace (.json.gz)" }, "timeline")) : "" },
     { label: "where", cls: "where", get: w => w.trace_dir ? folded(w.trace_dir) : w.reason ?? "",
       title: w => w.trace_dir ?? null }],
    st.windows.slice().reverse()));
  const hint = perfettoHint();
  if (hint) main.append(hint);
  if (st.stalls.length) {
    main.append(el("p", {}, el("a", { href: "#/stalls", class: "error" },
      `${st.stalls.length} stall(s): see Stalls`)));
  }
}

// ------------------------------------------------------- the run at a glance

const BAND_COLORS = {
  scheduled: { fill: "rgba(32, 90, 170, 0.16)", line: "#205aaa" },
  capture: { fill: "rgba(27, 127, 59, 0.18)", line: "#1b7f3b" },
  auto: { fill: "rgba(214, 120, 0, 0.20)", line: "#b86400" },
};

// Windows as bands (at least 3 px wide, so a 3-step window shows in a long run), marked
// windows with a triangle on top, stalls as red lines after their last step. What was drawn
// is kept on the chart ($bands, $stalls): clicks find the band under them.
const runBands = { id: "runBands", beforeDatasetsDraw(chart) {
  const { ctx, chartArea: a, scales: { x } } = chart;
  const data = chart.config.options.plugins.runBands;
  chart.$bands = []; chart.$stalls = [];
  ctx.save();
  for (const w of data.windows) {
    const c = BAND_COLORS[w.kind] || BAND_COLORS.scheduled;
    let x0 = x.getPixelForValue(w.first - 0.5), x1 = x.getPixelForValue(w.last + 0.5);
    if (x1 - x0 < 3) { const mid = (x0 + x1) / 2; x0 = mid - 1.5; x1 = mid + 1.5; }
    ctx.fillStyle = c.fill; ctx.fillRect(x0, a.top, x1 - x0, a.bottom - a.top);
    if (w.marks.length) {
      ctx.fillStyle = "#b00020"; ctx.beginPath(); const mid = (x0 + x1) / 2;
      ctx.moveTo(mid - 6, a.top); ctx.lineTo(mid + 6, a.top); ctx.lineTo(mid, a.top + 10); ctx.fill();
    }
    chart.$bands.push({ index: w.index, kind: w.kind, x0, x1, marked: w.marks.length > 0 });
  }
  ctx.strokeStyle = "#b00020"; ctx.lineWidth = 2; ctx.fillStyle = "#b00020"; ctx.font = "bold 12px sans-serif";
  for (const s of data.stalls) {
    if (s.step === null) continue;
    const px = x.getPixelForValue(s.step + 0.5);
    ctx.beginPath(); ctx.moveTo(px, a.top); ctx.lineTo(px, a.bottom); ctx.stroke();
    const label = `stall ${s.index}`, wide = ctx.measureText(label).width;
    ctx.fillText(label, px + 3 + wide > a.right ? px - 3 - wide : px + 3, a.top + 24);
    chart.$stalls.push({ index: s.index, step: s.step, x: px });
  }
  ctx.restore();
} };

function bandAt(chart, px) {
  return (chart.$bands || []).find(b => px >= b.x0 - 2 && px <= b.x1 + 2) || null;
}

const PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1",
                 "#ff9da7", "#9c755f", "#bab0ac"];

function runChartConfig(c) {
  const s = c.series, mid = p => (p.first + p.last) / 2;
  let n = 0;
  const colour = () => PALETTE[n++ % PALETTE.length];
  const line = (label, get, extra) => { const col = colour(); return Object.assign({ label, type: "line",
    pointRadius: s.points.length > 60 ? 0 : 2, borderWidth: 1.5, borderColor: col, backgroundColor: col + "99",
    data: s.points.map(p => ({ x: mid(p), y: get(p) })) }, extra || {}); };
  const sets = s.regions.length
    ? [...s.regions.map((n, i) => line(n, p => p.regions[n] ?? 0, { fill: i ? "-1" : "origin", stack: "phases" })),
       line("(in no region)", p => Math.max(0, p.mean_ms - Object.values(p.regions).reduce((a, b) => a + b, 0)),
            { fill: "-1", stack: "phases" })]
    : [line(s.width > 1 ? `step time (mean of ${s.width} steps)` : "step time", p => p.mean_ms, { stack: "mean" })];
  if (s.width > 1) sets.push(line(`slowest step of each ${s.width}`, p => p.max_ms,
    { borderDash: [4, 3], stack: "max", borderColor: "#6b7785", backgroundColor: "#6b7785" }));
  for (const r of c.roles) { const col = colour(); sets.push({ label: `${r.role} (windows, mean over ranks)`,
    type: "scatter", stack: `role-${r.trainer_id}`, pointRadius: 3, borderColor: col, backgroundColor: col,
    data: r.steps.map(([k, ms]) => ({ x: k, y: ms })) }); }
  const first = s.points[0].first, last = s.points[s.points.length - 1].last;
  return { type: "line", data: { datasets: sets }, plugins: [runBands],
    options: { parsing: false, normalized: true, interaction: { mode: "nearest", intersect: false },
      plugins: { runBands: { windows: c.windows, stalls: c.stalls } },
      scales: { x: { type: "linear", min: first - 0.5, max: last + 0.5, title: { display: true, text: "global step" },
                     ticks: { callback: v => Number.isInteger(v) ? v : "" } },
                y: { stacked: true, beginAtZero: true, title: { display: true, text: "ms" } } },
      onClick: (ev, _els, chart) => { const b = bandAt(chart, ev.x); if (b) location.hash = `#/window/${b.index}`; } } };
}

async function runChart(box) {
  const res = await api("/api/chart?points=1000");
  if (!res.ok) { box.replaceWith(el("p", { class: "error" }, `chart: ${res.status} ${res.body?.error ?? ""}`)); return; }
  if (!res.body.series.points.length) {
    box.replaceWith(el("p", { class: "muted", id: "run-chart" }, "no step time reported yet"));
    return;
  }
  drawRunChart(box, res.body);
}

function drawRunChart(box, c) { return mount(box, runChartConfig(c)); }

// ------------------------------------------------------- memory over the run

// Windows as bands over wall-clock time (seconds since the first sample).
const memoryBands = { id: "memoryBands", beforeDatasetsDraw(chart) {
  const { ctx, chartArea: a, scales: { x } } = chart;
  ctx.save();
  for (const [index, t0, t1] of chart.config.options.plugins.memoryBands.windows) {
    const x0 = x.getPixelForValue(t0), x1 = Math.max(x.getPixelForValue(t1), x0 + 3);
    if (x1 < a.left || x0 > a.right) continue;
    ctx.fillStyle = BAND_COLORS.scheduled.fill;
    ctx.fillRect(Math.max(x0, a.left), a.top, Math.min(x1, a.right) - Math.max(x0, a.left), a.bottom - a.top);
    ctx.fillStyle = BAND_COLORS.scheduled.line;
    ctx.fillText(`w${index}`, Math.max(x0, a.left) + 2, a.top + 10);
  }
  ctx.restore();
} };

// One chart a role: each rank's resident memory over the run, windows as bands, the culprit named.
async function memoryCharts(main) {
  const section = el("div", { id: "memory" });
  main.append(el("h2", {}, "Memory over the run"), section);
  const res = await api("/api/memory");
  if (!res.ok) { section.append(el("p", { class: "muted" }, `memory: ${res.body?.error ?? res.status}`)); return; }
  const m = res.body;
  if (!m.sample_s) { section.append(el("p", { class: "muted" }, "memory sampling is off (memory.sample_s: 0)")); return; }
  for (const line of m.culprits) section.append(el("p", { class: "slower culprit" }, `leak: ${line}`));
  const sampled = m.ranks.filter(r => r.series && r.series.length);
  if (!sampled.length) { section.append(el("p", { class: "muted" }, "no sample yet")); return; }
  const t0 = Math.min(...sampled.map(r => r.series[0][0]));
  const roles = [...new Set(sampled.map(r => r.role))];
  for (const role of roles) {
    const ranks = sampled.filter(r => r.role === role);
    section.append(el("h3", {}, `${role}: resident memory (MiB), ${ranks.length} ranks`));
    const box = el("div", { class: "chart memory-chart", "data-role": role });
    section.append(box);
    const sets = ranks.map((r, i) => ({ label: `rank ${r.rank}` + (r.growth ? ` +${num(r.growth.bytes_per_min / 1048576, 1)} MiB/min` : "")
        + (r.culprit ? " (culprit)" : ""), type: "line", pointRadius: 0, borderWidth: r.culprit ? 2.5 : 1.2,
      borderColor: PALETTE[i % PALETTE.length], backgroundColor: PALETTE[i % PALETTE.length],
      data: r.series.map(([t, b]) => ({ x: t - t0, y: b / 1048576 })) }));
    mount(box, { type: "line", data: { datasets: sets }, plugins: [memoryBands],
      options: { parsing: false, normalized: true, animation: false,
        plugins: { memoryBands: { windows: m.windows.map(([i, a, b]) => [i, a - t0, b - t0]) } },
        scales: { x: { type: "linear", title: { display: true, text: "seconds since the first sample" } },
                  y: { title: { display: true, text: "MiB" } } } } });
  }
}

async function windowPage(main, index, role, by) {
  by = by === "op" ? "op" : "kernel";
  const q = `top_k=20&per_rank=true&by=${by}${role ? "&role=" + encodeURIComponent(role) : ""}`;
  const res = await api(`/api/windows/${index}/kernels?${q}`);
  if (!res.ok) { fail(main, `window ${index}`, res); return; }
  const ks = res.body;
  const entry = (state.status?.windows || []).find(w => w.index === index);
  main.append(el("h2", {}, `Window ${index} (${ks.role ?? "policy"}): steps ${ks.steps.join("-")}` +
    `${ks.partial ? " partial" : ""}, ranks ${ks.ranks.length}, ` +
    `${ks.device === "cuda" ? "device time" : `self ${ks.device ?? ""} time`} (${ks.unit})`));
  if (entry) {
    main.append(el("p", { class: "pills" }, "roles: ", Object.values(entry.roles || {}).map(p =>
      el("a", { href: `#/window/${index}/${encodeURIComponent(p.role)}` }, p.role))));
    main.append(el("p", {}, "traces: ", el("a", { href: `/api/windows/${index}/traces.tar.gz` +
      `?role=${encodeURIComponent(ks.role ?? "policy")}` }, "download every rank's trace (.tar.gz)"),
      el("span", { class: "muted" }, " then open one rank's file at https://ui.perfetto.dev (Open trace file)")));
    main.append(el("p", {}, "timeline: ",
      traceLink(`/api/windows/${index}/timeline.json.gz`, "every rank of every role in Perfetto",
                "one process per rank, on one clock"), " · ",
      el("a", { href: `/api/windows/${index}/timeline.json.gz`, class: "timeline" },
         "download it (.json.gz)")));
    const hint = perfettoHint();
    if (hint) main.append(hint);
    const part = Object.values(entry.roles || {}).find(p => p.role === (ks.role ?? "policy"));
    const mark = regressionText(part ? part.regression : null);
    if (mark) main.append(el("p", { class: "slower" }, mark));
  }
  findingsSection(main, index, role);
  const base = `#/window/${index}/${encodeURIComponent(ks.role ?? "policy")}`;
  main.append(el("p", { class: "pills" }, "table: ",
    el("a", { href: `${base}/kernel`, id: "by-kernel" }, "kernels"),
    el("a", { href: `${base}/op`, id: "by-op" }, "ops (CUDA: device time by the op that launched it)")));
  const ops = by === "op" && ks.device !== "cpu" ? ks.ops : null;
  main.append(el("h2", {}, ops ? "Top ops by the device time they launched, and their spread across ranks"
    : "Top kernels, and their spread across ranks"));
  const cols = [{ label: ops ? "op" : "kernel", get: k => k.name }, { label: "total us", get: k => num(k.total_us), num: true },
     { label: "mean", get: k => num(k.mean_us), num: true }, { label: "min", get: k => num(k.min_us), num: true },
     { label: "max", get: k => num(k.max_us), num: true }, { label: "max@", get: k => k.max_rank, num: true },
     { label: "std", get: k => num(k.std_us), num: true }, { label: "calls", get: k => k.count, num: true },
     { label: "share", get: k => pct(k.share), num: true }];
  if (ops) cols.push({ label: "CPU self us", get: k => num(ops[k.name]?.cpu_us), num: true },
    { label: "largest kernels", get: k => (ops[k.name]?.kernels || []).map(([n, us]) => `${n.slice(0, 40)} ${num(us)}`).join("; ") });
  main.append(table(cols, ks.kernels));
  const top = ks.kernels.slice(0, 15);
  chart(main, { type: "bar", data: { labels: top.map(k => k.name.slice(0, 50)), datasets: [
    { label: "min..max over ranks (us)", data: top.map(k => [k.min_us, k.max_us]) },
    { label: "mean (us)", type: "line", showLine: false, pointRadius: 5, data: top.map(k => k.mean_us) }] },
    options: { indexAxis: "y" } }, true);
  heatmap(main, ks);
  breakdown(main, ks);
  launches(main, ks);
  stragglers(main, ks);
  collectivesSection(main, index, role);
  stepStrip(main, ks);
  memory(main, ks);
}

// ------------------------------------------------------ findings in words

// A finding's figures as one line: key=value, per-rank maps and lists compact, numbers rounded.
function compact(v) {
  if (typeof v === "number") return Number.isInteger(v) ? String(v) : String(+v.toFixed(3));
  if (Array.isArray(v)) return `[${v.map(compact).join(", ")}]`;
  if (v && typeof v === "object") return `{${Object.entries(v).map(([k, x]) => `${k}: ${compact(x)}`).join(", ")}}`;
  return String(v);
}

function evidenceText(ev) {
  return Object.entries(ev || {}).map(([k, v]) => `${k}=${compact(v)}`).join("; ");
}

// The findings of a window (``FindingsReply``), the costliest first, at most ``most`` of them;
// one line when there is none. What was drawn is kept on ``holder`` ($findings).
function drawFindings(holder, f, most) {
  const shown = f.findings.slice(0, most ?? f.findings.length);
  holder.$findings = shown.map(x => ({ rule: x.rule, ranks: x.ranks, all_ranks: x.all_ranks,
                                       cost_ms_per_step: x.cost_ms_per_step }));
  const kids = [];
  if (!shown.length) kids.push(el("p", { class: "muted findings-none" }, "no finding for this window"));
  else {
    const cut = t => t.length > 300 ? t.slice(0, 300) + "…" : t;
    kids.push(table(
      [{ label: "ms/step", get: x => num(x.cost_ms_per_step, 1), num: true }, { label: "rule", get: x => x.rule },
       { label: "ranks", get: x => x.all_ranks ? "every rank" : x.ranks.join(", ") },
       { label: "advice", cls: "advice", get: x => x.advice },
       { label: "evidence", cls: "evidence", get: x => cut(evidenceText(x.evidence)), title: x => evidenceText(x.evidence) }],
      shown));
    if (f.findings.length > shown.length) kids.push(el("p", { class: "muted" },
      `and ${f.findings.length - shown.length} more on the window's page`));
  }
  const why = {};  // the rules that could not judge the window, grouped by why
  for (const [rule, text] of Object.entries(f.not_judged ?? {})) (why[text] ??= []).push(rule);
  if (Object.keys(why).length) kids.push(el("ul", { class: "findings-not-judged muted" },
    Object.entries(why).map(([text, rules]) => el("li", {}, `not judged: ${rules.join(", ")}: ${text}`))));
  if (f.problems.length) kids.push(el("ul", { class: "findings-problems" }, f.problems.map(p => el("li", { class: "slower" }, p))));
  holder.replaceChildren(...kids);
}

// The window page's Findings: filled when the answer comes; the page does not wait for it.
function findingsSection(main, index, role) {
  const holder = el("div", { id: "findings" }, el("p", { class: "muted" }, "reading the findings..."));
  main.append(el("h2", {}, "Findings"), holder);
  api(`/api/windows/${index}/advise${role ? "?role=" + encodeURIComponent(role) : ""}`).then(res => {
    if (!res.ok) { holder.replaceChildren(el("p", { class: "error" }, `findings: ${res.status} ${res.body?.error ?? ""}`)); return; }
    drawFindings(holder, res.body);
  });
}

const PANEL_FINDINGS = 3;

// The run page's panel: the latest closed window's costliest findings, loaded on its own.
function latestFindings(main, st) {
  const closed = st.windows.filter(w => w.steps);
  if (!closed.length) return;
  const index = closed[closed.length - 1].index;
  const holder = el("div", { id: "latest-findings" }, el("p", { class: "muted" }, "reading the findings..."));
  main.append(el("h2", {}, "Findings of the latest window"),
    el("p", {}, el("a", { href: `#/window/${index}`, id: "latest-findings-link" }, `window ${index}`),
       el("span", { class: "muted" }, ", the costliest first")), holder);
  api(`/api/windows/${index}/advise`).then(res => {
    if (!res.ok) { holder.replaceChildren(el("p", { class: "error" }, `findings: ${res.status} ${res.body?.error ?? ""}`)); return; }
    drawFindings(holder, res.body, PANEL_FINDINGS);
  });
}

// ------------------------------------------------ collectives across ranks

const ARRIVAL_ROWS = 40;  // collectives charted: the largest skews

// The window's collectives (``WindowCollectivesReply``): each rank's waits and how often it
// arrived last (the rank most often last highlighted), what could not be matched, and the
// arrivals of the largest skews. Filled when its answer comes; the page does not wait for it.
function collectivesSection(main, index, role) {
  const holder = el("div", { id: "collectives" }, el("p", { class: "muted" }, "reading the collectives..."));
  main.append(el("h2", {}, "Collectives"), holder);
  const q = `shown=${ARRIVAL_ROWS}${role ? "&role=" + encodeURIComponent(role) : ""}`;
  api(`/api/windows/${index}/collectives?${q}`).then(res => {
    if (!res.ok) { holder.replaceChildren(el("p", { class: "error" }, `collectives: ${res.status} ${res.body?.error ?? ""}`)); return; }
    drawCollectives(holder, res.body);
  });
}

// The rank that arrived last most often (ties: the lowest rank), or null when none did.
function mostLast(ranks) {
  return ranks.reduce((a, r) => (r.arrived_last > (a ? a.arrived_last : 0) ? r : a), null);
}

function drawCollectives(holder, c) {
  const ms = us => us === null || us === undefined ? "" : num(us / 1000, 2);
  if (!c.matched && c.ranks_without.length === c.ranks_recorded) {
    holder.replaceChildren(el("p", { class: "muted", id: "collectives-none" }, "no collectives in this window: " +
      (c.ranks_recorded ? `none of its ${c.ranks_recorded} ranks' traces had one` : "no rank's summary is in")));
    return;
  }
  const top = mostLast(c.ranks);
  const steps = r => Object.keys(r.wait_us_per_step).length;
  const kids = [el("p", { id: "collectives-lead" }, `${c.matched} collectives matched across ${c.ranks.length} ranks` +
    (c.last_arriver ? `; rank ${c.last_arriver.rank} ${c.last_arriver.reason}`
      : top ? `; rank ${top.rank} arrives last most often (at ${top.arrived_last} of its ${top.collectives})` : "; no rank arrived last") +
    (c.matched > c.shown ? `; the ${c.shown} largest skews charted` : ""))];
  const ranks = table(
    [{ label: "rank", get: r => r.rank, num: true }, { label: "collectives", get: r => r.collectives, num: true },
     { label: "arrived last", get: r => r.arrived_last, num: true },
     { label: "wait ms", get: r => ms(r.wait_us), num: true },
     { label: "wait ms per step", get: r => steps(r) ? ms(r.wait_us / steps(r)) : "", num: true,
       title: r => Object.entries(r.wait_us_per_step).map(([s, us]) => `step ${s}: ${ms(us)} ms`).join("; ") || null },
     { label: "clock offset ms", get: r => r.clock_spread_us === null ? "" :
         `${ms(r.clock_offset_us)} ± ${ms(r.clock_spread_us)}` + (r.clock_reference !== r.rank ? ` (vs rank ${r.clock_reference})` : ""), num: true },
     { label: "corrected", get: r => r.clock_corrected ? "yes" : "" },
     { label: "cut", get: r => r.cut || "", num: true }],
    c.ranks, r => top && r.rank === top.rank ? "flagged" : null);
  ranks.id = "collectives-ranks";
  kids.push(ranks);
  if (c.problems.length) kids.push(el("ul", { id: "collectives-problems" }, c.problems.map(p => el("li", { class: "slower" }, p))));
  if (!c.collectives.length) {
    kids.push(el("p", { class: "muted" }, "no collective matched across ranks"));
    holder.replaceChildren(...kids);
    return;
  }
  const box = el("div", { class: "chart" });
  kids.push(el("p", { class: "muted legend" }, "a row per collective (the largest skews first), a mark per rank at its " +
    "arrival after the earliest rank's; red: the last to arrive"), box);
  holder.replaceChildren(...kids);
  arrivalChart(holder, box, c.collectives);
}

// A row per collective, a mark per rank at its arrival in ms after the earliest (the skew
// minus the rank's wait), the last to arrive in red. What was drawn is kept on the holder.
function arrivalChart(holder, box, collectives) {
  const rows = collectives.slice().sort((a, b) => b.skew_us - a.skew_us).slice(0, ARRIVAL_ROWS);
  const labels = rows.map((m, i) => `${i + 1}. ${m.name.slice(0, 24)} group ${String(m.group).slice(0, 16)}` +
    (m.step !== null ? ` step ${m.step}` : "") + ` #${m.seq}`);
  const points = last => rows.flatMap((m, i) => m.ranks.filter(r => (r === m.last_rank) === last).map(r =>
    ({ x: (m.skew_us - (m.wait_us[String(r)] ?? 0)) / 1000, y: labels[i], rank: r })));
  box.style.height = `${90 + 22 * rows.length}px`;
  mount(box, { type: "scatter", data: { datasets: [
    { label: "arrival (ms after the earliest rank)", data: points(false), backgroundColor: "#4e79a7", pointRadius: 3 },
    { label: "last to arrive", data: points(true), backgroundColor: "#e15759", pointRadius: 6, pointStyle: "rectRot" }] },
    options: { plugins: { tooltip: { callbacks: { label: c => `rank ${c.raw.rank}: +${num(c.raw.x, 3)} ms` } } },
      scales: { x: { type: "linear", beginAtZero: true, title: { display: true, text: "ms after the earliest arrival" } },
                y: { type: "category", labels, offset: true } } } });
  holder.$arrivals = { rows: labels, last: rows.map(m => m.last_rank), skew_us: rows.map(m => m.skew_us) };
}

// ------------------------------------------- the cross-rank step strip

const STRIP_RANKS = 32;  // ranks a page

function median(xs) {
  const v = xs.slice().sort((a, b) => a - b), n = v.length;
  return n ? (n % 2 ? v[(n - 1) / 2] : (v[n / 2 - 1] + v[n / 2]) / 2) : 0;
}

// Each rank's recorded steps laid end to end (ms from its first recorded step), the slowest
// rank (the longest row) and step (the largest median), and each cell over the straggler
// threshold times its step's median.
function stripModel(ks) {
  const rs = ks.rank_steps || {}, threshold = ks.stragglers?.threshold ?? 1.25;
  const ranks = Object.keys(rs).map(Number).sort((a, b) => a - b);
  const steps = [...new Set(ranks.flatMap(r => rs[r].map(([s]) => s)))].sort((a, b) => a - b);
  const med = Object.fromEntries(steps.map(s => [s, median(ranks.flatMap(r =>
    rs[r].filter(([k]) => k === s).map(([, ms]) => ms)))]));
  const total = r => rs[r].reduce((a, [, ms]) => a + ms, 0);
  const slowRank = ranks.reduce((a, b) => (total(b) > total(a) ? b : a), ranks[0]);
  let worst = null;  // the step furthest over its median, and its rank
  for (const r of ranks) for (const [s, ms] of rs[r]) {
    const ratio = ms / (med[s] || 1);
    if (!worst || ratio > worst.ratio) worst = { rank: r, step: s, ms, ratio };
  }
  const slow = new Set(ranks.flatMap(r => rs[r].filter(([s, ms]) => ms > threshold * med[s])
    .map(([s]) => `${r}/${s}`)));
  return { rs, ranks, steps, med, total, slowRank, worst, slow, threshold,
           medianTotal: median(ranks.map(total)) };
}

function stepStrip(main, ks) {
  main.append(el("h2", {}, "Steps across ranks"));
  if (!ks.rank_steps || !Object.keys(ks.rank_steps).length) {
    main.append(el("p", { class: "muted" }, "no rank timed its steps in this window")); return;
  }
  const holder = el("div", { id: "step-strip" });
  main.append(holder);
  drawStrip(holder, stripModel(ks), 0);
}

function drawStrip(holder, m, page) {
  if (holder.chart) { holder.chart.destroy(); state.charts = state.charts.filter(c => c !== holder.chart); }
  const pages = Math.ceil(m.ranks.length / STRIP_RANKS);
  page = Math.max(0, Math.min(page, pages - 1));
  const shown = m.ranks.slice(page * STRIP_RANKS, (page + 1) * STRIP_RANKS);
  const lead = el("p", {}, `slowest rank ${m.slowRank}: ${num(m.total(m.slowRank), 1)} ms over its steps ` +
    `(x${num(m.total(m.slowRank) / (m.medianTotal || 1), 2)} the median rank); slowest step: step ${m.worst.step} ` +
    `on rank ${m.worst.rank}, ${num(m.worst.ms, 1)} ms (x${num(m.worst.ratio, 2)} its median over the ranks). ` +
    `Red: a step over x${num(m.threshold, 2)} its median.`);
  const nav = pages > 1 ? el("p", { class: "pills" },
    el("button", { id: "strip-prev", disabled: page === 0, onclick: () => drawStrip(holder, m, page - 1) }, "previous"),
    ` ranks ${shown[0]}-${shown[shown.length - 1]} of ${m.ranks.length} (page ${page + 1} of ${pages}) `,
    el("button", { id: "strip-next", disabled: page === pages - 1, onclick: () => drawStrip(holder, m, page + 1) }, "next"),
    el("button", { id: "strip-slowest", onclick: () => drawStrip(holder, m,
      Math.floor(m.ranks.indexOf(m.slowRank) / STRIP_RANKS)) }, `the page of rank ${m.slowRank}`)) : null;
  const box = el("div", { class: "chart" });
  box.style.height = `${70 + 24 * shown.length}px`;
  holder.replaceChildren(lead, ...(nav ? [nav] : []), box);
  const cell = (r, i) => { const row = m.rs[r]; if (i >= row.length) return null;
    const start = row.slice(0, i).reduce((a, [, ms]) => a + ms, 0); return [start, start + row[i][1]]; };
  const width = Math.max(...shown.map(r => m.rs[r].length));
  const sets = [...Array(width).keys()].map(i => ({ label: `step ${m.steps[i] ?? i}`, grouped: false,
    data: shown.map(r => cell(r, i)), barPercentage: 0.85, categoryPercentage: 1,
    backgroundColor: shown.map(r => m.rs[r][i] && m.slow.has(`${r}/${m.rs[r][i][0]}`) ? "#e15759"
      : (i % 2 ? "#4e79a7" : "#a0cbe8")) }));
  const made = mount(box, { type: "bar", data: { labels: shown.map(r => `rank ${r}`), datasets: sets },
    options: { indexAxis: "y",
      plugins: { legend: { display: false }, tooltip: { callbacks: { label: c => {
        const r = shown[c.dataIndex], [s, ms] = m.rs[r][c.datasetIndex];
        return `rank ${r}, step ${s}: ${num(ms, 1)} ms (x${num(ms / (m.med[s] || 1), 2)} its median)`; } } } },
      scales: { x: { beginAtZero: true, title: { display: true, text: "ms from each rank's first recorded step" } } } } });
  holder.chart = made;
  holder.$strip = { page, pages, ranks: shown, slowRank: m.slowRank, slowStep: m.worst.step,
                    slow: [...m.slow] };
}

function launches(main, ks) {
  const rows = Object.entries(ks.launch || {}).map(([r, v]) => Object.assign({ rank: r }, v));
  if (!rows.length) return;
  main.append(el("h2", {}, "Launches (CUDA ranks)"));
  main.append(table(
    [{ label: "rank", get: r => r.rank }, { label: "launches", get: r => r.kernels, num: true },
     { label: "delay p50 us", get: r => num(r.delay_p50_us, 1), num: true },
     { label: "delay p95 us", get: r => num(r.delay_p95_us, 1), num: true },
     { label: "shorter than launch", get: r => pct(r.short_share), num: true },
     { label: "unattributed us", get: r => num((ks.unattributed_us || {})[r.rank] ?? 0), num: true },
     { label: "launch-bound steps", get: r => r.launch_bound.join(", ") }], rows));
}

function heatmap(main, ks) {
  main.append(el("h2", {}, `Rank x top kernel (${ks.device === "cuda" ? "device" : "self"} time, us)`));
  if (!ks.per_rank) { main.append(el("p", { class: "muted" }, "per-rank values are no longer kept for this window")); return; }
  const names = ks.kernels.slice(0, 10).map(k => k.name);
  const labels = names.map((n, i) => `${i + 1}. ${n.slice(0, 36)}`);  // unique, even when cut
  const data = [];
  let top = 0;
  names.forEach((n, i) => Object.entries(ks.per_rank[n] || {}).forEach(([r, v]) => {
    data.push({ x: labels[i], y: String(r), v, name: n }); top = Math.max(top, v); }));
  const ranks = [...new Set(data.map(d => d.y))].sort((a, b) => a - b);
  chart(main, { type: "matrix", data: { datasets: [{ label: "self time (us)", data,
    backgroundColor: c => `rgba(32, 90, 170, ${0.08 + 0.92 * ((c.raw?.v ?? 0) / (top || 1))})`,
    width: c => (c.chart.chartArea || {}).width / names.length - 2,
    height: c => (c.chart.chartArea || {}).height / Math.max(1, ranks.length) - 2 }] },
    options: { plugins: { legend: { display: false }, tooltip: { callbacks: {
      label: c => `rank ${c.raw.y}, ${c.raw.name}: ${num(c.raw.v)} us` } } },
      scales: { x: { type: "category", labels },
                y: { type: "category", labels: ranks, offset: true } } } });
}

function breakdown(main, ks) {
  const cuda = ks.device === "cuda" || ks.device === "mixed";
  main.append(el("h2", {}, cuda ? "Breakdown per rank over the device span (us)" : "Breakdown per rank (us)"));
  const ranks = Object.keys(ks.breakdown.ranks);
  const row = r => ks.breakdown.ranks[r];
  // CUDA: compute and comm are unions that overlap; stack comm only where no compute runs.
  const cats = cuda
    ? [["compute", r => row(r).compute_us], ["comm (no compute beside it)", r => row(r).comm_us - (row(r).overlap_us ?? 0)],
       ["memcpy", r => row(r).memcpy_us], ["idle", r => row(r).other_us]]
    : ["compute", "comm", "memcpy", "other"].map(c => [c, r => row(r)[`${c}_us`] ?? 0]);
  chart(main, { type: "bar", data: { labels: ranks.map(r => `rank ${r}`), datasets: cats.map(([label, get]) =>
    ({ label, data: ranks.map(get) })) },
    options: { scales: { x: { stacked: true }, y: { stacked: true } } } });
  if (cuda) main.append(table(
    [{ label: "rank", get: r => r }, { label: "comm us", get: r => num(row(r).comm_us), num: true },
     { label: "overlap us", get: r => num(row(r).overlap_us), num: true },
     { label: "comm with compute beside it", get: r => pct(row(r).comm_overlap), num: true }], ranks));
}

function stragglers(main, ks) {
  const s = ks.stragglers;
  main.append(el("h2", {}, `Stragglers (threshold x${num(s.threshold, 2)}; median step ${num(s.median_step_ms, 1)} ms)`));
  const rows = Object.entries(s.ranks).map(([r, v]) => Object.assign({ rank: r }, v));
  main.append(table(
    [{ label: "rank", get: r => r.rank }, { label: "step ms", get: r => num(r.step_ms, 1), num: true },
     { label: "x median", get: r => num(r.step_ratio, 2), num: true },
     { label: "compute ms", get: r => num(r.compute_ms, 1), num: true },
     { label: "compute x", get: r => num(r.compute_ratio, 2), num: true },
     { label: "comm share", get: r => pct(r.comm_share), num: true },
     { label: "flagged", get: r => r.flagged ? "straggler" : "" },
     { label: "launch-bound steps", get: r => (r.launch_bound || []).join(", ") },
     { label: "trace", get: r => traceLink(`/api/windows/${ks.window}/timeline.json.gz?ranks=${r.rank}` +
         `&role=${encodeURIComponent(ks.role ?? "policy")}`, `rank ${r.rank}`, `rank ${r.rank}'s trace in Perfetto`) }],
    rows, r => r.flagged ? "flagged" : null));
  const last = s.last_arriver;
  if (last) main.append(el("p", { class: "slower", id: "straggler-arriver" },
    `collectives: rank ${last.rank} ${last.reason}` + (last.note ? ` (not a compute straggler: ${last.note})` : "")));
  const peak = ks.memory ? String(ks.memory.max_peak_rank) : null;
  if (peak !== null && (s.flagged || []).map(String).includes(peak))
    main.append(el("p", { class: "slower", id: "straggler-memory" }, `rank ${peak}, a straggler, is also the rank ` +
      `with the highest memory peak (${num(ks.memory.max_peak_bytes / 2 ** 20, 1)} MB)`));
  main.append(el("h2", {}, "Step time per rank (ms)"));
  chart(main, { type: "bar", data: { labels: rows.map(r => `rank ${r.rank}`),
    datasets: [{ label: "mean step time (ms)", data: rows.map(r => r.step_ms) }] } });
}

function memory(main, ks) {
  main.append(el("h2", {}, "Memory peaks per rank"));
  if (!ks.memory) { main.append(el("p", { class: "muted" }, "profile_memory is off in this run")); return; }
  const ranks = Object.keys(ks.memory.peak_bytes), m = ks.memory;
  const at = r => (m.peak_step || {})[r], mb = b => b === null || b === undefined ? "" : num(b / 2 ** 20, 1);
  main.append(el("p", { id: "memory-peak" }, `highest peak: rank ${m.max_peak_rank}, ${mb(m.max_peak_bytes)} MB` +
    (at(m.max_peak_rank) !== null && at(m.max_peak_rank) !== undefined ? `, in step ${at(m.max_peak_rank)}` : "")));
  main.append(table(
    [{ label: "rank", get: r => r }, { label: "peak MB", get: r => mb(m.peak_bytes[r]), num: true },
     { label: "peak in step", get: r => at(r) ?? "", num: true },
     { label: "allocated MB", get: r => mb((m.allocated_bytes || {})[r]), num: true },
     { label: "freed MB", get: r => mb((m.freed_bytes || {})[r]), num: true }], ranks));
  chart(main, { type: "bar", data: { labels: ranks.map(r => `rank ${r}`),
    datasets: [{ label: "peak allocated (MB)", data: ranks.map(r => m.peak_bytes[r] / 2 ** 20) }] } });
}

function capturesPage(main, st) {
  main.append(el("h2", {}, "Request a capture"));
  if (state.viewer.read_only) { main.append(el("p", { class: "muted" }, state.viewer.read_only)); return; }
  const answer = el("div", { id: "capture-answer", class: "answer muted" }, "no request yet");
  const form = el("form", { class: "inline", id: "capture-form" },
    el("label", {}, "active ", el("input", { name: "active", type: "number", min: 1, value: 2 })),
    el("label", {}, "warmup ", el("input", { name: "warmup", type: "number", min: 0, value: 1 })),
    el("label", {}, "ranks ", el("input", { name: "ranks", placeholder: "all selected" })),
    el("label", {}, "start step ", el("input", { name: "start_step", type: "number", min: 0 })),
    el("label", {}, "token ", el("input", { name: "token", type: "password", class: "wide",
                                             value: state.token })),
    el("button", { type: "submit" }, "Capture"));
  form.addEventListener("submit", async ev => {
    ev.preventDefault();
    const f = new FormData(form);
    state.token = String(f.get("token") || "");
    sessionStorage.setItem("rayProfilerToken", state.token);
    const body = { active: Number(f.get("active")), warmup: Number(f.get("warmup")) };
    if (f.get("ranks")) body.ranks = String(f.get("ranks")).split(",").map(x => Number(x.trim()));
    if (f.get("start_step")) body.start_step = Number(f.get("start_step"));
    const res = await api("/api/captures", { method: "POST", json: body, auth: true });
    answer.className = "answer " + (res.ok ? "ok" : "error");
    answer.textContent = res.ok
      ? `accepted: window ${res.body.window}, steps ${res.body.steps.join("-")}, ranks ${res.body.ranks.join(", ")}`
      : `refused (${res.status}): ${res.body.reason ?? res.body.error}`;
    if (res.ok) pendingCapture(main, res.body.window);
  });
  main.append(form, answer);
  const next = st.next_window;
  if (next && next.kind === "capture") pendingCapture(main, next.index);
}

function pendingCapture(main, index) {
  if (document.getElementById(`cancel-${index}`)) return;
  const out = el("span", { class: "muted" }, "");
  const button = el("button", { id: `cancel-${index}`, onclick: async () => {
    const res = await api(`/api/captures/${index}`, { method: "DELETE", auth: true });
    out.textContent = res.ok ? " cancelled" : ` not cancelled (${res.status}): ${res.body.reason ?? res.body.error}`;
  } }, `Cancel capture ${index}`);
  main.append(el("p", {}, button, out));
}

async function diffPage(main, st, a, b) {
  const closed = st.windows.filter(w => w.steps).map(w => w.index);
  if (a === undefined) a = closed[0];
  if (b === undefined) b = closed[closed.length - 1];
  const side = (name, value) => el("input", { name, value: value ?? "", title: "WINDOW, or RUN:WINDOW for another job's run" });
  const form = el("form", { class: "inline" },
    el("label", {}, "window A ", side("a", a)), el("label", {}, "window B ", side("b", b)),
    el("button", { type: "submit" }, "Compare"));
  form.addEventListener("submit", ev => {
    ev.preventDefault();
    const f = new FormData(form);
    location.hash = `#/diff/${encodeURIComponent(f.get("a"))}/${encodeURIComponent(f.get("b"))}`;
  });
  main.append(el("h2", {}, "Window diff"), form,
    el("p", { class: "muted" }, "A side may be RUN:WINDOW: a run this coordinator keeps, or one recorded under its save_path (another job)."));
  if (a === undefined || b === undefined) { main.append(el("p", { class: "muted" }, "no closed window yet")); return; }
  const res = await api(`/api/diff?a=${encodeURIComponent(a)}&b=${encodeURIComponent(b)}&top_k=30`);
  if (!res.ok) { fail(main, "diff", res); return; }
  const d = res.body;
  const named = ref => ref.run && ref.run !== st.run.name ? `${ref.run}:${ref.window}` : `window ${ref.window}`;
  main.append(el("p", {}, `${named(d.b)} (steps ${d.b.steps.join("-")}) against ${named(d.a)} ` +
    `(steps ${d.a.steps.join("-")}): every kernel per step ${num(d.total_us[0])} -> ${num(d.total_us[1])} us; ` +
    `step ${num(d.step_ms[0], 1)} -> ${num(d.step_ms[1], 1)} ms (x${num(d.step_ratio, 2)})`));
  main.append(table(
    [{ label: "kernel", get: k => k.name }, { label: "status", get: k => k.status },
     { label: "A us/step", get: k => num(k.a_us, 1), num: true }, { label: "B us/step", get: k => num(k.b_us, 1), num: true },
     { label: "change", get: k => num(k.change_us, 1), num: true }, { label: "ratio", get: k => num(k.ratio, 2), num: true }],
    d.kernels));
  const top = d.kernels.slice(0, 15);
  chart(main, { type: "bar", data: { labels: top.map(k => k.name.slice(0, 50)),
    datasets: [{ label: "change per step (us)", data: top.map(k => k.change_us) }] }, options: { indexAxis: "y" } }, true);
  main.append(el("h2", {}, "Breakdown shift"));
  main.append(table(
    [{ label: "category", get: r => r.category }, { label: "A us", get: r => num(r.a_us), num: true },
     { label: "B us", get: r => num(r.b_us), num: true }, { label: "A share", get: r => pct(r.a_share), num: true },
     { label: "B share", get: r => pct(r.b_share), num: true }], d.breakdown));
}

async function phasesPage(main) {
  const res = await api("/api/phases?last=200");
  if (!res.ok) { fail(main, "phases", res); return; }
  const p = res.body;
  main.append(el("h2", {}, `Phase times: the last ${p.steps.length} steps (${p.steps_seen} seen)`));
  main.append(table(
    [{ label: "region", get: r => r.region }, { label: "mean ms", get: r => num(r.mean_ms, 1), num: true },
     { label: "share", get: r => pct(r.share), num: true }, { label: "max ms", get: r => num(r.max_ms, 1), num: true }],
    p.regions));
  const names = p.regions.map(r => r.region);
  chart(main, { type: "bar", data: { labels: p.steps.map(s => s.step), datasets: [
    ...names.map(n => ({ label: n, data: p.steps.map(s => s.regions[n] ?? 0) })),
    { label: "(in no region)", data: p.steps.map(s => s.other_ms) }] },
    options: { scales: { x: { stacked: true }, y: { stacked: true, title: { display: true, text: "ms" } } } } });
}

function stallsPage(main, st) {
  main.append(el("h2", {}, "Stalls"));
  if (!st.stalls.length) { main.append(el("p", { class: "muted" }, "no stall in this run")); return; }
  for (const s of st.stalls.slice().reverse()) {
    main.append(el("h2", {}, `Stall ${s.index}: trainer ${s.trainer_id}, after step ${s.last_step ?? "-"}` +
      (s.resumed_at ? `, resumed at step ${s.resumed_step}` : ", still stalled")));
    if (s.culprit) main.append(el("p", { class: "error" }, s.culprit));
    main.append(el("pre", {}, s.lines.join("\n")));
    if (s.path) main.append(el("p", { class: "muted" }, s.path));
  }
}

// ------------------------------------------------------------------ router

function parseRoute() {
  const parts = location.hash.replace(/^#\/?/, "").split("/").filter(Boolean);
  return { name: parts[0] || "run", args: parts.slice(1).map(decodeURIComponent) };
}

async function render() {
  const st = state.status;
  const route = parseRoute();
  state.route = route;
  const main = clear();
  if (!st) { main.append(el("p", { class: "muted" }, "waiting for the coordinator...")); return; }
  if (route.name === "window") await windowPage(main, Number(route.args[0]), route.args[1], route.args[2]);
  else if (route.name === "captures") capturesPage(main, st);
  else if (route.name === "diff") await diffPage(main, st, route.args[0], route.args[1]);
  else if (route.name === "phases") await phasesPage(main);
  else if (route.name === "stalls") stallsPage(main, st);
  else runPage(main, st);
  state.shown = fingerprint(st);
}

function fingerprint(st) {
  // What a view shows changes when a step, a window, a rank state or a stall changes.
  return JSON.stringify([st.global_step, st.phase, st.windows.map(w => [w.index, w.rank_count,
    w.summaries_pending.length, w.traces_pending.length, marksText(w)]), st.rank_counts, st.stalls.length]);
}

async function poll() {
  const res = await api("/api/status");
  const live = document.getElementById("live");
  if (!res.ok) {
    live.textContent = `coordinator: ${res.status} ${res.body?.error ?? ""}`;
    live.className = "error";
    return;
  }
  state.status = res.body;
  live.className = "";
  live.textContent = state.viewer.read_only
    ? `${res.body.run.name} · step ${res.body.global_step ?? "-"} · record (read-only)`
    : `${res.body.run.name} · step ${res.body.global_step ?? "-"} · ${res.body.phase}`;
  const busyPage = ["captures", "diff"].includes(state.route?.name);  // keep what is typed
  if (state.shown === null || (!busyPage && fingerprint(res.body) !== state.shown)) await render();
}

window.addEventListener("hashchange", () => render());
async function start() {
  const res = await api("/api/viewer");
  if (res.ok) state.viewer = res.body;
  if (state.viewer.read_only) {  // a run's record: nothing to capture, a banner that says so
    document.getElementById("nav-captures")?.remove();
    document.querySelector("header")?.append(el("p", { id: "read-only", class: "muted" }, state.viewer.read_only));
  }
  await poll();
  setInterval(poll, POLL_MS);
}

start();
