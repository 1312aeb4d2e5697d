"""What this CPU is, as bivit's kernel choices see it: its flags, the compiled variants and what each needs, and
whether AMX runs. One home, so that the kernel choice, `bivit doctor`, `bivit bench` and the op layer's notices
name the same flags and decide AMX the same way (doctor and bench once kept lists of their own that had drifted
from the variants' needs).
"""

from __future__ import annotations

from ..base import state
from .build import VARIANTS

# AMX tiles (the avx512 variant's `amx` GEMMs and bf16 attention) need both.
AMX_FLAGS = ("amx_tile", "amx_bf16")
# Flags that change oneDNN's choices only (its native fp16 GEMM: `bivit.ops.selection`).
ONEDNN_FLAGS = ("avx512_fp16", "amx_fp16")
# Every flag a kernel choice depends on (what `bivit doctor` and `bivit bench` report), as /proc/cpuinfo spells them.
FLAGS = tuple(dict.fromkeys((*(f for v in VARIANTS for f in v.needs), *AMX_FLAGS, *ONEDNN_FLAGS)))
# The CPU kinds bivit has a fastest path for, slowest first (AVX2-only, AVX-512 BF16, AMX): one flag each.
TIERS = ("avx2", "avx512_bf16", "amx_bf16")

# Why AMX does not run on a CPU that has it, when the OS keeps its tile state from the process, and the fix.
AMX_NOT_GRANTED = ("the CPU has AMX but the OS does not grant its tile state to this process (Linux before 5.16, "
                   "or a VM that hides it)", "a Linux kernel >= 5.16 with AMX enabled for this machine")


@state.memo(state.FIXED)
def cpu_info() -> tuple[str, frozenset[str]]:
    """(model name, instruction-set flags) from /proc/cpuinfo; ("", empty) where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return "", frozenset()
    model = next((l.split(":", 1)[1].strip() for l in lines if l.startswith("model name")), "")
    flags = frozenset(next((l.split(":", 1)[1].split() for l in lines if l.startswith("flags")), []))
    return model, flags


def has_amx(flags: frozenset[str]) -> bool:
    """Whether a CPU with `flags` has AMX bf16 tiles (whether the OS grants them is `amx_unused`'s question)."""
    return set(AMX_FLAGS) <= flags


def amx_unused(flags: frozenset[str], tiles_granted: bool, onednn_isa: str | None = None) -> tuple[str, str] | None:
    """(why, fix) when a CPU with AMX (`flags`) runs its bf16 GEMMs without it, else None. `tiles_granted`: the
    OS granted this process the tile state (asked by bivit's library or by PyTorch); `onednn_isa`:
    $ONEDNN_MAX_CPU_ISA (for oneDNN's GEMMs; None for bivit's own)."""
    if not has_amx(flags):
        return None
    if not tiles_granted:
        return AMX_NOT_GRANTED
    if onednn_isa and "AMX" not in onednn_isa.upper() and onednn_isa.upper() != "ALL":
        return f"ONEDNN_MAX_CPU_ISA={onednn_isa} keeps oneDNN below AMX", "unset ONEDNN_MAX_CPU_ISA"
    return None
