// The swarm dashboard: a map, live charts, jobs, a playground and the event log.
// It reads /v1/stream (server-sent events: snapshots, events, samples) with fetch() rather than
// EventSource, so an API key can go in the Authorization header (never in a URL). Everything
// from providers, models and users is set as text (textContent, attributes), never as markup;
// the broker serves the page with a Content-Security-Policy of default-src 'self'.
"use strict";

const $ = (sel) => document.querySelector(sel);
const short = (peer) => (peer ? "…" + peer.slice(-10) : "");  // peer ids share their first characters
const bytes = (n) => (n >= 2 ** 30 ? (n / 2 ** 30).toFixed(1) + " GiB" : (n / 2 ** 20).toFixed(0) + " MiB");
const KEY = "fusionai-api-key";
const FAILOVER_KINDS = {
  provider_lost: (e) => `provider ${short(e.peer)} lost${e.reason ? ": " + e.reason : ""}`,
  provider_left: (e) => `provider ${short(e.peer)} left`,
  session_failover: (e) => `a session moved off ${short(e.peer)} on ${e.stage || "a stage"}${e.reason ? " (" + e.reason + ")" : ""}`,
  microbatch_retry: (e) => `job ${e.job || ""}: a microbatch retried${e.peer ? " after " + short(e.peer) : ""}`,
  provider_quarantined: (e) => `provider ${short(e.peer)} quarantined: ${e.reason || ""}`,
};
const state = {
  snapshot: null, samples: [], every: 5, flash: new Map(), failovers: [], play: null,
  job: null, jobTimer: null, chartsDirty: true, lastEvent: 0,
};

// h("div", {class: "x", "data-y": 1}, "text", child...): an element; strings become text nodes.
function h(tag, attrs, ...kids) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v == null || v === false) continue;
    if (k === "class") el.className = v;
    else el.setAttribute(k, String(v));
  }
  for (const kid of kids.flat(Infinity)) {
    if (kid == null || kid === false) continue;
    el.append(kid instanceof Node ? kid : String(kid));
  }
  return el;
}

function chip(peer, backup) {
  const el = h("span", { class: backup ? "chip backup" : "chip", title: peer, "data-peer": peer }, short(peer));
  el.style.setProperty("--hue", hueOf(peer));
  return el;
}

function headers(extra) {
  const out = Object.assign({}, extra || {});
  const key = localStorage.getItem(KEY);
  if (key) out.Authorization = "Bearer " + key;
  return out;
}

function setConn(text, st) {
  const el = $("#conn");
  el.textContent = text;
  el.dataset.state = st;
}

function layerText(st) {
  if (st.layers && st.layers.length === 2) {
    return st.layers[1] - st.layers[0] === 1 ? `layer ${st.layers[0]}` : `layers ${st.layers[0]}–${st.layers[1] - 1}`;
  }
  return st.name;
}

// ---- the map ------------------------------------------------------------------------------

