// lmserve web console: a playground over the server's own OpenAI routes, and a live view of the engine
// from /v1/engine/stream. Plain JS, no build step, no dependencies.
"use strict";

const $ = (sel) => document.querySelector(sel);
const MODEL = $("#model").textContent;
const keyInput = $("#api-key");
keyInput.value = localStorage.getItem("lmserve-key") || "";
keyInput.addEventListener("change", () => { localStorage.setItem("lmserve-key", keyInput.value); restartStream(); });

function headers() {
  const h = { "Content-Type": "application/json" };
  if (keyInput.value) h["Authorization"] = "Bearer " + keyInput.value;
  return h;
}

function notice(text) {
  const n = $("#notice");
  n.textContent = text || "";
  n.hidden = !text;
}

async function errorText(resp) {
  try { const j = await resp.json(); return (j.error && j.error.message) || JSON.stringify(j); }
  catch (e) { return resp.status + " " + resp.statusText; }
}

// Server-sent events over fetch (EventSource cannot send the API key): calls onEvent(data) per event.
async function readEvents(resp, onEvent, signal) {
  const reader = resp.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  while (true) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += dec.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, i);
      buf = buf.slice(i + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      const isError = block.split("\n").some((l) => l.startsWith("event: error"));
      if (data && data !== "[DONE]") onEvent(JSON.parse(data), isError);
    }
    if (signal && signal.aborted) return;
  }
}

// ------------------------------------------------------------------ tabs
document.querySelectorAll(".tab").forEach((b) => b.addEventListener("click", () => {
  document.querySelectorAll(".tab").forEach((t) => t.classList.toggle("active", t === b));
  document.querySelectorAll(".view").forEach((v) => { v.hidden = v.id !== "view-" + b.dataset.view; });
  if (b.dataset.view === "engine") startStream(); else stopStream();
}));

// ------------------------------------------------------------------ sampling controls
const CONTROLS = [
  ["temperature", "Temperature", "number", 0.7, "0.05"], ["top_p", "Top-p", "number", 1.0, "0.05"],
  ["max_tokens", "Max tokens", "number", 256, "1"], ["seed", "Seed (empty: random)", "number", "", "1"],
  ["stop", "Stop strings (one per line)", "textarea", "", ""],
];
function buildControls(root, prefix) {
  for (const [name, label, kind, value, step] of CONTROLS) {
    const l = document.createElement("label");
    l.textContent = label;
    const el = document.createElement(kind === "textarea" ? "textarea" : "input");
    if (kind !== "textarea") { el.type = kind; el.step = step; }
    else el.rows = 2;
    el.id = prefix + name;
    el.value = value;
    l.appendChild(el);
    root.appendChild(l);
  }
}
buildControls($("#sampling"), "c-");
buildControls($("#sampling-complete"), "p-");
function sampling(prefix) {
  const v = (n) => $("#" + prefix + n).value.trim();
  const body = {};
  for (const n of ["temperature", "top_p", "max_tokens", "seed"]) {  // an empty field: the server's default
    if (v(n) !== "") body[n] = Number(v(n));
  }
  const stop = v("stop").split("\n").filter((s) => s.length);
  if (stop.length) body.stop = stop;
  return body;
}

// ------------------------------------------------------------------ chat
const history = [];
let controller = null;
let conversation = 0;  // Clear starts a new one: a reply still streaming for the old one stays out of history
const messages = $("#messages");

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  div.appendChild(body);
  messages.appendChild(div);
  messages.scrollTop = messages.scrollHeight;
  return div;
}

