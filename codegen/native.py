"""A run of compiled kernels as one native call (MonoNN's point, on this CPU).

A stitched program's kernels are TVM functions. Called from Python one after another, each call
converts its arguments (numpy arrays to DLPack tensors) and crosses the interpreter: a 64x64
addition took 0.64 us a call from Python, 0.10 us from C. ``NativeRun`` binds a sequence of
calls once, their arguments as DLPack tensors over fixed buffers, and runs them all by one call
into a small C loop (``run_calls``, compiled once per machine by ``$CC`` or ``cc``, the compiler
TVM links its kernels with, and cached beside the kernels). Tensors a run sets afresh (the
inputs, outputs made per run) get their data pointer each run (``set``); nothing else is touched
between runs. Whole programs gained 1-1.4% (ViT-Base: 94.3 to 93.0 ms, interleaved).

The same loop times a program kernel by kernel (``NativeRun(clocked=True)``: the clock read in
C before each call and after the last). A stopwatch in Python around each call, as such times
were taken until the 87th stop, added the crossing the native run saves to every kernel: BERT-base
(32 tokens, a Zen 3) ran 0.966x its kernels so timed, and the orchestration's BLP, summing
them, counted each kernel a fusion removed as about 8 us saved (its plan 1.7% faster than the
stitched program by its sums, 0.998-1.000x it in four races of whole runs).

A kernel that fails stops the run: the error names the kernel and carries TVM's message.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np

from .tvm_kernel import CodegenError, _Deferred, address, cache_dir

# tvm-ffi's paths, looked up when the loop is first built: importing tvm-ffi imports torch where
# torch is installed, and ``import rewriter`` stays without both until a kernel runs
libinfo = _Deferred("tvm_ffi.libinfo")

OUTPUT = "\0output"  # in a call's arguments: the step's output, wherever it lies

SOURCE = r"""
#include <string.h>
#include <time.h>
#include <tvm/ffi/c_api.h>

typedef struct {
  TVMFFIObjectHandle function;
  TVMFFIAny* args;
  int32_t num_args;
} Call;

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Call each function on its arguments in turn; where `stamps` is given (count + 1 of them),
   the clock before each call and after the last. Returns 0, or 1 + the index of the call that
   failed, with TVM's message copied into `message`. */
