"""Token buckets: how often each node may send signed messages or cause store writes. Pure and sync."""

from __future__ import annotations


class RateLimiter:
    """Token buckets, one per key: `rate_per_s` on average, up to `burst` at once. Pure and sync;
    the caller passes the time (trio's clock), so tests can drive it."""

    def __init__(self, rate_per_s: float, burst: int) -> None:
        if not rate_per_s > 0 or burst < 1:
            raise ValueError("a rate limit needs a positive rate and a burst of at least 1")
        self._rate = rate_per_s
        self._burst = float(burst)
        # key -> (tokens left, time they were counted)
        self._buckets: dict[str, tuple[float, float]] = {}

    def allow(self, key: str, now: float) -> bool:
        """Take one token for `key` if it has one."""
        tokens, at = self._buckets.get(key, (self._burst, now))
        tokens = min(self._burst, tokens + max(0.0, now - at) * self._rate)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            return False
        self._buckets[key] = (tokens - 1.0, now)
        return True