async function send(text) {
  const mine = conversation;
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const reply = addMessage("assistant", "");
  const out = reply.querySelector(".text");
  const system = $("#system").value.trim();
  const msgs = (system ? [{ role: "system", content: system }] : []).concat(history);
  controller = new AbortController();
  $("#send").disabled = true; $("#stop").disabled = false;
  const t0 = performance.now();
  let first = null, usage = null, text_ = "";
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: controller.signal,
      body: JSON.stringify({ model: MODEL, messages: msgs, stream: true, stream_options: { include_usage: true }, ...sampling("c-") }),
    });
    if (!resp.ok) throw new Error(await errorText(resp));
    await readEvents(resp, (ev, isError) => {
      if (isError || ev.error) throw new Error((ev.error && ev.error.message) || ev.message);
      if (ev.usage) usage = ev.usage;
      for (const c of ev.choices || []) {
        const d = (c.delta && c.delta.content) || "";
        if (d && first === null) first = performance.now();
        text_ += d;
        out.textContent = text_;
      }
      messages.scrollTop = messages.scrollHeight;
    }, controller.signal);
    if (mine === conversation) history.push({ role: "assistant", content: text_ });
    const end = performance.now();
    const meta = document.createElement("span");
    meta.className = "meta";
    const n = usage ? usage.completion_tokens : null;
    const ttft = first === null ? null : (first - t0) / 1000;
    const tps = n && first !== null && end > first && n > 1 ? (n - 1) / ((end - first) / 1000) : null;
    meta.textContent = `TTFT ${ttft === null ? "-" : ttft.toFixed(2) + " s"} · ${n ?? "-"} tokens · ` +
      `${tps === null ? "-" : tps.toFixed(1)} tok/s`;
    reply.dataset.ttft = ttft ?? "";
    reply.dataset.tokens = n ?? "";
    reply.appendChild(meta);
  } catch (e) {
    if (mine !== conversation) { /* cleared meanwhile: its turns are gone already */ }
    else if (e.name === "AbortError") { history.push({ role: "assistant", content: text_ }); }
    else { reply.classList.add("error"); out.textContent = (text_ ? text_ + "\n" : "") + "error: " + e.message; history.pop(); }
  } finally {
    controller = null;
    $("#send").disabled = false; $("#stop").disabled = true;
  }
}

$("#chat-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("#chat-input").value.trim();
  if (!text || controller) return;
  $("#chat-input").value = "";
  send(text);
});
$("#chat-input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("#chat-form").requestSubmit(); }
});
$("#stop").addEventListener("click", () => controller && controller.abort());
$("#clear").addEventListener("click", () => {
  conversation++;
  if (controller) controller.abort();
  history.length = 0; messages.innerHTML = "";
});

// ------------------------------------------------------------------ raw completion with logprobs
$("#complete").addEventListener("click", async () => {
  const box = $("#completion");
  const prompt = $("#prompt").value;
  box.innerHTML = "";
  const p = document.createElement("span");
  p.className = "prompt";
  p.textContent = prompt;
  box.appendChild(p);
  $("#complete").disabled = true;
  const t0 = performance.now();
  let first = null, count = 0;
  try {
    const resp = await fetch("/v1/completions", {
      method: "POST", headers: headers(),
      body: JSON.stringify({ model: MODEL, prompt, stream: true, logprobs: 5, ...sampling("p-") }),
    });
    if (!resp.ok) throw new Error(await errorText(resp));
    // The text shown is the completion's own (a chunk's `text`), not its tokens decoded one by one (a
    // character split over two tokens, a stop string cut off): each piece of text carries the tokens
    // that made it, held over while a chunk brings tokens but no text yet.
    let pending = [];  // [token, logprob, top] not yet shown
    await readEvents(resp, (ev, isError) => {
      if (isError || ev.error) throw new Error((ev.error && ev.error.message) || ev.message);
      for (const c of ev.choices || []) {
        const lp = c.logprobs;
        if (lp && lp.tokens) {
          if (lp.tokens.length && first === null) first = performance.now();
          count += lp.tokens.length;
          lp.tokens.forEach((tok, i) => pending.push([tok, lp.token_logprobs[i], (lp.top_logprobs || [])[i] || {}]));
        }
        if (!c.text) continue;
        const s = document.createElement("span");
        s.className = "tok";
        s.textContent = c.text;
        const l = pending.reduce((acc, [, lpv]) => acc + lpv, 0);  // the piece's log-probability
        s.dataset.logprob = l;
        s.style.background = `rgba(37, 99, 235, ${(0.05 + 0.35 * (1 - Math.exp(l))).toFixed(3)})`;
        s.title = pending.map(([tok, lpv, top]) => `${JSON.stringify(tok)}  logprob ${lpv.toFixed(3)} ` +
          `(p ${Math.exp(lpv).toFixed(3)})\n` +
          Object.entries(top).map(([t, v]) => `  ${JSON.stringify(t)}  ${v.toFixed(3)}`).join("\n")).join("\n");
        pending = [];
        s.addEventListener("mouseenter", () => { $("#token-info").textContent = s.title; });
        box.appendChild(s);
      }
    });
    const end = performance.now();
    $("#complete-stats").textContent = `TTFT ${first === null ? "-" : ((first - t0) / 1000).toFixed(2) + " s"} · ` +
      `${count} tokens · ${count > 1 && first !== null ? ((count - 1) / ((end - first) / 1000)).toFixed(1) : "-"} tok/s`;
  } catch (e) {
    const err = document.createElement("div");
    err.className = "msg error";
    err.textContent = "error: " + e.message;
    box.appendChild(err);
  } finally {
    $("#complete").disabled = false;
  }
});

