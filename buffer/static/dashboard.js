// The rollout-buffer dashboard: polls /dashboard/data once a second and draws on canvases.
// No dependencies, no build step. window.dashboardState says what the page last drew.
"use strict";

const POLL_MS = 1000;
const PALETTE = ["#2563eb", "#e67e22", "#16a34a", "#9333ea", "#dc2626", "#0891b2", "#ca8a04", "#db2777"];
const SERIES = { pending: "#e67e22", ready: "#2563eb", delivered: "#16a34a", rate: "#2563eb" };

window.dashboardState = { updates: 0, samples: 0, lastSampleT: null, lastUpdate: null, error: null, charts: {} };

const taskColors = new Map();
function colorFor(task) {
  if (!taskColors.has(task)) taskColors.set(task, PALETTE[taskColors.size % PALETTE.length]);
  return taskColors.get(task);
}

// --- formatting ------------------------------------------------------------------------

function fmt(value, digits = 0) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  return Number(value).toLocaleString(undefined, { minimumFractionDigits: digits, maximumFractionDigits: digits });
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

function niceStep(span, ticks) {
  const raw = span / Math.max(ticks, 1);
  const magnitude = 10 ** Math.floor(Math.log10(raw));
  const scaled = raw / magnitude;
  const nice = scaled <= 1 ? 1 : scaled <= 2 ? 2 : scaled <= 5 ? 5 : 10;
  return nice * magnitude;
}

function tickLabel(value, step) {
  const digits = step >= 1 ? 0 : Math.min(3, Math.ceil(-Math.log10(step)));
  return value.toFixed(digits);
}

// --- charts ----------------------------------------------------------------------------

// series: [{name, color, points: [[t, y]], band: [[t, lo, hi]] | undefined}]; t in seconds.
function drawChart(canvas, series, options = {}) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  ctx.font = "12px system-ui, -apple-system, 'Segoe UI', Roboto, Arial, sans-serif";

  const pad = { left: 48, right: 12, top: 26, bottom: 24 };
  const plotW = width - pad.left - pad.right;
  const plotH = height - pad.top - pad.bottom;

  const all = series.flatMap((s) => s.points);
  const pointCount = all.length;
  const tNow = options.now ?? (all.length ? Math.max(...all.map((p) => p[0])) : 0);
  const tMin = all.length ? Math.min(...all.map((p) => p[0])) : tNow - 60;
  const span = Math.max(tNow - tMin, 10);
  let yMin = options.yMin ?? Infinity;
  let yMax = -Infinity;
  for (const s of series) {
    for (const [, y] of s.points) { yMin = Math.min(yMin, y); yMax = Math.max(yMax, y); }
    for (const [, lo, hi] of s.band || []) { yMin = Math.min(yMin, lo); yMax = Math.max(yMax, hi); }
  }
  if (!Number.isFinite(yMin)) yMin = 0;
  if (!Number.isFinite(yMax) || yMax <= yMin) yMax = yMin + 1;
  const yStep = niceStep(yMax - yMin, 4);
  yMin = Math.floor(yMin / yStep) * yStep;
  yMax = Math.ceil(yMax / yStep) * yStep;

  const x = (t) => pad.left + ((t - (tNow - span)) / span) * plotW;
  const y = (v) => pad.top + plotH - ((v - yMin) / (yMax - yMin)) * plotH;

  // grid and axes
  ctx.strokeStyle = "#e3e7ed";
  ctx.fillStyle = "#6b7785";
  ctx.lineWidth = 1;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (let v = yMin; v <= yMax + yStep / 2; v += yStep) {
    ctx.beginPath();
    ctx.moveTo(pad.left, Math.round(y(v)) + 0.5);
    ctx.lineTo(pad.left + plotW, Math.round(y(v)) + 0.5);
    ctx.stroke();
    ctx.fillText(tickLabel(v, yStep), pad.left - 6, y(v));
  }
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  const xStep = niceStep(span, 5);
  for (let ago = 0; ago <= span; ago += xStep) {
    ctx.fillText(ago === 0 ? "now" : `-${Math.round(ago)}s`, x(tNow - ago), pad.top + plotH + 6);
  }

  if (pointCount === 0) {
    ctx.textBaseline = "middle";
    ctx.fillText("waiting for data…", pad.left + plotW / 2, pad.top + plotH / 2);
  }

  // bands, then lines
  for (const s of series) {
    if (!s.band || s.band.length < 2) continue;
    ctx.beginPath();
    s.band.forEach(([t, , hi], i) => (i ? ctx.lineTo(x(t), y(hi)) : ctx.moveTo(x(t), y(hi))));
    for (let i = s.band.length - 1; i >= 0; i--) ctx.lineTo(x(s.band[i][0]), y(s.band[i][1]));
    ctx.closePath();
    ctx.globalAlpha = 0.15;
    ctx.fillStyle = s.color;
    ctx.fill();
    ctx.globalAlpha = 1;
  }
  for (const s of series) {
    if (!s.points.length) continue;
    ctx.strokeStyle = s.color;
    ctx.lineWidth = 2;
    ctx.lineJoin = "round";
    ctx.beginPath();
    s.points.forEach(([t, v], i) => (i ? ctx.lineTo(x(t), y(v)) : ctx.moveTo(x(t), y(v))));
    ctx.stroke();
    if (s.points.length === 1) {
      ctx.fillStyle = s.color;
      ctx.beginPath();
      ctx.arc(x(s.points[0][0]), y(s.points[0][1]), 3, 0, 2 * Math.PI);
      ctx.fill();
    }
  }

  // legend, top left
  ctx.textAlign = "left";
  ctx.textBaseline = "middle";
  let lx = pad.left;
  for (const s of series) {
    const label = s.points.length ? `${s.name} ${fmt(s.points[s.points.length - 1][1], options.digits ?? 0)}` : s.name;
    ctx.fillStyle = s.color;
    ctx.fillRect(lx, 8, 10, 10);
    ctx.fillStyle = "#1f2933";
    ctx.fillText(label, lx + 14, 13);
    lx += ctx.measureText(label).width + 30;
  }

  canvas.dataset.points = String(pointCount);
  window.dashboardState.charts[canvas.id] = { points: pointCount, series: series.length, last: tNow };
}

