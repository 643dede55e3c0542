"""Configuration: TOML loading, overrides, validation with clear errors, frozen
structs and derived socket addresses."""
from __future__ import annotations

import pytest

from schemas.config import (
    AdmissionConfig,
    ConfigError,
    EngineConfig,
    KvConfig,
    SchedulerConfig,
    TenantConfig,
    Topology,
    WeirConfig,
    load_config,
)

TOML = """
log_level = "debug"

[topology]
run_dir = "{run_dir}"

[engine]
model = "tiny"
max_model_len = 512
dtype = "bfloat16"

[kv]
block_size = 32
num_blocks = 64
grow_blocks = 3
enable_prefix_cache = false

[scheduler]
max_num_seqs = 8
max_num_batched_tokens = 64
lookahead_tokens = 2

[admission]
max_outstanding = 10

[[admission.tenants]]
name = "acme"
max_outstanding = 4

[[admission.tenants]]
name = "globex"
"""


def write(tmp_path, text: str, name="weir.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture
def cfg_path(tmp_path):
    return write(tmp_path, TOML.format(run_dir=tmp_path / "run"))


def test_load_from_toml(cfg_path, tmp_path):
    cfg = load_config(cfg_path)
    assert isinstance(cfg, WeirConfig)
    assert cfg.log_level == "debug"
    assert cfg.topology == Topology(run_dir=str(tmp_path / "run"))
    assert cfg.engine == EngineConfig(model="tiny", max_model_len=512, dtype="bfloat16")
    assert cfg.kv == KvConfig(block_size=32, num_blocks=64, grow_blocks=3,
                              enable_prefix_cache=False)
    assert cfg.scheduler == SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                            lookahead_tokens=2)
    assert cfg.admission == AdmissionConfig(
        max_outstanding=10, tenants=(TenantConfig("acme", 4), TenantConfig("globex", 256)))
    assert cfg.streamer.client_timeout_s == 2.0            # untouched sections keep defaults
    assert cfg.supervisor.restart == "on-failure"


def test_defaults_with_only_run_dir(tmp_path):
    cfg = load_config(topology={"run_dir": str(tmp_path)})
    assert cfg.kv == KvConfig() and cfg.engine == EngineConfig()
    assert cfg.admission.tenants == (TenantConfig("default", 256),)
    assert cfg.log_level == "info"


def test_overrides_win_over_file(cfg_path):
    cfg = load_config(cfg_path, engine={"dtype": "float32", "model": None},
                      kv={"num_blocks": 128}, log_level="warning", streamer=None)
    assert cfg.engine.dtype == "float32"
    assert cfg.engine.model == "tiny"                      # None means "not given"
    assert cfg.engine.max_model_len == 512                 # other file values kept
    assert cfg.kv.num_blocks == 128 and cfg.kv.block_size == 32
    assert cfg.log_level == "warning"


def test_override_creates_missing_section(tmp_path):
    path = write(tmp_path, f'[topology]\nrun_dir = "{tmp_path}"\n')
    cfg = load_config(path, scheduler={"max_num_seqs": 2, "max_num_batched_tokens": 32})
    assert cfg.scheduler == SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32)


@pytest.mark.parametrize("section, values, message", [
    ("kv", {"block_size": 3}, "kv.block_size"),
    ("kv", {"block_size": 384}, "kv.block_size"),
    ("kv", {"num_blocks": -1}, "kv.num_blocks must be >= 2"),
    ("kv", {"grow_blocks": 0}, "kv.grow_blocks must be >= 1"),
    ("scheduler", {"max_num_seqs": -4}, "scheduler.max_num_seqs must be >= 1"),
    ("scheduler", {"lookahead_tokens": 0}, "scheduler.lookahead_tokens must be >= 1"),
    ("scheduler", {"async_depth": -1}, r"scheduler.async_depth must be 0 \(auto\), 1 or 2"),
    ("scheduler", {"async_depth": 3}, r"scheduler.async_depth must be 0 \(auto\), 1 or 2"),
    ("scheduler", {"max_num_seqs": 64, "max_num_batched_tokens": 8},
     "scheduler.max_num_batched_tokens is too small"),
    ("engine", {"max_model_len": 8}, "engine.max_model_len must be >= 16"),
    ("engine", {"num_threads": -1}, "engine.num_threads must be >= 0"),
    ("engine", {"cuda_graph_token_buckets": [64, 32]}, "cuda_graph_token_buckets must ascend"),
    ("engine", {"cuda_graph_token_buckets": [0, 32]}, "cuda_graph_token_buckets must ascend"),
    ("engine", {"cuda_graph_token_buckets": [32, 32]}, "cuda_graph_token_buckets must ascend"),
    ("engine", {"max_model_len": 4096}, "exceeds the KV pool"),   # 64 blocks * 32
    ("engine", {"dtype": "float16"}, "dtype"),
    ("engine", {"colour": "blue"}, "colour"),
    ("kv", {"block_size": "big"}, "block_size"),
    ("kv", {"dtype": "int8"}, r"kv\.dtype"),
    ("admission", {"max_outstanding": 0}, "admission.max_outstanding must be >= 1"),
    ("admission", {"tenants": [{"name": "a"}, {"name": "a"}]}, "duplicate"),
    ("streamer", {"client_timeout_s": 0}, "streamer.client_timeout_s must be > 0"),
    ("gateway", {"first_byte_timeout_s": 0}, "gateway timeouts must be > 0"),
    ("gateway", {"keepalive_timeout_s": -1}, "gateway timeouts must be > 0"),
    ("gateway", {"max_connections_per_peer": -1}, "gateway.max_connections_per_peer"),
    ("topology", {"base_port": 80}, "topology.base_port"),
    ("topology", {"hosts": {"gpu_box": "h1"}}, "unknown components"),
    ("topology", {"run_dir": ""}, "topology.run_dir is required"),
])
def test_invalid_values_raise_config_error(cfg_path, section, values, message):
    with pytest.raises(ConfigError, match=message):
        load_config(cfg_path, **{section: values})


