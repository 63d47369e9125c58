// memcalc's page: the form becomes `memcalc` command lines, the server runs them as the shell would
// (memcalc/web/server.py), and the page shows what they printed. No number here is computed: the tables and
// sentences are the commands' Markdown, the chart is the timeline's JSON, and size() formats its bytes by
// memcalc.report.units.size's rule (tests/test_web_browser.py holds the two equal).
"use strict";

const SEQS = [128, 256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152, 65536,
  98304, 131072];
const BATCHES = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128];
const DEFAULTS = {source: "preset", preset: "llama3-8b", hub: "", config: "", config_name: "", gpu: "h100-sxm",
  gpus: "1", zero: "0", method: "full", rank: "16", optimizer: "adamw", accum: "1", seq: "4096", mb: "1",
  tricks: "bf16+flash+ckpt", rl: "", completion: "512", generations: "", vllm: ""};
const FIELDS = {preset: "preset", hub: "hub", gpu: "gpu", gpus: "gpus", zero: "zero", method: "method",
  rank: "rank", optimizer: "optimizer", accum: "grad-accum", tricks: "tricks", rl: "rl", completion: "completion",
  generations: "generations", vllm: "vllm"};
const ONLINE = ["grpo", "rloo"];  // the trainers that generate: a completion length, generations, vLLM
const GENERATES = [...ONLINE, "ppo"];  // and PPO, a completion length alone (PPOConfig's response_length)
const $ = (id) => document.getElementById(id);
let state = {...DEFAULTS};
let asked = 0;  // the newest answer asked for: an older one arriving late is dropped
let rest = null;  // the timer that waits for the sliders to rest before the timeline

// ---- numbers as memcalc prints them ----------------------------------------------------------------

function grouped(text) {  // "20287.392" -> "20,287.392", as Python's format spec ","
  const [whole, frac] = text.split(".");
  const sign = whole.startsWith("-") ? "-" : "";
  const digits = whole.replace("-", "").replace(/\B(?=(\d{3})+(?!\d))/g, ",");
  return sign + digits + (frac === undefined ? "" : "." + frac);
}

function size(n) {  // memcalc.report.units.size(n, "gb"): 3 or 4 significant digits, decimal GB
  const x = n / 1e9, ax = Math.abs(x);
  const digits = ax >= 100 ? 1 : ax >= 10 ? 2 : 3;
  let text = x.toFixed(digits);  // rounds the double's exact value, half up on an exact tie
  const unit = 10 ** (9 - digits), twice = Math.abs(2 * n);
  if (Number.isSafeInteger(twice) && twice % unit === 0) {  // x may sit exactly halfway: Python rounds to even
    const q = twice / unit;  // |x| = q / (2 * 10^digits)
    if (q % 2 === 1 && q % 5 ** digits === 0) {
      const k = (q - 1) / 2, even = k % 2 === 0 ? k : k + 1;
      text = (Math.sign(x) * even / 10 ** digits).toFixed(digits);
    }
  }
  return grouped(text) + " GB";
}

const count = (n) => grouped(String(n));

// ---- state, the form and the link --------------------------------------------------------------------

function fromHash() {
  const read = new URLSearchParams(location.hash.slice(1));
  state = {...DEFAULTS};
  for (const key of Object.keys(DEFAULTS)) if (read.has(key)) state[key] = read.get(key);
  if (!["preset", "hub", "file"].includes(state.source)) state.source = DEFAULTS.source;
}

function toForm() {
  for (const [key, id] of Object.entries(FIELDS)) $(id).value = state[key];
  document.querySelector(`input[name=source][value=${state.source}]`).checked = true;
  $("preset").hidden = state.source !== "preset";
  $("hub").hidden = state.source !== "hub";
  $("config").hidden = state.source !== "file";
  $("rank").disabled = state.method === "full";
  $("online").hidden = !GENERATES.includes(state.rl);
  $("generations-label").hidden = $("vllm-label").hidden = !ONLINE.includes(state.rl);
  $("seq").max = SEQS.length - 1;
  $("micro-batch").max = BATCHES.length - 1;
  $("seq").value = nearest(SEQS, +state.seq);
  $("micro-batch").value = nearest(BATCHES, +state.mb);
  $("seq-value").textContent = count(+state.seq);
  $("micro-batch-value").textContent = count(+state.mb);
}

