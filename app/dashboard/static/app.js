// zoopick dashboard: small progressive enhancements; every page works without them.
"use strict";

// Live parts: an element with data-live-url is refreshed from that URL (an HTML fragment of
// the same template) every 1.5 s, until the fragment says data-done="true".
function poll(el) {
  const url = el.dataset.liveUrl;
  const tick = async () => {
    if (el.dataset.done === "true") return;
    try {
      const resp = await fetch(url, { headers: { "Accept": "text/html" }, credentials: "same-origin" });
      if (resp.ok) {
        // ticked boxes (jobs picked to compare) survive the refresh
        const ticked = new Set([...el.querySelectorAll("input[type=checkbox]:checked")].map((i) => i.value));
        el.innerHTML = await resp.text();
        el.querySelectorAll("input[type=checkbox]").forEach((i) => { if (ticked.has(i.value)) i.checked = true; });
        enhanceSortable(el);
        const table = el.closest("table.sortable");  // rows refreshed inside a sorted table
        const chosen = table && sortChoice[table.id];
        if (chosen) sortTable(table, chosen.col, chosen.dir);
        const body = el.querySelector("[data-done]");
        if (body) el.dataset.done = body.dataset.done;
      }
    } catch (e) { /* the server restarts or the network blips: try again */ }
    setTimeout(tick, 1500);
  };
  setTimeout(tick, 1500);
}

// Sortable tables: each header of a table.sortable becomes a button; a click sorts by that
// column (again: the other way). Cells sort by data-sort when they have it, else by their text,
// numbers as numbers. The choice is kept per table id, so a live refresh keeps the order.
const sortChoice = {};

function sortTable(table, col, dir) {
  const body = table.tBodies[0];
  const key = (row) => {
    const cell = row.cells[col];
    const raw = cell ? (cell.dataset.sort ?? cell.textContent.trim()) : "";
    const num = Number(raw);
    return raw !== "" && !Number.isNaN(num) ? num : raw;
  };
  const rows = [...body.rows].sort((a, b) => {
    const x = key(a), y = key(b);
    if (x === "" || y === "") return (x === "") - (y === "");  // blanks last
    const cmp = typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y));
    return dir * cmp;
  });
  rows.forEach((row) => body.appendChild(row));
  [...table.tHead.rows[0].cells].forEach((th, i) => {
    th.setAttribute("aria-sort", i === col ? (dir > 0 ? "ascending" : "descending") : "none");
  });
}

function enhanceSortable(root) {
  root.querySelectorAll("table.sortable").forEach((table) => {
    if (!table.tHead || table.dataset.sortable === "yes") return;
    table.dataset.sortable = "yes";
    [...table.tHead.rows[0].cells].forEach((th, i) => {
      if ("nosort" in th.dataset) return;  // a column of controls (the compare ticks)
      const button = document.createElement("button");
      button.type = "button";
      button.className = "sort";
      button.textContent = th.textContent;
      const arrow = document.createElement("span");  // drawn by CSS, not part of the name
      arrow.className = "arrow";
      arrow.setAttribute("aria-hidden", "true");
      button.appendChild(arrow);
      th.textContent = "";
      th.appendChild(button);
      button.addEventListener("click", () => {
        const last = sortChoice[table.id];
        const dir = last && last.col === i ? -last.dir : 1;
        sortChoice[table.id] = { col: i, dir };
        sortTable(table, i, dir);
      });
    });
    const chosen = sortChoice[table.id];
    if (chosen) sortTable(table, chosen.col, chosen.dir);
  });
}

// Upload with progress: the same form, sent with XMLHttpRequest for its upload events.
function enhanceUpload(form) {
  const bar = document.getElementById("upload-progress");
  const status = document.getElementById("upload-status");
  const error = document.getElementById("upload-error");
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const xhr = new XMLHttpRequest();
    xhr.open("POST", form.action);
    xhr.setRequestHeader("Accept", "application/json");
    xhr.setRequestHeader("X-CSRF-Token", form.dataset.csrf);
    bar.hidden = false; bar.value = 0; error.hidden = true;
    status.textContent = "Uploading…";
    xhr.upload.addEventListener("progress", (e) => {
      if (e.lengthComputable) {
        bar.value = e.loaded / e.total;
        status.textContent = `Uploading… ${Math.round(100 * e.loaded / e.total)}%`;
      }
    });
    xhr.addEventListener("load", () => {
      let body = {};
      try { body = JSON.parse(xhr.responseText); } catch (e) { /* not JSON */ }
      if (xhr.status >= 200 && xhr.status < 300) {
        status.textContent = "Uploaded.";
        window.location.assign(body.url);
      } else {
        status.textContent = "";
        error.textContent = body.detail || `Upload failed (HTTP ${xhr.status}).`;
        error.hidden = false;
      }
    });
    xhr.addEventListener("error", () => {
      status.textContent = "";
      error.textContent = "The upload broke off: is the server reachable?";
      error.hidden = false;
    });
    xhr.send(new FormData(form));
  });
}

document.addEventListener("DOMContentLoaded", () => {
  enhanceSortable(document);
  document.querySelectorAll("[data-live-url]").forEach(poll);
  const upload = document.getElementById("upload-form");
  if (upload) enhanceUpload(upload);
  const dataset = document.getElementById("dataset");
  if (dataset && dataset.dataset.done === "false") setTimeout(() => window.location.reload(), 1500);
});
