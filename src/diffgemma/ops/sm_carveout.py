"""cuBLAS GEMMs that leave some SMs free, so a small kernel chain on another stream can run beside them.

At the denoise shape (256 rows) cuBLAS tiles the dense MLP's GEMMs into about one thread block per SM, each SM full.
A kernel launched beside them on another stream (the router chain: its f32 GEMM runs on 4 thread blocks) takes a
few SMs first and pushes the GEMM's last blocks into a second wave, so the two run one after the other. With the
GEMM told to target all SMs but a few (cuBLASLt's SM count target, which torch sets from its experimental SM
carveout), both fit at once: bench/RESULTS.md round 16 has the numbers.

  cublas_sm_carveout(sms)   a context: GEMMs called in it go through cuBLASLt and target all SMs but `sms`
                            (None: no change). The choice is made on the host when the GEMM is called, so a
                            CUDA graph captured in the block keeps it.
"""

from __future__ import annotations

import contextlib
import os

import torch

_warned = False  # torch prints its "experimental" notice once a process; the first call silences it


def _set_carveout(sms):
    global _warned
    if sms is None or _warned:
        torch._C._set_sm_carveout_experimental(sms)
        return
    # torch writes a one-time C++ notice to stderr that the knob is experimental; this module is its one user
    # and falls back to plain cuBLAS if the knob goes away, so the notice would only alarm users
    _warned = True
    try:
        import sys

        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        torch._C._set_sm_carveout_experimental(sms)
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            torch._C._set_sm_carveout_experimental(sms)
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def available() -> bool:
    return (torch.cuda.is_available() and hasattr(torch._C, "_set_sm_carveout_experimental")
            and torch.backends.cuda.is_built())


@contextlib.contextmanager
def cublas_sm_carveout(sms: int | None):
    if sms is None or not available():
        yield
        return
    old_sms = torch._C._get_sm_carveout_experimental()
    old_lib = torch.backends.cuda.preferred_blas_library()
    try:
        _set_carveout(sms)
        torch.backends.cuda.preferred_blas_library("cublaslt")
        changed = True
    except (RuntimeError, AttributeError):  # a build without cuBLASLt: plain cuBLAS on every SM
        torch._C._set_sm_carveout_experimental(old_sms)
        changed = False
    try:
        yield
    finally:
        if changed:
            torch._C._set_sm_carveout_experimental(old_sms)
            torch.backends.cuda.preferred_blas_library(old_lib)
