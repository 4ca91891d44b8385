"""The findings' GPU figures and rules on cases the real GPU traces lack (issue 57): a sync
inside a collective, a pageable copy a counted sync launched (beside ``.item()``'s, which the
real pair shows: ``test_findings_device``), and TF32 on for one kind of kernel and off for the
other. Hand-built Kineto traces, read by the node agent's own reader and summary, and
hand-built figures for the rule."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tests.test_device_summary import Trace, summary

SYNC = "cudaStreamSynchronize"
TO_HOST = "Memcpy DtoH (Device -> Pageable)"


@pytest.mark.parametrize("collective", ["c10d::allreduce_", "record_param_comms", "c10d::barrier"])
def test_a_sync_inside_a_collective_is_the_collectives_wait_not_host_syncs(
    tmp_path: Any, collective: str
) -> None:
    t = Trace()
    t.step(1, 0, 1000)
    t.x("cpu_op", collective, 100, 300)
    t.x("cuda_runtime", SYNC, 200, 180)  # the collective's wait: collective_wait's
    t.x("cpu_op", "aten::nonzero", 500, 200)
    t.x("cuda_runtime", SYNC, 550, 100)  # the host's own wait
    t.launch(510, "gemm", 520, 20)
    gpu = summary(tmp_path, t, steps=(1, 1)).gpu
    assert gpu is not None and (gpu.wait_us, gpu.syncs) == (100.0, 1)
    assert [c.name for c in gpu.causes] == ["aten::nonzero"]


def test_a_pageable_copy_a_counted_sync_launched_is_its_wait_not_memcpy_pageable(
    tmp_path: Any,
) -> None:
    t = Trace()
    t.step(1, 0, 1000)
    t.x("cpu_op", "aten::item", 100, 200)
    t.x("cpu_op", "aten::_local_scalar_dense", 110, 180)  # .item(): its 4 bytes back
    t.launch(120, TO_HOST, 150, 4, call="cudaMemcpyAsync", cat="gpu_memcpy")
    t.x("cuda_runtime", SYNC, 135, 150)  # under it: one sync
    t.x("cpu_op", "aten::to", 400, 100)
    t.launch(410, "Memcpy HtoD (Pageable -> Device)", 430, 20, call="cudaMemcpyAsync",
             cat="gpu_memcpy")  # fmt: skip
    t.launch(600, TO_HOST, 610, 80, call="cudaMemcpy", cat="gpu_memcpy", launch_dur=100)
    gpu = summary(tmp_path, t, steps=(1, 1)).gpu
    assert gpu is not None and (gpu.wait_us, gpu.syncs) == (180.0 + 100.0, 2)
    assert (gpu.pageable_us, gpu.pageable_copies) == (20.0, 1)  # aten::to's alone


def test_gpu_kernel_ns_splits_gemms_from_convolutions_and_leaves_out_synced_copies() -> None:
    from worker_ext.agent.device_summary import gpu_kernel_ns

    names = [
        "ampere_sgemm_128x64_nn",  # fp32 GEMM
        "void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_64x64_16x6_nn_align4>(...)",  # TF32
        "ampere_scudnn_128x64_relu_medium_nn_v1",  # fp32 convolution (cuDNN)
        "sm80_xmma_fprop_implicit_gemm_f32f32_f32f32_f32_nhwckrsc_nchw_tilesize128x128x16",
        "sm80_xmma_wgrad_implicit_gemm_indexed_tf32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize64",
        "void cutlass_cudnn_infer::Kernel<cutlass_tensorop_s1688dgrad_optimized_tf32_64x128>",
        TO_HOST,
    ]
    rows = {i: [1000 * (i + 1), i + 1, 0] for i in range(len(names))}
    synced = {6: [3000, 2, 0]}  # two of its 7 copies, launched by a counted sync
    assert gpu_kernel_ns(names, rows, synced) == (4000, 5, 1000, 2000, 3000 + 4000, 5000 + 6000)


def _window(**rows: dict[str, float]) -> SimpleNamespace:
    """Figures of ranks 0, 1, ... (``r0=...``), each a 100 ms step, as ``GpuWindow``."""
    gpu = {int(k[1:]): v for k, v in rows.items()}
    return SimpleNamespace(step_ms=dict.fromkeys(gpu, 100.0), median_step_ms=100.0, gpu=gpu)


TH = {"min_share": 0.02, "speedup": 2.0}
MATMUL, CUDNN = "torch.backends.cuda.matmul.allow_tf32", "torch.backends.cudnn.allow_tf32"
TF32_GEMMS_FP32_CONVS = {"fp32_gemm_us": 9e3, "tf32_gemm_us": 5e3, "fp32_conv_us": 8e3}
FP32_GEMMS_TF32_CONVS = {"fp32_gemm_us": 6e3, "fp32_conv_us": 9e3, "tf32_conv_us": 4e3}


def test_tf32_off_names_cudnn_alone_on_a_rank_with_tf32_gemms_and_fp32_convolutions() -> None:
    from coordinator.core.findings_device import tf32_off

    got = tf32_off(_window(r0=TF32_GEMMS_FP32_CONVS), TH)  # type: ignore[arg-type]
    assert got is not None
    costs, more, advice = got
    assert costs == {0: pytest.approx(4.0)}  # 8 ms of fp32 convolutions, half saved
    assert more["fp32_conv_ms_per_step"] == {0: 8.0} and "fp32_gemm_ms_per_step" not in more
    assert more["switches_off"] == {CUDNN: 1}
    assert "cudnn.allow_tf32 = True" in advice and "matmul" not in advice
    assert "convolutions" in advice


def test_tf32_off_names_the_matmul_switch_alone_on_a_rank_with_tf32_convolutions() -> None:
    from coordinator.core.findings_device import tf32_off

    got = tf32_off(_window(r0=FP32_GEMMS_TF32_CONVS), TH)  # type: ignore[arg-type]
    assert got is not None
    costs, more, advice = got
    assert costs == {0: pytest.approx(3.0)}
    assert more["switches_off"] == {MATMUL: 1} and "fp32_conv_ms_per_step" not in more
    assert "matmul.allow_tf32 = True" in advice and "set_float32_matmul_precision" in advice
    assert "cudnn" not in advice


def test_tf32_off_judges_each_rank_and_kind_on_its_own() -> None:
    from coordinator.core.findings_device import tf32_off

    both_off = {"fp32_gemm_us": 6e3, "fp32_conv_us": 8e3}
    both_on = {"fp32_gemm_us": 9e3, "tf32_gemm_us": 1.0, "fp32_conv_us": 9e3, "tf32_conv_us": 1.0}
    under = {"fp32_gemm_us": 1e3, "fp32_conv_us": 1e3}  # 1% each: under 2%, not summed
    fig = _window(r0=TF32_GEMMS_FP32_CONVS, r1=FP32_GEMMS_TF32_CONVS, r2=both_off, r3=both_on,
                  r4=under)  # fmt: skip
    got = tf32_off(fig, TH)  # type: ignore[arg-type]
    assert got is not None
    costs, more, advice = got
    assert costs == pytest.approx({0: 4.0, 1: 3.0, 2: 7.0})
    assert more["fp32_gemm_ms_per_step"] == {0: 0.0, 1: 6.0, 2: 6.0}
    assert more["fp32_conv_ms_per_step"] == {0: 8.0, 1: 0.0, 2: 8.0}
    assert more["switches_off"] == {MATMUL: 2, CUDNN: 2}
    assert "matmuls and convolutions" in advice and MATMUL in advice and CUDNN in advice
    assert tf32_off(_window(r3=both_on, r4=under), TH) is None  # type: ignore[arg-type]


def test_tf32_off_takes_an_older_agents_row_without_convolutions_for_gemms() -> None:
    from coordinator.core.findings_device import tf32_off

    got = tf32_off(_window(r0={"fp32_gemm_us": 6e3, "tf32_gemm_us": 0.0}), TH)  # type: ignore[arg-type]
    assert got is not None and got[1]["switches_off"] == {MATMUL: 1}
