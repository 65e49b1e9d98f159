"""The testbed's one error type: a one-line message naming what is wrong and the value seen."""

from __future__ import annotations

from models.errors import ConfigError


class TestbedError(ConfigError):
    """The testbed cannot be built, found or removed as asked.

    Raised for missing privileges or tools (not root, no ``ip``/``tc``, no ``/dev/net/tun``), a
    testbed that is already up (``up``) or not up, a failed ``ip``/``tc`` command (with its
    stderr) and a forwarder that did not start. ``field`` is ``"testbed"``; ``str(error)`` reads
    ``"testbed: <problem> (got <value>)"``, as for every :class:`~models.errors.ConfigError`.
    """

    # pytest would otherwise try to collect this class from test modules that import it.
    __test__ = False
