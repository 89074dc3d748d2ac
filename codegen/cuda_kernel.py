"""eOperators for NVIDIA GPUs: a scope as CUDA source plus the launches that run it.

``cuda_kernel(scope, output)`` starts from the tensor expressions ``tvm_kernel`` lowers a scope
to (the same semantics as the CPU kernels), schedules them for the GPU and generates CUDA C with
TVM, on any machine (no GPU, driver or CUDA compiler needed):

* TVM's default GPU schedules (``tvm.s_tir.dlight``: matmul, GEMV, reductions, fallback) are
  tried first, on a fresh module each time (``ApplyDefaultSchedule`` mutates its input);
* where they refuse the kernel, every stage gets the plain GPU schedule: its output elements
  fused into one loop, split over blocks of ``THREADS`` threads, summations serial per thread.

TVM's host code for the kernel (allocate the temporaries, launch each device function with its
grid) is read off the lowered host function and kept as data (``bundle.CudaLaunches``), so the
bundle runtime replays it with CuPy alone.
"""

from __future__ import annotations

import importlib
import re

from bundle.format import CudaLaunches, Launch
from rewriter.ir import Scope, tensor_shapes

from .tvm_kernel import PAD_EVERY, CodegenError, lower_to_te, tvm

THREADS = 256
# "arch" only names the features the generated source may use; the runtime compiles the source
# for the GPU it runs on (NVRTC), so one bundle serves any GPU from Ampere on
TARGET = {"kind": "cuda", "arch": "sm_80", "max_num_threads": 1024, "thread_warp_size": 32}
_DIMS = {"blockIdx.x": ("grid", 0), "blockIdx.y": ("grid", 1), "blockIdx.z": ("grid", 2)}
_DIMS |= {"threadIdx.x": ("block", 0), "threadIdx.y": ("block", 1), "threadIdx.z": ("block", 2)}


def cuda_kernel(scope: Scope, output: str, dtype: str = "float32", label: str = "") -> tuple[CudaLaunches, str, dict]:
    """(the launches, the CUDA source, temporaries {buffer name: (elements,)}) computing ``scope``
    into the buffer ``output``; the launches name ``scope``'s tensors as buffers, and the
    kernel's own temporaries as ``output.name``. Raises CodegenError when TVM refuses."""
    inputs = tensor_shapes(scope)
    clash = sorted(set(inputs) & {"out"} | {n for n in inputs if re.fullmatch(r"s\d+", n)})
    if clash:
        raise CodegenError(f"tensor name(s) {clash} clash with the CUDA kernel's own buffer names")
    target = tvm.target.Target(TARGET)
    errors = []
    for schedule, pad in ((_dlight, PAD_EVERY), (_plain, False)):
        try:
            module = schedule(_prim_module(scope, dtype, pad), target)
            return _generated(module, target, scope, output, dtype, label)
        except Exception as err:  # noqa: BLE001  TVM raises assorted errors; the next schedule is tried
            errors.append(f"{schedule.__name__.strip('_')}: {type(err).__name__}: {str(err).splitlines()[0][:300]}")
    raise CodegenError(f"TVM could not generate CUDA for {scope}: " + "; ".join(errors))


def _prim_module(scope: Scope, dtype: str, pad: bool | str):
    """The scope as a TIR function. For dlight every zero-padded read is a padding stage, which
    it inlines into its own read stages as guarded loads: a guard written inside the compute
    itself is lost when dlight re-indexes the read, which then reads out of bounds (an illegal
    address on the GPU). The plain schedule keeps guarded loads (``pad=False``): no copy."""
    lowering = lower_to_te(scope, dtype, pad=pad)
    return tvm.IRModule({"main": tvm.te.create_prim_func([*lowering.inputs.values(), lowering.output])})


def _dlight(module, target):
    dl = tvm.s_tir.dlight
    rules = (dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback())
    with target:
        return dl.ApplyDefaultSchedule(*rules)(module)


def _plain(module, target):
    """Each stage its own kernel: output elements over blocks × threads, summations serial."""
    sch = tvm.s_tir.Schedule(module)
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        spatial = sum(1 for v in sch.get(block).iter_vars if v.iter_type == 0)
        loops = sch.get_loops(block)
        if spatial == 0:
            loops = [sch.add_unit_loop(block)]
            spatial = 1
        fused = sch.fuse(*loops[:spatial]) if spatial > 1 else loops[0]
        blocks, threads = sch.split(fused, [None, THREADS])
        sch.bind(blocks, "blockIdx.x")
        sch.bind(threads, "threadIdx.x")
    return sch.mod


def _generated(module, target, scope: Scope, output: str, dtype: str, label: str):
    """Lower, split host from device, generate the device source, read the launches."""
    build = importlib.import_module("tvm.tirx.build")  # the module; tvm.tirx.build is its build()
    bound = tvm.tirx.transform.BindTarget(target.with_host(tvm.target.Target("llvm")))(module)
    pipeline, _, finalize_device = tvm.tirx.get_default_tir_pipeline(target)
    host, devices = build.split_host_device_mods(pipeline(bound))
    if len(devices) != 1:
        raise CodegenError("the kernel has no device code (a stage was left unscheduled)")
    ((device_target, device),) = devices.items()
    source = build.codegen_build(finalize_device()(device), device_target).inspect_source()
    names = {**{n: n for n in tensor_shapes(scope)}, "out": output}
    temporaries, launches = _host_plan(host["main"].body, names, output, dtype)
    _check_signatures(source, launches, {v: k for k, v in names.items()})
    return CudaLaunches(output, f"{output}.cu", tuple(launches), label=label), source, temporaries


def _check_signatures(source: str, launches, buffers: dict) -> None:
    """Every launch passes what its function declares: as many arguments, each pointer the
    buffer the parameter is named after (TVM names it ``<buffer>_ptr``)."""
    declared = dict(re.findall(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(([^)]*)\)', source))
    for launch in launches:
        if launch.function not in declared:
            raise CodegenError(f"launch of {launch.function}, which the generated source does not define")
        params = [p.split()[-1] for p in declared[launch.function].split(",") if p.strip()]
        passed = [f"{buffers[a]}_ptr" if isinstance(a, str) else None for a in launch.args]
        if len(params) != len(passed) or any(p is not None and p != q for p, q in zip(passed, params)):
            raise CodegenError(f"{launch.function}({', '.join(params)}) launched with {launch.args}")


def _host_plan(body, names: dict, output: str, dtype: str):
    """The host function's temporaries and kernel launches, in order."""
    temporaries, launches = {}, []

    def visit(stmt):
        kind = type(stmt).__name__
        if kind == "SeqStmt":
            for s in stmt.seq:
                visit(s)
            return
        if kind == "AllocBuffer" and stmt.buffer.scope() == "global":
            if str(stmt.buffer.dtype) != dtype:
                raise CodegenError(f"temporary {stmt.buffer.name} has dtype {stmt.buffer.dtype}, not {dtype}")
            names[stmt.buffer.name] = f"{output}.{stmt.buffer.name}"
            temporaries[names[stmt.buffer.name]] = (int(_product(stmt.buffer.shape)),)
        if kind == "Evaluate" and type(stmt.value).__name__ == "Call" and stmt.value.op.name == "tirx.call_ffi_kernel":
            launches.append(_launch(stmt.value, names))
        for part in ("body", "then_case", "else_case"):
            if getattr(stmt, part, None) is not None:
                visit(getattr(stmt, part))

    visit(body)
    if not launches:
        raise CodegenError("the kernel's host code launches nothing")
    return temporaries, launches


def _launch(call, names: dict) -> Launch:
    function, *args = call.args
    params = list(call.attrs.launch_params)
    dims = {"grid": [1, 1, 1], "block": [1, 1, 1]}
    shared = 0
    for param, value in zip(params, args[len(args) - len(params) :]):
        if param in _DIMS:
            where, axis = _DIMS[param]
            dims[where][axis] = _int(value, param)
        elif "dyn_shared" in param:
            shared = _int(value, param)
        else:
            raise CodegenError(f"unknown launch parameter {param}")
    values = []
    for arg in args[: len(args) - len(params)]:
        buffer = re.fullmatch(r"(\w+)\.data", str(arg))
        if buffer and buffer.group(1) in names:
            values.append(names[buffer.group(1)])
        else:
            values.append(_int(arg, "argument"))
    return Launch(str(function.value), tuple(dims["grid"]), tuple(dims["block"]), tuple(values), shared)


def _int(value, what: str) -> int:
    if type(value).__name__ != "IntImm":
        raise CodegenError(f"{what} {value} is not a constant")
    return int(value.value)


def _product(shape) -> int:
    total = 1
    for extent in shape:
        total *= _int(extent, "temporary extent")
    return total