function nearest(grid, x) {
  let best = 0;
  grid.forEach((v, i) => { if (Math.abs(v - x) < Math.abs(grid[best] - x)) best = i; });
  return best;
}

function fromForm(event) {
  for (const [key, id] of Object.entries(FIELDS)) state[key] = $(id).value;
  state.source = document.querySelector("input[name=source]:checked").value;
  if (event && event.target.id === "seq") state.seq = String(SEQS[+$("seq").value]);
  if (event && event.target.id === "micro-batch") state.mb = String(BATCHES[+$("micro-batch").value]);
}

function link() {
  const kept = Object.entries(state).filter(([k, v]) => v !== DEFAULTS[k]);
  return "#" + new URLSearchParams(kept).toString();
}

// ---- the commands ----------------------------------------------------------------------------------------

function modelArgs(s, shown) {
  if (s.source === "hub") return ["--model", s.hub];
  if (s.source === "file") return ["--config", shown ? (s.config_name || "config.json") : s.config];
  return ["--model", s.preset];
}

function jobArgs(s, shown) {
  const a = [...modelArgs(s, shown), "--gpu", s.gpu];
  if (s.gpus !== "1") a.push("--gpus", s.gpus);
  if (s.zero !== "0") a.push("--zero", s.zero);
  if (s.method !== "full") a.push("--lora", s.rank);
  if (s.method === "qlora") a.push("--quantize", "nf4");
  if (s.optimizer !== "adamw") a.push("--optimizer", s.optimizer);
  if (s.rl) a.push("--rl", s.rl);
  if (GENERATES.includes(s.rl)) a.push("--completion-len", s.completion);
  if (ONLINE.includes(s.rl)) {
    if (s.generations) a.push("--num-generations", s.generations);
    if (s.vllm) a.push("--vllm", s.vllm);
  }
  a.push("--seq", s.seq, "--micro-batch", s.mb);
  if (s.accum !== "1") a.push("--grad-accum", s.accum);
  return a;
}

function commands(s, shown = false) {
  // PPOTrainer never checkpoints (memcalc refuses ckpt and selective under --rl ppo): the set without them
  const set = s.rl === "ppo" ? s.tricks.replace("+ckpt", "").replace("+selective", "") : s.tricks;
  const tricks = ["--tricks", set.replaceAll("+", ",")];
  return {estimate: ["estimate", ...jobArgs(s, shown)], fit: ["fit", ...jobArgs(s, shown), ...tricks],
    timeline: ["estimate", ...jobArgs(s, shown), ...tricks, "--timeline"]};
}

const quoted = (a) => /^[\w.,:/+=-]+$/.test(a) ? a : "'" + a.replaceAll("'", "'\\''") + "'";
const shell = (argv) => "memcalc " + argv.map(quoted).join(" ");

async function post(path, body) {
  try {
    const response = await fetch(path, {method: "POST", body: typeof body === "string" ? body : JSON.stringify(body)});
    return await response.json();
  } catch (e) {  // the server stopped, or answered no JSON
    return {code: 1, out: "", error: `the memcalc web server does not answer (${e.message}): start it again`};
  }
}

const run = (argv, format) => post("/api/run", {argv: [...argv, "--format", format]});

// ---- Markdown as the commands print it: lines, ### titles, tables, - notes, paragraphs ----------------------

function escaped(text) {
  return text.replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));
}

function cells(row) {  // | a | b \| c |
  return row.trim().slice(1, -1).split(/(?<!\\)\|/).map((c) => c.trim().replaceAll("\\|", "|"));
}

function blocks(markdown) {
  const out = [];
  for (const line of markdown.split("\n")) {
    const kind = line.startsWith("### ") ? "title" : line.startsWith("|") ? "table" : line.startsWith("- ") ? "notes"
      : line.endsWith("  ") ? "lines" : line.trim() ? "text" : "";
    const last = out[out.length - 1];
    if (!kind) { if (last) last.closed = true; continue; }
    if (last && last.kind === kind && !last.closed && kind !== "title") last.lines.push(line);
    else out.push({kind, lines: [line]});
  }
  return out;
}

