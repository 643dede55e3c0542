"""Identity on the ZeroMQ endpoint: keys name the tenant, the service key may speak for
any tenant, status shows a tenant only its own usage."""
from bus.identity import Identity, Keyring, Refusal, digest, visible_status
from schemas.client import ComponentStatus, TenantUsage
from schemas.config import ApiKey

KEYS = (ApiKey(digest("acme-secret"), "acme"), ApiKey(digest("ops-secret"), "ops", "operator"))


def test_open_endpoint_takes_the_claimed_tenant():
    ring = Keyring((), service_key="")
    assert ring.identify(None, "acme") == Identity("acme", "open")


def test_with_keys_a_missing_or_wrong_key_is_refused():
    ring = Keyring(KEYS, service_key="")
    assert isinstance(ring.identify(None, "default"), Refusal)
    assert isinstance(ring.identify("guess", "default"), Refusal)


def test_a_key_names_its_tenant_and_cannot_claim_another():
    ring = Keyring(KEYS, service_key="")
    assert ring.identify("acme-secret", "default") == Identity("acme", "tenant")
    assert ring.identify("acme-secret", "acme") == Identity("acme", "tenant")
    refused = ring.identify("acme-secret", "globex")
    assert isinstance(refused, Refusal) and "globex" in refused.message


def test_the_service_key_speaks_for_the_tenant_it_names():
    ring = Keyring(KEYS, service_key="gw-secret")
    assert ring.identify("gw-secret", "globex") == Identity("globex", "service")
    assert ring.identify("gw-secret", "globex").sees_all


def test_operators_see_all_tenants_see_their_own():
    ring = Keyring(KEYS, service_key="")
    assert ring.identify("ops-secret", "default").sees_all
    assert not ring.identify("acme-secret", "default").sees_all
    status = ComponentStatus("scheduler", 1, True, "ready", 0, 0.0, {"running": 3.0},
                             {"acme": TenantUsage(5, 7, 4), "globex": TenantUsage(1, 9, 9)})
    acme = visible_status(status, "acme")
    assert acme.stats == {"running": 3.0} and acme.tenants == {"acme": TenantUsage(5, 7, 4)}
    assert visible_status(status, "").tenants == {}


def test_the_service_key_comes_from_the_environment_or_a_file(tmp_path, monkeypatch):
    from bus.identity import generate_service_key, load_service_key

    monkeypatch.delenv("WEIR_SERVICE_KEY", raising=False)
    monkeypatch.delenv("WEIR_SERVICE_KEY_FILE", raising=False)
    assert load_service_key() is None
    path = tmp_path / "service.key"
    generate_service_key(path)
    first = path.read_text()
    generate_service_key(path)                       # kept, not replaced
    assert path.read_text() == first and oct(path.stat().st_mode & 0o777) == "0o600"
    monkeypatch.setenv("WEIR_SERVICE_KEY_FILE", str(path))
    assert load_service_key() == first.strip()
    monkeypatch.setenv("WEIR_SERVICE_KEY", "from-env")
    assert load_service_key() == "from-env"
