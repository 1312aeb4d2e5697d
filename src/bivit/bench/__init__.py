"""`bivit bench`: bivit (invariant and default mode) against the transformers port on one fixed input mix, each
case beside the roofline this machine allows it.

How the numbers are made (they are meant to be compared *within* one run, on one machine): `workload` (the
implementations, the input mix, the seeded checkpoint), `workers` (one process per implementation; memory),
`roofline` (FLOPs per case, the machine's GEMM and attention rates, the roofline), `run` (interleaved rounds),
`report` (tables, JSON, chart). benchmarks/README.md says the same for the scripts.

The scripts in `benchmarks/` use this surface, and nothing else of the package's:
* the workload: `Case`, `standard_cases`, `select_cases`, `make_case`, `square_case`, `noise_image`; `DTYPE_CHOICES`,
  `bench_dtypes`, `BENCH_DTYPES`, `TORCH_DTYPES`, `IMPLS`, `BIVIT_IMPLS`;
* the model and inputs on disk: `write_checkpoint_isolated`, `save_cases`;
* measuring: `Worker` (one implementation in its own process), `count_subnormals`, `case_flops`,
  `gemm_shapes`, `gemm_gflops`, `attention_gflops`, `PEAK_ROWS`;
* a script's frame: `script_args` (the options they share; `script_dtype`, their --dtype), `start` (threads,
  then the command and the machine line printed), `load_line`, `command_line`, `write_text`, `save_figure`;
* whole runs: `run_benchmark`, `summarize`, `format_report`, `write_outputs`.
"""

from .report import format_report, save_figure, summarize, write_outputs, write_text
from .roofline import PEAK_ROWS, Flops, attention_gflops, case_flops, gemm_gflops, gemm_shapes
from .run import command_line, environment, load_line, machine_line, run_benchmark, script_args, script_dtype, start
from .workers import Worker, count_subnormals, hf_unavailable_reason
from .workload import BENCH_DTYPES, BIVIT_IMPLS, DTYPE_CHOICES, IMPLS, TORCH_DTYPES, Case, bench_dtypes, \
    hf_supports, make_case, noise_image, save_cases, select_cases, square_case, standard_cases, write_checkpoint, \
    write_checkpoint_isolated

__all__ = [
    "BENCH_DTYPES", "BIVIT_IMPLS", "DTYPE_CHOICES", "IMPLS", "PEAK_ROWS", "TORCH_DTYPES", "Case", "Flops", "Worker",
    "attention_gflops", "bench_dtypes", "case_flops", "command_line", "count_subnormals", "environment",
    "format_report", "gemm_gflops", "gemm_shapes", "hf_supports", "hf_unavailable_reason", "load_line", "machine_line",
    "make_case", "noise_image", "run_benchmark", "save_cases", "save_figure", "script_args", "script_dtype",
    "select_cases", "square_case", "standard_cases", "start", "summarize", "write_checkpoint",
    "write_checkpoint_isolated", "write_outputs", "write_text",
]
