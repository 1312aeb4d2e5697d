"""`python -m support.golden_rows LAYOUTS MODEL:DTYPE...`: the golden inputs' rows (`bivit.diagnose.golden`) under this
process's kernels (steered by BIVIT_ATTENTION / BIVIT_GEMM / BIVIT_ARITH, as a test sets them), as one JSON line:
{"MODEL:DTYPE": {"bits": class, "kernels": {...}, "rows": {layout: {input: sha256}}}}. MODEL: "demo" or a
checkpoint directory. LAYOUTS: comma-separated `alone|packed|reversed@THREADS`: each input encoded alone, all in
one call, or all in one call in reverse order, at that many threads."""

import json
import sys

import torch

import bivit
from bivit.diagnose import golden


def rows(encoder, layouts: list[str]) -> dict:
    inputs = golden.inputs()
    names, values = list(inputs), list(inputs.values())
    out = {}
    for layout in layouts:
        how, threads = layout.split("@")
        torch.set_num_threads(int(threads))
        if how == "alone":
            encoded = [encoder.encode([x])[0] for x in values]
        elif how == "packed":
            encoded = encoder.encode(values)
        else:
            encoded = encoder.encode(values[::-1])[::-1]
        out[layout] = {n: golden.digest(r) for n, r in zip(names, encoded)}
    return out


def main() -> None:
    layouts = sys.argv[1].split(",")
    out = {}
    for spec in sys.argv[2:]:
        model, dtype = spec.rsplit(":", 1)
        enc = bivit.load_encoder(None if model == "demo" else model, dtype=dtype)
        about = enc.describe()
        out[spec] = {"bits": enc.bits, "kernels": {k: about["kernels"][k] for k in ("gemm", "attention", "norm")},
                     "rows": rows(enc, layouts)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
