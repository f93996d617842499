"""Test helpers for users of hedgepub: a pytest plugin that starts the local Pub/Sub server.

Installed as a pytest plugin (entry point ``hedgepub``), so its fixtures are available in any project
that has hedgepub installed.
"""
