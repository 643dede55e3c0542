import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def model_path() -> Path:
    from components.model.fetch import default_model_path

    return default_model_path()


@pytest.fixture
def anyio_backend():
    return "asyncio"


# What is marked slow (`./scripts/test --fast` and `-m "not slow"` leave it out), by rule:
# every test in tests/e2e (it starts the whole engine), every test that asks for the `hf`
# fixture (it loads the Hugging Face reference model), and these, which take many seconds per
# test on 2 cores. A key is a test file or one test's node id; one that names no file fails
# the collection, so the list cannot rot.
SLOW = {
    "tests/kernels/test_triton.py": "the Triton kernels under the interpreter",
    "tests/components/executor/test_cuda_graphs.py":
        "a model's static-buffer decode, its Triton kernels under the interpreter",
    "tests/components/executor/test_piecewise_graphs.py":
        "a model's piecewise prefill and mixed steps, its Triton kernels under the interpreter",
    "tests/kernels/test_gpu_check.py::test_cpu_dry_run":
        "the whole GPU check on the CPU, Triton under the interpreter",
    "tests/kernels/test_cpu_native.py::test_portable_kernel_matches_reference":
        "builds the native kernels for each other CPU level",
    "tests/weir/replay/test_fairness_sim.py": "simulates traces of up to 10,000 requests",
    "tests/weir/replay/test_policies.py": "simulates 1,000 Mooncake requests under two policies",
}


def is_slow(nodeid: str, fixturenames) -> bool:
    return (nodeid.startswith("tests/e2e/") or "hf" in fixturenames
            or any(nodeid == key or nodeid.startswith(key + ("::" if "::" not in key else "["))
                   for key in SLOW))


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    missing = [key for key in SLOW if not (ROOT / key.split("::")[0]).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py SLOW names no such file: {missing}")
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip)
        if is_slow(item.nodeid, getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def hf(model_path):
    """Hugging Face transformers on the same GGUF, float32: ``(tokenizer, model)``. Loaded
    once for the whole session (~30 s on 2 cores: transformers' GGUF path), shared by the
    executor's equivalence tests and the end-to-end greedy tests."""
    from tests.e2e.hf import load_hf

    return load_hf(model_path)
