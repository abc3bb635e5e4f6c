"""Launch a captured CUDA graph under a device-side condition (a CUDA graph IF node), through the driver API.

generate wants to queue the next denoise forward before the host knows whether there is one; the device knows (its
stop code and the SC bet are device tensors). A conditional node decides on the GPU: this module builds, around an
already captured torch graph, a second graph

    set_condition(handle, flag)  ->  IF handle != 0: [the captured graph, as a child graph node]

and launches it on a stream. The flag is read when the GPU reaches the launch, so it may be written by work queued
just before. torch has no Python API for conditional nodes, hence
ctypes on libcuda: the driver's C API, the same calls CUDA C++ makes. The device half, `cudaGraphSetConditional`, is
a device-runtime builtin; `_SET_PTX` below is what nvcc 13.0 emits for that one-line kernel, kept as text and
JIT-compiled by the driver (`nvcc -ptx` of
`__global__ void set_if(cudaGraphConditionalHandle h, const bool* f) { cudaGraphSetConditional(h, *f ? 1u : 0u); }`,
with the target lowered to sm_80 and the ISA version to 8.4, the CUDA 12.4 driver's).

Needs a CUDA 12.4+ driver. `guard_support(device)` checks once, with a small graph, that it all works; the engine
captures plain graphs where it does not.
"""

from __future__ import annotations

import ctypes
import weakref

import torch

_SET_PTX = b"""
.version 8.4
.target sm_80
.address_size 64

.extern .func cudaGraphSetConditional
(
    .param .b64 cudaGraphSetConditional_param_0,
    .param .b32 cudaGraphSetConditional_param_1
)
;

.visible .entry set_if(
    .param .u64 set_if_param_0,
    .param .u64 set_if_param_1
)
{
    .reg .pred %p<2>;
    .reg .b16 %rs<2>;
    .reg .b32 %r<2>;
    .reg .b64 %rd<4>;

    ld.param.u64 %rd1, [set_if_param_0];
    ld.param.u64 %rd2, [set_if_param_1];
    cvta.to.global.u64 %rd3, %rd2;
    ld.global.u8 %rs1, [%rd3];
    setp.ne.s16 %p1, %rs1, 0;
    selp.u32 %r1, 1, 0, %p1;
    {
    .param .b64 param0;
    st.param.b64 [param0+0], %rd1;
    .param .b32 param1;
    st.param.b32 [param1+0], %r1;
    call.uni cudaGraphSetConditional, (param0, param1);
    }
    ret;
}
\x00"""

_NODE_TYPE_CONDITIONAL = 13  # CU_GRAPH_NODE_TYPE_CONDITIONAL
_COND_TYPE_IF = 0  # CU_GRAPH_COND_TYPE_IF
_INSTANTIATE_AUTO_FREE_ON_LAUNCH = 1  # CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH
_INSTANTIATE_USE_NODE_PRIORITY = 8  # CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY
_COND_ASSIGN_DEFAULT = 1  # CU_GRAPH_COND_ASSIGN_DEFAULT: the default (0: skip) at every launch, then the kernel's value


class _KernelNodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint),
                ("blockDimZ", ctypes.c_uint), ("sharedMemBytes", ctypes.c_uint),
                ("kernelParams", ctypes.POINTER(ctypes.c_void_p)), ("extra", ctypes.POINTER(ctypes.c_void_p)),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class _ConditionalParams(ctypes.Structure):  # CUDA_CONDITIONAL_NODE_PARAMS
    _fields_ = [("handle", ctypes.c_uint64), ("type", ctypes.c_int), ("size", ctypes.c_uint),
                ("phGraph_out", ctypes.POINTER(ctypes.c_void_p)), ("ctx", ctypes.c_void_p)]


class _NodeUnion(ctypes.Union):
    _fields_ = [("reserved1", ctypes.c_longlong * 29), ("conditional", _ConditionalParams)]


class _NodeParams(ctypes.Structure):  # CUgraphNodeParams (256 bytes)
    _fields_ = [("type", ctypes.c_int), ("reserved0", ctypes.c_int * 3), ("u", _NodeUnion),
                ("reserved2", ctypes.c_longlong)]


