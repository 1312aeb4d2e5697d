"""The `bivit` command with a test's seam handed in first (production code reads no test file or variable):

    python tests/support/launch.py hold FILE serve ARGS...
        `bivit serve ARGS`, its batching worker starting no forward pass while FILE exists (`held`,
        `bivit.serve.batcher.Batcher`): a test decides what is in flight (`ServerProcess(holdable=True)`)
    python tests/support/launch.py pause STEP:SECONDS[:COUNT] encode-dataset ARGS...
        `bivit encode-dataset ARGS`, its writer sleeping SECONDS at STEP (before_rename | after_rename |
        after_commit) of every shard commit once it committed COUNT shards before it (default 0), or (journaled)
        after each input taken once the journal holds COUNT entries (`on_step`,
        `bivit.dataset.writer.DatasetWriter`): a test SIGKILLs the process at a chosen instant
"""

from __future__ import annotations

import functools
import os
import sys
import time


def hold(path: str) -> None:
    from bivit.serve import transport

    transport.run = functools.partial(transport.run, held=lambda: os.path.exists(path))


def pause(spec: str) -> None:
    from bivit.dataset import job, writer

    want, seconds, after, *_ = spec.split(":") + ["", ""]

    def on_step(step: str, count: int) -> None:
        if step == want and count >= int(after or 0):
            time.sleep(float(seconds or 1))

    job.DatasetWriter = functools.partial(writer.DatasetWriter, on_step=on_step)


if __name__ == "__main__":
    seam, value, *args = sys.argv[1:]
    {"hold": hold, "pause": pause}[seam](value)
    sys.argv = ["bivit", *args]
    from bivit.cli import main

    main()
