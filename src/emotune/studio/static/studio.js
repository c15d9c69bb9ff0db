// emotune studio: sort and filter the runs table; draw a run's training progress from server-sent events.
// Served by the studio itself; it loads nothing from anywhere else.
"use strict";

function setupRunsTable(table) {
  const body = table.tBodies[0];
  const rows = Array.from(body.rows);
  let sortKey = null, ascending = true;
  table.querySelectorAll("th[data-key]").forEach((th) => {
    th.addEventListener("click", () => {
      const key = th.dataset.key;
      ascending = sortKey === key ? !ascending : true;
      sortKey = key;
      const value = (row) => JSON.parse(row.dataset.row)[key];
      rows.sort((a, b) => {
        const x = value(a), y = value(b);
        if (x === y) return 0;
        if (x === null || x === undefined) return 1;
        if (y === null || y === undefined) return -1;
        return (x < y ? -1 : 1) * (ascending ? 1 : -1);
      });
      rows.forEach((row) => body.appendChild(row));
    });
  });
  const filter = document.getElementById("filter");
  if (filter) {
    filter.addEventListener("input", () => {
      const needle = filter.value.toLowerCase();
      rows.forEach((row) => { row.hidden = !row.textContent.toLowerCase().includes(needle); });
    });
  }
}

function drawCurve(canvas, entries) {
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const series = [["loss", "#2563eb"], ["eval_loss", "#dc2626"]];
  const points = entries.filter((e) => "step" in e);
  if (!points.length) return;
  const steps = points.map((e) => e.step);
  const values = points.flatMap((e) => series.map(([k]) => e[k]).filter((v) => typeof v === "number"));
  if (!values.length) return;
  const [x0, x1] = [Math.min(...steps), Math.max(...steps) || 1];
  const [y0, y1] = [Math.min(...values), Math.max(...values)];
  const pad = 30;
  const x = (s) => pad + (canvas.width - 2 * pad) * (x1 === x0 ? 0.5 : (s - x0) / (x1 - x0));
  const y = (v) => canvas.height - pad - (canvas.height - 2 * pad) * (y1 === y0 ? 0.5 : (v - y0) / (y1 - y0));
  for (const [key, color] of series) {
    const line = points.filter((e) => typeof e[key] === "number");
    ctx.strokeStyle = color; ctx.fillStyle = color; ctx.beginPath();
    line.forEach((e, i) => (i ? ctx.lineTo(x(e.step), y(e[key])) : ctx.moveTo(x(e.step), y(e[key]))));
    ctx.stroke();
    line.forEach((e) => ctx.fillRect(x(e.step) - 2, y(e[key]) - 2, 4, 4));
    if (line.length) ctx.fillText(key, canvas.width - pad - 50, key === "loss" ? 14 : 28);
  }
  ctx.fillStyle = "#555";
  ctx.fillText(`step ${x0}–${x1}`, pad, canvas.height - 8);
  ctx.fillText(`${y0.toFixed(3)}–${y1.toFixed(3)}`, 2, 12);
}

function cell(value) {
  const td = document.createElement("td");
  td.className = "num";
  td.textContent = typeof value === "number" ? (Number.isInteger(value) ? value : value.toPrecision(4)) : "";
  return td;
}

