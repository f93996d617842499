"""Shared fixtures for the hedging tests.

Tests here run asyncio code on virtual time with ``hedgepub.testing.virtual_time.run_virtual`` (or the
``@virtual_time`` decorator), so every rule is checked at exact virtual instants in microseconds of real
time. Other areas can do the same; see that module's docstring.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hedgepub._hedging.bucket import TokenBucket


def _bucket_with(tokens: float, max_tokens: int = 50, refill_ratio: float = 0.1) -> TokenBucket:
    bucket = TokenBucket(max_tokens, refill_ratio)
    # Refilling is the only way to add tokens, so that is how a test bucket gets its balance.
    for _ in range(round(tokens / refill_ratio)):
        bucket.refill()
    assert bucket.tokens == pytest.approx(tokens)
    return bucket


@pytest.fixture
def bucket_with() -> Callable[..., TokenBucket]:
    """``bucket_with(tokens, max_tokens=50, refill_ratio=0.1)``: a bucket holding ``tokens``."""
    return _bucket_with