function html(block) {
  if (block.kind === "title") return `<h3>${escaped(block.lines[0].slice(4))}</h3>`;
  if (block.kind === "notes") return `<ul class="notes">${block.lines.map((l) => `<li>${escaped(l.slice(2))}</li>`).join("")}</ul>`;
  if (block.kind === "lines") return `<div class="lines">${block.lines.map((l) => `<div>${escaped(l.trim())}</div>`).join("")}</div>`;
  if (block.kind === "text") return `<p>${escaped(block.lines.join(" "))}</p>`;
  const [head, , ...rows] = block.lines.map(cells);
  const fits = head.indexOf("fits?");
  const tr = (r) => `<tr${fits >= 0 && r[fits].startsWith("yes") ? ' class="yes"' : ""}>${r.map((c) => `<td>${escaped(c)}</td>`).join("")}</tr>`;
  return `<table><thead><tr>${head.map((c) => `<th>${escaped(c)}</th>`).join("")}</tr></thead><tbody>${rows.map(tr).join("")}</tbody></table>`;
}

// ---- the answer ----------------------------------------------------------------------------------------

async function answer() {
  const mine = ++asked, started = performance.now();
  document.body.dataset.asked = mine;
  clearTimeout(rest);
  const shown = commands(state, true);
  $("commands").textContent = [shown.estimate, shown.fit, shown.timeline].map(shell).join("\n");
  $("link").href = link();
  history.replaceState(null, "", link());
  $("answer").classList.add("stale");
  const asks = commands(state);
  const estimate = await run(asks.estimate, "markdown");
  if (mine !== asked) return;
  $("answer").classList.remove("stale");
  if (estimate.code) return refused(estimate.error, mine);
  $("error").hidden = true;
  const parts = blocks(estimate.out);
  const verdict = parts.pop();
  $("verdict").textContent = verdict.lines.join(" ");
  document.body.classList.toggle("fits", /^(Fits|The step fits)/.test(verdict.lines[0]) && !/; but /.test(verdict.lines.join(" ")));
  $("estimate").innerHTML = parts.map(html).join("");
  const ms = Math.round(performance.now() - started);
  const [fitJson, fitText] = [await run(asks.fit, "json"), await run(asks.fit, "markdown")];
  if (mine !== asked) return;
  showFit(fitJson, fitText);
  $("status").textContent = `answered in ${ms} ms`;
  document.body.dataset.ms = ms;
  document.body.dataset.answered = mine;
  runAhead();
  rest = setTimeout(() => timeline(mine), 300);  // the timeline replays the whole step: once the sliders rest
}

function refused(error, mine) {
  $("error").textContent = error;
  $("error").hidden = false;
  for (const id of ["verdict", "estimate", "fit", "at-peak", "timeline-note"]) $(id).textContent = "";
  $("chart").innerHTML = "";
  $("legend").textContent = "";
  document.body.classList.remove("fits");
  document.body.dataset.answered = mine;
  document.body.dataset.timeline = mine;
}

function showFit(json, text) {
  if (json.code) { $("fit").textContent = json.error; paint("seq", null); paint("micro-batch", null); return; }
  const said = /^(Model|Headroom)/;  // the estimate above says these already
  $("fit").innerHTML = blocks(text.out).map((b) => ({...b, lines: b.lines.filter((l) => !said.test(l))}))
    .filter((b) => b.lines.length).map(html).join("");
  const fit = JSON.parse(json.out);
  paint("seq", SEQS.filter((s) => s <= fit.max_seq_len).length);
  paint("micro-batch", BATCHES.filter((b) => b <= fit.max_micro_batch).length);
}

function paint(id, fitting) {  // the slider's track green as far as it fits, red beyond
  const slider = $(id);
  if (fitting === null) { slider.style.background = ""; return; }
  const share = 100 * Math.min(1, fitting / (+slider.max + 1));
  slider.style.background = `linear-gradient(to right, #9fd8ae ${share}%, #f2b8b5 ${share}%)`;
}

