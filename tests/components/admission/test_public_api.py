"""Who drives the admission policy (its service, the replay simulator, these tests) reads it
and its parts through public names only: no ``policy._x``, ``policy.ledger._x`` and the
like, found by walking each file's syntax tree."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DRIVERS = [ROOT / "components/admission/service.py", ROOT / "weir/replay/sim.py",
           *sorted((ROOT / "tests/components/admission").glob("*.py"))]
# the names a policy is reached by in those files
POLICY_NAMES = {"policy", "p", "fresh", "who", "pol"}


def private_reads(source: str) -> list[str]:
    """``a.b._c`` chains rooted at a policy's name (or ``self.policy``) that read a name
    starting with one underscore."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            continue
        chain, base = [node.attr], node.value
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        names = chain[1:] + ([base.id] if isinstance(base, ast.Name) else [])
        if POLICY_NAMES & set(names):
            found.append(".".join(reversed(chain + ([base.id] if isinstance(base, ast.Name)
                                                    else []))))
    return found


def test_the_walk_finds_a_private_read():
    assert sorted(private_reads("x = self.policy._buckets.get(t)\ny = p.ledger._entries\n"
                                "z = policy.ledger.entry(r)\nw = svc._admit\n")) == \
        ["p.ledger._entries", "self.policy._buckets"]


def test_the_policys_drivers_use_public_names_only():
    assert len(DRIVERS) > 10
    bad = {str(path.relative_to(ROOT)): reads for path in DRIVERS
           if path.name != "test_public_api.py"
           and (reads := private_reads(path.read_text()))}
    assert bad == {}
