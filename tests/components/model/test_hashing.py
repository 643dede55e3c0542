"""Block hashes: full blocks only, chained, scoped, stable across processes."""
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from components.model.hashing import block_hashes, chain_hash

ROOT = Path(__file__).resolve().parents[3]
TOKENS = list(range(100, 110))
GOLDEN = [7412235147205187503, 7472708946102262073]


def test_full_blocks_only():
    assert len(block_hashes(TOKENS, 4, "s", "m")) == 2
    assert len(block_hashes(TOKENS[:8], 4, "s", "m")) == 2
    assert len(block_hashes(TOKENS[:7], 4, "s", "m")) == 1
    assert block_hashes(TOKENS[:3], 4, "s", "m") == []
    assert block_hashes([], 4, "s", "m") == []
    assert len(block_hashes(TOKENS, 1, "s", "m")) == 10


def test_hashes_are_unsigned_64_bit_and_distinct():
    hashes = block_hashes(list(range(4096)), 16, "s", "m")
    assert all(0 <= h < 2**64 for h in hashes)
    assert len(set(hashes)) == len(hashes)


def test_trailing_partial_block_does_not_change_full_block_hashes():
    assert block_hashes(TOKENS[:8], 4, "s", "m") == block_hashes(TOKENS, 4, "s", "m")


def test_chaining_change_in_block_zero_changes_every_later_hash():
    base = block_hashes(TOKENS * 3, 5, "s", "m")
    changed = list(TOKENS * 3)
    changed[0] += 1
    other = block_hashes(changed, 5, "s", "m")
    assert all(a != b for a, b in zip(base, other))


def test_change_in_later_block_keeps_earlier_hashes():
    changed = list(TOKENS)
    changed[5] += 1
    a, b = block_hashes(TOKENS, 4, "s", "m"), block_hashes(changed, 4, "s", "m")
    assert a[0] == b[0] and a[1] != b[1]


def test_same_block_at_different_positions_hashes_differently():
    hashes = block_hashes([7, 7, 7, 7] * 3, 4, "s", "m")
    assert len(set(hashes)) == 3


def test_scope_and_model_separate_every_block():
    base = block_hashes(TOKENS, 2, "tenant-a", "model-x")
    for other in (block_hashes(TOKENS, 2, "tenant-b", "model-x"),
                  block_hashes(TOKENS, 2, "tenant-a", "model-y")):
        assert all(a != b for a, b in zip(base, other))


def test_scope_and_model_are_not_interchangeable():
    assert block_hashes(TOKENS, 2, "a", "b") != block_hashes(TOKENS, 2, "b", "a")
    assert block_hashes(TOKENS, 2, "", "ab") != block_hashes(TOKENS, 2, "a", "b")


def test_block_size_splits_matter():
    assert block_hashes(TOKENS[:8], 4, "s", "m")[-1] != block_hashes(TOKENS[:8], 8, "s", "m")[-1]


def test_parent_extends_a_chain():
    whole = block_hashes(TOKENS[:8], 2, "s", "m")
    assert block_hashes(TOKENS[4:8], 2, "s", "m", parent=whole[1]) == whole[2:]
    assert chain_hash(whole[0], TOKENS[2:4], "s", "m") == whole[1]


def test_token_sequence_types_do_not_matter():
    assert block_hashes(tuple(TOKENS), 4, "s", "m") == block_hashes(TOKENS, 4, "s", "m")


def test_pinned_values():
    assert block_hashes(list(range(10)), 4, "tenant-a", "smollm2-135m") == GOLDEN


def test_same_in_fresh_process_with_random_hash_seed():
    code = ("from components.model.hashing import block_hashes;"
            "print(block_hashes(list(range(10)), 4, 'tenant-a', 'smollm2-135m'))")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, cwd=ROOT,
                             env={"PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)})
        assert out.stdout.strip() == str(GOLDEN)


def test_rejects_bad_block_size():
    with pytest.raises(ValueError):
        block_hashes(TOKENS, 0, "s", "m")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**17), max_size=40), st.integers(1, 8))
def test_prefix_property(tokens, block_size):
    full = block_hashes(tokens, block_size, "s", "m")
    assert len(full) == len(tokens) // block_size
    for n in range(len(tokens) + 1):
        assert block_hashes(tokens[:n], block_size, "s", "m") == full[:n // block_size]
