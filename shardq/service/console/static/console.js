// The shardq console: polls /api/overview, draws the tables and charts, looks up jobs and
// workflows, and sends the actions (pause, resume, limits, redrive, purge, cancel) as JSON
// POSTs with the CSRF header.
// Every value from the service is put into the page as text (textContent), never as HTML:
// job bodies and errors come from whoever enqueued them.
"use strict";

const POLL_MS = 2000;
const POINTS = 60;   // two minutes of history at one point per poll (Grafana keeps the rest)
let csrf = "";
const history = { enqueued: [], acked: [], depth: [] };
let last = null;     // the previous poll's chart point (chartPoint): its time and each shard's figures
let dlCursor = null; // cursor of the current dead-letter page
let dlNext = null;   // cursor of the next one
let jobShown = null; // id of the job in the job panel
let dlShown = 0;     // number of the latest dead-letter load: an older reply arriving late is dropped
let jobAsked = 0;    // the same for job look-ups
let wfAsked = 0;     // and for workflow look-ups
let limitsQueue = null; // the queue whose limits the editor is open on
let queueRows = {};     // the latest overview's queues by name (the editor's current values)
let shardCount = 0;     // how many shards the service has (the latest overview's)

const $ = (sel) => document.querySelector(sel);

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function status(message, kind) {
  const s = $("#status");
  s.textContent = message || "";
  s.className = message ? kind || "" : "";
}

async function api(path, body) {
  const opts = body === undefined ? {} : {
    method: "POST", body: JSON.stringify(body),
    headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf },
  };
  const r = await fetch(path, Object.assign({ credentials: "same-origin" }, opts));
  if (r.status === 401) { window.location = "/login"; throw new Error("log in first"); }
  const data = await r.json();
  if (!r.ok) throw new Error(`${data.error}: ${data.message}`);
  return data;
}

