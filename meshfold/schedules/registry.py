"""The schedules by name: each schedule module's object is registered once
(``schedules/__init__.py``, one line each) and looked up once, where a run or a plan
starts (``get_schedule(parallel.pp_schedule)``); everything after asks the object."""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshfold.errors import ConfigError

if TYPE_CHECKING:  # annotations only (base.py imports this module)
    from meshfold.schedules.base import Schedule

_SCHEDULES: dict[str, Schedule] = {}


def register(schedule: Schedule) -> Schedule:
    """Make ``schedule`` known under its ``name`` (``parallel.pp_schedule``)."""
    _SCHEDULES[schedule.name] = schedule
    return schedule


def get_schedule(name: str) -> Schedule:
    """The registered schedule called ``name``; a ConfigError listing the known ones otherwise."""
    try:
        return _SCHEDULES[name]
    except KeyError:
        raise ConfigError(f"parallel.pp_schedule = {name!r}; choose one of {', '.join(_SCHEDULES)}") from None


def schedule_names() -> tuple[str, ...]:
    """The registered names, in registration order."""
    return tuple(_SCHEDULES)


def all_schedules() -> tuple[Schedule, ...]:
    return tuple(_SCHEDULES.values())


def find_schedule(name: str) -> Schedule | None:
    """The registered schedule called ``name``, or None."""
    return _SCHEDULES.get(name)
