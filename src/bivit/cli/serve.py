"""`bivit serve`: the encoder service over HTTP (the serve extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..base.options import whole
from ..serve.settings import ServerSettings as Limits  # light: no web framework
from .common import (EC_PROBE, AlphaOpt, DeviceOpt, DtypeOpt, EcDirOpt, MaxBatchPatchesOpt, ModelOpt, OutDtypeOpt,
                     ProjDtypeOpt, command, encoder_spec, fail, need_extra, writable)


@command()
def serve(
    model: Optional[str] = ModelOpt,
    host: str = typer.Option("127.0.0.1", help="Interface to bind; loopback by default"),
    port: int = typer.Option(8000, help="TCP port"),
    dtype: str = DtypeOpt,
    projector_dtype: Optional[str] = ProjDtypeOpt,
    output_dtype: Optional[str] = OutDtypeOpt,
    device: str = DeviceOpt,
    batch_invariant: bool = typer.Option(True, "--batch-invariant/--no-batch-invariant",
                                         help="Bit-identical answers however requests are batched (the cache is "
                                              "off without it)"),
    api_key: Optional[str] = typer.Option(None, envvar="BIVIT_API_KEY",
                                          help="Require 'Authorization: Bearer KEY' (all but /health)"),
    # Defaults are ServerSettings' own (one home for each limit).
    max_batch_patches: Optional[int] = MaxBatchPatchesOpt,
    max_wait_ms: float = typer.Option(Limits.max_wait_ms, help="Max wait for more items before a forward pass"),
    max_queue: int = typer.Option(Limits.max_queue, help="Items in flight before 429"),
    max_body_mb: float = typer.Option(Limits.max_body_mb, help="Request body limit (413 above)"),
    request_timeout_s: float = typer.Option(Limits.request_timeout_s,
                                            help="Per-request timeout after the body (504 after)"),
    header_timeout_s: float = typer.Option(Limits.header_timeout_s,
                                           help="Time to send a request's headers (connection closed after)"),
    body_timeout_s: float = typer.Option(Limits.body_timeout_s, help="Time to send a request's body (408 after)"),
    write_timeout_s: float = typer.Option(Limits.write_timeout_s,
                                          help="Time a client may read nothing of its answer (connection closed "
                                               "after)"),
    max_request_pixels_mb: float = typer.Option(Limits.max_request_pixels_mb,
                                                help="Decoded float32 pixels of one request (413 above)"),
    max_queue_pixels_mb: float = typer.Option(Limits.max_queue_pixels_mb,
                                              help="Decoded pixels of all admitted requests (429 above)"),
    max_response_mb: float = typer.Option(Limits.max_response_mb,
                                          help="Size of one response, every copy counted (413 above)"),
    max_answers_mb: Optional[float] = typer.Option(None, show_default=False,
                                                   help="Answers being computed or written, all requests (503 "
                                                        "above; default 4 x --max-response-mb)"),
    max_video_mpixels: float = typer.Option(Limits.max_video_mpixels,
                                            help="Decoding work of one request's videos, frames x frame pixels "
                                                 "(at least 128x128 a frame), millions (413 or item error above)"),
    cache_mb: float = typer.Option(Limits.cache_mb, help="Exact embedding cache size; 0 disables"),
    max_weights_mb: Optional[float] = typer.Option(None, show_default=False,
                                                   help="POST /v1/weights body limit (413 above; default the "
                                                        "served model's weights + 16 MiB)"),
    allow_weight_updates_without_key: bool = typer.Option(
        False, "--allow-weight-updates-without-key",
        help="Accept POST /v1/weights without --api-key (trusted machines only)"),
    log_level: str = typer.Option("info", help="debug, info, warning or error"),
    alpha: str = AlphaOpt,
    ec_dir: Optional[Path] = EcDirOpt,
) -> None:
    """Serve the encoder over HTTP (the serve extra).

    Endpoints: POST /v1/encode, /v1/weights, GET /health, /ready, /v1/info, /metrics. With --ec-dir every encoded
    item's rows also go to vLLM's encoder cache; its ids are each item's "ec_ids"."""
    for module in ("fastapi", "uvicorn", "prometheus_client", "multipart"):
        need_extra("serve", module, "serve")
    # The service's own options first: checking them imports nothing heavy (the encoder's options load torch).
    settings = Limits(api_key=api_key or None, max_wait_ms=max_wait_ms,
                      max_queue=max_queue, max_body_mb=max_body_mb, request_timeout_s=request_timeout_s,
                      header_timeout_s=header_timeout_s, body_timeout_s=body_timeout_s,
                      write_timeout_s=write_timeout_s, max_answers_mb=max_answers_mb,
                      max_request_pixels_mb=max_request_pixels_mb, max_queue_pixels_mb=max_queue_pixels_mb,
                      max_response_mb=max_response_mb, max_video_mpixels=max_video_mpixels,
                      cache_mb=cache_mb, max_weights_mb=max_weights_mb,
                      allow_weight_updates_without_key=allow_weight_updates_without_key,
                      ec_dir=None if ec_dir is None else str(ec_dir))
    if log_level.lower() not in ("debug", "info", "warning", "error"):
        fail(f"--log-level must be debug, info, warning or error, got {log_level!r}")
    whole(port, "--port", 0, 65535, "a TCP port")
    _check_listen(host, port)  # before the model loads: a port in use or a host not here is one line
    spec = encoder_spec(model, dtype, projector_dtype, output_dtype, alpha, device, max_batch_patches, batch_invariant)
    if ec_dir is not None:
        writable(ec_dir / EC_PROBE, option="--ec-dir")
    from ..core.encoder import load_encoder  # torch and the model, as below
    from ..serve.logs import configure_logging  # the serve folder: once the options are good
    from ..serve.transport import run  # FastAPI, uvicorn and torch: once the options are good

    configure_logging(log_level)  # the service logs JSON lines, its demo warning included
    encoder = load_encoder(spec)
    run(encoder, settings, host=host, port=port, log_level=log_level)


def _check_listen(host: str, port: int) -> None:
    """Exit 2 unless a socket can listen on `host`:`port` now (it is closed again at once)."""
    import socket  # 7 ms every command's start (--help) would pay

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            s.bind(address)
    except OSError as e:
        fail(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})")