function renderMap(s) {
  const stages = {};  // key -> [model, stage]
  for (const m of s.models) for (const st of m.stages) stages[st.key] = [m, st];
  $("#lanes").replaceChildren(...s.models.map((m) => h("div", { class: "lane", "data-model": m.model },
    h("div", { class: "lane-title" }, h("strong", {}, m.model),
      h("span", { class: "muted" }, `${m.ready ? "ready" : m.waiting || "placing"} · ${m.stages.length} provider stages · ${m.throughput_tokens_s} tokens/s planned`)),
    h("div", { class: "segments" }, m.stages.map((st) => {
      const seg = h("div", {
        class: "segment", "data-stage": st.key, "data-served": String(st.providers.length > 0),
        "data-layers": st.layers && st.layers.length === 2 ? `${st.layers[0]}-${st.layers[1] - 1}` : "",
      },
      h("div", {}, h("strong", {}, layerText(st)), " ", h("span", { class: "muted" }, st.key)),
      h("div", { class: "who" },
        st.providers.length ? st.providers.map((p) => chip(p.peer_id, false)) : h("em", {}, "no route"),
        st.backups.map((b) => chip(b, true))));
      seg.style.flexGrow = String(st.layers && st.layers.length === 2 ? Math.max(1, st.layers[1] - st.layers[0]) : 1);
      return seg;
    })))));
  if (!s.models.length) $("#lanes").replaceChildren(h("p", { class: "muted" }, "no models; add one with ", h("code", {}, "fusionai model add DIR")));

  const pools = {};
  const now = Date.now();
  const cards = s.providers.map((p) => {
    pools[p.pool] = (pools[p.pool] || 0) + 1;
    const r = p.reputation || {};
    const gflops = Object.entries(p.flops || {}).map(([k, v]) => `${k} ${(v / 1e9).toFixed(0)}`).join(", ");
    const used = (p.loaded || []).reduce((sum, key) => sum + ((stages[key] && stages[key][1].size_bytes) || 0), 0) + (p.kv_bytes || 0);
    const health = r.quarantined ? "quarantined" : p.pool === "dead" ? "lost" : p.flapping ? "flapping" : `seen ${p.last_seen_s.toFixed(1)} s ago`;
    const checks = r.quarantined ? `quarantined: ${r.reason}` : r.checks ? `${r.agreed}/${r.checks} agreed` : "none yet";
    const holds = (p.loaded || []).map((key) => {
      const found = stages[key];
      if (!found) return h("li", { "data-stage": key }, key);
      const [m, st] = found;
      const role = st.providers.some((x) => x.peer_id === p.peer_id) ? "serving" : st.backups.includes(p.peer_id) ? "backup" : "loaded";
      return h("li", { "data-stage": key, "data-role": role }, `${m.model} ${layerText(st)}: ${role}`);
    });
    const bar = h("span", {});
    bar.style.width = `${Math.min(100, (100 * used) / Math.max(1, p.memory_bytes)).toFixed(1)}%`;
    const card = h("article", {
      class: "card", "data-peer": p.peer_id, "data-pool": p.pool,
      "data-flash": String((state.flash.get(p.peer_id) || 0) > now),
    },
    h("div", { class: "card-title" },
      h("span", {}, chip(p.peer_id, false)),
      h("span", {},
        h("span", { class: "badge pool", "data-pool": p.pool }, p.pool), " ",
        h("span", { class: "badge reach", "data-reach": p.reach || "unknown", title: p.observed || "" }, p.reach || "unknown"),
        r.quarantined ? [" ", h("span", { class: "badge", "data-quarantined": "true" }, "quarantined")] : null)),
    h("dl", {},
      h("dt", {}, "Hardware"), h("dd", { class: "hardware" }, p.hardware),
      h("dt", {}, "Executor"), h("dd", {}, p.executor || "–"),
      h("dt", {}, "GFLOP/s"), h("dd", {}, gflops || "–"),
      h("dt", {}, "Memory"), h("dd", { class: "memory" }, h("span", { class: "bar" }, bar), " ", `${bytes(used)} of ${bytes(p.memory_bytes)}`),
      h("dt", {}, "Load"), h("dd", {}, `${p.queued} waiting${p.kv_bytes ? ", KV " + bytes(p.kv_bytes) : ""}`),
      h("dt", {}, "Health"), h("dd", { class: "health" }, health),
      h("dt", {}, "Checks"), h("dd", { class: "checks" }, checks)),
    holds.length ? h("ul", { class: "holds" }, holds) : h("p", { class: "muted" }, "holds no stage"));
    card.style.setProperty("--hue", hueOf(p.peer_id));
    return card;
  });
  $("#cards").replaceChildren(...cards);
  if (!cards.length) $("#cards").replaceChildren(h("p", { class: "muted" }, "no providers have joined"));
  $("#pools").textContent = Object.entries(pools).map(([k, v]) => `${v} ${k}`).join(" · ");
}

