"""Reading a user's file (scenario YAML, model config.json) without trusting a byte of it.

Every reader here turns whatever the file holds into a :class:`~models.errors.ConfigError` on the
field the caller names, one line, before anything else sees the data:

* size: at most :data:`MAX_FILE_BYTES` (a scenario is a few KiB; a config.json one or two);
* encoding: UTF-8 text (a latin-1 byte, UTF-16, a binary file give "not UTF-8 text");
* nesting: at most :data:`MAX_DEPTH` levels of mappings and lists (the YAML composer and the JSON
  decoder recurse, so 900 levels would otherwise end in a RecursionError);
* integers: more than :data:`MAX_INT_DIGITS` digits are not parsed (no count hetsim reads comes
  near; Python refuses to parse more than 4,300 digits and a float overflows past 309) but kept
  as a :class:`LongNumber`, a string the field's own validation refuses, so the error names the
  field (``workload.prompt_tokens: ... (got a 5000-digit number)``);
* YAML: no duplicate keys in a mapping (the last one would silently win), at most
  :data:`MAX_YAML_ALIASES` aliases (an alias bomb expands exponentially when validated);
* JSON: no ``NaN`` or ``Infinity`` literals.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import yaml

from models.errors import ConfigError, shorten

MAX_FILE_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_INT_DIGITS = 30
MAX_YAML_ALIASES = 100


def read_text(path: Path, field: str, max_bytes: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of ``path`` (at most ``max_bytes``).

    Raises:
        ConfigError: on ``field`` for a file that cannot be read, is too large or is not UTF-8.
    """
    shown = shorten(str(path), keep_end=True)
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO or a device would block or never end
            raise ConfigError(field, f"not a regular file (got {shown})")
        with open(path, "rb") as handle:
            # Read one byte past the limit: /proc files and pipes report no size.
            data = handle.read(max_bytes + 1)
    except OSError as error:
        raise ConfigError(field, f"cannot read file: {error.strerror or error} (got {shown})") from None
    if len(data) > max_bytes:
        raise ConfigError(field, f"file larger than {max_bytes} bytes (got {shown})")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(field, f"not UTF-8 text: byte {data[error.start]:#04x} at offset {error.start} "
                                 f"(got {shown})") from None


class LongNumber(str):
    """The text of an integer too long to parse; shown by its length, never whole."""

    def __repr__(self) -> str:
        return f"a {sum(c.isdigit() for c in self)}-digit number"


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader refusing duplicate keys, deep nesting, alias bombs and huge integers."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0
        self._aliases = 0

    def compose_node(self, parent, index):  # noqa: ANN001 (PyYAML's signature)
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_YAML_ALIASES:
                raise yaml.constructor.ConstructorError(
                    None, None, f"more than {MAX_YAML_ALIASES} aliases", self.peek_event().start_mark)
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise yaml.constructor.ConstructorError(
                None, None, f"nested deeper than {MAX_DEPTH} levels", self.peek_event().start_mark)
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):  # noqa: ANN001
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, "unhashable key", key_node.start_mark) from None
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"duplicate key {shorten(key)}", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):  # noqa: ANN001
        if sum(c.isdigit() for c in str(node.value)) > MAX_INT_DIGITS:
            return LongNumber(node.value)
        return super().construct_yaml_int(node)


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)


def load_yaml(path: Path, field: str) -> Any:
    """The YAML document in ``path``, read by :func:`read_text` and the strict loader above.

    Raises:
        ConfigError: on ``field``: unreadable, too large, not UTF-8, malformed YAML, duplicate
            keys, too deep, too many aliases or an integer too long (with line and column).
    """
    text = read_text(path, field)
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(field, f"malformed YAML{where}: {problem} (got {shorten(str(path), keep_end=True)})") from None
    except RecursionError:
        raise ConfigError(field, f"nested deeper than {MAX_DEPTH} levels (got {shorten(str(path), keep_end=True)})") from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number hetsim accepts")


def _bounded_int(text: str) -> int | LongNumber:
    return LongNumber(text) if len(text.lstrip("-")) > MAX_INT_DIGITS else int(text)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {shorten(key)}")
        result[key] = value
    return result


def load_json(path: Path, field: str) -> Any:
    """The JSON document in ``path``, read by :func:`read_text`; duplicate keys, NaN/Infinity
    literals and nesting past :data:`MAX_DEPTH` refused, integers over :data:`MAX_INT_DIGITS`
    digits kept as :class:`LongNumber`.

    Raises:
        ConfigError: on ``field``, naming the problem and the file.
    """
    text = read_text(path, field)
    shown = shorten(str(path), keep_end=True)
    if _json_depth(text) > MAX_DEPTH:
        raise ConfigError(field, f"invalid JSON: nested deeper than {MAX_DEPTH} levels (got {shown})")
    try:
        return json.loads(text, parse_int=_bounded_int, parse_constant=_refuse_constant,
                          object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as error:
        raise ConfigError(field, f"invalid JSON: {error} (got {shown})") from None
    except (ValueError, RecursionError) as error:
        raise ConfigError(field, f"invalid JSON: {shorten(str(error), 80, quote=False)} (got {shown})") from None


def _json_depth(text: str) -> int:
    """The deepest nesting of ``[`` and ``{`` outside strings (an upper bound for invalid JSON)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest
