// The rollout-buffer dashboard: polls dashboard/data once a second and draws with uPlot (vendored
// in static/vendor, no build step). Only the history samples newer than the last one held are
// fetched (?since=). Every URL is relative, so the page works behind a proxy under a prefix.
// window.dashboardState says what the page last drew, for tests and for curious users.
"use strict";

const POLL_MS = 1000;
const KEEP_SAMPLES = 3600; // an hour at one sample a second
const REWARD_WINDOW_S = 30;
const PALETTE = ["#2563eb", "#e67e22", "#16a34a", "#9333ea", "#dc2626", "#0891b2", "#ca8a04", "#db2777"];
const FINISH_COLORS = { stop: "#16a34a", length: "#e67e22", abort: "#9333ea", tool_calls: "#0891b2", error: "#dc2626" };

window.dashboardState = {
  updates: 0, samples: 0, lastSampleT: null, lastUpdate: null, error: null, charts: {}, polls: [], viewer: null,
  alerts: [],
};

const history = [];
const charts = new Map(); // id -> {plot, names, zoomed}
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

function pct(part, whole) {
  return whole ? `${fmt((100 * part) / whole, 1)}%` : "–";
}

function duration(seconds) {
  if (seconds === null || !Number.isFinite(seconds)) return "–";
  if (seconds < 90) return `${Math.round(seconds)} s`;
  if (seconds < 5400) return `${Math.round(seconds / 60)} min`;
  return `${fmt(seconds / 3600, 1)} h`;
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key === "style") node.style.cssText = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

// --- charts ----------------------------------------------------------------------------

// series: [{name, color, values: [y per history sample]}]; x: the samples' times (seconds).
function drawChart(id, xs, series, digits = 0) {
  const container = document.getElementById(id);
  const names = series.map((s) => s.name).join("\u0000");
  let chart = charts.get(id);
  if (!chart || chart.names !== names) {
    if (chart) chart.plot.destroy();
    const options = {
      width: Math.max(container.clientWidth, 300),
      height: 220,
      scales: { x: { time: true } },
      cursor: { drag: { x: true, y: false } },
      legend: { live: true },
      series: [
        {},
        ...series.map((s) => ({
          label: s.name, stroke: s.color, width: 2, spanGaps: true,
          value: (u, v) => (v === null || v === undefined ? "–" : fmt(v, digits)),
        })),
      ],
      axes: [{}, { size: 56, values: (u, ticks) => ticks.map((v) => fmt(v, digits > 0 && Math.abs(v) < 10 ? 2 : 0)) }],
      hooks: {
        setSelect: [(u) => { if (u.select.width > 0) chart.zoomed = true; }],
      },
    };
    chart = { plot: null, names, zoomed: false };
    chart.plot = new uPlot(options, [xs, ...series.map((s) => s.values)], container);
    container.addEventListener("dblclick", () => { chart.zoomed = false; });
    charts.set(id, chart);
  } else {
    chart.plot.setData([xs, ...series.map((s) => s.values)], !chart.zoomed);
  }
  const points = series.reduce((n, s) => n + s.values.filter((v) => v !== null && v !== undefined).length, 0);
  container.dataset.points = String(points);
  window.dashboardState.charts[id] = { points, series: series.length, last: xs.length ? xs[xs.length - 1] : null };
}

window.addEventListener("resize", () => {
  for (const [id, chart] of charts) chart.plot.setSize({ width: document.getElementById(id).clientWidth, height: 220 });
});

// --- history to series -----------------------------------------------------------------

function perSecond(field) {
  return history.map((s, i) => {
    if (i === 0) return null;
    const dt = s.t - history[i - 1].t;
    return dt > 0 ? Math.max(0, s[field] - history[i - 1][field]) / dt : null;
  });
}

function summed(field) {
  // Samples carry totals over every task; each sample's tasks are only the most active ones.
  return history.map((s) => (field in s ? s[field] : Object.values(s.tasks || {}).reduce((sum, task) => sum + (task[field] || 0), 0)));
}

function taskNames() {
  const names = new Set();
  for (const s of history) for (const name of Object.keys(s.tasks || {})) names.add(name);
  return [...names].sort();
}

