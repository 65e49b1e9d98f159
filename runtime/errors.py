"""Runtime errors that the CLI reports without importing torch."""


class LaunchError(RuntimeError):
    """A rank failed, died or hung; the message names the rank. Nothing was written."""
