"""Lists of records in the YAML files of published figures (``validation/published/``): each entry
a mapping with exactly the given fields, each refused with one line naming it."""

from __future__ import annotations

from collections.abc import Iterator

from models.errors import ConfigError


def records(data: object, key: str, fields: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    """``(where, entry)`` for each entry of the list ``data[key]``, ``where`` its field path
    (``key[i]``).

    Raises:
        ConfigError: ``data`` not a mapping, ``data[key]`` not a list, an entry that is not a
            mapping with exactly ``fields``.
    """
    if not isinstance(data, dict):
        raise ConfigError(key, f"a mapping with a list '{key}' is required (got {type(data).__name__})")
    if not isinstance(data.get(key), list):
        raise ConfigError(key, f"a list is required (got {type(data.get(key)).__name__})")
    for index, entry in enumerate(data[key]):
        where = f"{key}[{index}]"
        if not isinstance(entry, dict) or set(entry) != set(fields):
            keys = sorted(entry) if isinstance(entry, dict) else entry
            raise ConfigError(where, f"fields must be exactly {', '.join(fields)} (got {keys!r})")
        yield where, entry


def positive_number(where: str, value: object) -> float:
    """``value`` as a float; raises :class:`ConfigError` on ``where`` unless it is a positive number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(where, f"a positive number is required (got {value!r})")
    return float(value)
