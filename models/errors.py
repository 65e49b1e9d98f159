"""The one exception type for bad user input, shared by every layer.

The CLI turns a :class:`ConfigError` into a single line on stderr and exit code 2; anything
else that escapes is a bug and keeps its traceback.
"""


MAX_SHOWN_CHARS = 60


def shorten(value: object, limit: int = MAX_SHOWN_CHARS, *, keep_end: bool = False, quote: bool = True) -> str:
    """``repr`` of a string, ``str`` of anything else, cut to ``limit`` characters with an ellipsis,
    so that a 200,000-character value is echoed as its first few dozen characters (its last ones
    with ``keep_end``, for a file path, whose name is at its end). ``quote=False``: a string as is."""
    if isinstance(value, int) and value.bit_length() > 200:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    text = repr(value) if isinstance(value, str) and quote else str(value)
    text = text.replace("\n", " ").replace("\r", " ")
    if len(text) <= limit:
        return text
    return "…" + text[-(limit - 1):] if keep_end else text[:limit - 1] + "…"


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
        # One line whatever the message quotes (a YAML problem, an OS error).
        return " ".join(f"{self.field}: {self.message}".split())
