// The dashboard page: polls the coordinator's /api/... once a second and draws tables and SVG curves.
// Every value from the server goes in through textContent or an SVG attribute, never as HTML.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const RETURNS = [["train", "train_return_mean", "#1a6fd6", false], ["eval", "eval_return_mean", "#e07000", true]];
const SKIP = new Set(["iteration", "env_steps", "wall_time_s", "weight_version", "time", "train_return_mean",
  "eval_return_mean"]);
let selected = decodeURIComponent(location.hash.slice(1));
let series = {run: "", next: 0, rows: []};  // the selected run's metric rows so far (the API sends only new ones)
let tick = 0;
let polling = false;  // one poll at a time: two would both append the same new rows

function $(id) { return document.getElementById(id); }

function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text === undefined || text === null ? "" : String(text);
  if (cls) td.className = cls;
  return td;
}

function fill(tbody, items, render) {
  tbody.replaceChildren();
  for (const item of items) render(tbody.insertRow(), item);
}

function num(x, digits = 1) {
  return typeof x === "number" && isFinite(x) ? x.toFixed(digits) : "-";
}

function clock(t) { return new Date(t * 1000).toLocaleTimeString(); }

async function get(path) {
  const response = await fetch(path, {credentials: "same-origin", cache: "no-store",
    signal: AbortSignal.timeout(10000)});  // a request that hangs must not stop the polling
  if (response.status === 401) throw new Error("session expired: log in again with a fresh login URL");
  if (!response.ok) throw new Error(`${path}: ${response.status} ${await response.text()}`);
  return response.json();
}

function renderRuns(runs) {
  if (!runs.some(r => r.run_id === selected) && runs.length) {  // the newest live run, else the newest
    const live = runs.filter(r => r.state === "RUNNING" || r.state === "PENDING");
    selected = (live.length ? live : runs)[(live.length ? live : runs).length - 1].run_id;
  }
  fill($("runs").tBodies[0], runs, (tr, r) => {
    tr.dataset.runId = r.run_id;
    if (r.run_id === selected) tr.className = "selected";
    tr.addEventListener("click", () => { selected = r.run_id; location.hash = encodeURIComponent(r.run_id); poll(); });
    cell(tr, r.run_id, "mono");
    cell(tr, r.state, `state-${r.state}`);
    cell(tr, r.stage || "run");
    const td = cell(tr, "");
    const bar = document.createElement("progress");
    bar.max = Math.max(r.total, 1);
    bar.value = Math.min(r.done, bar.max);
    td.append(bar, ` ${r.done} / ${r.total} ${r.unit}`);
    cell(tr, r.weight_version);
    cell(tr, r.recoveries, r.recoveries ? "bad" : "");
    cell(tr, r.reason);
  });
}

function renderWorkers(workers) {
  fill($("workers").tBodies[0], workers, (tr, w) => {
    cell(tr, w.worker_id, "mono");
    cell(tr, w.role);
    cell(tr, w.host);
    cell(tr, w.pid);
    cell(tr, w.alive ? "alive" : "LOST", w.alive ? "ok" : "bad");
    cell(tr, `${num(w.since_heartbeat_s)} s ago`);
    cell(tr, `${num(w.since_progress_s)} s ago`);
    cell(tr, w.run_id, "mono");
    cell(tr, w.title, "mono");
  });
}

function el(name, attrs, parent) {
  const node = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (parent) parent.appendChild(node);
  return node;
}

