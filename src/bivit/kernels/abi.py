"""The compiled kernels' arguments: a `ctypes.Structure` per C struct of `abi.h`, filled by field name.

Every exported entry point takes one pointer to such a struct, so a call names each stride and size it passes
(`args.k_row = k.stride(0)`) instead of relying on the position of the 21st argument. `check` compares every
field's offset and size, and each struct's size, with what the loaded library reports (`bivit_abi_field`),
before anything is called: a mirror that drifted from `abi.h` refuses the library instead of passing
misplaced fields.
"""

from __future__ import annotations

import ctypes




class KernelUnavailable(Exception):
    """Why a compiled library or kernel is not used. `chosen`: by the configuration (a note), not lost to a fault
    or to the CPU (a warning). `fix`: what the user can do about it (None: nothing)."""

    def __init__(self, reason: str, chosen: bool = False, fix: str | None = None) -> None:
        super().__init__(reason)
        self.chosen = chosen
        self.fix = fix


_P, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class AttentionArgs(ctypes.Structure):
    """`struct bivit_attention_args`."""

    _fields_ = [("q", _P), ("k", _P), ("v", _P), ("out", _P), ("cu", _P), ("lse", _P), ("cos", _P), ("sin", _P),
                ("count", _I64), ("heads", _I64), ("d", _I64),
                ("q_row", _I64), ("k_row", _I64), ("v_row", _I64), ("out_row", _I64),
                ("q_head", _I64), ("k_head", _I64), ("v_head", _I64), ("out_head", _I64),
                ("scale", _F32), ("yt", _INT), ("threads", _INT)]


class GemmPackArgs(ctypes.Structure):
    """`struct bivit_gemm_pack_args` (also what `bivit_gemm_packed_bytes` reads: kind, N, K)."""

    _fields_ = [("w", _P), ("out", _P), ("w_row", _I64), ("N", _I64), ("K", _I64),
                ("kind", _INT), ("wt", _INT), ("threads", _INT)]


class GemmArgs(ctypes.Structure):
    """`struct bivit_gemm_args`."""

    _fields_ = [("x", _P), ("w", _P), ("bias", _P), ("y", _P), ("x_row", _I64), ("y_row", _I64),
                ("M", _I64), ("N", _I64), ("K", _I64),
                ("kind", _INT), ("xt", _INT), ("yt", _INT), ("act", _INT), ("flush", _INT), ("threads", _INT)]


class RopeArgs(ctypes.Structure):
    """`struct bivit_rope_args`."""

    _fields_ = [("x", _P), ("out", _P), ("cos", _P), ("sin", _P), ("rows", _I64), ("slots", _I64), ("d", _I64),
                ("x_row", _I64), ("x_slot", _I64), ("out_row", _I64), ("out_slot", _I64), ("threads", _INT)]


class NormArgs(ctypes.Structure):
    """`struct bivit_norm_args`."""

    _fields_ = [("x", _P), ("w", _P), ("b", _P), ("y", _P), ("mean", _P), ("rstd", _P), ("rows", _I64), ("d", _I64),
                ("x_row", _I64), ("y_row", _I64), ("eps", _F32), ("rms", _INT), ("xt", _INT), ("wt", _INT),
                ("yt", _INT), ("threads", _INT)]


STRUCTS = {"bivit_attention_args": AttentionArgs, "bivit_gemm_pack_args": GemmPackArgs,
           "bivit_gemm_args": GemmArgs, "bivit_rope_args": RopeArgs, "bivit_norm_args": NormArgs}


# The constants Python passes (element types, GELU kinds, GEMM kernels) or reads (return codes, the head dims the
# kernels take), with the values the C sources give them (gemm.h's BIVIT_CONSTS): `check` asks the loaded
# library for each, so a drifted copy refuses the library. The Triton kernels take theirs from here too.
CONSTS = {"E_F32": 0, "E_BF16": 1, "E_F16": 2, "ACT_NONE": 0, "ACT_GELU_TANH": 1, "ACT_GELU_ERF": 2,
          "GEMM_FP32": 0, "GEMM_AVX512_BF16": 1, "GEMM_AMX": 2, "GEMM_AMX_SWAPPED": 3,
          "RC_OK": 0, "RC_NO_MEMORY": 1, "RC_UNSUPPORTED": 2, "RC_BAD_SIZES": 3, "MAX_D": 128, "ROPE_MAX_D": 256}


