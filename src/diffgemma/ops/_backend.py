"""Which implementation of an op runs: the Triton kernel on CUDA, the torch reference elsewhere.

Every op file exposes `<op>_ref` (plain torch, obviously correct), `<op>_triton` (the kernel) and
`<op>` (the dispatcher). The dispatcher picks the kernel only for CUDA tensors with Triton
importable, so the CPU engine path (parity tests, f32) always runs the reference twin. Setting
DIFFGEMMA_NO_TRITON=1 forces the torch path on CUDA too (for A/B and for bisecting a bad kernel).
"""

from __future__ import annotations

import os

import torch

try:  # Triton is optional at run time: without it every op falls back to its reference.
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    triton = None
    tl = None
    HAVE_TRITON = False


try:  # host-side tensor descriptors (Triton >= 3.3); without them the kernels read through pointers
    from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401

    HAVE_TENSOR_DESCRIPTOR = HAVE_TRITON
except Exception:  # pragma: no cover - depends on the install
    TensorDescriptor = None
    HAVE_TENSOR_DESCRIPTOR = False


def tma_available(t: torch.Tensor) -> bool:
    """Whether a kernel can read through tensor descriptors (TMA): a CUDA device of compute capability 9.0+."""
    return HAVE_TENSOR_DESCRIPTOR and t.is_cuda and torch.cuda.get_device_capability(t.device) >= (9, 0)


def interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter (TRITON_INTERPRET=1: the tests), which has no inline PTX
    and no bf16 tensor-core products."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(t: torch.Tensor) -> bool:
    return HAVE_TRITON and t.is_cuda and os.environ.get("DIFFGEMMA_NO_TRITON", "0") != "1"


def env_choice(name: str, choices: tuple) -> str:
    """The value of environment variable `name`, one of `choices` (unset: the first); anything else is refused."""
    value = os.environ.get(name, choices[0])
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected " + " or ".join(repr(c) for c in choices))
    return value


def next_pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()
