"""`python -m support.golden_rows MODEL DTYPE`: the golden inputs' rows (`bivit.golden`) under this process's
kernels (steered by BIVIT_ATTENTION / BIVIT_GEMM / BIVIT_ARITH, as a test sets them), as one JSON line:
{"bits": class, "kernels": {...}, "rows": {input: sha256}}. MODEL: "demo" or a checkpoint directory."""

import json
import sys

import bivit
from bivit import golden


def main() -> None:
    model, dtype = sys.argv[1], sys.argv[2]
    enc = bivit.load_encoder(None if model == "demo" else model, dtype=dtype)
    about = enc.describe()
    print(json.dumps({"bits": enc.bits, "kernels": {k: about["kernels"][k] for k in ("gemm", "attention", "norm")},
                      "rows": golden.rows(enc)}))


if __name__ == "__main__":
    main()
