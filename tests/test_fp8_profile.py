"""bench/fp8_profile.py's kernel classes: library GEMMs by the aten op that launched them, Triton kernels by name."""

from __future__ import annotations

from types import SimpleNamespace

from bench.fp8_profile import classify, kernel_owners

CUTLASS = "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<...>>(...)"


def test_a_library_gemm_is_classed_by_its_launching_op():
    events = [SimpleNamespace(name="aten::_scaled_grouped_mm", kernels=[SimpleNamespace(name=CUTLASS + "g")]),
              SimpleNamespace(name="aten::_scaled_mm", kernels=[SimpleNamespace(name=CUTLASS)]),
              SimpleNamespace(name="aten::copy_", kernels=[SimpleNamespace(name="elementwise_copy")])]
    owners = kernel_owners(events)
    assert classify(CUTLASS + "g", owners) == "expert_gemm"
    assert classify(CUTLASS, owners) == "linear"
    assert classify("elementwise_copy", owners) == "glue"


def test_triton_kernels_are_classed_by_name():
    want = {"_fp8_gmm_kernel": "expert_gemm", "_fp8_linear_kernel": "linear", "_flash_kernel": "attention",
            "_quantize_rows_kernel": "quant_norm", "_gelu_mul_quant_kernel": "quant_norm",
            "_layer_finish_moe_kernel": "quant_norm", "_route_kernel": "routing", "_moe_plan_kernel": "routing",
            "_router_gemm_kernel": "routing", "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT": "linear",
            "index_elementwise_kernel": "glue"}
    for name, cls in want.items():
        assert classify(name, {}) == cls, name