def test_unknown_section_and_top_level_field(cfg_path, tmp_path):
    with pytest.raises(ConfigError, match="cache"):
        load_config(cfg_path, cache={"size": 1})
    path = write(tmp_path, TOML.format(run_dir=tmp_path) + "\n[kv2]\nx = 1\n", "bad.toml")
    with pytest.raises(ConfigError, match="kv2"):
        load_config(path)


def test_unknown_field_in_toml(tmp_path):
    text = TOML.format(run_dir=tmp_path).replace("grow_blocks = 3", "grow_blocks = 3\nfoo = 1")
    with pytest.raises(ConfigError, match="foo"):
        load_config(write(tmp_path, text))


def test_unreadable_or_invalid_toml(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(write(tmp_path, "[kv\nblock_size = 8"))


def test_direct_construction_validates():
    with pytest.raises(ConfigError, match="kv.block_size"):
        KvConfig(block_size=3)
    with pytest.raises(ConfigError, match="exceeds the KV pool"):
        WeirConfig(topology=Topology(run_dir="/tmp/w"), engine=EngineConfig(max_model_len=64),
                   kv=KvConfig(block_size=8, num_blocks=7))
    # exactly the pool size is fine
    cfg = WeirConfig(topology=Topology(run_dir="/tmp/w"), engine=EngineConfig(max_model_len=64),
                     kv=KvConfig(block_size=8, num_blocks=8))
    assert cfg.engine.max_model_len == 64
    assert issubclass(ConfigError, ValueError)


def test_frozen(cfg_path):
    cfg = load_config(cfg_path)
    with pytest.raises(AttributeError):
        cfg.kv.block_size = 8
    with pytest.raises(AttributeError):
        cfg.log_level = "error"
    with pytest.raises(AttributeError):
        cfg.topology.run_dir = "/elsewhere"
    assert cfg.kv.block_size == 32


def test_ipc_addresses(tmp_path):
    topo = load_config(topology={"run_dir": str(tmp_path)}).topology
    assert topo.inbox("scheduler") == f"ipc://{tmp_path}/scheduler.sock"
    assert topo.inbox("scheduler", bind=True) == f"ipc://{tmp_path}/scheduler.sock"
    assert topo.inbox("kv_manager") == f"ipc://{tmp_path}/kv_manager.sock"
    assert topo.heartbeats() == f"ipc://{tmp_path}/supervisor.sock"
    assert topo.control(bind=True) == f"ipc://{tmp_path}/control.sock"
    assert topo.client_endpoint == "tcp://127.0.0.1:7450"


def test_tcp_addresses():
    topo = load_config(topology={"transport": "tcp", "base_port": 9000, "bind_host": "0.0.0.0",
                                 "hosts": {"executor": "gpu1", "scheduler": "cpu1"},
                                 "supervisor_host": "ctl"}).topology
    # component i listens on base_port + i (tokenizer 0 .. streamer 6)
    assert topo.inbox("tokenizer", bind=True) == "tcp://0.0.0.0:9000"
    assert topo.inbox("scheduler", bind=True) == "tcp://0.0.0.0:9002"
    assert topo.inbox("executor", bind=True) == "tcp://0.0.0.0:9004"
    assert topo.inbox("streamer", bind=True) == "tcp://0.0.0.0:9006"
    # peers connect to the component's host, localhost when not listed
    assert topo.inbox("executor") == "tcp://gpu1:9004"
    assert topo.inbox("scheduler") == "tcp://cpu1:9002"
    assert topo.inbox("kv_manager") == "tcp://127.0.0.1:9003"
    # the supervisor's two sockets follow the components
    assert topo.heartbeats(bind=True) == "tcp://0.0.0.0:9007"
    assert topo.heartbeats() == "tcp://ctl:9007"
    assert topo.control(bind=True) == "tcp://0.0.0.0:9008"
    assert topo.control() == "tcp://ctl:9008"


def test_tcp_needs_no_run_dir_and_all_addresses_distinct():
    topo = Topology(transport="tcp")
    addrs = [topo.inbox(c, bind=True) for c in ("tokenizer", "admission", "scheduler",
                                                 "kv_manager", "executor", "detokenizer",
                                                 "streamer")]
    addrs += [topo.heartbeats(bind=True), topo.control(bind=True)]
    assert len(set(addrs)) == 9
    assert topo.inbox("admission") == "tcp://127.0.0.1:7461"


def test_supervisor_host_from_hosts_applies_to_both_supervisor_sockets():
    topo = Topology(transport="tcp", hosts={"supervisor": "box"})
    assert topo.heartbeats() == "tcp://box:7467"
    assert topo.control() == "tcp://box:7468"
