import os
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


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def hf(model_path):
    """Hugging Face transformers on the same GGUF, float32: ``(tokenizer, model)``. Loaded
    once for the whole session (~30 s on 2 cores: transformers' GGUF path), shared by the
    executor's equivalence tests and the end-to-end greedy tests."""
    from tests.e2e.hf import load_hf

    return load_hf(model_path)
