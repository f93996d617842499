"""The token bucket, rule by rule (docs/hedging.md "The token bucket", rules 13-16)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hedgepub._hedging.bucket import TokenBucket
from hedgepub._settings import HedgingSettings

BucketWith = Callable[..., TokenBucket]


def test_starts_empty() -> None:
    bucket = TokenBucket(50, 0.1)
    assert bucket.tokens == 0
    assert bucket.try_spend() is False


def test_from_settings_uses_size_and_ratio_and_starts_empty() -> None:
    bucket = TokenBucket.from_settings(HedgingSettings(max_tokens=100, refill_ratio=0.05))
    assert (bucket.max_tokens, bucket.refill_ratio, bucket.tokens) == (100, 0.05, 0)


def test_counts_whole_thousandths_without_float_drift() -> None:
    bucket = TokenBucket(250, 0.1)
    for _ in range(2000):
        bucket.refill()
    # 2000 * 0.1 in floats is 200.00000000000284; in thousandths it is exactly 200.
    assert bucket.tokens == 200.0
    total = 0.0
    for _ in range(2000):
        total += 0.1
    assert total != 200.0


def test_spending_needs_one_whole_token_and_spends_exactly_one(bucket_with: BucketWith) -> None:
    bucket = bucket_with(0.9)
    assert bucket.try_spend() is False
    assert bucket.tokens == pytest.approx(0.9)
    bucket.refill()
    assert bucket.tokens == 1.0
    assert bucket.try_spend() is True
    assert bucket.tokens == 0
    assert bucket.try_spend() is False


def test_spending_leaves_the_fraction(bucket_with: BucketWith) -> None:
    bucket = bucket_with(2.3)
    assert bucket.try_spend() and bucket.try_spend()
    assert bucket.tokens == pytest.approx(0.3)
    assert not bucket.try_spend()


def test_refill_adds_the_ratio_once_per_call() -> None:
    bucket = TokenBucket(50, 0.2)
    bucket.refill()
    assert bucket.tokens == 0.2
    bucket.refill()
    assert bucket.tokens == 0.4


def test_refill_is_capped_at_max_tokens() -> None:
    bucket = TokenBucket(2, 0.2)
    for _ in range(100):
        bucket.refill()
    assert bucket.tokens == 2.0
    assert bucket.try_spend() and bucket.try_spend() and not bucket.try_spend()


def test_smallest_ratio_counts_single_thousandths() -> None:
    bucket = TokenBucket(1, 0.001)
    for _ in range(999):
        bucket.refill()
    assert not bucket.try_spend()
    bucket.refill()
    assert bucket.try_spend()


def test_repr_shows_the_live_balance() -> None:
    bucket = TokenBucket(50, 0.1)
    assert repr(bucket) == "TokenBucket(tokens=0/50, refill_ratio=0.1)"
    for _ in range(32):
        bucket.refill()
    assert repr(bucket) == "TokenBucket(tokens=3.2/50, refill_ratio=0.1)"


@pytest.mark.parametrize(
    ("max_tokens", "ratio", "error"),
    [(0, 0.1, ValueError), (1.5, 0.1, TypeError), (True, 0.1, TypeError), (5, 0.0, ValueError),
     (5, float("nan"), ValueError), (5, "0.1", TypeError), (1, 2.0, ValueError)],
)  # fmt: skip
def test_bad_arguments_are_refused(max_tokens: object, ratio: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        TokenBucket(max_tokens, ratio)  # type: ignore[arg-type]


def test_concurrent_refills_and_spends_from_threads_lose_nothing() -> None:
    bucket = TokenBucket(250, 0.05)
    threads_count, refills_each = 8, 500  # 8 * 500 * 0.05 = 200 tokens, under the cap
    barrier = threading.Barrier(threads_count)

    def refill() -> None:
        barrier.wait()
        for _ in range(refills_each):
            bucket.refill()

    workers = [threading.Thread(target=refill) for _ in range(threads_count)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert bucket.tokens == 200.0

    spent = [0] * threads_count

    def spend(index: int) -> None:
        barrier.wait()
        for _ in range(100):
            if bucket.try_spend():
                spent[index] += 1

    workers = [threading.Thread(target=spend, args=(index,)) for index in range(threads_count)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert sum(spent) == 200
    assert bucket.tokens == 0


@settings(max_examples=100, deadline=None)
@given(
    max_tokens=st.integers(1, 250),
    ratio=st.sampled_from([0.001, 0.01, 0.05, 0.1, 0.123, 0.2]),
    operations=st.lists(st.sampled_from(["spend", "refill"]), max_size=200),
)
def test_balance_stays_in_range_and_spends_never_exceed_additions(
    max_tokens: int, ratio: float, operations: list[str]
) -> None:
    bucket = TokenBucket(max_tokens, ratio)
    step, cap = round(ratio * 1000), max_tokens * 1000
    model = refills = spends = 0  # the balance in thousandths, as the spec defines it
    for operation in operations:
        if operation == "refill":
            bucket.refill()
            refills += 1
            model = min(model + step, cap)
        else:
            spent = bucket.try_spend()
            assert spent == (model >= 1000)
            spends += spent
            model -= 1000 if spent else 0
        assert round(bucket.tokens * 1000) == model
        assert 0 <= bucket.tokens <= max_tokens
    assert spends <= refills * bucket.refill_ratio + 1e-9