function age(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  if (seconds < 60) return `${seconds.toFixed(1)} s`;
  if (seconds < 3600) return `${(seconds / 60).toFixed(1)} min`;
  if (seconds < 86400) return `${(seconds / 3600).toFixed(1)} h`;
  return `${(seconds / 86400).toFixed(1)} d`;
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

// ---------------------------------------------------------------------------- overview
async function poll() {
  try {
    const o = await api("/api/overview");
    shardCount = o.shards.length;
    renderQueues(o.queues);
    renderShards(o.shards);
    recordCharts(o.shards);
    const down = o.shards.filter((s) => !s.up).length;
    $("#updated").textContent = `updated ${new Date().toLocaleTimeString()}` +
      (down ? ` · ${down} shard${down > 1 ? "s" : ""} down` : "");
    document.body.dataset.ready = "1";
  } catch (e) {
    $("#updated").textContent = `update failed: ${e.message}`;
  }
}

function renderQueues(queues) {
  const body = $("#queues tbody");
  body.replaceChildren();
  queueRows = Object.fromEntries(queues.map((q) => [q.name, q]));
  for (const q of queues) {
    const tr = el("tr");
    tr.dataset.queue = q.name;
    tr.append(el("td", q.name, "name"));
    for (const k of ["ready", "delayed", "waiting", "in_flight", "dead", "keys"]) tr.append(el("td", q[k], k));
    tr.append(el("td", age(q.oldest_ready_age_s), "oldest"));
    tr.append(limitsCell(q.limits));
    const state = el("td", null, "state");
    const paused = q.paused;
    const badge = el("span", paused ? (q.partly_paused ? "partly paused" : "paused") : "active",
                     `badge ${paused ? "paused" : "active"}`);
    if (q.partly_paused) {
      badge.title = `paused on ${q.paused_shards} of ${shardCount} shards: a pause that missed a shard ` +
                    "(down then, or now), which pausing again finishes";
    }
    state.append(badge);
    tr.append(state);
    const act = el("td");
    // A partly paused queue offers both: pause (finish the pause) and resume.
    const actions = q.partly_paused ? ["pause", "resume"] : [paused ? "resume" : "pause"];
    for (const action of actions) {
      const b = el("button", action, action);
      b.type = "button";
      b.dataset.queue = q.name;
      b.addEventListener("click", () => pauseResume(q.name, action, b));
      act.append(b);
    }
    if (q.limits && q.limits.in_flight !== undefined) {  // its owner's figures known (else nothing to edit)
      const edit = el("button", "edit limits", "limits-edit");
      edit.type = "button";
      edit.dataset.queue = q.name;
      edit.addEventListener("click", () => openLimits(q.name));
      act.append(edit);
    }
    tr.append(act);
    body.append(tr);
  }
  if (limitsQueue) fillLimits();
  const sel = $("#dl-queue");
  const chosen = sel.value;
  const names = queues.map((q) => q.name);
  if (names.join("\n") !== Array.from(sel.options, (o) => o.value).join("\n")) {
    sel.replaceChildren(...names.map((n) => { const o = el("option", n); o.value = n; return o; }));
    if (names.includes(chosen)) sel.value = chosen;
    // The first look opens on a queue that holds dead letters, if any does: the first
    // queue by name is often an empty one, and the page would say there are none.
    const withDead = queues.find((q) => q.dead > 0);
    if (!chosen && withDead) sel.value = withDead.name;
    if (!chosen && names.length) loadDeadLetters(null);
  }
}

function renderShards(shards) {
  const body = $("#shards tbody");
  body.replaceChildren();
  for (const s of shards) {
    const tr = el("tr", null, s.up ? "" : "down");
    tr.dataset.shard = s.shard;
    tr.append(el("td", s.shard));
    const up = el("td");
    up.append(el("span", s.up ? "up" : "down", `badge ${s.up ? "active" : "down"}`));
    tr.append(up);
    tr.append(el("td", s.pid ?? "–", "pid"));
    tr.append(el("td", s.status ?? "–", "status"));
    tr.append(el("td", s.restarts ?? "–", "restarts"));
    tr.append(el("td", s.jobs ?? "–"));
    tr.append(el("td", bytes(s.wal_bytes)));
    tr.append(el("td", s.segments ?? "–"));
    tr.append(el("td", s.clients ?? "–"));
    tr.append(el("td", s.replay_records === null || s.replay_records === undefined ? "–"
      : `${s.replay_records} records in ${Number(s.replay_seconds).toFixed(3)} s`));
    tr.append(el("td", s.up ? (s.last_exit ?? "") : (s.reason ?? s.error ?? s.last_exit ?? ""), "text"));
    body.append(tr);
  }
}

async function pauseResume(queue, action, button) {
  button.disabled = true;
  try {
    await api(`/api/${action}`, { queue });
    status(`${action === "pause" ? "paused" : "resumed"} ${queue}`, "ok");
  } catch (e) {
    status(`${action} ${queue}: ${e.message}`, "error");
  }
  await poll();
}

// ---------------------------------------------------------------------------- limits
// A limited queue's figures are its owner shard's (docs/limits.md): in flight against the
// cap, tokens against the burst, the rate, the ready jobs a limit holds back now.
function num(x) {
  return String(Number(Number(x).toFixed(3)));
}

function rateText(perS) {
  if (perS === null || perS === undefined) return null;
  if (perS >= 1) return `${num(perS)}/s`;
  if (perS * 60 >= 1) return `${num(perS * 60)}/m`;
  return `${num(perS * 3600)}/h`;
}

function limitsCell(f) {
  const td = el("td", null, "limits");
  if (!f) { td.textContent = "–"; return td; }
  const part = (text, cls) => td.append(el("span", text, `lim ${cls}`));
  if (f.in_flight === undefined) {  // no figures of its owner: never another shard's instead
    part(f.owner_down ? `owner shard ${f.owner} down: figures not known`
                      : `no figures from owner shard ${f.owner} yet`, "lim-unknown");
    return td;
  }
  part(f.concurrency !== undefined ? `${f.in_flight} / ${f.concurrency} in flight` : `${f.in_flight} in flight`,
       "lim-inflight");
  if (f.rate_per_s !== undefined) {
    part(`${Math.round(f.tokens)} / ${num(f.burst)} tokens`, "lim-tokens");
    part(`rate ${rateText(f.rate_per_s)}`, "lim-rate");
  }
  part(`${f.held_back} held back`, "lim-held");
  if (f.fenced_until !== undefined) {
    const fenced = el("span", `fenced until ${new Date(f.fenced_until * 1000).toLocaleTimeString()}`, "badge fenced");
    fenced.title = "after a power cut no lease of this queue starts before then: leases the cut took " +
                   "from the log may still be running (docs/limits.md, \"Across restarts\")";
    td.append(fenced);
  }
  if (f.group_separator !== undefined) {
    const caps = [f.group_concurrency !== undefined ? `cap ${f.group_concurrency}` : null,
                  f.group_rate_per_s !== undefined ? rateText(f.group_rate_per_s) : null].filter(Boolean);
    part(`${f.groups} group${f.groups === 1 ? "" : "s"}` +
         (f.groups_held_back ? ` (${f.groups_held_back} at a limit)` : ""), "lim-groups");
    if (caps.length) part(`each group ${caps.join(", ")}`, "lim-group-caps");
    if (f.fair) part("fair turns", "lim-fair");
  }
  if (f.runtime_override) {
    const changed = el("span", "changed at run time", "badge override");
    changed.title = `changed at run time: ${JSON.stringify(f.runtime_override)} (reset to config to undo)`;
    td.append(changed);
  }
  return td;
}

// The editor's fields: [limit key, input, how its text is read]; an empty field keeps the
// limit as it is, "none" removes it.
const LIMIT_FIELDS = [["concurrency", "#limits-concurrency", "integer"], ["rate", "#limits-rate", "text"],
  ["burst", "#limits-burst", "number"], ["group_concurrency", "#limits-group-concurrency", "integer"],
  ["group_rate", "#limits-group-rate", "text"]];

function limitValue(text, kind) {
  if (text.toLowerCase() === "none") return null;
  if (kind === "integer" && /^-?[0-9]+$/.test(text)) return Number(text);
  if (kind === "number" && Number.isFinite(Number(text))) return Number(text);
  return text;  // as typed: the service names a bad value (InvalidConfig, 400)
}

function openLimits(queue) {
  limitsQueue = queue;
  for (const [, sel] of LIMIT_FIELDS) $(sel).value = "";
  $("#limits-form").hidden = false;
  fillLimits();
  $("#limits-concurrency").focus();
}

function closeLimits() {
  limitsQueue = null;
  $("#limits-form").hidden = true;
}

function fillLimits() {  // the values in force, as placeholders (the typed values stay)
  const f = (queueRows[limitsQueue] || {}).limits || {};
  $("#limits-queue").textContent = limitsQueue;
  $("#limits-form").dataset.queue = limitsQueue;
  if (f.in_flight === undefined) {  // its owner shard went down since: the values in force are not known
    for (const [, sel] of LIMIT_FIELDS) $(sel).placeholder = "not known";
    return;
  }
  const current = {
    concurrency: f.concurrency ?? "none", rate: rateText(f.rate_per_s) ?? "none",
    burst: f.rate_per_s !== undefined ? num(f.burst) : "needs a rate",
    group_concurrency: f.group_concurrency ?? "none", group_rate: rateText(f.group_rate_per_s) ?? "none",
  };
  for (const [key, sel] of LIMIT_FIELDS) $(sel).placeholder = String(current[key]);
  $("#limits-group-fields").hidden = f.group_separator === undefined;
}

async function sendLimits(reset) {
  const queue = limitsQueue;
  if (!queue) return;
  const values = {};
  for (const [key, sel, kind] of LIMIT_FIELDS) {
    const text = $(sel).value.trim();
    if (text && !$(sel).closest("[hidden]")) values[key] = limitValue(text, kind);
  }
  if (!reset && !Object.keys(values).length) {
    status(`limits of ${queue}: type a new value (an empty field keeps its limit; "none" removes it)`, "error");
    return;
  }
  const form = $("#limits-form");
  form.dataset.state = "sending";
  try {
    const r = await api("/api/limits", { queue, values: reset ? null : values });
    const f = r.limits;
    status(`limits of ${queue} ${reset ? "back to the config's" : "changed"}: ` +
           `concurrency ${f.concurrency ?? "none"}, rate ${rateText(f.rate_per_s) ?? "none"}`, "ok");
    for (const [, sel] of LIMIT_FIELDS) $(sel).value = "";
    form.dataset.state = "done";
  } catch (e) {
    status(`limits of ${queue}: ${e.message}`, "error");
    form.dataset.state = "error";
  }
  await poll();
}

// ---------------------------------------------------------------------------- charts
// Each point is made from the shards' own figures (the overview's shards[].totals), so a
// shard missing from a poll cannot fake a spike or a dip:
// * a rate counts a shard's counter difference only between two polls it answered both,
//   as the same process (pid): a shard back from a stop or a restart counts from its new
//   figures, never its lifetime counter as if it came in one poll (nor a negative one);
// * the depth carries a missing shard's last known depth (its jobs are still there, in its
//   log), and the point is marked partial: `carried` names those shards.
function chartPoint(prev, shards, now) {
  const point = { t: now, shards: {}, depth: 0, carried: [], rates: null };
  const sums = { enqueued: 0, acked: 0 };
  for (const s of shards) {
    const before = prev ? prev.shards[s.shard] : undefined;
    const t = s.up ? s.totals : null;
    if (!t) {  // down or not answering: its last known figures, not answered now
      if (before) {
        point.shards[s.shard] = Object.assign({}, before, { answered: false });
        point.depth += before.depth;
        point.carried.push(s.shard);
      }
      continue;
    }
    const mine = { pid: s.pid, answered: true, enqueued: t.enqueued, acked: t.acked,
                   depth: t.ready + t.delayed + t.waiting + t.in_flight };
    point.shards[s.shard] = mine;
    point.depth += mine.depth;
    if (before && before.answered && before.pid === mine.pid) {
      for (const k of Object.keys(sums)) sums[k] += Math.max(0, mine[k] - before[k]);
    }
  }
  const dt = prev ? now - prev.t : 0;
  if (dt > 0) point.rates = { enqueued: sums.enqueued / dt, acked: sums.acked / dt };
  return point;
}

function recordCharts(shards) {
  const point = chartPoint(last, shards, Date.now() / 1000);
  push("depth", point.depth);
  $("#depth").textContent = point.depth;
  const note = $("#depth-note");
  note.textContent = point.carried.length
    ? `(shard${point.carried.length > 1 ? "s" : ""} ${point.carried.join(", ")}: last known)` : "";
  if (point.rates) {
    for (const k of ["enqueued", "acked"]) {
      push(k, point.rates[k]);
      $(`#rate-${k}`).textContent = point.rates[k].toFixed(1);
    }
  }
  last = point;
  for (const k of Object.keys(history)) draw(`#chart-${k}`, history[k]);
}

function push(k, v) {
  history[k].push(v);
  if (history[k].length > POINTS) history[k].shift();
}

function draw(sel, values) {
  const c = $(sel);
  const g = c.getContext("2d");
  const w = c.width, h = c.height, pad = 4;
  g.clearRect(0, 0, w, h);
  g.strokeStyle = "#e2e5ec";
  g.beginPath(); g.moveTo(0, h - pad); g.lineTo(w, h - pad); g.stroke();
  if (values.length < 2) return;
  const max = Math.max(1, ...values);
  g.strokeStyle = "#2f6fde";
  g.lineWidth = 1.5;
  g.beginPath();
  values.forEach((v, i) => {
    const x = w - ((values.length - 1 - i) / (POINTS - 1)) * w;  // newest at the right edge
    const y = h - pad - (v / max) * (h - 2 * pad);
    if (i) g.lineTo(x, y); else g.moveTo(x, y);
  });
  g.stroke();
  g.fillStyle = "#6b7385";
  g.font = "10px system-ui";
  g.fillText(max >= 100 ? max.toFixed(0) : max.toFixed(1), 2, 10);
}

// ---------------------------------------------------------------------------- dead letters
function selectedIds() {
  return Array.from(document.querySelectorAll("#dead-letters input.dl-select:checked"), (c) => c.value);
}

function updateSelection() {
  const n = selectedIds().length;
  $("#dl-redrive").disabled = n === 0;
  $("#dl-purge").disabled = n === 0;
}

function bodyText(d) {  // a task body as its name and arguments (decoded by the API), else the text
  return d.task ? `task ${d.task.name} ${d.task.args}` : d.body;
}

async function loadDeadLetters(cursor) {
  const queue = $("#dl-queue").value;
  const table = $("#dead-letters");
  if (!queue) return;
  const load = ++dlShown;
  table.dataset.state = "loading";
  try {
    const params = new URLSearchParams({ queue, limit: "50" });
    if (cursor) params.set("cursor", cursor);
    const page = await api(`/api/dead-letters?${params}`);
    // Replies can arrive out of order (the first page load asks for the first queue while
    // the user already picked another): only the latest request may draw the table.
    if (load !== dlShown) return;
    dlCursor = cursor;
    dlNext = page.cursor;
    const body = $("#dead-letters tbody");
    body.replaceChildren();
    for (const d of page.items) {
      const tr = el("tr");
      tr.dataset.id = d.id;
      const pick = el("td");
      const box = el("input");
      box.type = "checkbox";
      box.className = "dl-select";
      box.value = d.id;
      box.addEventListener("change", updateSelection);
      pick.append(box);
      tr.append(pick, el("td", d.id, "id"), el("td", d.key ?? "–"), el("td", d.attempts),
                el("td", d.error ?? "", "text error"), el("td", bodyText(d), "text body"));
      const acts = el("td");
      for (const [label, fn, cls] of [["redrive", dlRedrive, "redrive"], ["purge", dlPurge, "purge danger"],
                                      ["look up", (ids) => lookUp(ids[0]), "lookup"]]) {
        const b = el("button", label, cls);
        b.type = "button";
        b.addEventListener("click", () => fn([d.id]));
        acts.append(b);
      }
      tr.append(acts);
      body.append(tr);
    }
    $("#dl-all").checked = false;
    $("#dl-next").disabled = !dlNext;
    $("#dl-note").textContent = (page.items.length ? "" : "no dead letters on this page") +
      (page.skipped_shards.length ? ` · shards ${page.skipped_shards.join(", ")} down, not shown` : "");
    updateSelection();
    table.dataset.state = "loaded";
  } catch (e) {
    if (load !== dlShown) return;
    table.dataset.state = "error";
    status(`dead letters: ${e.message}`, "error");
  }
}

async function dlAction(action, ids) {  // action: "redrive" or "purge"
  if (action === "purge" &&
      !window.confirm(`Delete ${ids.length} dead letter${ids.length > 1 ? "s" : ""} for good?`)) return;
  try {
    const r = await api(`/api/${action}`, { queue: $("#dl-queue").value, ids });
    status(action === "purge" ? `purged: ${r.purged}` : `redriven: ${r.redriven}`, "ok");
  } catch (e) {
    status(`${action}: ${e.message}`, "error");
  }
  await Promise.all([loadDeadLetters(dlCursor), poll()]);
}

const dlRedrive = (ids) => dlAction("redrive", ids);
const dlPurge = (ids) => dlAction("purge", ids);

// ---------------------------------------------------------------------------- job look-up
// The rows of a job, in order: [field, label, how its text is made from the reply]. A row
// whose field the reply lacks is left out (a job acked with its result kept has only its
// id, shard, state, progress and result); the task rows need a task body.
const JOB_FIELDS = [["job_id", "job id"], ["state", "state"], ["queue", "queue"], ["shard", "shard"],
  ["key", "key"], ["position", "jobs ahead in its key"], ["attempts", "deliveries"], ["priority", "priority"],
  ["deadline", "deadline", (j) => when(j.deadline)], ["enqueued_at", "enqueued", (j) => when(j.enqueued_at)],
  ["error", "last error"], ["cancelled", "cancelled"], ["queue_paused", "queue paused"],
  ["progress", "progress", progressText], ["result_bytes", "result", resultText, "result"],
  ["task", "task", (j) => j.task.name], ["task", "arguments", (j) => j.task.args, "args"],
  ["task", "keeps its result", (j) => j.task.keep_result === null ? null : age(j.task.keep_result), "keep_result"],
  ["task", "reports to", (j) => barrierText(j.task.reports_to), "reports_to"],
  ["task", "input from", (j) => barrierText(j.task.inputs_from), "inputs_from"],
  ["body_bytes", "body bytes"], ["body", "body"]];

function when(t) {
  return t ? `${new Date(t * 1000).toLocaleString()} (${age(Math.abs(t - Date.now() / 1000))} ${t > Date.now() / 1000 ? "from now" : "ago"})` : "–";
}

function progressText(j) {  // what the task last said with ctx.progress(fraction, note)
  const parts = [];
  if (j.progress !== null && j.progress !== undefined) parts.push(`${num(j.progress * 100)} %`);
  if (j.note !== null && j.note !== undefined) parts.push(j.note);
  return parts.length ? parts.join(" · ") : null;
}

function resultText(j) {
  return j.result_bytes === null ? "none kept" : `${bytes(j.result_bytes)}, kept until ${when(j.result_expires_at)}`;
}

function barrierText(b) {  // a workflow barrier of a task body (reports_to, inputs_from)
  if (!b) return null;
  const where = `barrier ${b.barrier} on shard ${b.shard ?? "?"}`;
  return b.total === undefined ? where : `${where}: member ${b.index ?? "?"} of ${b.total ?? "?"}`;
}

async function lookUp(id) {
  id = String(id || "").trim();
  $("#job-id").value = id;
  const body = $("#job-result tbody");
  body.replaceChildren();
  $("#job-cancel").disabled = true;
  jobShown = null;
  const ask = ++jobAsked;
  if (!id) return;
  try {
    const j = await api(`/api/job?id=${encodeURIComponent(id)}`);
    if (ask !== jobAsked) return;
    for (const [k, label, text, name] of JOB_FIELDS) {
      if (!(k in j) || (k === "task" && !j.task)) continue;
      const v = text ? text(j) : j[k];
      const tr = el("tr");
      tr.dataset.field = name || k;
      tr.append(el("th", label), el("td", v === null || v === undefined ? "–" : v));
      body.append(tr);
    }
    jobShown = id;
    $("#job-cancel").disabled = j.state === "succeeded";  // done: nothing left to cancel
    $("#job-result").dataset.state = j.state;
  } catch (e) {
    if (ask !== jobAsked) return;
    const tr = el("tr");
    tr.dataset.field = "error";
    tr.append(el("th", "not found"), el("td", e.message));
    body.append(tr);
    $("#job-result").dataset.state = "missing";
  }
}

async function cancelJob() {
  if (!jobShown || !window.confirm(`Cancel job ${jobShown}?`)) return;
  try {
    const r = await api("/api/cancel", { id: jobShown });
    status(`job ${r.id}: ${r.result}`, "ok");
  } catch (e) {
    status(`cancel: ${e.message}`, "error");
  }
  await Promise.all([lookUp(jobShown), poll()]);
}

// ---------------------------------------------------------------------------- workflow look-up
// A workflow's record and its first steps (GET /api/workflow: what `shardq workflow show`
// prints). Its rows, in order: [field, label, how its text is made from the reply].
const WF_FIELDS = [["id", "workflow id"], ["state", "state"], ["error", "error"],
  ["started_at", "started", (w) => when(w.started_at)], ["ended_at", "ended", (w) => when(w.ended_at)],
  ["expires_at", "record kept until", (w) => when(w.expires_at)], ["steps_by_state", "steps", stepCounts]];

function stepCounts(w) {  // "6 steps: 5 succeeded · 1 pending", every step counted (shown or not)
  const counts = Object.entries(w.steps_by_state).sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0]));
  return `${w.steps_total} step${w.steps_total === 1 ? "" : "s"}` +
    (counts.length ? `: ${counts.map(([state, n]) => `${n} ${state}`).join(" · ")}` : "");
}