def fill(cls: type[ctypes.Structure], **fields) -> ctypes.Structure:
    """An instance of `cls` with every field given by name (a field left out or unknown is an error: a zero
    stride would run, and read the wrong rows)."""
    names = {name for name, _ in cls._fields_}
    if set(fields) != names:
        raise TypeError(f"{cls.__name__}: missing {sorted(names - set(fields))}, unknown {sorted(set(fields) - names)}")
    return cls(**fields)


def check(lib: ctypes.CDLL, structs: dict[str, type[ctypes.Structure]] | None = None) -> None:
    """Raise KernelUnavailable unless every struct of `structs` (C name -> mirror; default: all above) has,
    field by field, the layout `lib` was built with, and every constant of CONSTS its value there."""
    lookup = lib.bivit_abi_field
    lookup.restype = ctypes.c_int
    lookup.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(_I64), ctypes.POINTER(_I64)]
    offset, size = _I64(), _I64()
    for name, cls in (STRUCTS if structs is None else structs).items():
        mine = [(f, getattr(cls, f).offset, getattr(cls, f).size) for f, _ in cls._fields_]
        mine.append(("", 0, ctypes.sizeof(cls)))  # last: a field the library lacks is the clearer message
        for field, want_offset, want_size in mine:
            if lookup(name.encode(), field.encode(), ctypes.byref(offset), ctypes.byref(size)) != 0:
                raise KernelUnavailable(f"the compiled library has no field {name}.{field or '(size)'}: "
                                        "built from other sources than bivit's")
            if (offset.value, size.value) != (want_offset, want_size):
                raise KernelUnavailable(f"the compiled library lays out {name}.{field or '(size)'} at offset "
                                        f"{offset.value}, {size.value} bytes; bivit at {want_offset}, {want_size}")
    const = lib.bivit_abi_const
    const.restype = ctypes.c_int
    const.argtypes = [ctypes.c_char_p, ctypes.POINTER(_I64)]
    value = _I64()
    for name, want in CONSTS.items():
        if const(name.encode(), ctypes.byref(value)) != 0:
            raise KernelUnavailable(f"the compiled library has no constant {name}: built from other sources than "
                                    "bivit's")
        if value.value != want:
            raise KernelUnavailable(f"the compiled library has {name} = {value.value}; bivit passes {want}")


def bind(lib: ctypes.CDLL) -> None:
    """Declare every entry point's signature: one pointer to its struct (`check` first)."""
    check(lib)
    entries = {"bivit_attention_bf16": AttentionArgs, "bivit_attention_f32": AttentionArgs,
               "bivit_attention_amx_bf16": AttentionArgs, "bivit_rope_bf16": RopeArgs, "bivit_rope_f32": RopeArgs,
               "bivit_gemm_pack": GemmPackArgs, "bivit_gemm_packed_bytes": GemmPackArgs, "bivit_gemm": GemmArgs,
               "bivit_norm": NormArgs}
    for name, cls in entries.items():
        fn = getattr(lib, name, None)
        if fn is None:  # the AMX attention is in the avx512 library only
            continue
        fn.restype = ctypes.c_size_t if name == "bivit_gemm_packed_bytes" else ctypes.c_int
        fn.argtypes = [ctypes.POINTER(cls)]
    lib.bivit_amx_init.restype = ctypes.c_int
    lib.bivit_amx_init.argtypes = []
    lib.bivit_gemm_peak.restype = ctypes.c_double
    lib.bivit_gemm_peak.argtypes = [ctypes.c_int, _I64, ctypes.c_int]
