"""`GET /`: the KV pool, live, in a browser — plain HTML and JavaScript, nothing fetched from
elsewhere. The page listens to `/pool/events` (server-sent events, one picture of the pool
each time the engine changed it) and draws one cell per block of layer 0: coloured by the
request that holds it, outlined when several requests share it, hatched grey when it is free
but still caches a prefix, blank when free. Beside it: the running, waiting and swapped
queues, and the tokens the last step ran.

Each picture it draws is also written, counted from the drawn cells themselves, into
`<pre id="drawn">` (one line per picture: version, used cells, cached cells, shared cells), so
a test can compare what a browser drew with the server's own figures. `/?frames=N` stops
listening after N pictures, so that a headless browser sees the page settle.

The page is sent with its first picture already in it (`render`: the same cells and chips the
script draws, written by the server), so a browser that runs no script, or takes a screenshot
at once, still shows the pool; the events then redraw those same cells. A chip names the id
its client got back (`cmpl-…`, `chatcmpl-…`); a click on a chip or a cell shows that request's
block table in every layer (`/pool/request/{id}`)."""

import html
import json

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>minipaged: the KV pool, live</title>
<style>
 body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
 #pool { display: grid; grid-template-columns: repeat(32, 18px); gap: 2px; margin: 1em 0; }
 .cell { width: 18px; height: 18px; box-sizing: border-box; border: 1px solid #ddd; }
 .cell.free { background: #fff; }
 .cell.cached { background: repeating-linear-gradient(45deg, #bbb 0 3px, #eee 3px 6px); }
 .cell.shared { border: 3px solid #000; }
 .queues span { display: inline-block; min-width: 2.2em; padding: 1px 4px; margin: 1px;
                border-radius: 3px; color: #fff; font-size: 12px; text-align: center; }
 #drawn { display: none; }
 .legend span { margin-right: 1.5em; }
 .queues span, .cell.used { cursor: pointer; }
 .why { max-width: 46em; color: #444; }
 #table { background: #f6f6f6; padding: .5em; white-space: pre-wrap; }
</style></head>
<body>
<h1>minipaged: the KV pool, live</h1>
<p id="summary">%(summary)s</p>
<p class="legend"><span>one cell = one block of layer 0, coloured by the request holding it</span>
<span>thick border: shared by several requests</span><span>hatched: free, still caching a
prefix</span><span>white: free</span></p>
<div id="pool">%(cells)s</div>
<div class="queues">
 <p>running: <span id="running">%(running)s</span></p>
 <p>waiting: <span id="waiting">%(waiting)s</span></p>
 <p>swapped: <span id="swapped">%(swapped)s</span></p>
</div>
<p id="step">%(step)s</p>
<div class="why">
<p>The KV cache is cut into blocks of %(block_size)s tokens. A request holds a list of blocks
(its block table) and attention reads its keys and values through that list, so its blocks
need not be side by side: they look scattered because the free set hands out block ids at
random, which is the point: any free block will do.</p>
<p>Only layer 0 is drawn: every layer has its own pool, but each layer's table for a request is
the same shape and grows at the same step, so one layer shows them all. Click a request
(a chip or a cell) to see its block table in every layer.</p>
<p>Hatched blocks are free: no request holds them, but they still hold a finished prompt's
tokens, so a request with the same prefix reuses them without recomputing. A pool of hatched
cells is not full: they are given out, oldest first, once no white cell is left.</p>
<p>How it works: <a href="/lesson">lesson 08, serving</a> (and the lessons before it).</p>
</div>
<pre id="table"></pre>
<pre id="drawn"></pre>
<script>
function colour(id) { return "hsl(" + ((id * 137.508) % 360).toFixed(1) + ", 65%, 48%)"; }

var names = %(names)s;           // req_id -> the id its client sees

function chips(el, ids) {
  el.replaceChildren(...ids.map(function (id) {
    var s = document.createElement("span");
    s.textContent = names[id] || id; s.dataset.owner = id;
    s.style.background = colour(id); return s;
  }));
}

// a click on a request (a chip or a cell it holds): its block table in every layer
document.body.addEventListener("click", function (e) {
  var o = Number(e.target.dataset.owner), name = names[o];
  if (!(o >= 0) || !name) return;
  fetch("/pool/request/" + encodeURIComponent(name)).then(function (r) { return r.json(); })
    .then(function (t) { document.getElementById("table").textContent = JSON.stringify(t); });
});

function draw(state) {
  var pool = document.getElementById("pool");
  while (pool.children.length < state.num_blocks) {
    var c = document.createElement("div"); c.className = "cell free"; pool.appendChild(c);
  }
  names = state.names;
  var shared = new Set(state.shared);
  for (var b = 0; b < state.num_blocks; b++) {
    var cell = pool.children[b], o = state.owner[b];
    var kind = o >= 0 ? "used" : (o == -2 ? "cached" : "free");
    cell.className = "cell " + kind + (shared.has(b) ? " shared" : "");
    cell.style.background = o >= 0 ? colour(o) : "";
    cell.dataset.owner = o;
    cell.title = "block " + b + (o >= 0 ? ": " + (names[o] || "request " + o) :
                                         (o == -2 ? ": cached free" : ": free"));
  }
  chips(document.getElementById("running"), state.running);
  chips(document.getElementById("waiting"), state.waiting);
  chips(document.getElementById("swapped"), state.swapped);
  document.getElementById("summary").textContent =
    state.used + " of " + state.num_blocks + " blocks held by requests (" + state.block_size +
    " tokens each), " + state.cached_free + " free but caching a prefix; " + state.preemptions +
    " preemptions, " + state.generated_tokens + " tokens generated";
  document.getElementById("step").textContent =
    "step " + state.step + ": " + state.step_tokens + " tokens through the model";
  var line = [state.version, pool.querySelectorAll(".cell.used").length,
              pool.querySelectorAll(".cell.cached").length,
              pool.querySelectorAll(".cell.shared").length].join(" ");
  document.getElementById("drawn").textContent += line + "\\n";
}

// ?frames=N: stop listening after N pictures (a headless browser then sees the page settle)
var frames = Number(new URLSearchParams(location.search).get("frames") || 0), drawn = 0;
var events = new EventSource("/pool/events");
events.onmessage = function (e) {
  draw(JSON.parse(e.data));
  if (frames && ++drawn >= frames) { events.close(); document.body.dataset.done = "yes"; }
};
</script>
</body></html>
"""


def colour(req_id: int) -> str:
    """The script's `colour`, for the picture sent with the page."""
    return f"hsl({(req_id * 137.508) % 360:.1f}, 65%, 48%)"


def render(state: dict) -> str:
    """The page with `state` (a `pool_state`) already drawn in it: the cells and chips the
    script's `draw` would make, so the first picture needs no event."""
    shared, names = set(state["shared"]), state["names"]

    def cell(b, o):
        kind = "used" if o >= 0 else ("cached" if o == -2 else "free")
        style = f' style="background: {colour(o)};"' if o >= 0 else ""
        title = f"{names.get(o, f'request {o}')}" if o >= 0 else \
            ("cached free" if o == -2 else "free")
        return (f'<div class="cell {kind}{" shared" if b in shared else ""}"{style} '
                f'data-owner="{o}" title="block {b}: {html.escape(title)}"></div>')

    def chips(ids):
        return "".join(f'<span data-owner="{i}" style="background: {colour(i)};">'
                       f'{html.escape(names.get(i, str(i)))}</span>' for i in ids)
    s = state
    fill = {
        "summary": f"{s['used']} of {s['num_blocks']} blocks held by requests ({s['block_size']} "
                   f"tokens each), {s['cached_free']} free but caching a prefix; "
                   f"{s['preemptions']} preemptions, {s['generated_tokens']} tokens generated",
        "cells": "".join(cell(b, o) for b, o in enumerate(s["owner"])),
        "running": chips(s["running"]), "waiting": chips(s["waiting"]),
        "swapped": chips(s["swapped"]),
        "step": f"step {s['step']}: {s['step_tokens']} tokens through the model",
        "block_size": s["block_size"],
        "names": json.dumps({str(k): v for k, v in names.items()}).replace("</", "<\\/")}
    page = PAGE
    for key, text in fill.items():
        page = page.replace(f"%({key})s", str(text))
    return page