int run_calls(const Call* calls, int32_t count, char* message, int32_t capacity, int64_t* stamps) {
  for (int32_t i = 0; i < count; ++i) {
    if (stamps != NULL) stamps[i] = now_ns();
    TVMFFIAny result;
    memset(&result, 0, sizeof(result)); /* kTVMFFINone */
    if (TVMFFIFunctionCall(calls[i].function, calls[i].args, calls[i].num_args, &result) != 0) {
      TVMFFIObjectHandle error = NULL;
      TVMFFIErrorMoveFromRaised(&error);
      message[0] = 0;
      if (error != NULL) {
        TVMFFIErrorCell* cell = (TVMFFIErrorCell*)((char*)error + sizeof(TVMFFIObject));
        size_t n = cell->message.size < (size_t)capacity - 1 ? cell->message.size : (size_t)capacity - 1;
        memcpy(message, cell->message.data, n);
        message[n] = 0;
        TVMFFIObjectDecRef(error);
      }
      return i + 1;
    }
    if (result.type_index >= kTVMFFIStaticObjectBegin) TVMFFIObjectDecRef(result.v_obj);
  }
  if (stamps != NULL) stamps[count] = now_ns();
  return 0;
}
"""

_DLTENSOR_PTR = 7  # kTVMFFIDLTensorPtr
_DL_CPU = 1
_DL_CODES = {"i": 0, "u": 1, "f": 2}


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device_type", ctypes.c_int32),
        ("device_id", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("code", ctypes.c_uint8),
        ("bits", ctypes.c_uint8),
        ("lanes", ctypes.c_uint16),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.c_void_p),  # NULL: C-contiguous
        ("byte_offset", ctypes.c_uint64),
    ]


class _Any(ctypes.Structure):  # TVMFFIAny holding a DLTensor pointer
    _fields_ = [("type_index", ctypes.c_int32), ("zero_padding", ctypes.c_uint32), ("value", ctypes.c_void_p)]


class _Call(ctypes.Structure):
    _fields_ = [("function", ctypes.c_void_p), ("args", ctypes.POINTER(_Any)), ("num_args", ctypes.c_int32)]


@functools.cache
def driver() -> ctypes.CDLL | None:
    """``run_calls``, compiled on first use and kept in the kernel cache (written atomically);
    None, with a warning, where it cannot be built (no C compiler): kernels are then called from
    Python, as any other call is."""
    include = [libinfo.find_include_path(), libinfo.find_dlpack_include_path()]
    library = Path(libinfo.find_libtvm_ffi())
    key = hashlib.sha256("\n".join([SOURCE, *include, str(library)]).encode()).hexdigest()[:16]
    path = cache_dir() / f"native-{key}.so"
    try:
        if not path.exists():
            _compile(path, include, library)
        lib = ctypes.CDLL(str(path))
    except (OSError, CodegenError) as err:
        warnings.warn(f"compiled kernels run from Python, one call each: {err}", RuntimeWarning, stacklevel=2)
        return None
    lib.run_calls.argtypes = [
        ctypes.POINTER(_Call),
        ctypes.c_int32,
        ctypes.c_char_p,
        ctypes.c_int32,
        ctypes.POINTER(ctypes.c_int64),
    ]
    lib.run_calls.restype = ctypes.c_int32
    return lib


def _compile(path: Path, include: Sequence[str], library: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as work:
        source, built = Path(work) / "run_calls.c", Path(work) / "run_calls.so"
        source.write_text(SOURCE)
        command = [
            os.environ.get("CC", "cc"),
            "-O2",
            "-shared",
            "-fPIC",
            *(f"-I{d}" for d in include),
            str(source),
            "-o",
            str(built),
            f"-L{library.parent}",
            "-ltvm_ffi",
            f"-Wl,-rpath,{library.parent}",
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise CodegenError(f"the native run loop did not compile ({' '.join(command)}): {done.stderr.strip()}")
        os.replace(built, path)


def arguments(kernel, **names: str) -> tuple[str, ...]:
    """A compiled kernel's input arguments in the order it takes them: the name given for each of
    its tensors (``X=...``)."""
    return tuple(names[tensor] for tensor in kernel.inputs)


class NativeRun:
    """Kernel calls bound to their buffers, run in order by one native call.

    ``add(function, args, views, label)``: ``function`` a compiled TVM function; each argument
    an array (bound as it is: C-contiguous, held here) or a name that each run sets with
    ``set(name, array)``; ``views`` the shapes the function takes them in. ``clocked``: the
    loop reads the clock before each call and after the last (``seconds``: each call's time in
    the last run), so a program is timed kernel by kernel as it runs, with no Python between
    its kernels."""

    def __init__(self, dtype: str, clocked: bool = False) -> None:
        self.dtype = np.dtype(dtype)
        self.clocked = clocked
        self._stamps: ctypes.Array | None = None
        self.labels: list[str] = []
        self.slots: dict[str, list[_DLTensor]] = {}  # a name a run sets -> its tensors
        self._keep: list = []  # what the C structures point into
        self._calls: list[tuple[object, ctypes.Array]] = []
        self._bound: ctypes.Array | None = None
        self._message = ctypes.create_string_buffer(2048)

    def add(self, function, args: Sequence[np.ndarray | str], views: Sequence[tuple[int, ...]], label: str) -> None:
        tensors = [self._tensor(arg, view) for arg, view in zip(args, views)]
        anys = (_Any * len(tensors))(*(_Any(_DLTENSOR_PTR, 0, ctypes.addressof(t)) for t in tensors))
        self._keep += [function, tensors]
        self._calls.append((function, anys))
        self.labels.append(label)
        self._bound = None
        self._stamps = (ctypes.c_int64 * (len(self._calls) + 1))() if self.clocked else None

    def _tensor(self, arg: np.ndarray | str, view: tuple[int, ...]) -> _DLTensor:
        shape = (ctypes.c_int64 * len(view))(*view)
        tensor = _DLTensor(None, _DL_CPU, 0, len(view), _DL_CODES[self.dtype.kind], self.dtype.itemsize * 8, 1, shape)
        self._keep.append(shape)
        if isinstance(arg, str):
            self.slots.setdefault(arg, []).append(tensor)
        else:
            if not arg.flags.c_contiguous or arg.size != int(np.prod(view)):
                raise CodegenError(f"NativeRun: a bound buffer of shape {arg.shape} is no C-contiguous {view}")
            tensor.data = arg.ctypes.data
            self._keep.append(arg)
        return tensor

    def set(self, name: str, array: np.ndarray) -> None:
        """Bind ``name`` to ``array`` (C-contiguous, aligned) for the runs that follow."""
        pointer = address(array)
        for tensor in self.slots[name]:
            tensor.data = pointer

    def __call__(self) -> None:
        if self._bound is None:
            self._bound = (_Call * len(self._calls))(
                *(_Call(function.__chandle__(), anys, len(anys)) for function, anys in self._calls)
            )
        failed = driver().run_calls(self._bound, len(self._calls), self._message, len(self._message), self._stamps)
        if failed:
            message = self._message.value.decode(errors="replace")
            raise CodegenError(f"kernel {self.labels[failed - 1]} failed: {message}")

    def seconds(self) -> list[float]:
        """Each call's seconds in the last run (a ``clocked`` run only)."""
        stamps = np.frombuffer(self._stamps, dtype=np.int64)
        return (np.diff(stamps) * 1e-9).tolist()