function stepProgress(s) {  // a live job's last ctx.progress; a pending step's barrier arrivals
  if (s.progress !== null && s.progress !== undefined) return `${num(s.progress * 100)} %`;
  if (s.arrived !== null && s.arrived !== undefined) return `${s.arrived} of ${s.total ?? "?"} arrived`;
  return "–";
}

function stepRow(s) {
  const tr = el("tr");
  tr.dataset.step = s.step;
  tr.dataset.state = s.state;
  const job = el("td", null, "job");
  if (s.job_id === null) {
    job.textContent = "–";
  } else {  // its job, in the job panel
    const b = el("button", s.job_id, "job-link");
    b.type = "button";
    b.title = "look this job up";
    b.addEventListener("click", () => { lookUp(s.job_id); $("#job-form").scrollIntoView(); });
    job.append(b);
  }
  tr.append(el("td", s.step, "step"), el("td", s.task, "text task"), job, el("td", s.state, "state"),
            el("td", s.attempts ?? "–", "attempts"), el("td", stepProgress(s), "progress"),
            el("td", s.note ?? "", "text note"), el("td", s.error ?? "", "text error"),
            el("td", bytes(s.result_bytes), "result"));
  return tr;
}

async function lookUpWorkflow(id) {
  id = String(id || "").trim();
  $("#wf-id").value = id;
  const table = $("#wf-result");
  const body = $("#wf-result tbody");
  body.replaceChildren();
  $("#wf-steps tbody").replaceChildren();
  $("#wf-steps").hidden = true;
  $("#wf-note").textContent = "";
  const ask = ++wfAsked;
  if (!id) return;
  table.dataset.state = "loading";
  try {
    const w = await api(`/api/workflow?id=${encodeURIComponent(id)}`);
    if (ask !== wfAsked) return;
    for (const [k, label, text] of WF_FIELDS) {
      const v = text ? text(w) : w[k];
      const tr = el("tr");
      tr.dataset.field = k;
      tr.append(el("th", label), el("td", v === null || v === undefined ? "–" : v));
      body.append(tr);
    }
    $("#wf-steps tbody").append(...w.steps.map(stepRow));
    $("#wf-steps").hidden = w.steps.length === 0;
    if (w.steps_shown < w.steps_total) {
      $("#wf-note").textContent = `${w.steps_shown} of ${w.steps_total} steps shown (the counts above are of all)`;
    }
    table.dataset.state = w.state;
  } catch (e) {
    if (ask !== wfAsked) return;
    const tr = el("tr");
    tr.dataset.field = "error";
    tr.append(el("th", "not found"), el("td", e.message));
    body.append(tr);
    table.dataset.state = "missing";
  }
}

