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
        el.innerHTML = await resp.text();
        const body = el.querySelector("[data-done]");
        if (body) el.dataset.done = body.dataset.done;
      }
    } catch (e) { /* the server restarts or the network blips: try again */ }
    setTimeout(tick, 1500);
  };
  setTimeout(tick, 1500);
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
  document.querySelectorAll("[data-live-url]").forEach(poll);
  const upload = document.getElementById("upload-form");
  if (upload) enhanceUpload(upload);
  const dataset = document.getElementById("dataset");
  if (dataset && dataset.dataset.done === "false") setTimeout(() => window.location.reload(), 1500);
});
