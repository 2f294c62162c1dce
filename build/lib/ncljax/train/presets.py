"""Moved to ``ncljax.config.presets`` (README, "Renamed"); config files written for the
old location keep working."""

from ncljax.config.presets import *  # noqa: F403
