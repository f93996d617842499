"""hedgepub's version, in a module of its own so that modules below the package's top can read it."""

__version__ = "0.2.0.dev0"
