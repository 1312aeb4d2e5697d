"""How long loading the full-size Kimi-K2.6 vision part takes, how much memory it costs, and what the first
forward pass pays on top.

    python benchmarks/load_checkpoint.py [--dir /tmp/bivit-k26] [--dtype bfloat16] [--runs 3]

Writes a checkpoint shaped like the published one (random weights, bf16, the vision tower and projector in the
last two shards, stand-in language-model shards before them, an index), then loads it `--runs` times, each in a
fresh process, and reports wall time and memory. A load does: read the shards (memory-mapped), check every
weight is finite, build the model, load the installed kernels, and in invariant mode pack the weights and run
the load-time proof. Nothing is compiled or cached between runs: every run is a first load. Each run then times
two encodes of one 448x448 image.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

LOAD = r"""
import json, sys, time
t0 = time.perf_counter()
import bivit
from bivit.bench import noise_image
t1 = time.perf_counter()
base_anon = int(dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)["RssAnon"].split()[0]) / 1024
enc = bivit.load_encoder(sys.argv[1], dtype=sys.argv[2])
t2 = time.perf_counter()
weights = sum(t.numel() * t.element_size() for t in enc.model.state_dict().values())
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
kb = lambda k: int(status[k].split()[0]) / 1024
image = noise_image(448, 448, 0)
encodes = []
for _ in range(2):
    t = time.perf_counter()
    enc.encode([image])
    encodes.append(time.perf_counter() - t)
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "weights_mb": weights / 2**20, "encode_s": encodes,
                  "peak_rss_mb": kb("VmHWM"), "anon_mb": kb("RssAnon"), "import_anon_mb": base_anon}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "bivit-k26")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    if not (args.dir / "model.safetensors.index.json").exists():
        import torch

        from bivit.checkpoint.state_dict import random_state_dict, save_checkpoint
        from bivit.checkpoint.config import PRESETS

        cfg = PRESETS["kimi-k2.6"]
        tower = {k: v for k, v in random_state_dict(cfg).items()}
        lm = [{f"language_model.model.layers.{i}.mlp.experts.weight": torch.zeros(1024, 1024)} for i in range(4)]
        save_checkpoint(args.dir, cfg, tower, dtype=torch.bfloat16, shards=2, extra_shards=lm)
    from bivit import bench

    env = bench.environment(int(os.environ.get("OMP_NUM_THREADS", 0)) or __import__("torch").get_num_threads())
    print("$", bench.command_line())
    print(bench.machine_line(env))
    for run in range(args.runs):
        out = subprocess.run([sys.executable, "-c", LOAD, str(args.dir), args.dtype], capture_output=True,
                             text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"run {run + 1}: load_encoder({args.dir}, dtype={args.dtype}): {r['load_s']:.2f} s (import "
              f"{r['import_s']:.2f} s); then 448x448 encodes {r['encode_s'][0]:.2f} s (first) and "
              f"{r['encode_s'][1]:.2f} s; weights {r['weights_mb']:.0f} MB; anonymous memory after import "
              f"{r['import_anon_mb']:.0f} MB, after load and encodes {r['anon_mb']:.0f} MB; peak RSS "
              f"{r['peak_rss_mb']:.0f} MB (counts the mapped shard pages too)", flush=True)
    print(bench.load_line())


if __name__ == "__main__":
    main()