function runAhead() {  // the sliders' next positions, replayed ahead in the server's second process
  const next = [];
  for (const step of [1, -1, 2, -2]) {
    for (const [grid, key] of [[SEQS, "seq"], [BATCHES, "mb"]]) {
      const i = nearest(grid, +state[key]) + step;
      if (i < 0 || i >= grid.length) continue;
      const asks = commands({...state, [key]: String(grid[i])});
      next.push([...asks.estimate, "--format", "markdown"], [...asks.fit, "--format", "json"]);
    }
  }
  post("/api/ahead", {argvs: next});
}

// ---- the timeline ----------------------------------------------------------------------------------------

const W = 800, H = 260, LEFT = 72, RIGHT = 8, TOP = 10, BOTTOM = 22;
let drawn = null;

async function timeline(mine) {
  const got = await run(commands(state).timeline, "json");
  if (mine !== asked) return;
  document.body.dataset.timeline = mine;
  if (got.code) {
    $("timeline-note").textContent = got.error;
    $("chart").innerHTML = "";
    $("legend").textContent = "";
    $("at-peak").textContent = "";
    return;
  }
  const answer = JSON.parse(got.out);
  draw(answer.timeline[0], answer.verdict[0].usable_bytes);
}

const COLORS = {"weights": "#9db4d3", "fp32 master weights": "#b9a5d6", "optimizer state": "#d6b3a5",
  "gradients": "#e3c77b", "saved for backward": "#8cc7a1", "temporaries": "#e69a8d", "inputs": "#c9c9c9",
  "buffers": "#a7a7a7"};

function draw(t, usable) {
  const n = t.live_bytes.length, columns = W - LEFT - RIGHT;
  const low = 0, high = Math.max(usable, t.peak_bytes) * 1.04;
  const y = (b) => TOP + (H - TOP - BOTTOM) * (1 - (b - low) / (high - low));
  const tops = [];  // per column: the point with the most live bytes
  for (let c = 0; c < columns; c++) {
    const from = Math.floor(c * n / columns), to = Math.max(from + 1, Math.floor((c + 1) * n / columns));
    let best = from;
    for (let i = from; i < to && i < n; i++) if (t.live_bytes[i] > t.live_bytes[best]) best = i;
    tops.push(Math.min(best, n - 1));
  }
  let below = tops.map(() => 0), areas = "";
  t.kinds.forEach((kind, k) => {  // each kind stacked on those before it: together, the live bytes
    const above = tops.map((i, c) => below[c] + t.live_by_kind[k][i]);
    const edge = (v) => v.map((b, c) => `${LEFT + c},${y(b).toFixed(1)}`);
    areas += `<path fill="${COLORS[kind]}" d="M${edge(above).join("L")}L${edge(below).reverse().join("L")}Z"><title>${kind}</title></path>`;
    below = above;
  });
  const phases = t.phases.map((p) => {
    const x = LEFT + p.start * columns / n;
    return `<line class="phase" x1="${x}" x2="${x}" y1="${TOP}" y2="${H - BOTTOM}"/><text x="${x + 3}" y="${H - 6}">${p.phase}</text>`;
  }).join("");
  $("chart").innerHTML = `${areas}${phases}
    <line class="usable" x1="${LEFT}" x2="${W - RIGHT}" y1="${y(usable)}" y2="${y(usable)}"/>
    <text x="${W - RIGHT - 4}" y="${y(usable) - 4}" text-anchor="end">usable ${size(usable)}</text>
    <text x="${LEFT - 4}" y="${y(t.peak_bytes) + 4}" text-anchor="end">${size(t.peak_bytes)}</text>
    <text x="${LEFT - 4}" y="${y(low)}" text-anchor="end">0</text>
    <line class="cursor" id="cursor" y1="${TOP}" y2="${H - BOTTOM}" visibility="hidden"/>`;
  $("legend").innerHTML = t.kinds.map((k) => `<span><i style="background:${COLORS[k]}"></i>${k}</span>`).join("");
  $("timeline-note").textContent = `${t.tricks.join("+")}: peak ${size(t.peak_bytes)} at event ${count(t.peak_index + 1)}`
    + ` of ${count(n)} (${t.peak_at})`;
  const rows = t.at_peak.map((g) => `<tr><td>${escaped(g.what)}</td><td>${g.layers}</td><td>${count(g.tensors)}</td><td>${size(g.bytes)}</td></tr>`);
  $("at-peak").innerHTML = `<h3>Live at the peak (${escaped(t.peak_at)})</h3><table><thead><tr><th>what</th><th>layers</th>`
    + `<th>tensors</th><th>bytes</th></tr></thead><tbody>${rows.join("")}</tbody></table>`;
  drawn = {t, tops, n};
}

