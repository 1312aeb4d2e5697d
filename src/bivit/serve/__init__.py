"""The encoder service behind `bivit serve`, split the way vLLM splits an endpoint:

    protocol         the wire format: a request's items, its answer or error as safetensors/JSON (imports no web
                     framework)
    settings         the limits (`bivit serve` options), validated
    transport        uvicorn serving the app (`run`), with the connection limits (count, header and write
                     timeouts, a refused body's rest)
    routes           the FastAPI app: routes, auth, request ids, the request log, lifecycle
    bodies           reading a request's body within the limits and splitting it into items
    admission        what an item costs, what a request and the service may hold, which decode pool it waits in
    pools            the decode threads, shared round-robin between requests
    serving          one request's life: cache, admission, the core's stages (prepare in the pools, chunks to
                     the batcher, assemble)
    batcher          the worker thread that owns the Encoder and coalesces queued items into forward passes
    embedding_cache  the exact embedding cache (valid because of batch invariance)
    weights          weight updates (`POST /v1/weights`) and the gate requests hold while they run
    answers          writing an answer in pieces (the JSON one made as it is sent), holding its bytes until written
    metrics          the Prometheus series of one app
    logs             the service's JSON log lines

Nothing here is imported by `import bivit`; `transport`, `routes`, `serving` and `metrics` need the `serve` extra.
"""
