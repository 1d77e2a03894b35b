"""The error a user's mistake raises (imported by every module that checks input; no dependencies)."""


class ConfigError(ValueError):
    """A user mistake in the configuration: one line naming the key and a valid choice."""
