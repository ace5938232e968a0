"""`SlotBook`: the slot cache's states and per-owner pins, without storage or threads."""

from __future__ import annotations

import random

import pytest

from moestream.common.policy import SlotPolicy
from moestream.decoder.experts.slot_book import OWNERS, SlotBook, SlotState


def book(n: int = 2) -> SlotBook:
    return SlotBook(SlotPolicy(n, decay=0.9))


def test_an_entry_goes_filling_then_ready_or_failed():
    b = book()
    e = b.claim("a", "fill")
    assert e.state is SlotState.FILLING and not e.ready and "a" in b
    assert b.ready("a") is e and e.ready
    assert b.ready("a") is None  # only a filling entry becomes ready
    assert b.fail("a") is e and e.state is SlotState.FAILED and "a" not in b and b.pinned == 0
    assert b.fail("a") is None and b.ready("a") is None
    f = b.claim("b", "layer")
    assert b.fail("b") is f and b.ready("b") is None  # failed while filling: never ready
    b.check()


def test_pins_are_counted_per_owner_and_an_owner_drops_only_its_own():
    b = book()
    b.claim("a", "fill")
    b.pin("a", "hold")
    b.pin("a", "layer")
    b.pin("a", "layer")
    assert dict(b.get("a").pins) == {"fill": 1, "hold": 1, "layer": 2} and b.policy.pin_count("a") == 4
    b.unpin("a", "layer")
    b.unpin("a", "fill")
    with pytest.raises(ValueError, match="no 'fill' pin"):
        b.unpin("a", "fill")  # one too many: the hold and the layer's pin stay
    assert b.policy.pin_count("a") == 2
    b.unpin("a", "hold")
    b.unpin("a", "layer")
    assert b.pinned == 0 and b.policy.pin_count("a") == 0
    b.check()
    with pytest.raises(ValueError, match="owner"):
        b.pin("a", "someone")
    b.fail("a")
    b.unpin("a", "layer")  # a dropped key's pins went with it


def test_pinned_entries_are_never_evicted_and_a_full_book_says_so():
    b = book(2)
    b.claim("a", "fill")
    b.claim("b", "layer")
    assert b.claim("c", "layer") is None  # every slot pinned: no overcommit
    b.ready("a")
    b.unpin("a", "fill")
    c = b.claim("c", "layer")
    assert c is not None and "a" not in b and "b" in b and c.slot == 0  # a's slot, a gone
    with pytest.raises(ValueError, match="already has slot"):
        b.claim("c", "fill")
    b.check()


def test_lookup_counts_hits_and_misses_and_pins_what_it_finds():
    b = book(2)
    assert b.lookup("a") is None
    b.claim("a", "fill")
    b.ready("a")
    b.unpin("a", "fill")
    assert b.lookup("a", "layer") is b.get("a") and b.get("a").pins["layer"] == 1
    assert (b.policy.hits, b.policy.misses) == (1, 1)


def test_random_operations_keep_the_invariants():
    """Pins mirror the policy's counts, slots stay distinct, no pinned entry ever leaves but by `fail`."""
    rng, b = random.Random(0), book(4)
    held: list[tuple[str, str]] = []  # (key, owner) pins we hold
    for _ in range(2000):
        key, op = f"k{rng.randrange(8)}", rng.random()
        if op < 0.3 and key not in b:
            owner = rng.choice(OWNERS)
            if b.claim(key, owner) is not None:
                held.append((key, owner))
        elif op < 0.5 and key in b:
            b.ready(key)
        elif op < 0.7 and key in b:
            owner = rng.choice(OWNERS)
            b.pin(key, owner)
            held.append((key, owner))
        elif op < 0.95 and held:
            k, owner = held.pop(rng.randrange(len(held)))
            b.unpin(k, owner)
        elif key in b:
            b.fail(key)
            held = [(k, o) for k, o in held if k != key]
        for k, _ in held:
            assert k in b
        b.check()