class _Driver:
    """The few libcuda entry points used here, and the set-condition kernel loaded in the current context."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.set_if: dict = {}  # context -> the kernel loaded there

    def __call__(self, name: str, *args) -> None:
        res = getattr(self.lib, name)(*args)
        if res != 0:
            err = ctypes.c_char_p()
            self.lib.cuGetErrorName(res, ctypes.byref(err))
            raise RuntimeError(f"{name}: {err.value.decode() if err.value else res}")

    def kernel(self, ctx: ctypes.c_void_p) -> ctypes.c_void_p:
        if ctx.value not in self.set_if:
            module, func = ctypes.c_void_p(), ctypes.c_void_p()
            self("cuModuleLoadData", ctypes.byref(module), ctypes.c_char_p(_SET_PTX))
            self("cuModuleGetFunction", ctypes.byref(func), module, b"set_if")
            self.set_if[ctx.value] = func
        return self.set_if[ctx.value]


_DRIVER: _Driver | None = None


def _driver() -> _Driver:
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = _Driver()
    return _DRIVER


class GuardedGraph:
    """`graph` (a torch CUDAGraph captured with keep_graph=True) as the body of an IF node whose condition is the
    bool device scalar `flag`, read when the launch reaches the GPU. `launch()` queues it on the current stream."""

    def __init__(self, graph: torch.cuda.CUDAGraph, flag: torch.Tensor):
        if flag.dtype != torch.bool or flag.numel() != 1 or not flag.is_cuda:
            raise ValueError("GuardedGraph: flag must be a one-element bool CUDA tensor")
        d = _driver()
        self.body_source = graph  # its nodes are cloned into the body; its memory (the pool) must outlive ours
        self.flag = flag
        ctx = ctypes.c_void_p()
        d("cuCtxGetCurrent", ctypes.byref(ctx))
        outer, handle = ctypes.c_void_p(), ctypes.c_uint64()
        d("cuGraphCreate", ctypes.byref(outer), ctypes.c_uint(0))
        self._exec = ctypes.c_void_p()
        weakref.finalize(self, _destroy, d, outer, self._exec)
        d("cuGraphConditionalHandleCreate", ctypes.byref(handle), outer, ctx, ctypes.c_uint(0),
          ctypes.c_uint(_COND_ASSIGN_DEFAULT))
        # set_if(handle, flag): one thread (its argument values are captured with the graph)
        self._args = (ctypes.c_uint64(handle.value), ctypes.c_void_p(flag.data_ptr()))
        argv = (ctypes.c_void_p * 2)(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in self._args])
        kp = _KernelNodeParams(func=d.kernel(ctx), gridDimX=1, gridDimY=1, gridDimZ=1, blockDimX=1, blockDimY=1,
                               blockDimZ=1, sharedMemBytes=0, kernelParams=argv, extra=None, kern=None, ctx=None)
        setter = ctypes.c_void_p()
        d("cuGraphAddKernelNode_v2", ctypes.byref(setter), outer, None, ctypes.c_size_t(0), ctypes.byref(kp))
        params = _NodeParams(type=_NODE_TYPE_CONDITIONAL)
        params.u.conditional.handle = handle.value
        params.u.conditional.type = _COND_TYPE_IF
        params.u.conditional.size = 1
        params.u.conditional.ctx = ctx
        cond = ctypes.c_void_p()
        d("cuGraphAddNode_v2", ctypes.byref(cond), outer, ctypes.byref(setter), None, ctypes.c_size_t(1),
          ctypes.byref(params))
        body = ctypes.c_void_p(params.u.conditional.phGraph_out[0])
        child = ctypes.c_void_p()
        d("cuGraphAddChildGraphNode", ctypes.byref(child), body, None, ctypes.c_size_t(0),
          ctypes.c_void_p(graph.raw_cuda_graph()))
        # torch's own flags (CUDAGraph::instantiate): node priorities kept (the router chain's high-priority stream)
        d("cuGraphInstantiateWithFlags", ctypes.byref(self._exec), outer,
          ctypes.c_ulonglong(_INSTANTIATE_AUTO_FREE_ON_LAUNCH | _INSTANTIATE_USE_NODE_PRIORITY))

    def launch(self) -> None:
        _driver()("cuGraphLaunch", self._exec, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))


def _destroy(d: _Driver, graph: ctypes.c_void_p, exec_: ctypes.c_void_p) -> None:
    try:
        if exec_.value:
            d.lib.cuGraphExecDestroy(exec_)
        if graph.value:
            d.lib.cuGraphDestroy(graph)
    except Exception:  # at interpreter exit the driver may be gone already
        pass


_SUPPORT: dict = {}


def guard_support(device: torch.device) -> str | None:
    """None when guarded launches work on `device` (checked once: a small graph with a forked stream, launched with
    its flag true, false, true, and its result checked), else why not."""
    key = str(device)
    if key not in _SUPPORT:
        _SUPPORT[key] = _probe(device)
    return _SUPPORT[key]


def _probe(device: torch.device) -> str | None:
    if device.type != "cuda" or torch.version.hip is not None:
        return "not a CUDA device"
    try:
        with torch.cuda.device(device):
            x = torch.zeros(4, device=device)
            flag = torch.ones((), dtype=torch.bool, device=device)
            side = torch.cuda.Stream(device)
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(graph):
                x.add_(1.0)
                side.wait_stream(torch.cuda.current_stream(device))  # a forked stream, as the engine's router chain
                with torch.cuda.stream(side):
                    x.mul_(2.0)
                torch.cuda.current_stream(device).wait_stream(side)
            graph.instantiate()
            guarded = GuardedGraph(graph, flag)
            guarded.launch()
            flag.fill_(False)
            guarded.launch()
            flag.fill_(True)
            guarded.launch()
            graph.replay()  # the plain graph still runs as before
            torch.cuda.synchronize(device)
            got = x.tolist()
        return None if got == [14.0] * 4 else f"wrong result {got}"  # ((0+1)*2 skipped, (2+1)*2, (6+1)*2)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
