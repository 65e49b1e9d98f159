"""Bounds on the numbers a user gives the measuring commands, as ``hetsim`` options and as
validation matrix fields alike: past them a run would take hours, or a timeout overflows the
process group's ``timedelta``."""

MAX_REPEATS = 10_000  # a generation takes milliseconds at least: more would run for hours
MAX_TIMEOUT_S = 86_400.0
MAX_TIMED_S = 3600.0
