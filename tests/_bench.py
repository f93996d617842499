"""What the bench tests say when a run cannot show hedging's effect on the tail."""

from __future__ import annotations

import os
from typing import Any


def starved_reason(document: dict[str, Any], unhedged_p50_ms: float, injected_ms: float) -> str:
    """Why a comparison of tails means nothing for this run, in measured terms.

    The server answers most publishes in about ``injected_ms``, yet the unhedged median was
    ``unhedged_p50_ms``: the rest went by in the bench process itself, whose server and publishers share
    one interpreter, on a machine whose load average is given beside its CPU count. Then nearly every
    publish outlives the hedge delay, the token bucket runs dry (as it should under overload), and the
    hedged tail cannot differ from the unhedged one.
    """
    run = document.get("config", {}).get("run", {})
    load = run.get("load_average") or ["?"]
    cpus = run.get("cpus") or os.cpu_count()
    return (
        f"the unhedged median was {unhedged_p50_ms:g} ms where the server answers most publishes in "
        f"{injected_ms:g} ms; the rest went by in the bench process (its server and publishers share one "
        f"interpreter; load average {load[0]} on {cpus} CPUs), so nearly every publish outlived the hedge "
        "delay and emptied the token bucket: no tail comparison is possible"
    )