// The mean over the last REWARD_WINDOW_S seconds, per task, of a quantity the history keeps as
// an all-time sum and count (rewards written; waits of the groups served): from the sum and
// count at both ends of the window (nothing in it: a gap).
function windowedMeans(sumField, countField) {
  return taskNames().map((name) => {
    const values = [];
    let start = 0;
    for (let i = 0; i < history.length; i++) {
      while (start < i && history[start + 1].t <= history[i].t - REWARD_WINDOW_S) start++;
      const now = (history[i].tasks || {})[name];
      const then = i === start ? null : (history[start].tasks || {})[name];
      if (!now || now[countField] === undefined) { values.push(null); continue; }
      const count = now[countField] - (then ? then[countField] : 0);
      const sum = now[sumField] - (then ? then[sumField] : 0);
      values.push(count > 0 ? sum / count : null);
    }
    return { name, color: colorFor(name), values };
  });
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

function badge(task) {
  return el("span", { class: "badge", style: `background:${colorFor(task)};color:#fff` }, task);
}

// Why groups were discarded (buffer/core/pipeline.py, reads.py), in words. invalid_group: the
// task's is_valid_group said no; the default one (default_func.py) refuses a group whose rewards
// are all equal, which has no advantage to learn from.
const DISCARD_REASONS = {
  invalid_group: "equal rewards (no learning signal)",
  too_few_valid_items: "too few items passed filter_item",
  timeout_too_small: "timed out with too few items",
  too_large_to_pad: "too far below the group size to pad",
  stale: "too stale for the policy (max_staleness)",
};

function discardReason(why, hooksOverridden) {
  if (why === "invalid_group" && (hooksOverridden || []).includes("is_valid_group")) {
    return "refused by the generator's is_valid_group";
  }
  return DISCARD_REASONS[why] || why;
}

function renderTasks(stats) {
  const rows = Object.values(stats.tasks || {}).map((task) => {
    const discarded = el("span", { class: "discarded" });
    for (const [why, n] of Object.entries(task.discarded_groups || {})) {
      if (discarded.childNodes.length) discarded.append(", ");
      discarded.append(el("span", { title: why, "data-reason": why }, `${discardReason(why, task.hooks_overridden)}: ${fmt(n)}`));
    }
    return [
      badge(task.task_type), task.group_size, fmt(task.total_written), fmt(task.pending_groups), fmt(task.ready_groups),
      fmt(task.delivered_groups), fmt(task.delivered_items), discarded.childNodes.length ? discarded : "0", fmt(task.set_aside_groups),
      task.reward_count ? fmt(task.reward_mean, 3) : "–", task.reward_count > 1 ? fmt(task.reward_std, 3) : "–",
    ];
  });
  fillRows(document.querySelector("#tasks tbody"), rows, 11, "no task has data yet");
}

// Each job as progress: done of planned, its rate and the time left at that rate.
function renderJobProgress(jobs) {
  const list = document.getElementById("job-progress");
  list.replaceChildren();
  if (!jobs.length) {
    list.append(el("p", { class: "empty" }, "no jobs yet"));
    return;
  }
  for (const job of jobs) {
    const p = job.progress || {};
    const total = p.total || 0;
    const done = p.completed || 0;
    const rate = p.trajectories_per_s || 0;
    const share = total ? Math.min(1, done / total) : job.status === "running" ? 0 : 1;
    const eta = job.status === "running" && rate > 0 && total ? (total - done) / rate : null;
    const bar = el("div", { class: `bar ${job.status}` }, el("span", { style: `width:${(100 * share).toFixed(1)}%` }));
    const summary = total
      ? `${fmt(done)} of ${fmt(total)} (${pct(done, total)}) · ${fmt(rate, 1)}/s · ` +
        (job.status === "running" ? `ETA ${duration(eta)}` : job.status) +
        (p.failed ? ` · ${fmt(p.failed)} failed` : "")
      : `${job.status} · ${fmt(job.counters ? job.counters.written : null)} written · ${duration(job.duration_s)}`;
    const row = el("div", { class: "job" },
      el("span", {}, `${job.id} `, badge(job.task_type)), bar, el("span", { class: "muted" }, summary));
    list.append(row);
    if (job.error) {
      const error = el("div", { class: "error" }, job.error);
      if (job.where) error.append(el("div", { class: "file" }, `at ${job.where}`));
      list.append(error);
    }
  }
}

// The policy server as the jobs saw it, summed per task.
function renderEngine(jobs) {
  const byTask = new Map();
  for (const job of jobs) {
    const p = job.progress || {};
    if (!p.requests && !p.request_failures) continue;
    const t = byTask.get(job.task_type) || { requests: 0, failures: 0, latencyCount: 0, latencySum: 0, tokens: 0, lengths: 0, reasons: {} };
    t.requests += p.requests || 0;
    t.failures += p.request_failures || 0;
    t.latencyCount += p.latency_s_count || 0;
    t.latencySum += p.latency_s_sum || 0;
    t.tokens += p.response_tokens_sum || 0;
    t.lengths += p.response_tokens_count || 0;
    for (const [reason, n] of Object.entries(p.finish_reasons || {})) t.reasons[reason] = (t.reasons[reason] || 0) + n;
    byTask.set(job.task_type, t);
  }
  const rows = [...byTask.entries()].map(([task, t]) => {
    const answers = Object.values(t.reasons).reduce((a, b) => a + b, 0);
    const mix = el("div", { class: "mix", title: Object.entries(t.reasons).map(([r, n]) => `${r}: ${n}`).join(", ") });
    for (const [reason, n] of Object.entries(t.reasons)) {
      mix.append(el("span", { style: `width:${(100 * n) / answers}%;background:${FINISH_COLORS[reason] || "#6b7785"}` }));
    }
    const legend = Object.entries(t.reasons).map(([r, n]) => `${r} ${pct(n, answers)}`).join(" · ");
    return [
      badge(task), fmt(answers), t.latencyCount ? `${fmt(t.latencySum / t.latencyCount, 2)} s` : "–",
      `${fmt(t.failures)} of ${fmt(t.requests)} (${pct(t.failures, t.requests)})`,
      t.lengths ? fmt(t.tokens / t.lengths, 0) : "–", pct(t.reasons.length || 0, answers),
      el("div", {}, mix, el("div", { class: "muted" }, legend)),
    ];
  });
  fillRows(document.querySelector("#engine tbody"), rows, 7, "no generator job has asked the policy server yet");
}

// --- what is wrong, said at the top ----------------------------------------------------

// A running job whose LLM requests kept failing, with no answer and no trajectory over this
// long, has its policy server down. The jobs' counters are cumulative: the page keeps what
// each poll saw of them (jobSeries) and compares now with ENGINE_WINDOW_S ago.
const ENGINE_WINDOW_S = 30;
const ENGINE_MIN_FAILURES = 3;
const jobSeries = new Map(); // job id -> [{t, failures, answers, completed}], oldest first

function observeJobs(jobs, t) {
  const seen = new Set();
  for (const job of jobs) {
    seen.add(job.id);
    const p = job.progress || {};
    const series = jobSeries.get(job.id) || [];
    series.push({ t, failures: p.request_failures || 0, answers: p.latency_s_count || 0, completed: p.completed || 0 });
    while (series.length > 2 && series[1].t <= t - ENGINE_WINDOW_S) series.shift();
    jobSeries.set(job.id, series);
  }
  for (const id of [...jobSeries.keys()]) if (!seen.has(id)) jobSeries.delete(id);
}

// One job's policy server, from its samples (oldest first, the first at or before the window's
// start): "down" when requests failed and nothing came back, "failing" when some failed
// among answers, null otherwise. Pure, for tests: window.dashboardTest.engineVerdict.
function engineVerdict(job, series) {
  if (job.status !== "running" || !series.length) return null;
  const now = series[series.length - 1];
  const kinds = Object.entries((job.progress || {}).request_failures_by_kind || {}).sort((a, b) => b[1] - a[1]);
  const kind = kinds.length ? ` (mostly ${kinds[0][0]})` : "";
  if (now.answers === 0 && now.completed === 0 && now.failures >= ENGINE_MIN_FAILURES) {
    return { level: "bad", kind: "engine-down", text: `${fmt(now.failures)} LLM requests failed${kind}, none answered yet` };
  }
  const then = series[0];
  const span = now.t - then.t;
  const failed = now.failures - then.failures;
  if (span < ENGINE_WINDOW_S / 2 || failed <= 0) return null;
  if (now.answers === then.answers && now.completed === then.completed && failed >= ENGINE_MIN_FAILURES) {
    return { level: "bad", kind: "engine-down", text: `${fmt(failed)} LLM requests failed${kind} and none answered in the last ${duration(span)}` };
  }
  return { level: "warn", kind: "engine-failing", text: `${fmt(failed)} LLM requests failed${kind} in the last ${duration(span)}, among ${fmt(now.answers - then.answers)} answers` };
}

// The trainer, as /dashboard/data's "trainer" tells it: tasks whose oldest ready group has
// waited past trainer.behind_after_s (reads take the oldest first).
function trainerAlerts(trainer) {
  if (!trainer) return [];
  const last = trainer.last_read_age_s === null || trainer.last_read_age_s === undefined
    ? "it has never read"
    : `its last read was ${trainer.at_least ? "over " : ""}${duration(trainer.last_read_age_s)} ago`;
  return (trainer.behind || []).map((task) => {
    const t = trainer.tasks[task];
    return {
      level: "warn", kind: "trainer-behind", task,
      text: `${fmt(t.ready_groups)} groups ready, the oldest for ${duration(t.oldest_ready_age_s)}; ${last}`,
    };
  });
}

function renderAlerts(jobs, trainer) {
  const alerts = [];
  for (const job of jobs) {
    const verdict = engineVerdict(job, jobSeries.get(job.id) || []);
    if (verdict) alerts.push({ ...verdict, task: job.task_type, job: job.id });
  }
  alerts.push(...trainerAlerts(trainer));
  const titles = { "engine-down": "engine down", "engine-failing": "engine errors", "trainer-behind": "trainer behind" };
  const box = document.getElementById("alerts");
  box.replaceChildren(...alerts.map((a) => el("div", { class: `alert ${a.level}`, "data-kind": a.kind },
    el("strong", {}, titles[a.kind]), a.job ? `${a.job} ` : "", badge(a.task), ` ${a.text}`)));
  window.dashboardState.alerts = alerts.map((a) => ({ kind: a.kind, task: a.task, job: a.job || null, text: a.text }));
}

window.dashboardTest = { engineVerdict, trainerAlerts, discardReason };

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

// --- the trajectory viewer -------------------------------------------------------------

// The tokens the trainer gets from a trajectory's token records, and their loss mask: the first
// turn's full prompt, then per turn its new prompt tokens (mask 0) and its output (mask 1). A
// turn whose prompt does not extend what is held starts a new sample (a branch), as buffer.trainer.samples
// does. Without turns, the single-turn form in extra_info; without either, null.
function trainerTokens(trajectory) {
  const turns = trajectory.turns;
  const info = trajectory.extra_info || {};
  if (!turns || !turns.length) {
    if (Array.isArray(info.prompt_token_ids) && Array.isArray(info.token_ids)) {
      return [{ tokens: [...info.prompt_token_ids, ...info.token_ids], mask: [...info.prompt_token_ids.map(() => 0), ...info.token_ids.map(() => 1)] }];
    }
    return null;
  }
  const samples = [];
  let tokens = null;
  let mask = null;
  let previous = null; // previous turn's full prompt + output
  for (const turn of turns) {
    const offset = turn.prompt_offset || 0;
    const full = (previous ? previous.slice(0, offset) : []).concat(turn.prompt_ids || []);
    if (tokens === null) {
      tokens = full.slice();
      mask = full.map(() => 0);
    } else if (full.length >= tokens.length && tokens.every((id, i) => full[i] === id)) {
      const added = full.slice(tokens.length);
      tokens.push(...added);
      mask.push(...added.map(() => 0));
    } else {
      samples.push({ tokens, mask });
      tokens = full.slice();
      mask = full.map(() => 0);
    }
    const output = turn.output_ids || [];
    tokens.push(...output);
    mask.push(...output.map(() => 1));
    previous = full.concat(output);
  }
  samples.push({ tokens, mask });
  return samples;
}

const MAX_TOKENS_SHOWN = 4000;

// The token view (the "tokens" select): hidden, as text (each token decoded with the served
// model's tokenizer, its id on hover) or as ids. Without a tokenizer "as text" shows ids and says why.
function renderTokens(samples, view, decoded) {
  if (view === "hidden") {
    if (samples === null) return el("p", { class: "muted token-summary" }, "no token records");
    const total = samples.reduce((n, sample) => n + sample.tokens.length, 0);
    const trained = samples.reduce((n, sample) => n + sample.mask.filter((m) => m === 1).length, 0);
    return el("p", { class: "muted token-summary" },
      `${fmt(total)} tokens, ${fmt(trained)} under the loss mask (tokens: "as text" or "as ids" shows them)`);
  }
  if (samples === null) {
    return el("p", { class: "muted no-tokens" },
      "no token records (turns): the trainer gets these messages re-rendered with the model's chat template, " +
      "which needs its tokenizer (buffer.trainer.samples); the page cannot show those tokens.");
  }
  const texts = view === "text" && decoded && decoded.texts ? decoded.texts : null;
  const box = el("div", {});
  if (view === "text" && !texts) {
    box.append(el("p", { class: "muted no-decode" }, `token ids: no tokenizer to decode them (${(decoded && decoded.why) || "unknown"})`));
  }
  samples.forEach((sample, index) => {
    const trained = sample.mask.filter((m) => m === 1).length;
    box.append(el("div", { class: "muted" },
      `${samples.length > 1 ? `sample ${index + 1} of ${samples.length} (a branch): ` : ""}` +
      `${fmt(sample.tokens.length)} tokens, ${fmt(trained)} under the loss mask (highlighted)`));
    const tokens = el("div", { class: texts ? "tokens text" : "tokens" });
    sample.tokens.slice(0, MAX_TOKENS_SHOWN).forEach((id, i) => {
      const text = texts ? texts[String(id)] : undefined;
      tokens.append(text === undefined
        ? el("span", { class: `m${sample.mask[i]}` }, id)
        : el("span", { class: `m${sample.mask[i]}`, title: `id ${id}`, "data-id": String(id) }, text));
    });
    if (sample.tokens.length > MAX_TOKENS_SHOWN) tokens.append(el("span", { class: "m0" }, `… ${sample.tokens.length - MAX_TOKENS_SHOWN} more`));
    box.append(tokens);
  });
  return box;
}

function renderTrajectory(trajectory, index, view, decoded) {
  const info = trajectory.extra_info || {};
  const raw = trajectory.raw_reward !== undefined ? trajectory.raw_reward : trajectory.reward;
  const heading = `#${index + 1} · reward ${fmt(raw, 3)}` +
    (raw !== trajectory.reward ? ` (trained on: ${fmt(trajectory.reward, 3)})` : "") +
    (info.finish_reason ? ` · ${info.finish_reason}` : "") + (trajectory.uid ? ` · uid ${trajectory.uid}` : "");
  const box = el("div", { class: "trajectory" }, el("h3", {}, heading));
  for (const message of trajectory.messages || []) {
    const content = typeof message.content === "string" ? message.content : JSON.stringify(message.content);
    const extra = message.tool_calls ? `\n${JSON.stringify(message.tool_calls)}` : "";
    box.append(el("div", { class: "message" }, el("span", { class: "role" }, message.role), el("pre", {}, (content || "") + extra)));
  }
  box.append(renderTokens(trainerTokens(trajectory), view, decoded));
  return box;
}

async function getJson(url) {
  const response = await fetch(url, { cache: "no-store" });
  if (!response.ok) throw new Error(`HTTP ${response.status}: ${await response.text()}`);
  return response.json();
}

async function listGroups() {
  const task = document.getElementById("viewer-task").value;
  const select = document.getElementById("viewer-group");
  const status = document.getElementById("viewer-status");
  if (!task) return;
  try {
    const data = await getJson(`dashboard/groups?task_type=${encodeURIComponent(task)}`);
    select.replaceChildren(el("option", { value: "" }, data.groups.length ? "pick a group" : "none ready"));
    for (const group of data.groups) {
      const rewards = group.raw_rewards.map((r) => fmt(r, 2)).join(", ");
      select.append(el("option", { value: String(group.instance_id) }, `${group.instance_id} (${group.size}: ${rewards})`));
    }
    select.disabled = !data.groups.length;
    status.textContent = `${data.groups.length} ready groups`;
    window.dashboardState.viewer = { task, groups: data.groups.length, opened: null };
  } catch (error) {
    status.textContent = String(error);
  }
}

let openedGroup = null; // the group the viewer shows, redrawn when the token view changes

function drawGroup() {
  const body = document.getElementById("viewer-body");
  if (!openedGroup) return;
  const view = document.getElementById("viewer-tokens").value;
  body.replaceChildren(...openedGroup.trajectories.map((t, i) => renderTrajectory(t, i, view, openedGroup.tokens)));
}

async function openGroup() {
  const task = document.getElementById("viewer-task").value;
  const instance = document.getElementById("viewer-group").value;
  const body = document.getElementById("viewer-body");
  if (!task || !instance) return;
  try {
    openedGroup = await getJson(`dashboard/group?task_type=${encodeURIComponent(task)}&instance_id=${encodeURIComponent(instance)}`);
    drawGroup();
    window.dashboardState.viewer = {
      task, groups: window.dashboardState.viewer?.groups, opened: instance, trajectories: openedGroup.trajectories.length,
      tokenizer: openedGroup.tokens ? openedGroup.tokens.tokenizer : null,
    };
  } catch (error) {
    openedGroup = null;
    body.replaceChildren(el("p", { class: "error" }, String(error)));
  }
}

function renderViewerTasks(stats) {
  const select = document.getElementById("viewer-task");
  const names = Object.keys(stats.tasks || {}).sort();
  const have = [...select.options].map((o) => o.value).filter(Boolean);
  if (names.join() === have.join()) return;
  const chosen = select.value;
  select.replaceChildren(el("option", { value: "" }, "pick a task"), ...names.map((n) => el("option", { value: n }, n)));
  select.value = names.includes(chosen) ? chosen : "";
}

document.getElementById("viewer-task").addEventListener("change", listGroups);
document.getElementById("viewer-refresh").addEventListener("click", listGroups);
document.getElementById("viewer-group").addEventListener("change", openGroup);
document.getElementById("viewer-tokens").addEventListener("change", drawGroup);

// --- the loop --------------------------------------------------------------------------

function render(data) {
  for (const sample of data.history || []) history.push(sample);
  if (history.length > KEEP_SAMPLES) history.splice(0, history.length - KEEP_SAMPLES);
  const stats = data.stats || {};
  const xs = history.map((s) => s.t);
  const written = perSecond("total_written");
  const lastRate = written.length ? written[written.length - 1] : null;

  document.getElementById("tile-written").textContent = fmt(stats.total_written);
  document.getElementById("tile-read").textContent = fmt(stats.total_read);
  document.getElementById("tile-rate").textContent = fmt(lastRate, 1);
  document.getElementById("tile-ready").textContent = fmt(stats.current_size);
  document.getElementById("tile-pending").textContent = fmt(stats.pending_items);
  document.getElementById("tile-duplicates").textContent = fmt(stats.duplicates);
  document.getElementById("reward-window").textContent = String(REWARD_WINDOW_S);

  drawChart("chart-rate", xs, [
    { name: "written/s", color: "#2563eb", values: written },
    { name: "read/s", color: "#16a34a", values: perSecond("total_read") },
  ], 1);
  drawChart("chart-groups", xs, [
    { name: "pending", color: "#e67e22", values: summed("pending_groups") },
    { name: "ready", color: "#2563eb", values: summed("ready_groups") },
  ]);
  drawChart("chart-delivered", xs, [{ name: "delivered", color: "#16a34a", values: summed("delivered_groups") }]);
  drawChart("chart-reward", xs, windowedMeans("reward_sum", "reward_count"), 3);
  drawChart("chart-lag", xs, windowedMeans("served_age_s_sum", "served_age_count"), 1);

  renderTasks(stats);
  renderJobProgress(data.jobs || []);
  renderEngine(data.jobs || []);
  observeJobs(data.jobs || [], Date.now() / 1000);
  renderAlerts(data.jobs || [], data.trainer);
  renderGenerators(data.generators || [], data.generator_errors || []);
  renderViewerTasks(stats);

  const state = window.dashboardState;
  state.updates += 1;
  state.samples = history.length;
  state.lastSampleT = history.length ? history[history.length - 1].t : null;
  state.lastUpdate = Date.now();
  state.error = null;
}

async function poll() {
  const status = document.getElementById("status");
  try {
    const since = history.length ? `?since=${history[history.length - 1].t}` : "";
    const response = await fetch(`dashboard/data${since}`, { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const text = await response.text();
    const data = JSON.parse(text);
    const polls = window.dashboardState.polls;
    polls.push({ bytes: text.length, samples: (data.history || []).length });
    if (polls.length > 20) polls.shift();
    render(data);
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
