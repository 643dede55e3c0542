"""CUDA-only checks (skipped cleanly on the CPU): the Triton kernels (fp32 and bf16) and the
flash-attn adapter against the torch reference, and CUDA-graph replay against eager logits for
every batch bucket. They reuse scripts/gpu/check.py's check functions, which that script runs
at full size."""
import os

import pytest
import torch

from scripts.gpu import check as gpu_check

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="TRITON_INTERPRET=1 in this process: kernels are interpreted"),
]


def _passes(run) -> None:
    report = gpu_check.Report()
    run(report)
    assert report.passed > 0 and not report.failures, report.failures


def test_triton_matches_reference_on_cuda():
    _passes(lambda r: gpu_check.check_triton(r, "cuda", [torch.float32, torch.bfloat16]))


def test_flash_attn_matches_reference_on_cuda():
    pytest.importorskip("flash_attn")
    _passes(lambda r: gpu_check.check_flash_attn(r, "cuda"))


def test_auto_backend_on_cuda_falls_back_from_flash_attn():
    from kernels import get_backend
    assert get_backend("auto", "cuda", block_size=16, dtype=torch.bfloat16).name == "triton"
    assert get_backend("auto", "cuda", block_size=256, dtype=torch.float32).name == "triton"


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-3), (torch.bfloat16, 5e-2)])
def test_graph_replay_matches_eager_for_every_bucket(dtype, tol):
    from components.executor.build import build_model
    from components.executor.cuda_graphs import batch_buckets
    from components.executor.synthetic import SMOLLM2_135M, random_weights
    shape = SMOLLM2_135M.scaled(num_layers=4)
    model = build_model(shape, random_weights(shape, dtype, "cuda"), dtype=dtype, device="cuda",
                        backend="triton")
    report = gpu_check.Report()
    _, _, info = gpu_check.check_graphs(report, f"4-layer {dtype}", model, max_len=512,
                                        max_batch=64, block_size=16, tol=tol,
                                        partials=(3, 13, 50))
    assert not report.failures, report.failures
    assert info["buckets"] == batch_buckets(64) and info["seconds"] > 0


def test_graph_replay_with_flash_attn():
    pytest.importorskip("flash_attn")
    from components.executor.build import build_model
    from components.executor.synthetic import SMOLLM2_135M, random_weights
    from kernels.flash_attn_backend import FlashAttnBackend
    shape = SMOLLM2_135M.scaled(num_layers=4)
    backend = FlashAttnBackend(block_size=256, dtype=torch.bfloat16, device="cuda")
    model = build_model(shape, random_weights(shape, torch.bfloat16, "cuda"),
                        dtype=torch.bfloat16, device="cuda", backend=backend)
    report = gpu_check.Report()
    gpu_check.check_graphs(report, "flash-attn", model, max_len=1024, max_batch=16,
                           block_size=256, tol=5e-2, partials=(3, 13))
    assert report.passed > 0 and not report.failures, report.failures