function renderFailovers() {
  $("#failovers").replaceChildren(...state.failovers.map((f) => h("div", { "data-kind": f.kind }, f.text)));
}

function renderGateways(gateways) {
  const rows = (gateways || []).map((g) => h("tr", { "data-gateway": g.gateway },
    h("td", { class: "mono" }, g.gateway), h("td", {}, `${g.up ? "up" : "silent"} · report ${g.last_report_s} s ago`),
    h("td", {}, g.leases), h("td", {}, g.requests), h("td", {}, g.tokens), h("td", {}, g.refused)));
  $("#gateways tbody").replaceChildren(...(rows.length ? rows : [h("tr", {}, h("td", { colspan: 6, class: "muted" },
    "none: the broker serves the OpenAI endpoints itself (", h("code", {}, "fusionai gateway --broker URL"), " adds one)"))]));
}

// ---- charts -------------------------------------------------------------------------------

const CHARTS = [
  ["tokens", "Tokens/s per model", "tokens/s", (s) => mapOf(s.models, (m) => m.tokens_s)],
  ["requests", "Requests/s per model", "req/s", (s) => mapOf(s.models, (m) => m.requests_s)],
  ["queue", "Queued jobs per model", "jobs", (s) => mapOf(s.models, (m) => m.queued)],
  ["util", "Provider utilisation", "%", (s) => mapOf(s.providers, (p) => 100 * p.util), short],
  ["latency", "Stage latency per provider", "ms", (s) => mapOf(s.providers, (p) => p.stage_ms), short],
  ["waiting", "Requests waiting per provider", "requests", (s) => mapOf(s.providers, (p) => p.queued), short],
  ["failovers", "Failovers and verification, per sample", "events", (s) => ({
    failovers: Object.values(s.failovers).reduce((a, b) => a + b, 0),
    agreed: s.checks.agreed || 0, disagreed: s.checks.disagreed || 0,
    quarantined: s.checks.quarantined || 0,
  })],
  ["gateways", "Gateways' tokens/s", "tokens/s", (s) => mapOf(s.gateways, (g) => g.tokens_s)],
  ["network", "Network tokens/s", "tokens/s", (s) => ({ all: s.tokens_s })],
];

function mapOf(obj, f) {
  const out = {};
  for (const [k, v] of Object.entries(obj || {})) out[k] = f(v);
  return out;
}

function renderCharts() {
  if ($("#view-charts").hidden) { state.chartsDirty = true; return; }
  state.chartsDirty = false;
  const box = $("#charts");
  const first = state.samples.length ? state.samples[0].at : Date.now() / 1000;
  const span = Math.min(3600, Math.max(60, Date.now() / 1000 - first));
  $("#span").textContent = `the last ${Math.round(span / 60)} min, a sample every ${state.every} s`;
  for (const [id, title, unit, pick, label] of CHARTS) {
    let el = box.querySelector(`[data-chart="${id}"]`);
    if (!el) {
      el = h("figure", { "data-chart": id });
      box.append(el);
    }
    const series = {};
    state.samples.forEach((s, i) => {
      const values = pick(s);
      for (const name of Object.keys(values)) if (!series[name]) series[name] = state.samples.slice(0, i).map((x) => [x.at, null]);
      for (const name of Object.keys(series)) series[name].push([s.at, name in values ? values[name] : null]);
    });
    lineChart(el, { title, unit, series, span, label });
  }
}

function addSample(sample) {
  const last = state.samples[state.samples.length - 1];
  if (last && sample.seq <= last.seq) return;  // (the history read at connect has it)
  state.samples.push(sample);
  const keep = Math.ceil(3600 / state.every);
  if (state.samples.length > keep) state.samples.splice(0, state.samples.length - keep);
  renderCharts();
}

async function loadHistory() {
  const resp = await fetch("/v1/metrics/history", { headers: headers() });
  if (!resp.ok) return;
  const body = await resp.json();
  state.every = body.every_s;
  state.samples = body.samples;
  renderCharts();
}

