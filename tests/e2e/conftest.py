import pytest

from tests.e2e.engine import Engine

BASE_TOML = """
[kv]
num_blocks = 512
[engine]
max_model_len = 1024
[scheduler]
max_num_batched_tokens = 256
[admission]
tenants = [{ name = "default" }, { name = "acme" }, { name = "globex" }]
"""


@pytest.fixture(scope="session")
def engine(tmp_path_factory, model_path):
    eng = Engine(tmp_path_factory.mktemp("engine"), BASE_TOML)
    yield eng
    eng.stop()
