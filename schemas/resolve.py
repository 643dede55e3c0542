"""A request's class and time-to-first-token deadline: the one rule, pure.

Every process that needs to know what a request runs as asks here, with the config, the
tenant, the class the client asked for and the client's own TTFT deadline:

- **admission** grants the class (or refuses the request, with the reason) and takes the
  deadline as its starting point (``components/admission/policy.py`` then stretches a
  class's target for a prompt whose own prefill needs more than half of it);
- the **router** ranks replicas against the deadline (falling back to its own
  ``router.overload_ttft_s`` when there is none);
- the **streamer** counts a request under its class (``label``) before admission names
  it, and judges its first token against the deadline.

The rule:

- The granted class is the tenant's default (``AdmissionConfig.allowed_classes``: its
  ``default_class``, else its first class, else the config's first) when the client asks
  for none or for that one; a class the tenant may use and not above its default (a higher
  ``priority`` number is a lower class) when asked; otherwise none, refused
  ``class_not_allowed``. An unconfigured tenant gets none, refused ``unknown_tenant``.
- The ``label`` is the granted class's name; for a refused request, the class it asked
  for if that is a configured class, else its tenant's default, else "" (an unconfigured
  tenant asking for an unconfigured class): a name nobody configured never becomes a label.
- The TTFT deadline (milliseconds from arrival) is the client's own, else the labelled
  class's ``ttft_slo_ms``, else none.
"""
from __future__ import annotations

from dataclasses import dataclass

from schemas.config import AdmissionConfig, ServiceClass, TenantConfig


@dataclass(frozen=True, slots=True)
class Resolved:
    """What a request runs as. ``granted`` is None exactly when ``refusal`` is set."""

    tenant: TenantConfig | None      # None: the tenant is not configured
    granted: ServiceClass | None     # the class admission grants
    refusal: str                     # "", "unknown_tenant" or "class_not_allowed"
    message: str                     # the refusal's message ("" when granted)
    label: str                       # the class it is counted under (see the module doc)
    deadline_ms: float | None        # its TTFT deadline from arrival (see the module doc)


def deterministic(mode: str, asked: bool, cls: ServiceClass | None) -> bool | str:
    """Whether a request runs in the deterministic serving mode, under the engine's
    ``engine.deterministic`` ``mode``, having ``asked`` for it (``SamplingParams.
    deterministic``), in class ``cls`` (the one it is granted; None: refused): under "all"
    always; under "requested" when it asked or its class says so; under "off" never, and
    a request that asked is refused: the message, as a str."""
    if mode == "off":
        return ('this engine does not serve deterministic requests (engine.deterministic = '
                '"off")') if asked else False
    return mode == "all" or asked or (cls is not None and cls.deterministic)


def ttft_deadline_ms(own_ms: float | None, cls: ServiceClass | None) -> float | None:
    """The TTFT deadline from arrival: the client's own, else the class's ``ttft_slo_ms``
    (None without either)."""
    if own_ms is not None:
        return own_ms
    return cls.ttft_slo_ms if cls is not None else None


def resolve(adm: AdmissionConfig, tenant: str, asked: str | None,
            own_deadline_ms: float | None) -> Resolved:
    """The class and TTFT deadline of a request of ``tenant`` that asked for class
    ``asked`` (None: none) with its own TTFT deadline ``own_deadline_ms`` (None: none)."""
    classes = adm.service_classes()
    t = adm.tenant(tenant)
    if t is None:
        label = asked if asked is not None and asked in classes else ""
        return Resolved(None, None, "unknown_tenant", f"unknown tenant {tenant!r}", label,
                        ttft_deadline_ms(own_deadline_ms, classes.get(label)))
    allowed = adm.allowed_classes(t)
    default = classes[allowed[0]]
    why = ""
    if asked is None or asked == default.name:
        granted: ServiceClass | None = default
    elif asked not in allowed:
        granted = None
        why = f"tenant {t.name!r} may not use class {asked!r} (allowed: {', '.join(allowed)})"
    elif classes[asked].priority < default.priority:
        granted = None
        why = f"class {asked!r} is above the tenant's class {default.name!r}; a client " \
              f"may ask only for a lower class"
    else:
        granted = classes[asked]
    if granted is not None:
        return Resolved(t, granted, "", "", granted.name,
                        ttft_deadline_ms(own_deadline_ms, granted))
    label = asked if asked in classes else default.name
    return Resolved(t, None, "class_not_allowed", why, label,
                    ttft_deadline_ms(own_deadline_ms, classes[label]))