// ---- jobs ---------------------------------------------------------------------------------

function renderJobs(jobs) {
  const rows = jobs.map((j) => {
    const bar = h("span", {});
    bar.style.width = `${(100 * j.progress).toFixed(1)}%`;
    return h("tr", { "data-job": j.id },
      h("td", { class: "peer" }, h("a", { href: "#job/" + encodeURIComponent(j.id) }, j.id)),
      h("td", {}, j.kind || ""), h("td", {}, j.model), h("td", {}, j.state, j.error ? ": " + j.error : ""),
      h("td", {}, h("span", { class: "bar" }, bar), ` ${j.done}/${j.microbatches}`),
      h("td", {}, new Date(j.updated * 1000).toLocaleTimeString()));
  });
  $("#jobs tbody").replaceChildren(...(rows.length ? rows : [h("tr", {}, h("td", { colspan: 6, class: "muted" }, "no jobs yet"))]));
}

async function showJob(id) {
  clearTimeout(state.jobTimer);
  const token = (state.job = {});  // a later call (another job, a refresh) wins
  const box = $("#job");
  box.hidden = false;
  const [jr, sr] = await Promise.all([
    fetch("/v1/jobs/" + encodeURIComponent(id), { headers: headers() }),
    fetch("/v1/jobs/" + encodeURIComponent(id) + "/story", { headers: headers() }),
  ]);
  if (state.job !== token) return;
  if (!jr.ok) {
    box.replaceChildren(h("p", {}, `job ${id}: ${jr.status === 404 ? "not found" : "error " + jr.status}`));
    return;
  }
  const job = await jr.json();
  const story = sr.ok ? (await sr.json()).events || [] : [];
  if (state.job !== token) return;
  const bar = h("span", {});
  bar.style.width = `${(100 * job.progress).toFixed(1)}%`;
  const loss = {};
  for (const e of story) {
    if (e.loss != null && e.step != null) (loss.loss = loss.loss || []).push([e.step, e.loss]);
    if (e.val_loss != null && e.step != null) (loss.validation = loss.validation || []).push([e.step, e.val_loss]);
  }
  const curve = h("figure", { "data-chart": "loss" });
  box.replaceChildren(
    h("h3", {}, `Job ${job.id}`),
    h("p", {}, `${job.kind} on ${job.model}: ${job.state}${job.error ? " (" + job.error + ")" : ""} `,
      h("span", { class: "bar" }, bar), ` ${job.done}/${job.microbatches}`),
    Object.keys(loss).length ? curve : h("p", { class: "muted" }, "no loss reported (fine-tune and training jobs report one per step)"),
    h("h4", {}, "Story"),
    h("ol", {}, story.map((e) => h("li", {}, `${new Date(e.at * 1000).toLocaleTimeString()} ${e.kind} ${storyText(e)}`))));
  if (Object.keys(loss).length) {
    // steps on the x axis: drawn as if each step were a second
    const steps = Object.values(loss).flat().map(([s]) => s);
    const lo = Math.min(...steps), hi = Math.max(...steps), now = Date.now() / 1000;
    const series = mapOf(loss, (pts) => pts.map(([s, v]) => [now - (hi - s), v]));
    lineChart(curve, {
      title: `Loss, steps ${lo} to ${hi}`, unit: "", series, span: Math.max(1, hi - lo),
      zero: false, ends: [`step ${lo}`, `step ${hi}`], end: now,
    });
  }
  if (!["succeeded", "failed", "cancelled"].includes(job.state) && location.hash === "#job/" + encodeURIComponent(id)) {
    state.jobTimer = setTimeout(() => showJob(id), 2000);
  }
}

