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
  const tbody = document.querySelector("#history tbody");
  const canvas = document.getElementById("curve");
  const source = new EventSource(progress.dataset.events);
  source.addEventListener("progress", (event) => {
    const entry = JSON.parse(event.data);
    entries.push(entry);
    const row = document.createElement("tr");
    row.dataset.id = event.lastEventId;
    for (const key of ["step", "loss", "eval_loss", "tokens_per_s", "peak_memory_mb", "learning_rate"]) row.appendChild(cell(entry[key]));
    tbody.appendChild(row);
    progress.textContent = `${entries.length} log entries so far; last step ${entry.step ?? "?"}.`;
    drawCurve(canvas, entries);
  });
  source.addEventListener("end", (event) => {
    const end = JSON.parse(event.data);
    document.getElementById("status").textContent = end.status;
    progress.dataset.ended = "true";
    source.close();
  });
}

document.addEventListener("DOMContentLoaded", () => {
  const table = document.getElementById("runs");
  if (table) setupRunsTable(table);
  const progress = document.getElementById("progress");
  if (progress) followProgress(progress);
});