// Lines (and dots) of [[x, y], ...] series on axes fitted to them; each series also lands in data-<name>.
function chart(svg, lines, xlabel) {
  svg.replaceChildren();
  const W = 560, H = 260, L = 52, R = 12, T = 10, B = 34;
  const all = lines.flatMap(s => s.points);
  for (const s of lines) svg.dataset[s.name] = JSON.stringify(s.points);
  svg.dataset.points = String(all.length);
  if (!all.length) {
    el("text", {x: W / 2 - 60, y: H / 2}, svg).textContent = "no data yet";
    return;
  }
  let [x0, x1] = [Math.min(...all.map(p => p[0])), Math.max(...all.map(p => p[0]))];
  let [y0, y1] = [Math.min(...all.map(p => p[1])), Math.max(...all.map(p => p[1]))];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= 1; y1 += 1; }
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R);
  const sy = y => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  for (let i = 0; i <= 4; i++) {
    const y = y0 + (y1 - y0) * i / 4;
    el("line", {x1: L, x2: W - R, y1: sy(y), y2: sy(y), class: "grid"}, svg);
    el("text", {x: 4, y: sy(y) + 4}, svg).textContent = String(Number(y.toPrecision(3)));
    const x = x0 + (x1 - x0) * i / 4;
    el("text", {x: sx(x) - 14, y: H - B + 16}, svg).textContent = Math.round(x).toString();
  }
  el("line", {x1: L, x2: L, y1: T, y2: H - B, class: "axis"}, svg);
  el("line", {x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis"}, svg);
  el("text", {x: W / 2 - 20, y: H - 4}, svg).textContent = xlabel;
  let legend = L + 8;
  for (const s of lines) {
    if (!s.points.length) continue;
    const d = s.points.map((p, i) => `${i ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join("");
    el("path", {d, fill: "none", stroke: s.color, "stroke-width": 2, "data-series": s.name}, svg);
    if (s.dots) for (const p of s.points) el("circle", {cx: sx(p[0]), cy: sy(p[1]), r: 3, fill: s.color}, svg);
    el("text", {x: legend, y: T + 12, fill: s.color}, svg).textContent = s.name;
    legend += 60;
  }
}

function renderCharts() {
  const rows = series.rows;
  const byIteration = !rows.some(r => r.env_steps > 0);
  const xkey = byIteration ? "iteration" : "env_steps";
  const pick = key => rows.filter(r => typeof r[key] === "number").map(r => [r[xkey], r[key]]);
  chart($("returns"), RETURNS.map(([name, key, color, dots]) => ({name, color, dots, points: pick(key)})),
    xkey.replace("_", " "));
  const select = $("metric");
  const keys = [...new Set(rows.flatMap(r => Object.keys(r)))].filter(k => !SKIP.has(k)).sort();
  if (keys.join() !== [...select.options].map(o => o.value).join()) {
    const keep = select.value;
    select.replaceChildren(...keys.map(k => new Option(k, k)));
    select.value = keys.includes(keep) ? keep : (keys.find(k => k.endsWith("loss")) || keys[0] || "");
  }
  chart($("metric-chart"), [{name: "metric", color: "#6a3fb5", dots: false, points: pick(select.value)}],
    xkey.replace("_", " "));
}

function renderRun(detail) {
  $("run-view").hidden = false;
  $("run-id").textContent = detail.run.run_id;
  fill($("placement").tBodies[0], detail.placement, (tr, p) => {
    cell(tr, p.role);
    cell(tr, p.worker_id, "mono");
    cell(tr, p.host);
    cell(tr, p.pid);
    cell(tr, p.weight_version === null ? "-" : `v${p.weight_version}`);
    cell(tr, p.staleness === null ? "-" : p.staleness, p.staleness > 0 ? "bad" : "");
    cell(tr, p.alive ? p.error : `lost ${p.error}`, p.alive && !p.error ? "" : "bad");
  });
  if (!detail.placement.length) {
    cell($("placement").tBodies[0].insertRow(), `not placed (${detail.run.state})`, "note");
  }
  const timeline = $("recoveries");
  timeline.replaceChildren(...detail.recoveries.map(r => {
    const li = document.createElement("li");
    li.textContent = `${clock(r.time)}  recovery ${r.attempt}: lost ${r.role} ${r.worker_id} (${r.cause}); ` +
      `discarded ${r.discarded}; resumed at iteration ${r.resumed_at_iteration} from ` +
      `${r.resumed_from || "the start"}, ${num(r.seconds)} s after the loss`;
    return li;
  }));
  timeline.dataset.count = String(detail.recoveries.length);
  if (!detail.recoveries.length) {
    const li = document.createElement("li");
    li.className = "note";
    li.textContent = "none: no worker of this run was lost";
    timeline.append(li);
  }
  $("logs").replaceChildren(...detail.logs.slice(-12).map(l => {
    const li = document.createElement("li");
    li.className = l.level;
    li.textContent = `${clock(l.time)}  ${l.message}`;
    return li;
  }));
}

function renderGateways(view) {
  const rows = view.gateways.flatMap(g => g.robots.length ? g.robots.map(r => [g, r]) : [[g, null]]);
  fill($("gateways").tBodies[0], rows, (tr, [g, r]) => {
    cell(tr, `${g.address}${g.registered ? "" : " (named by --dashboard-gateway)"}`, "mono");
    if (!r) { cell(tr, g.error ? `unreachable: ${g.error}` : "no arms connected", g.error ? "bad" : "note"); return; }
    cell(tr, r.robot_id, "mono");
    cell(tr, `${r.driver} @ ${num(r.control_hz, 0)} Hz`);
    cell(tr, `${num(r.jitter_ms, 2)} ms`);
    const td = cell(tr, `max ${num(r.jitter_max_ms, 2)} ms `);
    const svg = el("svg", {width: 120, height: 20, viewBox: "0 0 120 20", "data-series": JSON.stringify(r.jitter_ms_series)}, td);
    const top = Math.max(r.jitter_max_ms, 1e-6);
    el("path", {fill: "none", stroke: "#1a6fd6", d: r.jitter_ms_series.map((v, i) =>
      `${i ? "L" : "M"}${i},${(19 - 18 * v / top).toFixed(1)}`).join("")}, svg);
    cell(tr, `${num(r.lateness_ms, 2)} ms`);
    cell(tr, r.overruns, r.overruns ? "bad" : "");
    cell(tr, r.estopped ? `E-STOP ${r.hold_reason}` : r.holding ? `holding: ${r.hold_reason}` : "no",
      r.estopped || r.fault ? "bad" : "");
    cell(tr, `${r.intervening ? "INTERVENING; " : ""}${r.episode_intervened_ticks} ticks this episode (#${r.episode})`);
  });
  const named = view.named_by_runs.filter(n => !view.gateways.some(g => g.address === n.gateway));
  $("gateway-note").textContent = (view.gateways.length ? "" :
    "No robot gateway is registered with this coordinator (serve robot_gateway --coordinator ADDR) or named " +
    "with --dashboard-gateway HOST:PORT. ") + named.map(n =>
    `Run ${n.run_id} drives gateway ${n.gateway}, which is neither: start the coordinator with ` +
    `--dashboard-gateway ${n.gateway} to see its arms here.`).join(" ");
}

async function poll() {
  if (polling) return;
  polling = true;
  try {
    const overview = await get("/api/overview");
    $("coordinator").textContent = `coordinator ${overview.coordinator}`;
    renderRuns(overview.runs);
    renderWorkers(overview.workers);
    if (selected) {
      if (series.run !== selected) series = {run: selected, next: 0, rows: []};
      const detail = await get(`/api/runs/${encodeURIComponent(selected)}?since=${series.next}`);
      if (series.run === selected) {
        for (const row of detail.metrics) {  // a recovered run repeats iterations after its checkpoint: the new
          while (series.rows.length && series.rows[series.rows.length - 1].iteration >= row.iteration) {
            series.rows.pop();  // rows replace the old ones, as in its metrics.csv
          }
          series.rows.push(row);
        }
        series.next = detail.next;
        renderCharts();
        renderRun(detail);
      }
    }
    if (tick++ % 2 === 0) renderGateways(await get("/api/gateways"));
    $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    $("error").textContent = "";
  } catch (err) {
    $("error").textContent = String(err.message || err);
  } finally {
    polling = false;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("metric").addEventListener("change", renderCharts);
  poll();
  setInterval(poll, 1000);
});
