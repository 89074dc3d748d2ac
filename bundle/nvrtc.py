"""Generated CUDA source as NVRTC (CuPy's ``RawModule``) compiles it, on any GPU machine.

TVM's source includes ``<cuda/std/cstdint>`` and ``<cuda/std/type_traits>`` when compiled by
NVRTC; whether those headers are on NVRTC's search path depends on how CUDA and CuPy were
installed. The generated float kernels need only the fixed-width integer types, so that preamble
is replaced by their definitions (Linux's LP64 types): the source then depends on no header.
"""

from __future__ import annotations

import re

OPTIONS = ("--std=c++17",)
_RTC_PREAMBLE = re.compile(r"#ifdef __CUDACC_RTC__\n.*?\n#else\n.*?\n#endif\n", re.S)
_FIXED_WIDTH = {
    "int8_t": "signed char",
    "uint8_t": "unsigned char",
    "int16_t": "short",
    "uint16_t": "unsigned short",
    "int32_t": "int",
    "uint32_t": "unsigned int",
    "int64_t": "long",  # as glibc defines them (LP64): a second, equal typedef is legal C++
    "uint64_t": "unsigned long",
}


def self_contained(source: str) -> str:
    """``source`` with TVM's NVRTC preamble replaced by the fixed-width integer types."""
    types = "".join(f"typedef {c} {t};\n" for t, c in _FIXED_WIDTH.items())
    return _RTC_PREAMBLE.sub(lambda _: types, source, count=1)
