"""The errors a user's input can raise: one line each, naming what was wrong.

They live in ``core`` so every layer can raise them without importing the layer that reads the
input (``config``, ``data``); those modules re-export them under their old names.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem, with the offending key in the message."""


class DatasetError(ValueError):
    """A dataset cannot be found or read; the message names the file and the problem."""
