"""The token bucket that limits hedging: one whole token per hedge, a fraction back per successful batch.

The balance is kept in whole thousandths of a token (an ``int``), so a million refills of ``0.1`` add up
to exactly ``100_000`` tokens' worth, with no floating-point drift. The refill ratio is therefore used
rounded to the nearest thousandth (the settings allow 0.001 to 0.2, so this never rounds to zero).

The bucket starts empty, as Google's Go and Rust clients' do: a fresh topic hedges only after enough of
its batches have succeeded. Failures add nothing, so when the service is slow or failing for everyone the
tokens run out and hedging switches itself off.
"""

from __future__ import annotations

import math
import threading

from hedgepub._settings import HedgingSettings

#: Thousandths of a token per token.
_SCALE = 1000


class TokenBucket:
    """Tokens that pay for hedged attempts; shared by every batch of one topic and thread-safe.

    Args:
        max_tokens: most whole tokens the bucket can hold (at least 1).
        refill_ratio: tokens added by each successful batch, at least 0.001 and at most ``max_tokens``.
    """

    def __init__(self, max_tokens: int, refill_ratio: float) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise TypeError(f"max_tokens must be an int; got {type(max_tokens).__name__} {max_tokens!r}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1; got {max_tokens!r}")
        if isinstance(refill_ratio, bool) or not isinstance(refill_ratio, (int, float)):
            raise TypeError(
                f"refill_ratio must be a number; got {type(refill_ratio).__name__} {refill_ratio!r}"
            )
        if not math.isfinite(refill_ratio) or not 0.001 <= refill_ratio <= max_tokens:
            raise ValueError(f"refill_ratio must be in [0.001, {max_tokens}]; got {refill_ratio!r}")
        self._max = max_tokens * _SCALE
        self._refill = round(refill_ratio * _SCALE)
        self._balance = 0
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: HedgingSettings) -> TokenBucket:
        """An empty bucket sized by ``settings.max_tokens`` and refilled by ``settings.refill_ratio``."""
        return cls(settings.max_tokens, settings.refill_ratio)

    def try_spend(self) -> bool:
        """Spend exactly one whole token if at least one is available; say whether it was spent."""
        with self._lock:
            if self._balance < _SCALE:
                return False
            self._balance -= _SCALE
            return True

    def refill(self) -> None:
        """Credit one successful batch: add the refill ratio, never above ``max_tokens``."""
        with self._lock:
            self._balance = min(self._balance + self._refill, self._max)

    @property
    def tokens(self) -> float:
        """Tokens available now (fractions included)."""
        return self._balance / _SCALE

    @property
    def max_tokens(self) -> int:
        """Most whole tokens the bucket can hold."""
        return self._max // _SCALE

    @property
    def refill_ratio(self) -> float:
        """Tokens added per successful batch, as used (rounded to a thousandth)."""
        return self._refill / _SCALE

    def __repr__(self) -> str:
        return f"TokenBucket(tokens={self.tokens:g}/{self.max_tokens}, refill_ratio={self.refill_ratio:g})"