// ------------------------------------------------------------------ engine view
const COLORS = { ".": "#e5e7eb", c: "#93c5fd", 1: "#16a34a" };
const SHARED = ["#fdba74", "#fb923c", "#f97316", "#ea580c", "#c2410c", "#9a3412", "#7c2d12", "#431407"];
const series = { tps: [], ttft: [], tpot: [] };  // [time (s), value]
const WINDOW_S = 300;
let stream = null, lastSnap = null;

function stopStream() { if (stream) { stream.abort(); stream = null; } }
function restartStream() { stopStream(); if (!$("#view-engine").hidden) startStream(); }
async function startStream() {
  if (stream) return;
  const ctl = new AbortController();
  stream = ctl;
  try {
    const resp = await fetch("/v1/engine/stream", { headers: headers(), signal: ctl.signal });
    if (!resp.ok) { notice("engine view: " + await errorText(resp)); stream = null; return; }
    notice("");
    await readEvents(resp, (snap, isError) => {
      if (isError) { notice("engine view: " + snap.message); return; }
      draw(snap);
    }, ctl.signal);
  } catch (e) {
    if (e.name !== "AbortError") notice("engine view: " + e.message);
  }
  if (stream === ctl) stream = null;
}

function draw(s) {
  const counts = { ".": 0, c: 0, used: 0, shared: 0 };
  for (const ch of s.blocks) {
    if (ch === "." || ch === "c") counts[ch]++;
    else if (ch === "1") counts.used++;
    else counts.shared++;
  }
  const grid = $("#block-grid");
  Object.assign(grid.dataset, { free: counts["."], cached: counts.c, used: counts.used, shared: counts.shared, total: s.blocks.length });
  drawGrid(grid, s.blocks);
  $("#kv-summary").textContent = `${s.blocks.length} blocks of ${s.block_size} tokens: ${counts.used + counts.shared} in use ` +
    `(${counts.shared} shared), ${counts.c} cached, ${counts["."]} free`;

  const b = s.batch;
  const bar = $("#batch-bar");
  bar.querySelector(".prefill").style.width = (100 * b.prefill / b.budget) + "%";
  bar.querySelector(".decode").style.width = (100 * b.decode / b.budget) + "%";
  $("#batch-summary").textContent = `${b.prefill} prefill + ${b.decode} decode of ${b.budget} tokens`;
  const hit = s.prompt_tokens_queried ? (100 * s.prefix_hit_tokens / s.prompt_tokens_queried).toFixed(1) + " %" : "-";
  const rows = [["running", s.num_running], ["waiting", s.num_waiting], ["prefix-cache hit rate", hit],
    ["preemptions", s.preemptions], ["tokens computed", s.computed_tokens]];
  $("#counters").innerHTML = rows.map(([k, v]) => `<dt>${k}</dt><dd>${v}</dd>`).join("");

  const body = $("#queue tbody");
  body.innerHTML = "";
  for (const r of s.running.concat(s.waiting)) {
    const tr = document.createElement("tr");
    for (const v of [r.id, null, r.prompt, r.computed, r.output, r.blocks]) {
      const td = document.createElement("td");
      if (v === null) { const p = document.createElement("span"); p.className = "phase " + r.phase; p.textContent = r.phase; td.appendChild(p); }
      else td.textContent = v;
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }

  if (lastSnap && s.time > lastSnap.time) series.tps.push([s.time, Math.max(0, s.output_tokens - lastSnap.output_tokens) / (s.time - lastSnap.time)]);
  for (const f of s.finished) {
    if (f.ttft !== null) series.ttft.push([s.time, f.ttft]);
    if (f.tpot !== null) series.tpot.push([s.time, 1000 * f.tpot]);
  }
  for (const k in series) while (series[k].length && series[k][0][0] < s.time - WINDOW_S) series[k].shift();
  lastSnap = s;
  chart($("#chart-tps"), series.tps, s.time, "line");
  chart($("#chart-ttft"), series.ttft, s.time, "dots");
  chart($("#chart-tpot"), series.tpot, s.time, "dots");
}

function drawGrid(canvas, blocks) {
  const n = blocks.length;
  const w = canvas.clientWidth || canvas.width;
  const cell = Math.max(3, Math.min(16, Math.floor(Math.sqrt((w * 240) / Math.max(1, n)))));
  const cols = Math.max(1, Math.floor(w / cell));
  const h = Math.ceil(n / cols) * cell;
  const dpr = window.devicePixelRatio || 1;
  canvas.width = w * dpr; canvas.height = h * dpr; canvas.style.height = h + "px";
  const g = canvas.getContext("2d");
  g.scale(dpr, dpr);
  const gap = cell > 5 ? 1 : 0;
  for (let i = 0; i < n; i++) {
    const ch = blocks[i];
    g.fillStyle = COLORS[ch] || SHARED[Math.min(SHARED.length - 1, Number(ch) - 2)];
    g.fillRect((i % cols) * cell, Math.floor(i / cols) * cell, cell - gap, cell - gap);
  }
}

function chart(canvas, pts, now, kind) {
  const w = canvas.clientWidth || canvas.width, h = 150, dpr = window.devicePixelRatio || 1;
  canvas.width = w * dpr; canvas.height = h * dpr; canvas.style.height = h + "px";
  const g = canvas.getContext("2d");
  g.scale(dpr, dpr);
  g.clearRect(0, 0, w, h);
  const left = 40, bottom = h - 18;
  if (!pts.length) { g.fillStyle = "#6b7280"; g.font = "12px system-ui"; g.fillText("no data yet", left, h / 2); return; }
  let max = 1e-9;
  for (const p of pts) if (p[1] > max) max = p[1];
  max *= 1.1;
  g.strokeStyle = "#e3e6ec"; g.fillStyle = "#6b7280"; g.font = "11px system-ui";
  for (let i = 0; i <= 2; i++) {
    const y = bottom - (bottom - 6) * i / 2;
    g.beginPath(); g.moveTo(left, y); g.lineTo(w, y); g.stroke();
    g.fillText((max * i / 2).toPrecision(3), 2, y + 4);
  }
  g.fillText(`last ${WINDOW_S / 60} min`, left, h - 4);
  const x = (t) => left + (w - left) * (1 - (now - t) / WINDOW_S);
  const y = (v) => bottom - (bottom - 6) * v / max;
  g.fillStyle = g.strokeStyle = "#2563eb";
  if (kind === "line") {
    g.beginPath();
    pts.forEach(([t, v], i) => (i ? g.lineTo(x(t), y(v)) : g.moveTo(x(t), y(v))));
    g.stroke();
  } else {
    for (const [t, v] of pts) { g.beginPath(); g.arc(x(t), y(v), 2.5, 0, 2 * Math.PI); g.fill(); }
  }
}
