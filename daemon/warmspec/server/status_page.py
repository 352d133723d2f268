"""A live status page on the HTTP port: ``GET /`` (or ``/status``) and its data, ``/status.json``.

One HTML document with its CSS and JavaScript inline -- no build step, no external asset, so it
works offline -- polling ``/status.json`` once a second: the model and device, requests in flight
and queued, the running request's and the recent requests' tokens per pass, acceptance and
tok/s, where accepted tokens came from, the prefix cache in memory and on disk, memory, the
verify-cost table as a chart, and the roofline: this machine's measured memory bandwidth, the bytes
a plain step reads (weights + KV cache), the plain-decode ceiling they imply and the effective
speculative rate against it.

The page itself is static and holds no data, so it is served without the API key; the data
needs the key like every API route (the page sends ``#key=...`` from its address as a bearer
token). Building the snapshot reads counters and array sizes only: nothing waits on the model.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from aiohttp import web

from ..core import GenerationStats

from ..roofline import roofline

PUBLIC_PATHS = frozenset({"/", "/status"})
ROLLING = 16  # requests in the rolling figures


def _rates(s: GenerationStats) -> dict[str, Any]:
    return msgspec.to_builtins(s) | {"tokens_per_pass": s.tokens_per_pass, "acceptance": s.acceptance,
                                     "tok_s": s.decode_tok_s}


def _sum(stats: list[GenerationStats]) -> GenerationStats:
    total = GenerationStats()
    for s in stats:
        total.add(s)
    return total


def snapshot(app) -> dict[str, Any]:
    """Everything the page shows, as JSON-ready builtins."""
    st = app.status()
    engine = app.engine
    running = engine.current
    current = _rates(msgspec.structs.replace(running)) if running is not None else None
    recent = list(app.scheduler.recent)
    rolling = _rates(_sum(recent[-ROLLING:]))
    costs = engine._costs  # never measured from here: that would run the model on the event loop
    table = ({str(c): {str(p): t / row[1] for p, t in row.items()} for c, row in costs.points.items()}
             if costs is not None else {})
    effective = current["tok_s"] if current and current["passes"] else rolling["tok_s"]
    loaded = st.model_state == "loaded"
    roof = roofline(app.bandwidth, app.parameters_bytes if loaded else 0, engine.live.nbytes, effective)
    t = st.totals
    return {
        "time": time.time(),
        "status": msgspec.to_builtins(st),
        "current": current,
        "rolling": rolling | {"requests": len(recent[-ROLLING:])},
        "recent": [_rates(s) for s in recent[-12:]][::-1],
        # accepted draft tokens by guess source since start: request (the prompt and the answer so
        # far), workspace (files read), recent (earlier answers), prediction, mtp, draft
        "sources": {name: c.accepted for name, c in t.sources.items()},
        "costs": table,
        "roofline": msgspec.to_builtins(roof),
    }


async def page(request: web.Request) -> web.Response:
    return web.Response(text=HTML, content_type="text/html",
                        headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
                                 "Content-Security-Policy": "default-src 'self'; style-src 'unsafe-inline'; "
                                                            "script-src 'unsafe-inline'"})


def add_routes(router: web.UrlDispatcher, get_app) -> None:
    """``get_app(request)``: the ``App`` behind this HTTP server."""

    async def data(request: web.Request) -> web.Response:
        return web.Response(body=msgspec.json.encode(snapshot(get_app(request))),
                            content_type="application/json", headers={"Cache-Control": "no-cache"})

    router.add_get("/", page)
    router.add_get("/status", page)
    router.add_get("/status.json", data)


HTML = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>warmspec</title>
<style>
:root { --fg:#1d232a; --mute:#66707a; --bg:#f6f7f9; --card:#fff; --line:#dfe3e8; --acc:#0b6bcb; --warm:#d9480f; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; color:var(--fg); background:var(--bg); }
header { padding:14px 22px; background:#1d232a; color:#fff; display:flex; gap:18px; align-items:baseline; flex-wrap:wrap; }
header h1 { font-size:18px; margin:0; } header span { color:#c8ced6; }
.pill { padding:2px 9px; border-radius:10px; background:#2f9e44; color:#fff; font-weight:600; }
.pill.idle { background:#66707a; } .pill.unloaded { background:#e67700; }
main { display:grid; grid-template-columns:repeat(auto-fill, minmax(330px, 1fr)); gap:14px; padding:16px 22px; }
section { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:12px 14px; }
section.wide { grid-column:span 2; } @media (max-width:720px) { section.wide { grid-column:span 1; } }
h2 { font-size:13px; text-transform:uppercase; letter-spacing:.04em; color:var(--mute); margin:0 0 8px; }
table { width:100%; border-collapse:collapse; } td, th { padding:2px 4px; text-align:right; font-variant-numeric:tabular-nums; }
td:first-child, th:first-child { text-align:left; color:var(--mute); } th { color:var(--mute); font-weight:500; border-bottom:1px solid var(--line); }
.big { font-size:26px; font-weight:650; } .unit { color:var(--mute); font-size:12px; }
.row { display:flex; gap:20px; flex-wrap:wrap; } .row > div { min-width:90px; }
svg text { font-size:10px; fill:var(--mute); } #err { color:#c92a2a; padding:0 22px; }
footer { color:var(--mute); padding:0 22px 16px; font-size:12px; }
</style></head>
<body>
<header><h1>warmspec</h1><span id="model">…</span><span id="device"></span><span id="state" class="pill idle">…</span>
<span>pid <b id="pid">–</b></span><span>up <b id="uptime">–</b></span></header>
<div id="err"></div>
<main>
<section><h2>Requests</h2><div class="row">
 <div><div class="big" id="active">–</div><div class="unit">in flight</div></div>
 <div><div class="big" id="queued">–</div><div class="unit">queued</div></div>
 <div><div class="big" id="completed">–</div><div class="unit">completed</div></div>
 <div><div class="big" id="failed">–</div><div class="unit">failed</div></div></div></section>
<section><h2>Running request</h2><div class="row">
 <div><div class="big" id="cur-tokens">–</div><div class="unit">tokens</div></div>
 <div><div class="big" id="cur-tpp">–</div><div class="unit">tokens / pass</div></div>
 <div><div class="big" id="cur-acc">–</div><div class="unit">acceptance</div></div>
 <div><div class="big" id="cur-toks">–</div><div class="unit">tok/s</div></div></div>
 <div class="unit" id="cur-prompt"></div></section>
<section><h2>Recent requests (rolling)</h2><div class="row">
 <div><div class="big" id="roll-tpp">–</div><div class="unit">tokens / pass</div></div>
 <div><div class="big" id="roll-acc">–</div><div class="unit">acceptance</div></div>
 <div><div class="big" id="tok-s">–</div><div class="unit">tok/s</div></div>
 <div><div class="big" id="roll-n">–</div><div class="unit">requests</div></div></div></section>
<section class="wide"><h2>Roofline: plain decoding is bound by memory bandwidth</h2>
 <div class="row">
 <div><div class="big" id="bandwidth">–</div><div class="unit">GB/s measured</div></div>
 <div><div class="big" id="step-mb">–</div><div class="unit">MB read per plain step</div></div>
 <div><div class="big" id="ceiling">–</div><div class="unit">tok/s plain ceiling</div></div>
 <div><div class="big" id="effective">–</div><div class="unit">tok/s effective</div></div>
 <div><div class="big" id="over">–</div><div class="unit">× the ceiling</div></div></div>
 <svg id="roof" viewBox="0 0 640 220" width="100%" height="220" role="img" aria-label="roofline"></svg></section>
<section><h2>Prefix cache</h2><table>
 <tr><th></th><th>memory</th><th>disk</th></tr>
 <tr><td>hits</td><td id="pc-hits">–</td><td id="pd-hits">–</td></tr>
 <tr><td>entries</td><td id="pc-entries">–</td><td id="pd-entries">–</td></tr>
 <tr><td>MB held</td><td id="pc-bytes">–</td><td id="pd-bytes">–</td></tr>
 <tr><td>budget MB</td><td id="pc-budget">–</td><td id="pd-budget">–</td></tr>
 <tr><td>tokens reused</td><td id="pc-reused">–</td><td id="pd-loaded">–</td></tr>
 <tr><td>misses / dropped</td><td id="pc-misses">–</td><td id="pd-dropped">–</td></tr></table></section>
<section><h2>Memory</h2><table>
 <tr><td>resident</td><td id="rss">–</td></tr><tr><td>peak resident</td><td id="peak">–</td></tr>
 <tr><td>available</td><td id="avail">–</td></tr><tr><td>weights</td><td id="weights">–</td></tr>
 <tr><td>MLX active / peak</td><td id="mlx">–</td></tr>
 <tr><td>keep-alive</td><td id="keepalive">–</td></tr><tr><td>loads</td><td id="loads">–</td></tr></table></section>
<section><h2>Accepted tokens by source</h2><table id="sources"></table>
 <div class="unit" id="totals"></div></section>
<section class="wide"><h2>Verify cost: a pass of P positions, × one position</h2>
 <svg id="costs" viewBox="0 0 640 200" width="100%" height="200" role="img" aria-label="verify costs"></svg></section>
<section class="wide"><h2>Last requests</h2><table id="recent"></table></section>
</main>
<footer>polled <span id="polls">0</span> times · <span id="updated">never</span></footer>
<script>
"use strict";
const $ = id => document.getElementById(id);
const key = new URLSearchParams(location.hash.slice(1)).get("key");
const fmt = (x, d = 1) => x == null || !isFinite(x) ? "–" : Number(x).toFixed(d);
const mb = b => b == null ? "–" : (b / 1e6).toFixed(1);
const pct = x => x == null ? "–" : (100 * x).toFixed(0) + "%";
const dur = s => s == null ? "never" : s >= 3600 ? (s / 3600).toFixed(1) + " h" : s >= 60 ? (s / 60).toFixed(0) + " min" : s.toFixed(0) + " s";
const set = (id, v) => { $(id).textContent = v; };
const NS = "http://www.w3.org/2000/svg";
function el(svg, tag, attrs, text) {
  const e = document.createElementNS(NS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text != null) e.textContent = text;
  svg.appendChild(e); return e;
}
function axes(svg, W, H, m, xt, yt) {
  el(svg, "line", {x1: m, y1: H - m, x2: W - 10, y2: H - m, stroke: "#999"});
  el(svg, "line", {x1: m, y1: 10, x2: m, y2: H - m, stroke: "#999"});
  el(svg, "text", {x: W - 10, y: H - m + 24, "text-anchor": "end"}, xt);
  el(svg, "text", {x: m - 30, y: 10, "text-anchor": "start"}, yt);
}
const COLORS = ["#0b6bcb", "#d9480f", "#2f9e44", "#862e9c"];
function drawCosts(table) {
  const svg = $("costs"); svg.replaceChildren();
  const W = 640, H = 200, m = 40, ctx = Object.keys(table);
  if (!ctx.length) { el(svg, "text", {x: 20, y: 40}, "no cost table (plain decoding only)"); return; }
  let maxP = 1, maxY = 1;
  for (const c of ctx) for (const p in table[c]) { maxP = Math.max(maxP, +p); maxY = Math.max(maxY, table[c][p]); }
  axes(svg, W, H, m, "positions per pass", "× one position");
  const x = p => m + (W - m - 20) * (p - 1) / Math.max(maxP - 1, 1), y = v => H - m - (H - m - 20) * v / maxY;
  for (let v = 0; v <= maxY; v += Math.max(0.5, Math.ceil(maxY / 4 * 2) / 2))
    el(svg, "text", {x: m - 6, y: y(v) + 3, "text-anchor": "end"}, v.toFixed(1));
  ctx.forEach((c, i) => {
    const pts = Object.keys(table[c]).map(Number).sort((a, b) => a - b);
    el(svg, "polyline", {fill: "none", stroke: COLORS[i % 4], "stroke-width": 2,
      points: pts.map(p => x(p) + "," + y(table[c][p])).join(" ")});
    for (const p of pts) el(svg, "circle", {cx: x(p), cy: y(table[c][p]), r: 2.5, fill: COLORS[i % 4]});
    el(svg, "text", {x: m + 10, y: 22 + 13 * i, fill: COLORS[i % 4]}, "context of " + c + " tokens");
  });
  for (const p of [1, 8, 16, 24, 32].filter(p => p <= maxP))
    el(svg, "text", {x: x(p), y: H - m + 13, "text-anchor": "middle"}, p);
}
function drawRoof(r, points) {
  // Log-log, as rooflines are drawn: one pass reads the weights once, so at k tokens per pass the
  // bandwidth bound is k times the plain ceiling -- a straight line of slope 1.
  const svg = $("roof"); svg.replaceChildren();
  const W = 640, H = 220, m = 46;
  if (!r.ceiling_tok_s) { el(svg, "text", {x: 20, y: 40}, "bandwidth not measured"); return; }
  const maxX = 32, lo = r.ceiling_tok_s / 4, hi = r.ceiling_tok_s * 40;
  const x = t => m + (W - m - 20) * Math.log2(t) / Math.log2(maxX);
  const y = v => H - m - (H - m - 16) * Math.log(Math.max(v, lo) / lo) / Math.log(hi / lo);
  axes(svg, W, H, m, "tokens per pass (log)", "tok/s (log)");
  for (const t of [1, 2, 4, 8, 16, 32]) el(svg, "text", {x: x(t), y: H - m + 13, "text-anchor": "middle"}, t);
  for (let v = Math.pow(10, Math.ceil(Math.log10(lo))); v <= hi; v *= 10)
    el(svg, "text", {x: m - 6, y: y(v) + 3, "text-anchor": "end"}, v >= 1 ? v.toFixed(0) : v);
  el(svg, "line", {x1: x(1), y1: y(r.ceiling_tok_s), x2: x(maxX), y2: y(r.ceiling_tok_s * maxX),
                   stroke: "#999", "stroke-dasharray": "5 4"});
  el(svg, "text", {x: x(6), y: y(r.ceiling_tok_s * 6) - 8, "text-anchor": "end"},
     "bandwidth roof: ceiling × tokens per pass");
  el(svg, "line", {x1: m, x2: W - 10, y1: y(r.ceiling_tok_s), y2: y(r.ceiling_tok_s), stroke: "#d9480f"});
  el(svg, "text", {x: W - 12, y: y(r.ceiling_tok_s) + 13, "text-anchor": "end", fill: "#d9480f"},
     "plain-decode ceiling " + r.ceiling_tok_s.toFixed(1) + " tok/s");
  points.forEach((p, i) => {
    if (!(p.t >= 1) || !(p.y > 0)) return;
    const cx = x(Math.min(p.t, maxX)), cy = y(Math.min(p.y, hi));
    el(svg, "circle", {cx, cy, r: 6, fill: COLORS[i % 4]});
    el(svg, "text", {x: cx + 9, y: cy + 4 + 12 * i, fill: COLORS[i % 4]},
       p.label + " " + p.y.toFixed(1) + " tok/s at " + p.t.toFixed(2) + " tok/pass");
  });
}
let polls = 0;
async function poll() {
  try {
    const res = await fetch("status.json", {headers: key ? {Authorization: "Bearer " + key} : {}, cache: "no-store"});
    if (res.status === 401) { set("err", "this daemon has an API key: open this page as …/#key=YOUR_KEY"); return; }
    if (!res.ok) throw new Error("HTTP " + res.status);
    render(await res.json()); set("err", "");
  } catch (e) { set("err", "cannot reach the daemon: " + e.message); }
  finally { setTimeout(poll, 1000); }
}
function render(d) {
  const s = d.status, pc = s.prefix_cache, mem = s.memory, r = d.roofline, c = d.current, roll = d.rolling;
  set("polls", ++polls); set("updated", new Date(d.time * 1000).toLocaleTimeString());
  set("model", s.model.id); set("device", s.model.device + " · " + s.blas.split(" (")[0]);
  set("pid", s.pid); set("uptime", dur(s.uptime_s));
  const st = $("state"); st.textContent = s.active ? "decoding" : s.model_state === "loaded" ? "idle" : s.model_state;
  st.className = "pill " + (s.active ? "" : s.model_state === "loaded" ? "idle" : "unloaded");
  set("active", s.active ? 1 : 0); set("queued", s.queue); set("completed", s.requests_completed); set("failed", s.requests_failed);
  set("cur-tokens", c ? c.completion_tokens : "–"); set("cur-tpp", c && c.passes ? fmt(c.tokens_per_pass, 2) : "–");
  set("cur-acc", c && c.drafted ? pct(c.acceptance) : "–"); set("cur-toks", c && c.passes ? fmt(c.tok_s) : "–");
  set("cur-prompt", c ? c.prompt_tokens + " prompt tokens, " + c.cached_tokens + " cached" : "no request decoding");
  set("roll-tpp", roll.passes ? fmt(roll.tokens_per_pass, 2) : "–"); set("roll-acc", roll.drafted ? pct(roll.acceptance) : "–");
  set("tok-s", roll.passes ? fmt(roll.tok_s) : "–"); set("roll-n", roll.requests);
  set("bandwidth", r.bandwidth_bytes_s ? fmt(r.bandwidth_bytes_s / 1e9) : "–"); set("step-mb", mb(r.step_bytes));
  set("ceiling", fmt(r.ceiling_tok_s)); set("effective", fmt(r.effective_tok_s)); set("over", fmt(r.over_ceiling, 2));
  set("pc-hits", pc.hits); set("pd-hits", pc.disk_budget_bytes ? pc.disk_hits : "off");
  set("pc-entries", pc.entries); set("pd-entries", pc.disk_entries); set("pc-bytes", mb(pc.bytes)); set("pd-bytes", mb(pc.disk_bytes));
  set("pc-budget", mb(pc.budget_bytes)); set("pd-budget", mb(pc.disk_budget_bytes));
  set("pc-reused", pc.tokens_reused); set("pd-loaded", pc.disk_tokens_loaded);
  set("pc-misses", pc.misses); set("pd-dropped", pc.disk_dropped);
  set("rss", mb(mem.rss_bytes) + " MB"); set("peak", mb(mem.peak_rss_bytes) + " MB"); set("avail", mb(mem.available_bytes) + " MB");
  set("weights", mb(s.model.parameters_bytes) + " MB"); set("mlx", mb(mem.mlx_active_bytes) + " / " + mb(mem.mlx_peak_bytes) + " MB");
  set("keepalive", s.keep_alive_s == null ? "never unloads" : "unload after " + dur(s.keep_alive_s) + " idle (idle " + dur(s.idle_s) + ")");
  set("loads", s.loads);
  const src = $("sources"); src.replaceChildren();
  for (const [name, n] of Object.entries(d.sources)) { const tr = src.insertRow(); tr.insertCell().textContent = name; tr.insertCell().textContent = n; }
  const t = s.totals;
  set("totals", t.completion_tokens + " tokens in " + t.passes + " passes; " + t.accepted + " of " + t.drafted + " drafted accepted");
  drawCosts(d.costs);
  const pts = [];
  if (roll.passes) pts.push({t: roll.tokens_per_pass, y: roll.tok_s, label: "recent"});
  if (c && c.passes) pts.push({t: c.tokens_per_pass, y: c.tok_s, label: "running"});
  drawRoof(r, pts);
  const rec = $("recent"); rec.replaceChildren();
  const head = rec.insertRow();
  for (const h of ["#", "prompt", "cached", "tokens", "tok/pass", "acceptance", "tok/s", "prefill s"]) { const th = document.createElement("th"); th.textContent = h; head.appendChild(th); }
  d.recent.forEach((q, i) => {
    const tr = rec.insertRow();
    for (const v of [i + 1, q.prompt_tokens, q.cached_tokens, q.completion_tokens, fmt(q.tokens_per_pass, 2),
                     q.drafted ? pct(q.acceptance) : "–", fmt(q.tok_s), fmt(q.prefill_s, 2)]) tr.insertCell().textContent = v;
  });
}
poll();
</script>
</body></html>
"""
