"""How long loading the full-size Kimi-K2.6 vision part takes, and how much memory it costs.

Writes a checkpoint shaped like the published one (random weights, bf16, the vision tower and projector in the
last two shards, stand-in language-model shards before them, an index), then loads it in a fresh process and
reports wall time and peak RSS against the size of the weights.

    python benchmarks/load_checkpoint.py [--dir /tmp/bivit-k26] [--dtype bfloat16]
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

LOAD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import bivit
t1 = time.perf_counter()
base_anon = int(dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)["RssAnon"].split()[0]) / 1024
enc = bivit.load_encoder(sys.argv[1], dtype=sys.argv[2])
t2 = time.perf_counter()
weights = sum(t.numel() * t.element_size() for t in enc.model.state_dict().values())
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
kb = lambda k: int(status[k].split()[0]) / 1024
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "weights_mb": weights / 2**20,
                  "peak_rss_mb": kb("VmHWM"), "anon_mb": kb("RssAnon"), "import_anon_mb": base_anon}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "bivit-k26")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    if not (args.dir / "model.safetensors.index.json").exists():
        import torch

        from bivit.checkpoint import random_state_dict, save_checkpoint
        from bivit.config import PRESETS

        cfg = PRESETS["kimi-k2.6"]
        tower = {k: v for k, v in random_state_dict(cfg).items()}
        lm = [{f"language_model.model.layers.{i}.mlp.experts.weight": torch.zeros(1024, 1024)} for i in range(4)]
        save_checkpoint(args.dir, cfg, tower, dtype=torch.bfloat16, shards=2, extra_shards=lm)
    print("command:", " ".join([sys.executable, *sys.argv]))
    out = subprocess.run([sys.executable, "-c", LOAD, str(args.dir), args.dtype], capture_output=True, text=True,
                         check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"load_encoder({args.dir}, dtype={args.dtype}): {r['load_s']:.2f} s (import {r['import_s']:.2f} s); "
          f"weights {r['weights_mb']:.0f} MB; process memory after import {r['import_anon_mb']:.0f} MB, after "
          f"load {r['anon_mb']:.0f} MB (anonymous), i.e. {r['anon_mb'] - r['import_anon_mb'] - r['weights_mb']:.0f} MB "
          f"beyond the weights; peak RSS {r['peak_rss_mb']:.0f} MB (counts the mapped shard pages too)")


if __name__ == "__main__":
    main()