// ---------------------------------------------------------------------------- start
async function start() {
  try {
    const s = await api("/api/session");
    csrf = s.csrf;
    $("#data-dir").textContent = s.data_dir;
    $("#logout").hidden = s.auth !== "token";
  } catch (e) {
    status(`session: ${e.message}`, "error");
    return;
  }
  $("#dl-queue").addEventListener("change", () => loadDeadLetters(null));
  $("#dl-reload").addEventListener("click", () => loadDeadLetters(dlCursor));
  $("#dl-first").addEventListener("click", () => loadDeadLetters(null));
  $("#dl-next").addEventListener("click", () => dlNext && loadDeadLetters(dlNext));
  $("#dl-redrive").addEventListener("click", () => dlRedrive(selectedIds()));
  $("#dl-purge").addEventListener("click", () => dlPurge(selectedIds()));
  $("#dl-all").addEventListener("change", (e) => {
    document.querySelectorAll("#dead-letters input.dl-select").forEach((c) => { c.checked = e.target.checked; });
    updateSelection();
  });
  $("#job-form").addEventListener("submit", (e) => { e.preventDefault(); lookUp($("#job-id").value); });
  $("#job-cancel").addEventListener("click", cancelJob);
  $("#wf-form").addEventListener("submit", (e) => { e.preventDefault(); lookUpWorkflow($("#wf-id").value); });
  $("#limits-form").addEventListener("submit", (e) => { e.preventDefault(); sendLimits(false); });
  $("#limits-reset").addEventListener("click", () => sendLimits(true));
  $("#limits-close").addEventListener("click", closeLimits);
  await poll();
  setInterval(poll, POLL_MS);
}

document.addEventListener("DOMContentLoaded", start);
