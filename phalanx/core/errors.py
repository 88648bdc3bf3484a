"""The errors phalanx reports to users (a leaf module: everything may import it)."""
from __future__ import annotations


class ConfigError(ValueError):
    """Bad user input (config, data, flags, checkpoint): the CLI prints it on one line and exits with 2."""
