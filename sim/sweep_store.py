"""The resumable store of a grid sweep: each point's result committed exactly once, in SQLite.

One file, ``DIR/sweep.sqlite``, in write-ahead-log mode (https://sqlite.org/wal.html). Two tables:

* ``points``: one row per simulated point, ``key`` UNIQUE (its content key,
  :func:`sim.grid.point_key`), ``run`` (which invocation computed it, see ``runs``), ``axes``
  (JSON), ``error`` (empty, or why the simulator refused the point), ``seconds`` (its wall time),
  ``profile_context`` (how a profile priced it, :attr:`sim.grid.PointOutcome.profile_context`)
  and ``shares_note`` (an uneven split's basis, :attr:`sim.grid.PointOutcome.shares_note`); each
  added to a store an older hetsim made, whose points it leaves empty (:data:`ADDED_POINT_COLUMNS`);
* ``results``: the point's tidy result rows (:data:`sim.metrics.RESULT_COLUMNS`, plus ``oom``:
  the first op that does not fit, for a variant that overflows) with ``ord`` keeping their order.

A point and its rows go in one transaction, the point by ``INSERT OR IGNORE``: a process killed
at any instant (``kill -9``) leaves every point either wholly stored or absent, and a point stored
twice (two sweeps sharing a directory) keeps its first result. Only the process that runs the
sweep writes; workers return results to it. ``synchronous=NORMAL`` in WAL mode loses no committed
transaction when a process dies, only possibly the last ones on a power cut (sqlite.org/pragma.html
#pragma_synchronous), which a rerun recomputes.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from sim.grid import PointOutcome
from sim.metrics import RESULT_COLUMNS

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (run INTEGER PRIMARY KEY AUTOINCREMENT, started_s REAL NOT NULL,
                                 points INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS points (key TEXT NOT NULL UNIQUE, run INTEGER NOT NULL REFERENCES runs(run),
                                   axes TEXT NOT NULL, error TEXT NOT NULL, seconds REAL NOT NULL,
                                   profile_context TEXT NOT NULL DEFAULT '',
                                   shares_note TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS results (key TEXT NOT NULL REFERENCES points(key), ord INTEGER NOT NULL,
                                    scenario TEXT, variant TEXT, source TEXT, metric TEXT, value REAL,
                                    unit TEXT, device TEXT, oom TEXT NOT NULL, UNIQUE (key, ord));
"""
STORE_NAME = "sweep.sqlite"
ADDED_POINT_COLUMNS = ("profile_context", "shares_note")
"""The ``points`` columns later hetsims added, in order. A store an older hetsim made gets them
empty: its points' keys carry the older simulator's digest (:func:`sim.grid.hetsim_version`), so
no current point reuses them, and they still read back (as in a grid sharing the directory).
Each is the :class:`sim.grid.PointOutcome` field of its name, in that class's order after
``seconds``."""


class SweepStore:
    """The SQLite store of one sweep directory (see the module docstring). A context manager.

    Raises:
        sqlite3.DatabaseError: a file that is not a sweep store (the CLI names it as ``--out``).
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, isolation_level=None)  # transactions are explicit
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=30000")  # another reader or a second sweep: wait
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(points)")}
        for column in ADDED_POINT_COLUMNS:
            if column not in columns:
                self._db.execute(f"ALTER TABLE points ADD COLUMN {column} TEXT NOT NULL DEFAULT ''")
        self.run: int | None = None

    def __enter__(self) -> SweepStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._db.close()

    def start_run(self, points: int) -> int:
        """Record a new invocation that will compute ``points`` points; its number."""
        cursor = self._db.execute("INSERT INTO runs (started_s, points) VALUES (?, ?)", (time.time(), points))
        self.run = cursor.lastrowid
        return self.run

    def stored(self, keys: Iterable[str]) -> set[str]:
        """Which of ``keys`` have a stored result."""
        keys = list(keys)
        found: set[str] = set()
        for i in range(0, len(keys), 900):  # SQLite's default limit of bound parameters is 999
            chunk = keys[i:i + 900]
            found.update(k for (k,) in self._db.execute(
                f"SELECT key FROM points WHERE key IN ({','.join('?' * len(chunk))})", chunk))
        return found

    def commit(self, key: str, axes_json: str, outcome: PointOutcome) -> bool:
        """Store one point's outcome in one transaction; False (nothing written) when ``key`` was
        stored already."""
        assert self.run is not None, "start_run first"
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            inserted = db.execute(f"INSERT OR IGNORE INTO points (key, run, axes, error, seconds, "
                                  f"{', '.join(ADDED_POINT_COLUMNS)}) VALUES (?, ?, ?, ?, ?"
                                  f"{', ?' * len(ADDED_POINT_COLUMNS)})",
                                  (key, self.run, axes_json, outcome.error, outcome.seconds,
                                   *(getattr(outcome, column) for column in ADDED_POINT_COLUMNS))).rowcount
            if inserted:
                db.executemany("INSERT INTO results VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                               [(key, i, *row, outcome.oom.get(row[1], "")) for i, row in enumerate(outcome.rows)])
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return bool(inserted)

    def outcomes(self, keys: Iterable[str]) -> dict[str, PointOutcome]:
        """The stored outcome of each of ``keys`` that has one."""
        keys = list(keys)
        points = pd.read_sql_query(f"SELECT key, error, seconds, {', '.join(ADDED_POINT_COLUMNS)} FROM points",
                                   self._db).set_index("key")
        results = pd.read_sql_query(f"SELECT key, {', '.join(RESULT_COLUMNS)}, oom FROM results ORDER BY key, ord",
                                    self._db)
        by_key = {k: g for k, g in results.groupby("key", sort=False)}
        outcomes = {}
        for key in keys:
            if key not in points.index:
                continue
            rows = by_key.get(key)
            table = rows[RESULT_COLUMNS].itertuples(index=False, name=None) if rows is not None else ()
            oom = {} if rows is None else {v: o for v, o in zip(rows["variant"], rows["oom"]) if o}
            outcomes[key] = PointOutcome(tuple(table), oom, points.at[key, "error"], float(points.at[key, "seconds"]),
                                         *(points.at[key, column] for column in ADDED_POINT_COLUMNS))
        return outcomes
