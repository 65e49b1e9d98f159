"""The one exception type for bad user input, shared by every layer.

The CLI turns a :class:`ConfigError` into a single line on stderr and exit code 2; anything
else that escapes is a bug and keeps its traceback.
"""


class ConfigError(ValueError):
    """Bad user input: a scenario, model config or cluster description that cannot be used.

    The message must name the offending field (dotted path, e.g. ``cluster.hosts[0].nic.bandwidth``)
    and the value, in one line: ``"<field>: <problem> (got <value>)"``.
    """

    def __init__(self, field: str, message: str):
        # args stay (field, message) so copies made by type(e)(*e.args) (simpy re-raises that
        # way) and pickling across worker processes rebuild the same error.
        super().__init__(field, message)
        self.field = field
        self.message = message

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"
