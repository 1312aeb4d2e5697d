"""Peak memory of `encoder.encode` over many small images: what one call holds at a time.

    python scripts/encode_memory.py [--count 500] [--size 224]

Writes `count` random PNGs of `size` x `size` to a temporary folder, loads the demo encoder (bf16), encodes two
(warm-up), then all of them in one `encode` call, and prints the process's peak RSS before and after the call,
with the pixels the inputs amount to. Inputs are prepared as forward passes fill, so the call should hold about
one `max_batch_patches` budget of pixels (16384 patches, 38.5 MB of float32), not all of them.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

import bivit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=500)
    ap.add_argument("--size", type=int, default=224)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        paths = []
        for i in range(args.count):
            paths.append(Path(d) / f"{i:04d}.png")
            Image.fromarray(rng.integers(0, 255, (args.size, args.size, 3), dtype=np.uint8)).save(paths[-1])
        enc = bivit.load_encoder()
        enc.encode(paths[:2])
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        t0 = time.perf_counter()
        out = enc.encode(paths)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    patches = enc.prepare(np.zeros((args.size, args.size, 3), np.uint8)).patches
    pixels = args.count * patches * 3 * 14 * 14 * 4 / 2**20
    print(f"python scripts/encode_memory.py --count {args.count} --size {args.size}")
    print(f"{len(out)} images ({pixels:.0f} MiB of float32 pixels in all), max_batch_patches {enc.max_batch_patches}: "
          f"peak RSS {before:.0f} MiB before encode, {after:.0f} MiB after (+{after - before:.0f} MiB), "
          f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
