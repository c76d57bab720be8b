"""Decode-step attribution: kernels binned by component, the head after the final norm, gaps."""

from __future__ import annotations

from deltaserve.bench.attribution import attribute, component_of


def test_components_by_kernel_name() -> None:
    assert component_of("_delta_kernel") == "gdn" and component_of("_out_kernel") == "gdn"
    assert component_of("_paged_kernel") == "attention"
    assert component_of("_add_rms_kernel") == "norm"
    assert component_of("_silu_mul_kernel") == "mlp_act"
    assert component_of("void gemv2T_kernel_val<int, int, __nv_bfloat16>") == "gemv"
    assert component_of("_gemv_kernel") == "gemv"
    assert component_of("indexSelectSmallIndex") == "other"


def test_head_is_what_follows_the_final_norm_and_gaps_are_the_rest() -> None:
    kernels = [  # (name, start us, duration us), deliberately out of order
        ("_add_rms_kernel", 10.0, 1.0),
        ("gemv2T_kernel", 0.0, 3.0),
        ("_delta_kernel", 5.0, 2.0),
        ("gemv2T_kernel", 12.0, 50.0),  # after the final norm: the head
        ("argmax", 70.0, 1.5),
    ]
    got = attribute(kernels, wall_us=80.0)
    assert got["gemv_us"] == 3.0 and got["gdn_us"] == 2.0 and got["norm_us"] == 1.0
    assert got["head_us"] == 51.5 and got["head_kernels"] == 2
    assert got["busy_us"] == 57.5 and got["gaps_us"] == 22.5 and got["kernels"] == 5