function followProgress(progress) {
  const entries = [];
  let lastId = 0;
  const live = [];  // [time, step] of entries that arrived while watching: the ETA's rate
  const tbody = document.querySelector("#history tbody");
  const canvas = document.getElementById("curve");
  const eta = document.getElementById("eta");
  const maxSteps = Number(progress.dataset.maxSteps) || null;
  const source = new EventSource(progress.dataset.events);
  progress.dataset.connections = "0";
  source.addEventListener("open", () => { progress.dataset.connections = String(Number(progress.dataset.connections) + 1); });
  source.addEventListener("progress", (event) => {
    const id = Number(event.lastEventId);
    if (id <= lastId) return;  // already shown (a server may send an entry again after a reconnect)
    lastId = id;
    const entry = JSON.parse(event.data);
    entries.push(entry);
    const row = document.createElement("tr");
    row.dataset.id = event.lastEventId;
    for (const key of ["step", "loss", "eval_loss", "tokens_per_s", "peak_memory_mb", "learning_rate"]) row.appendChild(cell(entry[key]));
    tbody.appendChild(row);
    progress.textContent = `${entries.length} log entries so far; last step ${entry.step ?? "?"}${maxSteps ? " of " + maxSteps : ""}.`;
    drawCurve(canvas, entries);
    if (typeof entry.step === "number") live.push([Date.now() / 1000, entry.step]);
    if (maxSteps && live.length >= 2) {
      const [t0, s0] = live[0], [t1, s1] = live[live.length - 1];
      const rate = (s1 - s0) / Math.max(t1 - t0, 1e-3);
      if (rate > 0) eta.textContent = `About ${Math.max(0, Math.round((maxSteps - s1) / rate))} s of training left (${rate.toFixed(2)} steps/s).`;
    }
  });
  source.addEventListener("telemetry", (event) => {
    const sample = JSON.parse(event.data);
    document.getElementById("telemetry-stage").textContent = sample.stage ?? "—";
    const body = document.querySelector("#telemetry tbody");
    body.replaceChildren();
    for (const [key, [value, unit]] of Object.entries(sample.values)) {
      const row = document.createElement("tr");
      const name = document.createElement("th"); name.textContent = key;
      const cellValue = document.createElement("td"); cellValue.className = "num"; cellValue.textContent = `${value.toFixed(1)} ${unit}`;
      row.append(name, cellValue);
      body.appendChild(row);
    }
    progress.dataset.telemetry = String(Number(progress.dataset.telemetry || 0) + 1);
  });
  source.addEventListener("end", (event) => {
    const end = JSON.parse(event.data);
    document.getElementById("status").textContent = end.status;
    eta.textContent = "";
    progress.dataset.ended = "true";
    source.close();
  });
}

function post(url, fields) {
  return fetch(url, {method: "POST", body: new URLSearchParams(fields), credentials: "same-origin"});
}

async function failure(response) {
  try { return (await response.json()).error; } catch (e) { return `${response.status} ${response.statusText}`; }
}

function setupClassify(form) {
  const error = document.getElementById("try-error");
  const body = document.querySelector("#probs tbody");
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    error.textContent = "";
    body.replaceChildren();
    const response = await post(form.dataset.url, new FormData(form));
    if (!response.ok) { error.textContent = await failure(response); return; }
    const result = await response.json();
    for (const {label, p} of result.probs) {
      const row = document.createElement("tr");
      const name = document.createElement("th"); name.textContent = label;
      const value = document.createElement("td"); value.className = "num"; value.textContent = p.toFixed(4);
      const bar = document.createElement("td");
      const fill = document.createElement("span"); fill.className = "bar"; fill.style.width = `${Math.round(p * 300)}px`;
      bar.appendChild(fill);
      row.append(name, value, bar);
      body.appendChild(row);
    }
    form.dataset.done = String(Number(form.dataset.done || 0) + 1);
  });
}

function setupChat(form) {
  const error = document.getElementById("try-error");
  const conversation = document.getElementById("conversation");
  const messages = [];
  const show = (role, text) => {
    const line = document.createElement("p"); line.className = "message";
    const who = document.createElement("b"); who.textContent = role;
    const said = document.createElement("span"); said.textContent = text;
    line.append(who, said);
    conversation.appendChild(line);
    return said;
  };
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    error.textContent = "";
    const text = form.elements.message.value;
    messages.push({role: "user", content: text});
    show("user", text);
    form.elements.message.value = "";
    const fields = {csrf: form.elements.csrf.value, max_tokens: form.elements.max_tokens.value, messages: JSON.stringify(messages)};
    const response = await post(form.dataset.url, fields);
    if (!response.ok) { messages.pop(); error.textContent = await failure(response); return; }
    const said = show("assistant", "");
    said.id = "reply";
    const reader = response.body.getReader(), decoder = new TextDecoder();
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      said.textContent += decoder.decode(value, {stream: true});
    }
    said.removeAttribute("id");
    messages.push({role: "assistant", content: said.textContent});
    form.dataset.done = String(Number(form.dataset.done || 0) + 1);
  });
}

function setupUpload(input) {
  input.addEventListener("change", async () => {
    if (input.files.length) document.getElementById("llamafactory-text").value = await input.files[0].text();
  });
}

document.addEventListener("DOMContentLoaded", () => {
  const table = document.getElementById("runs");
  if (table) setupRunsTable(table);
  const progress = document.getElementById("progress");
  if (progress) followProgress(progress);
  const classify = document.getElementById("try-classify");
  if (classify) setupClassify(classify);
  const chat = document.getElementById("try-chat");
  if (chat) setupChat(chat);
  const upload = document.getElementById("llamafactory-file");
  if (upload) setupUpload(upload);
});
