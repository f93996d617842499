"""Hedging settings as code for hedgepub and for Google's Java, Go and Rust clients.

The setting names and valid ranges are those of the clients' own sources:

* Java, google-cloud-java ``java-pubsub``: ``com.google.cloud.pubsub.v1.HedgingSettings`` (a builder:
  ``setHedgeDelay(Duration)`` 100 ms to 10 s, ``setMaxTokens(int)`` 1 to 250, ``setRefillRatio(float)``
  0.001 to 0.2; out of range throws ``IllegalArgumentException``), passed with
  ``Publisher.newBuilder(topic).setHedgingSettings(...)``.
* Go, google-cloud-go ``pubsub/v2`` (``hedging.go``): ``publisher.PublishSettings.HedgingSettings =
  &pubsub.HedgingSettings{Delay, MaxTokens, RefillRatio}``; ``Delay`` 100 ms to 10 s, ``MaxTokens``
  above 0 and at most 250, ``RefillRatio`` 0.001 to 0.2 (zero fields take the defaults 1 s, 50, 0.1;
  others out of range fail validation).
* Rust, google-cloud-rust ``src/pubsub`` (``publisher/options.rs``): ``HedgingOptions::new()
  .set_delay(Duration).set_max_tokens(u32).set_refill_ratio(f32)`` given to
  ``Publisher::builder(topic).set_hedging_options(...)``; the builder clamps the delay to 100 ms..10 s,
  the tokens to 1..250 and the ratio to 0.001..0.2.

The three fixed-delay settings mean the same thing in every client, hedgepub included; only hedgepub has
the adaptive delay, so the advice gives the other clients its best fixed-delay setting.
"""

from __future__ import annotations

from dataclasses import dataclass

from hedgepub._settings import HedgingSettings


@dataclass(frozen=True)
class SettingNames:
    """One client's names for the delay, the bucket size and the refill ratio, and their ranges."""

    client: str
    delay: str
    max_tokens: str
    refill_ratio: str
    delay_range_s: tuple[float, float] = (0.1, 10.0)
    max_tokens_range: tuple[int, int] = (1, 250)
    refill_ratio_range: tuple[float, float] = (0.001, 0.2)


#: Each client's setting names and ranges (see the module docstring for where they come from).
CLIENT_SETTINGS: dict[str, SettingNames] = {
    "hedgepub": SettingNames("hedgepub", "hedge_delay", "max_tokens", "refill_ratio"),
    "java": SettingNames("Java (google-cloud-pubsub)", "setHedgeDelay", "setMaxTokens", "setRefillRatio"),
    "go": SettingNames("Go (cloud.google.com/go/pubsub/v2)", "Delay", "MaxTokens", "RefillRatio"),
    "rust": SettingNames("Rust (google-cloud-pubsub)", "set_delay", "set_max_tokens", "set_refill_ratio"),
}


def _millis(seconds: float) -> int:
    return round(seconds * 1000)


def hedgepub_snippet(settings: HedgingSettings) -> str:
    """Python constructing a hedgepub publisher with ``settings`` (runs as it is)."""
    if settings.adaptive_delay is not None:
        return (
            "from hedgepub import AdaptiveDelay, HedgingSettings, PublisherClient\n\n"
            "hedging = HedgingSettings(\n"
            f"    max_tokens={settings.max_tokens},\n"
            f"    refill_ratio={settings.refill_ratio!r},\n"
            f"    adaptive_delay=AdaptiveDelay(percentile={settings.adaptive_delay.percentile!r}),\n"
            ")\n"
            "publisher = PublisherClient(hedging_settings=hedging)\n"
        )
    return (
        "from hedgepub import HedgingSettings, PublisherClient\n\n"
        f"hedging = HedgingSettings(hedge_delay={settings.hedge_delay!r}, max_tokens={settings.max_tokens}, "
        f"refill_ratio={settings.refill_ratio!r})\n"
        "publisher = PublisherClient(hedging_settings=hedging)\n"
    )


def java_snippet(settings: HedgingSettings) -> str:
    """Java for the fixed-delay part of ``settings``."""
    return (
        "HedgingSettings hedgingSettings =\n"
        "    HedgingSettings.newBuilder()\n"
        f"        .setHedgeDelay(Duration.ofMillis({_millis(settings.hedge_delay)}))\n"
        f"        .setMaxTokens({settings.max_tokens})\n"
        f"        .setRefillRatio({settings.refill_ratio!r}f)\n"
        "        .build();\n"
        "Publisher publisher = Publisher.newBuilder(topicName).setHedgingSettings(hedgingSettings).build();\n"
    )


def go_snippet(settings: HedgingSettings) -> str:
    """Go for the fixed-delay part of ``settings``."""
    return (
        "publisher := client.Publisher(topicName)\n"
        "publisher.PublishSettings.HedgingSettings = &pubsub.HedgingSettings{\n"
        f"\tDelay:       {_millis(settings.hedge_delay)} * time.Millisecond,\n"
        f"\tMaxTokens:   {settings.max_tokens},\n"
        f"\tRefillRatio: {settings.refill_ratio!r},\n"
        "}\n"
    )


def rust_snippet(settings: HedgingSettings) -> str:
    """Rust for the fixed-delay part of ``settings``."""
    return (
        "use google_cloud_pubsub::client::Publisher;\n"
        "use google_cloud_pubsub::publisher::HedgingOptions;\n"
        "use std::time::Duration;\n\n"
        "let publisher = Publisher::builder(topic_name)\n"
        "    .set_hedging_options(\n"
        "        HedgingOptions::new()\n"
        f"            .set_delay(Duration::from_millis({_millis(settings.hedge_delay)}))\n"
        f"            .set_max_tokens({settings.max_tokens}_u32)\n"
        f"            .set_refill_ratio({settings.refill_ratio!r}_f32),\n"
        "    )\n"
        "    .build()\n"
        "    .await?;\n"
    )


def snippets(best: HedgingSettings | None, best_fixed: HedgingSettings | None) -> dict[str, str]:
    """Code per client: hedgepub gets ``best`` (adaptive or not), the others ``best_fixed``; a client
    whose best is no hedging gets no code."""
    code = {} if best is None else {"hedgepub": hedgepub_snippet(best)}
    if best_fixed is not None:
        code.update(java=java_snippet(best_fixed), go=go_snippet(best_fixed), rust=rust_snippet(best_fixed))
    return code
