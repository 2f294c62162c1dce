"""Moved to ``ncljax.config`` (README, "Renamed"); config files written for the old
location keep working."""

from ncljax.config.base import *  # noqa: F403
