"""Weight updates (`POST /v1/weights`): a safetensors body replacing every weight of the served encoder.

An update passes a gate that requests hold shared and an update holds alone: the update waits for the requests
in flight (they finish on the old weights, none is lost), new requests wait for the update; the weights are
swapped on the batching worker between forward passes. So every response is computed entirely with the weights
whose fingerprint it names, and the cache (keyed by fingerprint) never serves an old embedding as a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any, Iterator

from safetensors import SafetensorError, safe_open

from ..errors import BivitError, CheckpointError, ErrorKind
from .logs import log

SOURCE = "POST /v1/weights"


class WeightsGate:
    """Held shared by requests, alone by a weight update; an update waiting holds back new requests."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writers = 0  # waiting or running updates

    @contextlib.asynccontextmanager
    async def shared(self):
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writers)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self):
        async with self._cond:
            self._writers += 1  # from now on no new reader enters
        try:
            async with self._cond:
                await self._cond.wait_for(lambda: not self._readers)
            yield
        finally:  # also when cancelled while waiting: the readers held back must be let in
            async with self._cond:
                self._writers -= 1
                self._cond.notify_all()


class WeightUpdates:
    """The weight updates of one service (`service`: its `encoder`, `batcher`, `settings`, the `fingerprint`
    serving now, and `weights_swapped(fingerprint)`, run on the batching worker once new weights are in):
    `gate` (held shared by every request), `busy` (one update, and one body, at a time: each may be gigabytes)."""

    def __init__(self, service: Any):
        self.service = service
        self.gate = WeightsGate()
        self.busy = asyncio.Lock()

    @property
    def limit_mb(self) -> float:
        """--max-weights-mb, else the served model's weights as their dtypes store them + 16 MiB of header: the
        largest a valid update can be."""
        svc = self.service
        weights = sum(t.numel() * t.element_size() for t in svc.encoder.model.state_dict().values())
        return svc.settings.max_weights_mb or weights / 2**20 + 16

    async def update(self, path: str) -> dict:
        """A safetensors file (a spooled body) -> the encoder's new weights (all or nothing) -> {fingerprint,
        previous, tensors}. The caller holds `busy`."""
        svc = self.service
        try:
            handle = await asyncio.get_running_loop().run_in_executor(None, lambda: safe_open(path, "pt"))
        except (SafetensorError, ValueError, OSError) as e:
            raise ErrorKind.BAD_WEIGHTS.error(f"body is not a safetensors file ({e})") from None
        tensors = _LazyTensors(handle, SOURCE)

        def apply() -> str:  # on the batching worker, between forward passes
            fingerprint = svc.encoder.update_weights(tensors, source=SOURCE)
            svc.weights_swapped(fingerprint)
            return fingerprint

        async with self.gate.exclusive():
            previous = svc.fingerprint
            swap = asyncio.wrap_future(svc.batcher.call(apply))
            try:
                fingerprint = await asyncio.shield(swap)
            except asyncio.CancelledError:  # the client hung up: keep the gate until the swap is over
                await asyncio.wait({swap})
                raise
            except BivitError as e:  # refused whole: the old weights keep serving
                raise ErrorKind.BAD_WEIGHTS.error(str(e)) from None
        log.info("weights updated", extra={"fields": {"fingerprint": fingerprint, "previous": previous,
                                                      "tensors": len(tensors)}})
        return {"fingerprint": fingerprint, "previous_fingerprint": previous, "tensors": len(tensors)}


class _LazyTensors(Mapping):
    """The tensors of an open safetensors file, each read when asked for (a weight update checks and copies one at
    a time, not the whole body); one that cannot be read is a CheckpointError naming it."""

    def __init__(self, handle, source: str):
        self.handle, self.source, self._keys = handle, source, list(handle.keys())

    def __getitem__(self, key: str):
        if key not in self._keys:
            raise KeyError(key)
        try:
            return self.handle.get_tensor(key)
        except Exception as e:  # noqa: BLE001 - a damaged or truncated body
            raise CheckpointError(f"{self.source}: tensor {key!r} cannot be read ({e})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)