function hover(event) {
  if (!drawn) return;
  const box = $("chart").getBoundingClientRect();
  const c = Math.round((event.clientX - box.left) * W / box.width) - LEFT;
  if (c < 0 || c >= drawn.tops.length) return leave();
  const {t, tops, n} = drawn, i = tops[c];
  const phase = t.phases.find((p) => p.start <= i && i < p.end).phase;
  const layer = t.layers[i] === null ? "" : ` (block ${t.layers[i]})`;
  $("cursor").setAttribute("x1", LEFT + c);
  $("cursor").setAttribute("x2", LEFT + c);
  $("cursor").setAttribute("visibility", "visible");
  const live = t.kinds.map((kind, k) => [kind, t.live_by_kind[k][i]]).filter(([, b]) => b > 0)
    .map(([kind, b]) => `<tr><td>${kind}</td><td>${size(b)}</td></tr>`).join("");
  const tip = $("tip");
  tip.innerHTML = `event ${count(i + 1)} of ${count(n)}, ${phase}<br>`
    + `${escaped(t.ops[i])} ${t.nbytes[i] < 0 ? "frees" : "allocates"} ${size(Math.abs(t.nbytes[i]))}: `
    + `${escaped(t.labels[t.what[i]])}${layer}<table>${live}<tr><th>live</th><th>${size(t.live_bytes[i])}</th></tr></table>`;
  tip.hidden = false;
  const x = event.clientX - box.left, right = x + 12 + tip.offsetWidth <= box.width;  // beside the cursor, inside
  tip.style.left = `${right ? x + 12 : Math.max(0, x - 12 - tip.offsetWidth)}px`;
  tip.style.top = `${Math.max(0, Math.min(event.clientY - box.top + 12, box.height - tip.offsetHeight))}px`;
}

function leave() {
  $("tip").hidden = true;
  if ($("cursor")) $("cursor").setAttribute("visibility", "hidden");
}

// ---- wiring ------------------------------------------------------------------------------------------------

let typing = null;

function changed(event) {
  fromForm(event);
  toForm();
  clearTimeout(typing);
  if (state.source === "file" && !state.config) {  // nothing to answer until a file is chosen
    $("status").textContent = "choose a config.json";
    return;
  }
  typing = setTimeout(answer, event && event.type === "input" ? 40 : 0);
}

async function upload() {
  const file = $("config").files[0];
  if (!file) return;
  const kept = await post("/api/config", await file.text());
  if (kept.error) {
    document.body.dataset.asked = ++asked;
    return refused(`${file.name}: ${kept.error.replace(/^config\.json: /, "")}`, asked);
  }
  state.config = kept.path;
  state.config_name = file.name;
  answer();
}

async function start() {
  const choices = await (await fetch("/api/choices")).json();
  $("preset").innerHTML = choices.presets.map((p) => `<option>${escaped(p)}</option>`).join("");
  $("gpu").innerHTML = choices.gpus.map((g) => `<option value="${g.key}">${escaped(g.key)}: ${escaped(g.name)}</option>`).join("");
  $("hub").innerHTML = choices.hub.length ? choices.hub.map((h) => `<option>${escaped(h)}</option>`).join("")
    : "<option value=\"\">(no model in the Hugging Face cache)</option>";
  if (!DEFAULTS.hub && choices.hub.length) DEFAULTS.hub = choices.hub[0];
  fromHash();
  toForm();
  $("job").addEventListener("change", (e) => { if (e.target.id !== "config") changed(e); });
  $("job").addEventListener("input", (e) => { if (e.target.type === "range") changed(e); });
  $("config").addEventListener("change", upload);
  $("chart").addEventListener("mousemove", hover);
  $("chart").addEventListener("mouseleave", leave);
  window.addEventListener("hashchange", () => { if (location.hash !== link()) { fromHash(); toForm(); answer(); } });
  if (state.source !== "file" || state.config) answer();
}

start();