// --- data to series --------------------------------------------------------------------

function rates(history) {
  const points = [];
  for (let i = 1; i < history.length; i++) {
    const dt = history[i].t - history[i - 1].t;
    if (dt > 0) points.push([history[i].t, Math.max(0, history[i].total_written - history[i - 1].total_written) / dt]);
  }
  return points;
}

function summed(history, field) {
  // Samples carry totals over every task; each sample's tasks are only the most active ones.
  return history.map((s) => [s.t, field in s ? s[field] : Object.values(s.tasks || {}).reduce((sum, task) => sum + (task[field] || 0), 0)]);
}

function rewardSeries(history) {
  const byTask = new Map();
  for (const sample of history) {
    for (const [name, task] of Object.entries(sample.tasks || {})) {
      if (!task.written || task.reward_mean === null) continue;
      if (!byTask.has(name)) byTask.set(name, { name, color: colorFor(name), points: [], band: [] });
      const entry = byTask.get(name);
      const std = task.reward_std || 0;
      entry.points.push([sample.t, task.reward_mean]);
      entry.band.push([sample.t, task.reward_mean - std, task.reward_mean + std]);
    }
  }
  return [...byTask.values()];
}

// --- tables and lists ------------------------------------------------------------------

function fillRows(tbody, rows, columns, emptyText) {
  tbody.replaceChildren();
  if (!rows.length) {
    tbody.append(el("tr", { class: "empty" }, el("td", { colspan: String(columns) }, emptyText)));
    return;
  }
  for (const cells of rows) tbody.append(el("tr", {}, ...cells.map((cell) => el("td", {}, cell))));
}

function renderTasks(stats) {
  const rows = Object.values(stats.tasks || {}).map((task) => {
    const discarded = Object.entries(task.discarded_groups || {}).map(([why, n]) => `${why}: ${n}`).join(", ");
    const name = el("span", {}, el("span", { class: "badge", style: `background:${colorFor(task.task_type)};color:#fff` }, task.task_type));
    return [
      name, task.group_size, fmt(task.total_written), fmt(task.pending_groups), fmt(task.ready_groups),
      fmt(task.delivered_groups), fmt(task.delivered_items), discarded || "0", fmt(task.set_aside_groups),
      task.reward_count ? fmt(task.reward_mean, 3) : "–", task.reward_count > 1 ? fmt(task.reward_std, 3) : "–",
    ];
  });
  fillRows(document.querySelector("#tasks tbody"), rows, 11, "no task has data yet");
}