function storyText(e) {
  return Object.entries(e).filter(([k]) => !["id", "at", "kind", "job"].includes(k))
    .map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`).join(" ");
}

// ---- events -------------------------------------------------------------------------------

function renderEvent(e) {
  if (e.id <= state.lastEvent) return;  // (a stream opened again replays recent events)
  state.lastEvent = e.id;
  const who = [e.job && "job " + e.job, e.peer && short(e.peer)].filter(Boolean).join(" ");
  const li = h("li", { "data-kind": e.kind }, `${new Date(e.at * 1000).toLocaleTimeString()} ${e.kind} ${who}`);
  $("#events").prepend(li);
  while ($("#events").children.length > 200) $("#events").lastChild.remove();
  const text = FAILOVER_KINDS[e.kind];
  if (text) {
    state.failovers.unshift({ kind: e.kind, text: `${new Date(e.at * 1000).toLocaleTimeString()} ${text(e)}` });
    state.failovers.length = Math.min(state.failovers.length, 5);
    renderFailovers();
    if (e.peer && Date.now() / 1000 - e.at < 30) {
      state.flash.set(e.peer, Date.now() + 5000);
      const card = document.querySelector(`.card[data-peer="${CSS.escape(e.peer)}"]`);
      if (card) {
        card.dataset.flash = "true";
        setTimeout(() => { if (state.snapshot) renderMap(state.snapshot); }, 5100);
      }
    }
  }
}

// ---- the playground -----------------------------------------------------------------------

function renderPlayModels(models) {
  const select = $("#play-model");
  const chosen = select.value;
  const names = models.filter((m) => m.ready).map((m) => m.model);
  if (names.join("\n") === Array.from(select.options).map((o) => o.value).join("\n")) return;
  select.replaceChildren(...names.map((n) => h("option", { value: n }, n)));
  if (names.includes(chosen)) select.value = chosen;
}

async function play(ev) {
  ev.preventDefault();
  if (state.play) return;
  const model = $("#play-model").value;
  const prompt = $("#play-prompt").value;
  if (!model) { $("#play-state").textContent = "no model is ready"; return; }
  const chat = $("#play-mode").value === "chat";
  const body = {
    model, stream: true, stream_options: { include_route: true },
    max_tokens: Number($("#play-max").value) || 32, temperature: Number($("#play-temp").value) || 0,
  };
  if (chat) body.messages = [{ role: "user", content: prompt }];
  else body.prompt = prompt;
  const out = $("#play-out");
  const rows = $("#play-tokens tbody");
  out.textContent = "";
  out.dataset.done = "false";
  rows.replaceChildren();
  const control = new AbortController();
  state.play = control;
  $("#play-send").disabled = true;
  $("#play-stop").disabled = false;
  $("#play-state").textContent = "generating…";
  const started = performance.now();
  let tokens = 0, ms = 0, error = "", checked = "";
  try {
    const resp = await fetch(chat ? "/v1/chat/completions" : "/v1/completions", {
      method: "POST", headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify(body), signal: control.signal,
    });
    if (!resp.ok) {
      const text = await resp.text();
      try { error = JSON.parse(text).error.message; } catch (_) { error = `error ${resp.status}`; }
    } else {
      await readEvents(resp, (data) => {
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) { error = chunk.error.message; return; }
        for (const v of chunk.verification || []) {  // the broker's check of a sampled answer
          checked = v.verdict.ok ? " · checked: the broker reproduced it" :
            ` · check failed: not reproduced (quarantined: ${v.verdict.quarantined.join(", ") || "nobody"})`;
        }
        const choice = (chunk.choices || [])[0];
        const piece = choice ? (chat ? (choice.delta && choice.delta.content) || "" : choice.text || "") : "";
        out.append(piece);
        if (chunk.fusionai) {
          tokens += 1;
          ms += chunk.fusionai.ms;
          rows.append(h("tr", { "data-token": tokens },
            h("td", {}, tokens), h("td", { class: "mono" }, JSON.stringify(piece)), h("td", {}, chunk.fusionai.ms.toFixed(1)),
            h("td", {}, chunk.fusionai.providers.map((p) => chip(p, false)))));
        }
      });
    }
  } catch (err) {
    error = control.signal.aborted ? "stopped" : String(err);
  } finally {
    state.play = null;
    $("#play-send").disabled = false;
    $("#play-stop").disabled = true;
    const seconds = (performance.now() - started) / 1000;
    $("#play-state").textContent = (error ? error + " · " : "") +
      `${tokens} tokens in ${seconds.toFixed(2)} s (${(tokens / Math.max(seconds, 1e-3)).toFixed(1)} tokens/s)` +
      (tokens ? `, ${(ms / tokens).toFixed(1)} ms per token` : "") + checked;
    out.dataset.done = "true";
  }
}

// Read server-sent events from a fetch response; `onData` gets each event's data.
async function readEvents(resp, onData, onEvent) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(line[5] === " " ? 6 : 5));
      }
      if (data.length) (onEvent ? onEvent(event, data.join("\n")) : onData(data.join("\n")));
    }
  }
}

// ---- the feed and the views ---------------------------------------------------------------

function handle(event, data) {
  if (event === "snapshot") {
    const s = JSON.parse(data);
    state.snapshot = s;
    $("#broker").textContent = short(s.broker.peer_id);
    $("#broker").title = s.broker.peer_id;
    renderMap(s);
    renderJobs(s.jobs);
    renderGateways(s.gateways);
    renderPlayModels(s.models);
    if ($("#main").hidden) {
      $("#main").hidden = false;
      $("#nav").hidden = false;
      route();
    }
    document.body.dataset.updated = String(Date.now());
  } else if (event === "event") {
    renderEvent(JSON.parse(data));
  } else if (event === "sample") {
    addSample(JSON.parse(data));
  }
}

function route() {
  const hash = location.hash.slice(1) || "map";
  const [view, arg] = hash.split("/");
  const name = ["map", "charts", "jobs", "play", "events", "job"].includes(view) ? view : "map";
  const shown = name === "job" ? "jobs" : name;
  for (const section of document.querySelectorAll(".view")) section.hidden = section.id !== "view-" + shown;
  for (const a of document.querySelectorAll("nav a")) {
    if (a.dataset.view === shown) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  let job = null;
  try { job = arg ? decodeURIComponent(arg) : null; } catch (_) { /* a malformed link */ }
  if (name === "job" && job) showJob(job).catch(() => {});
  else { $("#job").hidden = true; state.job = null; clearTimeout(state.jobTimer); }
  if (shown === "charts" && state.chartsDirty) renderCharts();
}

function askForKey() {
  setConn("API key needed", "error");
  $("#main").hidden = true;
  $("#nav").hidden = true;
  $("#keyform").hidden = false;
  $("#key").focus();
}

async function connect() {
  let resp;
  try {
    resp = await fetch("/v1/stream", { headers: headers() });
  } catch (err) {
    setConn("disconnected", "error");
    return setTimeout(connect, 2000);
  }
  if (resp.status === 401) return askForKey();
  if (!resp.ok) {
    setConn("error " + resp.status, "error");
    return setTimeout(connect, 2000);
  }
  setConn("live", "live");
  loadHistory().catch(() => {});
  try {
    await readEvents(resp, null, handle);
  } catch (err) {
    /* the stream broke: reconnect below */
  }
  setConn("reconnecting", "error");
  setTimeout(connect, 1000);
}

$("#keyform").addEventListener("submit", (ev) => {
  ev.preventDefault();
  localStorage.setItem(KEY, $("#key").value);
  $("#keyform").hidden = true;
  connect();
});
$("#play").addEventListener("submit", play);
$("#play-stop").addEventListener("click", () => state.play && state.play.abort());
$("#play-prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) $("#play").requestSubmit();
});
window.addEventListener("hashchange", route);
setInterval(() => { if (!$("#view-charts").hidden) renderCharts(); }, 5000);  // (the time axis moves)
connect();
