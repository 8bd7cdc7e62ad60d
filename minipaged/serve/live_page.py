"""`GET /`: the KV pool, live, in a browser — plain HTML and JavaScript, nothing fetched from
elsewhere. The page listens to `/pool/events` (server-sent events, one picture of the pool
each time the engine changed it) and draws one cell per block of layer 0: coloured by the
request that holds it, outlined when several requests share it, hatched grey when it is free
but still caches a prefix, blank when free. Beside it: the running, waiting and swapped
queues, and the tokens the last step ran.

Each picture it draws is also written, counted from the drawn cells themselves, into
`<pre id="drawn">` (one line per picture: version, used cells, cached cells, shared cells), so
a test can compare what a browser drew with the server's own figures. `/?frames=N` stops
listening after N pictures, so that a headless browser sees the page settle."""

LIVE_PAGE = """<!doctype html>
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
</style></head>
<body>
<h1>minipaged: the KV pool, live</h1>
<p id="summary">waiting for the server...</p>
<p class="legend"><span>one cell = one block of layer 0, coloured by the request holding it</span>
<span>thick border: shared by several requests</span><span>hatched: free, still caching a
prefix</span><span>white: free</span></p>
<div id="pool"></div>
<div class="queues">
 <p>running: <span id="running"></span></p>
 <p>waiting: <span id="waiting"></span></p>
 <p>swapped: <span id="swapped"></span></p>
</div>
<p id="step"></p>
<pre id="drawn"></pre>
<script>
function colour(id) { return "hsl(" + ((id * 137.508) % 360).toFixed(1) + ", 65%, 48%)"; }

function chips(el, ids) {
  el.replaceChildren(...ids.map(function (id) {
    var s = document.createElement("span");
    s.textContent = id; s.style.background = colour(id); return s;
  }));
}

function draw(state) {
  var pool = document.getElementById("pool");
  while (pool.children.length < state.num_blocks) {
    var c = document.createElement("div"); c.className = "cell free"; pool.appendChild(c);
  }
  var shared = new Set(state.shared);
  for (var b = 0; b < state.num_blocks; b++) {
    var cell = pool.children[b], o = state.owner[b];
    var kind = o >= 0 ? "used" : (o == -2 ? "cached" : "free");
    cell.className = "cell " + kind + (shared.has(b) ? " shared" : "");
    cell.style.background = o >= 0 ? colour(o) : "";
    cell.dataset.owner = o;
    cell.title = "block " + b + (o >= 0 ? ": request " + o : (o == -2 ? ": cached free" : ": free"));
  }
  chips(document.getElementById("running"), state.running);
  chips(document.getElementById("waiting"), state.waiting);
  chips(document.getElementById("swapped"), state.swapped);
  document.getElementById("summary").textContent =
    state.used + " of " + state.num_blocks + " blocks used (" + state.block_size +
    " tokens each), " + state.cached_free + " cached free; " + state.preemptions +
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
