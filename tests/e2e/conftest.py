import pytest

from tests.e2e.engine import Engine

PUBLIC_SYSTEM = ("You are the help desk of the city library. Answer questions about opening "
                 "hours, loans, renewals, fines, events and the catalogue. Be brief and kind. "
                 "If you do not know, say so and suggest asking a librarian at the front desk.")

BASE_TOML = f"""
[kv]
num_blocks = 512
public_prefixes = [{{ name = "library", system_prompt = "{PUBLIC_SYSTEM}", tenants = ["acme", "globex"] }}]
[engine]
max_model_len = 1024
[scheduler]
max_num_batched_tokens = 256
[admission]
tenants = [{{ name = "default" }}, {{ name = "acme" }}, {{ name = "globex" }}]
"""


@pytest.fixture(scope="session")
def engine(tmp_path_factory, model_path):
    eng = Engine(tmp_path_factory.mktemp("engine"), BASE_TOML)
    yield eng
    eng.stop()
