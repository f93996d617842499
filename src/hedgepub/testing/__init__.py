"""Test helpers shipped with hedgepub.

- :mod:`hedgepub.testing.plugin`: the pytest plugin (entry point ``hedgepub``) with the ``pubsub_server``
  fixture, a local server per test.
- :mod:`hedgepub.testing.scripted`: :class:`~hedgepub.testing.scripted.ScriptedTransport`, a transport
  that answers Publish calls from a script, for publisher tests without a server.
- :mod:`hedgepub.testing.virtual_time`: an asyncio loop on virtual time, so that seconds of hedge delays
  and back-off run in milliseconds.

Nothing in the library imports this package.
"""
