"""Serve the engine over HTTP in OpenAI's API: `python -m minipaged.serve`.

Not a stage of the course: stage 5's engine, unchanged, behind a web server. `loop.py` runs the
engine in one thread that requests join and leave between steps; `app.py` speaks OpenAI's
protocol (FastAPI on uvicorn, as vLLM's server); `metrics.py` prints Prometheus text;
`live_page.py` draws the pool in a browser; `server.py` puts them together. Needs the `serve` extra (fastapi, uvicorn).

    from minipaged.serve.server import start
    server = start(num_blocks=64)          # the embedded model, on 127.0.0.1 and a free port
    ...                                    # openai.OpenAI(base_url=server.url + "/v1", ...)
    server.stop()
"""
