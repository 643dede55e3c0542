import pytest

from tests.e2e.engine import Engine

PUBLIC_SYSTEM = ("You are the help desk of the city library. Answer questions about opening "
                 "hours, loans, renewals, fines, events and the catalogue. Be brief and kind. "
                 "If you do not know, say so and suggest asking a librarian at the front desk.")

BASE_TOML = f"""
[kv]
num_blocks = 512
public_prefixes = [
  {{ name = "library", system_prompt = "{PUBLIC_SYSTEM}", tenants = ["acme", "globex"] }},
]
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


# -- the HTTP gateway (tests/e2e/test_gateway*.py, test_http_fuzz.py) -------------------
GATEWAY_KEY = "sk-test-acme-123"            # tenant "acme"
GATEWAY_MODEL = "SmolLM2-135M-Instruct"
GATEWAY_TOML = """
[kv]
num_blocks = 256
[engine]
max_model_len = 1024
[admission]
max_outstanding = 4
tenants = [{ name = "default" }, { name = "acme" }]
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_gateway(tmp_path_factory, gateway_options: str = "") -> Engine:
    """The engine with its gateway on a free port; ``GATEWAY_KEY`` is tenant acme's key.
    ``gateway_options``: extra ``[gateway]`` TOML lines."""
    import hashlib

    digest = hashlib.sha256(GATEWAY_KEY.encode()).hexdigest()
    return Engine(tmp_path_factory.mktemp("gw"), GATEWAY_TOML, http_port=free_port(),
                  gateway_extra=f'api_keys = [{{ sha256 = "{digest}", tenant = "acme" }}]\n'
                                + gateway_options)


@pytest.fixture(scope="module")
def gw(tmp_path_factory, model_path):
    """An engine with its gateway, one per test module that asks (a module may override
    it, e.g. with gateway options)."""
    eng = start_gateway(tmp_path_factory)
    yield eng
    eng.stop()


@pytest.fixture
def oai(gw):
    """The official `openai` client on ``gw``, as tenant acme, no retries."""
    import openai

    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key=GATEWAY_KEY, max_retries=0)
