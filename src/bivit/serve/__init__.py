"""The encoder service behind `bivit serve`, split the way vLLM splits an endpoint:

    protocol  request/response types and their safetensors/JSON encoding (shared with `bivit.client`;
              imports no web framework)
    batcher   the worker thread that owns the Encoder and coalesces queued items into forward passes
    cache     the exact embedding cache (valid because of batch invariance)
    metrics   the Prometheus series of one app
    settings  the limits (`bivit serve` options), validated
    bodies    reading a request's body within the limits and splitting it into items
    answers   writing an answer in pieces (the JSON one made as it is sent), holding its bytes until written
    serving   one request's life after that: cache, admission, the core's stages (prepare in thread pools,
              chunks to the batcher, assemble), weight updates
    app       the FastAPI app: routes, auth, request log, lifecycle; `run` starts uvicorn

Nothing here is imported by `import bivit`; `app`, `serving` and `metrics` need the `serve` extra.
"""
