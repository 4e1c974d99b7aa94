"""The store tier's probe cache alone: what it remembers absent, and for how long."""

from __future__ import annotations

from kvtier.tiering_spec.tiers.store.probes import NEGATIVE_TTL_S, ProbeCache


def _absent(cache: ProbeCache, digests: list[bytes], now: float) -> None:
    for digest in digests:
        assert cache.ask(digest)
        cache.answer(digest, False)
    assert cache.take(now) == []


def test_absent_keys_expire_in_the_order_found_and_go_when_answers_come() -> None:
    cache = ProbeCache(max_absent=100)
    _absent(cache, [b"a", b"b"], now=0.0)
    _absent(cache, [b"c"], now=1.0)
    assert all(cache.known_absent(d, 1.5) for d in (b"a", b"b", b"c"))
    _absent(cache, [b"d"], now=NEGATIVE_TTL_S + 0.5)  # a and b expired, c not yet
    assert len(cache._absent) == 2, "expired keys stay remembered"
    assert not cache.known_absent(b"a", NEGATIVE_TTL_S + 0.5)
    assert cache.known_absent(b"c", NEGATIVE_TTL_S + 0.5)


def test_absent_keys_are_bounded_the_oldest_going_first() -> None:
    """However many answers come within the time to live, at most ``max_absent`` are
    remembered; one found absent again counts from then."""
    cache = ProbeCache(max_absent=3)
    _absent(cache, [b"a", b"b", b"c"], now=0.0)
    cache._absent.pop(b"a")  # (as known_absent drops it once expired)
    _absent(cache, [b"a"], now=0.5)  # found absent again: now the newest
    _absent(cache, [b"d", b"e"], now=1.0)
    assert list(cache._absent) == [b"a", b"d", b"e"]
    assert not cache.known_absent(b"b", 1.0) and cache.known_absent(b"a", 1.0)
    for i in range(1000):
        _absent(cache, [b"x%d" % i], now=1.5)
        assert len(cache._absent) <= 3
