"""A real `bivit serve` process on a free loopback port, for the tests and the load-test benchmarks
(`benchmarks/loadtest.py`, `benchmarks/hostile_load.py` put `tests/` on their path to use it).

The server logs to a file (not a pipe: a full pipe would block the server), so callers can read its JSON lines.
`holdable=True` starts it through `launch.py`, which hands the batching worker a `held` check (a file's existence):
inside `with srv.held():` no forward pass starts, so a test decides what is in flight instead of racing the server.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import httpx

LAUNCH = Path(__file__).with_name("launch.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """Start with `ServerProcess(args, log_dir)`; always `stop()` (or use it as a context manager)."""

    def __init__(self, args: Sequence[str], log_dir: Path, api_key: Optional[str] = None,
                 ready_timeout: float = 60.0, holdable: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = Path(log_dir) / f"server-{self.port}.log"
        self.hold_path = Path(log_dir) / f"hold-{self.port}" if holdable else None
        bivit = [sys.executable, "-m", "bivit"] if self.hold_path is None else \
            [sys.executable, str(LAUNCH), "hold", str(self.hold_path)]
        cmd = [*bivit, "serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self._log = open(self.log_path, "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("BIVIT_API_KEY", None)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_ready(ready_timeout)
        except BaseException:
            self.stop()
            raise

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                if httpx.get(f"{self.url}/ready", headers=self.headers, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log_text()}")

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """No forward pass starts inside the block (requests are admitted and queued); queued items run after."""
        if self.hold_path is None:
            raise RuntimeError("start the server with holdable=True")
        self.hold_path.touch()
        try:
            yield
        finally:
            self.hold_path.unlink(missing_ok=True)

    def metrics(self) -> dict[str, float]:
        r = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=30)
        r.raise_for_status()
        return metric_values(r.text)

    def wait_for_metric(self, name: str, done: Callable[[float], bool], timeout: float = 120.0) -> float:
        """Poll /metrics until `done(value of name)` (0 while the series is absent) -> that value. `timeout` only
        bounds a hang: the wait ends on the server's state, never on a guess of how long the server takes."""
        deadline = time.monotonic() + timeout
        while not done(value := self.metrics().get(name, 0.0)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} stayed at {value} (server exit code {self.proc.poll()}):\n"
                                   f"{self.log_text()[-3000:]}")
            time.sleep(0.01)
        return value

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_records(self) -> list[dict]:
        out = []
        for line in self.log_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def metric_values(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{label="v"}': value} (sample names as written, labels sorted)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def rss_mb(pid: int) -> float:
    """A process's resident memory now, MB."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # VmHWM restarts from the current RSS


def peak_mb(pid: int) -> float:
    """A process's peak resident memory (VmHWM) since it started or since `reset_peak`, MB."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


class HealthProbe:
    """GET /health every 0.1 s on its own connection; `worst()` is the slowest answer since the last reset."""

    def __init__(self, url: str):
        self.url, self.times, self.failures = url, [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                httpx.get(f"{self.url}/health", timeout=60)
            except httpx.HTTPError:
                self.failures += 1
            self.times.append(time.monotonic() - t0)
            time.sleep(0.1)

    def worst(self) -> str:
        out = f"/health worst {max(self.times, default=0):.2f} s over {len(self.times)} probes"
        out += f", {self.failures} failed" if self.failures else ""
        self.times, self.failures = [], 0
        return out

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
