"""The one rule for a request's class and TTFT deadline (schemas/resolve.py): the class
granted or why not, the label counted before admission names it, and the deadline, exact."""
import pytest

from schemas.config import AdmissionConfig, ServiceClass, TenantConfig
from schemas.resolve import Resolved, resolve, ttft_deadline_ms

INTERACTIVE = ServiceClass("interactive", priority=0, ttft_slo_ms=250.0)
BATCH = ServiceClass("batch", priority=1)
GOLD = ServiceClass("gold", priority=0, ttft_slo_ms=100.0)
ADM = AdmissionConfig(classes=(INTERACTIVE, BATCH, GOLD),
                      tenants=(TenantConfig("a"), TenantConfig("b", default_class="batch"),
                               TenantConfig("c", classes=("batch",))))


@pytest.mark.parametrize("tenant,asked,granted,label", [
    ("a", None, INTERACTIVE, "interactive"),          # the config's first class
    ("b", None, BATCH, "batch"),                      # its default_class
    ("c", None, BATCH, "batch"),                      # its first class
    ("a", "interactive", INTERACTIVE, "interactive"),
    ("a", "batch", BATCH, "batch"),                   # a lower class
    ("a", "gold", GOLD, "gold"),                      # the same priority is not above it
    ("c", "batch", BATCH, "batch"),
])
def test_the_class_granted(tenant, asked, granted, label):
    r = resolve(ADM, tenant, asked, None)
    assert (r.granted, r.refusal, r.message, r.label) == (granted, "", "", label)
    assert r.tenant is ADM.tenant(tenant)


def test_a_class_above_the_tenants_default_or_not_its_own_is_refused():
    assert resolve(ADM, "b", "interactive", None) == Resolved(
        ADM.tenant("b"), None, "class_not_allowed",
        "class 'interactive' is above the tenant's class 'batch'; a client may ask only "
        "for a lower class", "interactive", 250.0)
    assert resolve(ADM, "c", "interactive", None) == Resolved(
        ADM.tenant("c"), None, "class_not_allowed",
        "tenant 'c' may not use class 'interactive' (allowed: batch)", "interactive", 250.0)
    # a name nobody configured is refused and never a label: the tenant's default is
    assert resolve(ADM, "b", "platinum", None) == Resolved(
        ADM.tenant("b"), None, "class_not_allowed",
        "tenant 'b' may not use class 'platinum' (allowed: batch, interactive, gold)",
        "batch", None)


def test_an_unknown_tenant_is_refused_and_labelled_only_by_a_configured_class():
    assert resolve(ADM, "stranger", "gold", None) == Resolved(
        None, None, "unknown_tenant", "unknown tenant 'stranger'", "gold", 100.0)
    assert resolve(ADM, "stranger", "platinum", None).label == ""
    assert resolve(ADM, "stranger", None, 40).deadline_ms == 40


def test_the_deadline_is_the_requests_own_else_its_classs_ttft_slo():
    assert resolve(ADM, "a", None, None).deadline_ms == 250.0
    assert resolve(ADM, "a", None, 900).deadline_ms == 900      # its own, looser or not
    assert resolve(ADM, "a", None, 0).deadline_ms == 0          # 0 is a deadline
    assert resolve(ADM, "a", "gold", None).deadline_ms == 100.0
    assert resolve(ADM, "a", "batch", None).deadline_ms is None  # no SLO, none asked
    assert ttft_deadline_ms(None, None) is None
    assert ttft_deadline_ms(None, INTERACTIVE) == 250.0
    assert ttft_deadline_ms(12, BATCH) == 12


def test_a_config_with_no_classes_runs_one_default_class_without_a_deadline():
    adm = AdmissionConfig(classes=())
    r = resolve(adm, "default", None, None)
    assert (r.granted.name, r.label, r.deadline_ms) == ("default", "default", None)


def test_the_tenant_and_class_tables_are_indexed_once_per_config():
    assert ADM.tenant("b") is ADM.tenants[1]
    assert ADM.tenant("nobody") is None
    assert ADM.tenants_by_name is ADM.tenants_by_name
    assert ADM.service_classes() is ADM.service_classes()
    assert list(ADM.service_classes()) == ["interactive", "batch", "gold"]
