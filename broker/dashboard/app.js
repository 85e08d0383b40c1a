// The broker dashboard: reads /v1/stream (server-sent events) and renders each snapshot.
// fetch() is used instead of EventSource so an API key can go in the Authorization header.
"use strict";

const $ = (sel) => document.querySelector(sel);
const short = (peer) => (peer ? "…" + peer.slice(-10) : "");  // peer ids share their first characters
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
const bytes = (n) => (n >= 2 ** 30 ? (n / 2 ** 30).toFixed(1) + " GiB" : (n / 2 ** 20).toFixed(0) + " MiB");
const state = { events: [] };

function setConn(text, st) {
  const el = $("#conn");
  el.textContent = text;
  el.dataset.state = st;
}

function renderProviders(providers) {
  const pools = {};
  const rows = providers.map((p) => {
    pools[p.pool] = (pools[p.pool] || 0) + 1;
    const gflops = Object.entries(p.flops || {}).map(([k, v]) => `${k} ${(v / 1e9).toFixed(0)}`).join(", ");
    const r = p.reputation || {};
    const health = r.quarantined ? "quarantined" : p.pool === "dead" ? "lost" : p.flapping ? "flapping" : `seen ${p.last_seen_s.toFixed(1)} s ago`;
    const checks = r.quarantined ? `quarantined: ${r.reason}` : r.checks ? `${r.agreed}/${r.checks} agreed` : "none yet";
    return `<tr data-peer="${esc(p.peer_id)}" data-pool="${esc(p.pool)}">
      <td class="peer" title="${esc(p.peer_id)}">${esc(short(p.peer_id))}</td>
      <td class="pool" data-pool="${esc(p.pool)}">${esc(p.pool)}</td>
      <td>${esc(p.hardware)}</td><td>${esc(p.executor || "")}</td><td>${esc(gflops)}</td>
      <td>${bytes(p.memory_bytes)}</td>
      <td>${p.queued} queued${p.kv_bytes ? ", KV " + bytes(p.kv_bytes) : ""}</td>
      <td class="health">${esc(health)}</td><td class="reach" title="${esc(p.observed || "")}">${esc(p.reach || "")}</td><td class="checks">${esc(checks)}</td>
      <td>${esc((p.loaded || []).join(", "))}</td></tr>`;
  });
  $("#providers tbody").innerHTML = rows.join("") || `<tr><td colspan="11" class="muted">no providers have joined</td></tr>`;
  $("#pools").textContent = Object.entries(pools).map(([k, v]) => `${v} ${k}`).join(" · ");
}

function renderModels(models) {
  $("#models").innerHTML = models.map((m) => `<div class="model" data-model="${esc(m.model)}">
      <strong>${esc(m.model)}</strong>
      <span class="muted">${m.ready ? "ready" : esc(m.waiting || "placing")} · ${m.throughput_tokens_s} tokens/s planned</span>
      <ul>${m.stages.map((s) => `<li><span class="mono">${esc(s.key)}</span> (${esc(s.name)}):
        ${s.providers.map((p) => `<span class="mono">${esc(short(p.peer_id))}</span>`).join(", ") || "<em>no route</em>"}
        ${s.backups.length ? `<span class="muted">backup ${s.backups.map((b) => esc(short(b))).join(", ")}</span>` : ""}</li>`).join("")}</ul>
    </div>`).join("") || `<p class="muted">no models; add one with <code>fusionai model add DIR</code></p>`;
}

function renderJobs(jobs) {
  $("#jobs tbody").innerHTML = jobs.map((j) => `<tr data-job="${esc(j.id)}">
      <td class="peer">${esc(j.id)}</td><td>${esc(j.model)}</td><td>${esc(j.state)}${j.error ? ": " + esc(j.error) : ""}</td>
      <td><span class="bar"><span style="width:${(100 * j.progress).toFixed(1)}%"></span></span> ${j.done}/${j.microbatches}</td>
      <td>${new Date(j.updated * 1000).toLocaleTimeString()}</td></tr>`).join("") || `<tr><td colspan="5" class="muted">no jobs yet</td></tr>`;
}

function renderGateways(gateways) {
  $("#gateways tbody").innerHTML = (gateways || []).map((g) => `<tr data-gateway="${esc(g.gateway)}">
      <td class="mono">${esc(g.gateway)}</td><td>${g.up ? "up" : "silent"} · report ${esc(g.last_report_s)} s ago</td>
      <td>${esc(g.leases)}</td><td>${esc(g.requests)}</td><td>${esc(g.tokens)}</td><td>${esc(g.refused)}</td></tr>`).join("")
    || `<tr><td colspan="6" class="muted">none: the broker serves the OpenAI endpoints itself (<code>fusionai gateway --broker URL</code> adds one)</td></tr>`;
}

function renderEvent(e) {
  state.events.unshift(e);
  state.events.length = Math.min(state.events.length, 200);
  const li = document.createElement("li");
  const who = [e.job && "job " + e.job, e.peer && short(e.peer)].filter(Boolean).join(" ");
  li.textContent = `${new Date(e.at * 1000).toLocaleTimeString()} ${e.kind} ${who}`;
  $("#events").prepend(li);
  while ($("#events").children.length > 200) $("#events").lastChild.remove();
}

function handle(event, data) {
  if (event === "snapshot") {
    const s = JSON.parse(data);
    $("#broker").textContent = short(s.broker.peer_id);
    $("#broker").title = s.broker.peer_id;
    renderProviders(s.providers);
    renderModels(s.models);
    renderJobs(s.jobs);
    renderGateways(s.gateways);
    document.body.dataset.updated = String(Date.now());
  } else if (event === "event") {
    renderEvent(JSON.parse(data));
  }
}

async function connect() {
  const headers = {};
  const key = localStorage.getItem("fusionai-api-key");
  if (key) headers.Authorization = "Bearer " + key;
  let resp;
  try {
    resp = await fetch("/v1/stream", { headers });
  } catch (err) {
    setConn("disconnected", "error");
    return setTimeout(connect, 2000);
  }
  if (resp.status === 401) {
    setConn("API key needed", "error");
    $("#keyform").hidden = false;
    return;
  }
  if (!resp.ok) {
    setConn("error " + resp.status, "error");
    return setTimeout(connect, 2000);
  }
  setConn("live", "live");
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        let event = "message";
        const data = [];
        for (const line of block.split("\n")) {
          if (line.startsWith("event: ")) event = line.slice(7);
          else if (line.startsWith("data: ")) data.push(line.slice(6));
        }
        if (data.length) handle(event, data.join("\n"));
      }
    }
  } catch (err) {
    /* the stream broke: reconnect below */
  }
  setConn("reconnecting", "error");
  setTimeout(connect, 1000);
}

$("#keyform").addEventListener("submit", (ev) => {
  ev.preventDefault();
  localStorage.setItem("fusionai-api-key", $("#key").value);
  $("#keyform").hidden = true;
  connect();
});
connect();
