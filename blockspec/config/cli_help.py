"""How blockspec's commands print --help: every flag's default, after its help text."""
from __future__ import annotations

import argparse
import copy


def _has_default(action: argparse.Action) -> bool:
    """A flag that takes a value and has a default to name (None or "" means unset; a switch is off by default)."""
    return bool(action.option_strings) and action.nargs != 0 and action.default not in (None, "", argparse.SUPPRESS)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """argparse's help with "(default: X)" appended to each flag that has a default and whose help does not name it
    already; a flag without help text gets a line with its default."""

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and _has_default(action):
            action = copy.copy(action)  # NOTE: the parser's own action keeps its (empty) help
            action.help = "default: %(default)s"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not _has_default(action):
            return text
        return f"{text} (default: %(default)s)"
