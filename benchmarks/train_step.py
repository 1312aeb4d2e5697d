"""Forward + backward time of the trainable module (`bivit.load_model`) against the transformers port.

    python benchmarks/train_step.py                          # full-size K2.6, bf16 and fp32, 1024 patches, 3 rounds
    python benchmarks/train_step.py --patches 256 --repeats 2 --dtype bfloat16
    python benchmarks/train_step.py --preset demo            # quick check of the script itself
    python benchmarks/train_step.py --threads 1              # on a shared machine: no waits on descheduled threads

One training step = forward of one square image through tower + projector, a scalar loss over the
embeddings, backward to every weight (what a trainer recomputing rollout embeddings pays). Same seeded random
weights (one bf16 checkpoint both implementations load), same pixels, same loss. Per dtype one process holds
one bivit module (its invariant and default modes are a flag on the same weights) and the port; each round
times bivit-invariant, bivit-default and the port once, the starting implementation rotating per round, so
a shared machine's noise lands on all alike. One untimed warm-up step per implementation comes first.
Reported: median seconds per step and the ratio to the port (< 1: faster than the port).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bivit import bench
from bivit.checkpoint.config import PRESETS

IMPLS = ("bivit-invariant", "bivit-default", "hf-sdpa")


def make_steps(checkpoint: Path, dtype: str, case: bench.Case) -> dict:
    """impl -> a callable running one forward + backward step (returns the loss)."""
    import bivit

    import transformers
    from transformers import Kimi_K25Model

    model = bivit.load_model(checkpoint, dtype=dtype)
    transformers.logging.set_verbosity_error()  # the stand-in text model's "newly initialized" notice
    transformers.logging.disable_progress_bar()
    hf = Kimi_K25Model.from_pretrained(str(checkpoint), dtype=bench.TORCH_DTYPES[dtype],
                                       attn_implementation="sdpa").eval()
    hf.requires_grad_(True)
    pixels, grid = case.batch.pixel_values, case.batch.grid_thw
    probe: dict[tuple, torch.Tensor] = {}

    def loss_of(outs) -> torch.Tensor:
        total = 0
        for o in outs:
            if o.shape not in probe:
                probe[o.shape] = torch.randn(o.shape, generator=torch.Generator().manual_seed(0))
            total = total + (o.float() * probe[o.shape]).sum()
        return total

    def bivit_step(invariant: bool):
        def step():
            model.batch_invariant = invariant
            model.zero_grad(set_to_none=True)
            loss = loss_of(model(pixels, grid))
            loss.backward()
            return loss.detach()
        return step

    def hf_step():
        hf.zero_grad(set_to_none=True)
        loss = loss_of(hf.get_image_features(pixels.to(hf.dtype), grid).pooler_output)
        loss.backward()
        return loss.detach()

    return {"bivit-invariant": bivit_step(True), "bivit-default": bivit_step(False), "hf-sdpa": hf_step}


def run(args) -> dict:
    cfg = PRESETS[args.preset]
    case = bench.square_case(args.patches, args.seed)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bivit-train-bench-") as tmp:
        checkpoint = Path(tmp) / "ckpt"
        bench.write_checkpoint_isolated(checkpoint, args.preset, args.seed)
        for dtype in args.dtypes:
            steps = make_steps(checkpoint, dtype, case)
            losses = {impl: float(steps[impl]()) for impl in IMPLS}  # warm-up; also a parity line
            times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
            for r in range(args.repeats):
                for impl in IMPLS[r % 3:] + IMPLS[:r % 3]:
                    t = time.perf_counter()
                    steps[impl]()
                    times[impl].append(time.perf_counter() - t)
            results[dtype] = {"times": times, "losses": losses}
            del steps
    return {"cfg": cfg, "case": case, "results": results}


def report(args, record: dict) -> str:
    case = record["case"]
    lines = [f"preset {args.preset}; one image of {case.patches} patches "
             f"({case.tokens} tokens); {args.repeats} interleaved rounds after one warm-up",
             "", "| dtype | implementation | fwd+bwd s (median) | [min, max] | / port | loss |",
             "|---|---|---:|---:|---:|---:|"]
    for dtype, res in record["results"].items():
        port = statistics.median(res["times"]["hf-sdpa"])
        for impl in IMPLS:
            ts = res["times"][impl]
            med = statistics.median(ts)
            lines.append(f"| {dtype} | {impl} | {med:.3f} | [{min(ts):.3f}, {max(ts):.3f}] | {med / port:.2f} | "
                         f"{res['losses'][impl]:.6g} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = bench.script_args(__doc__.splitlines()[0], dtype="both", dtypes=sorted(bench.DTYPE_CHOICES))
    p.add_argument("--patches", type=int, default=1024, help="patches of the square image (a square, even side)")
    args = p.parse_args(argv)
    bench.start(args)
    args.dtypes = bench.DTYPE_CHOICES[args.dtype]
    print(report(args, run(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