function renderJobs(jobs) {
  const rows = jobs.map((job) => {
    const progress = Object.entries(job.progress || {})
      .filter(([, value]) => typeof value !== "object") // histograms and counts by kind: not a cell
      .map(([key, value]) => `${key.replaceAll("_", " ")}: ${typeof value === "number" ? fmt(value, Number.isInteger(value) ? 0 : 2) : value}`)
      .join(" · ");
    let error = "";
    if (job.error) {
      error = el("div", { class: "error" }, job.error);
      if (job.where) error.append(el("div", { class: "file" }, `at ${job.where}`));
    }
    return [
      job.id, job.task_type, el("span", { class: `badge ${job.status}` }, job.status),
      `${fmt(job.duration_s, 1)} s`, fmt(job.counters ? job.counters.written : null), progress || "–", error || "–",
    ];
  });
  fillRows(document.querySelector("#jobs tbody"), rows, 7, "no jobs yet");
}

function renderList(list, items, emptyText, render) {
  list.replaceChildren();
  if (!items.length) {
    list.append(el("li", { class: "empty" }, emptyText));
    return;
  }
  for (const item of items) list.append(render(item));
}

function renderGenerators(generators, errors) {
  renderList(document.getElementById("generators"), generators, "none found", (g) =>
    el("li", {}, el("strong", {}, g.task_type), ` (${g.run_rollout}) `, el("div", { class: "file" }, g.file)));
  renderList(document.getElementById("generator-errors"), errors, "none", (e) => {
    const item = el("li", { class: "generator-error" },
      el("strong", {}, e.task_type), ` — ${e.kind} error`, el("div", { class: "file" }, e.file), el("div", { class: "error" }, e.error));
    if (e.where) item.append(el("div", { class: "file" }, `at ${e.where}`));
    return item;
  });
}

// --- the loop --------------------------------------------------------------------------

function render(data) {
  const history = data.history || [];
  const stats = data.stats || {};
  const now = history.length ? history[history.length - 1].t : Date.now() / 1000;
  const rate = rates(history);

  document.getElementById("tile-written").textContent = fmt(stats.total_written);
  document.getElementById("tile-read").textContent = fmt(stats.total_read);
  document.getElementById("tile-rate").textContent = rate.length ? fmt(rate[rate.length - 1][1], 1) : "–";
  document.getElementById("tile-ready").textContent = fmt(stats.current_size);
  document.getElementById("tile-pending").textContent = fmt(stats.pending_items);
  document.getElementById("tile-duplicates").textContent = fmt(stats.duplicates);

  drawChart(document.getElementById("chart-rate"), [{ name: "written/s", color: SERIES.rate, points: rate }], { now, yMin: 0, digits: 1 });
  drawChart(document.getElementById("chart-groups"), [
    { name: "pending", color: SERIES.pending, points: summed(history, "pending_groups") },
    { name: "ready", color: SERIES.ready, points: summed(history, "ready_groups") },
  ], { now, yMin: 0 });
  drawChart(document.getElementById("chart-delivered"), [
    { name: "delivered", color: SERIES.delivered, points: summed(history, "delivered_groups") },
  ], { now, yMin: 0 });
  drawChart(document.getElementById("chart-reward"), rewardSeries(history), { now, digits: 3 });

  renderTasks(stats);
  renderJobs(data.jobs || []);
  renderGenerators(data.generators || [], data.generator_errors || []);

  const state = window.dashboardState;
  state.updates += 1;
  state.samples = history.length;
  state.lastSampleT = history.length ? now : null;
  state.lastUpdate = Date.now();
  state.error = null;
  document.body.dataset.samples = String(history.length);
  document.body.dataset.lastSampleT = String(state.lastSampleT);
}

async function poll() {
  const status = document.getElementById("status");
  try {
    const response = await fetch("/dashboard/data", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    render(await response.json());
    status.textContent = `updated ${new Date().toLocaleTimeString()}`;
    status.classList.remove("error");
  } catch (error) {
    window.dashboardState.error = String(error);
    status.textContent = `cannot reach the service: ${error}`;
    status.classList.add("error");
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
