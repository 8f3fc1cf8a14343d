"""The viewer's actions, read from its key bindings: the help's key lines and the command
palette's commands (``ctrl+p``) come from the same bindings, so neither can go stale.

A binding's ``description`` is its short name (the footer's, the palette's title) and its
``tooltip`` says what it does (the help's line, the palette's help).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

from textual.app import App
from textual.binding import Binding, BindingType
from textual.command import DiscoveryHit, Hit, Hits, Provider


@dataclass(frozen=True)
class Action:
    """One thing the viewer can do: its keys (``""`` for the palette only), name and help."""

    keys: str
    title: str
    help: str
    action: str


def actions(app: App[Any], bindings: Iterable[BindingType], prefix: str = "") -> list[Action]:
    """The bindings grouped by action (``q`` and ``ctrl+c`` quit alike), in their order, the
    keys as the footer shows them; ``prefix`` names the panel they belong to."""
    grouped: dict[str, list[Binding]] = {}
    for binding in bindings:
        if isinstance(binding, Binding):
            for key in binding.key.split(","):
                grouped.setdefault(binding.action, []).append(
                    Binding(
                        key.strip(),
                        binding.action,
                        binding.description,
                        key_display=binding.key_display,
                        tooltip=binding.tooltip,
                    )
                )
    result = []
    for action, group in grouped.items():
        keys = " ".join(dict.fromkeys(app.get_key_display(b) for b in group))
        title = next((b.description for b in group if b.description), action)
        what = next((b.tooltip for b in group if b.tooltip), title)
        result.append(Action(keys, f"{prefix}{title}", what, action))
    return result


class HasCommands(Protocol):
    def palette_commands(self) -> Sequence[tuple[Action, Callable[[], object]]]: ...


class ViewerCommands(Provider):
    """The command palette's source of the viewer's own actions (beside Textual's: theme,
    keys, screenshot, maximize)."""

    def _commands(self) -> Sequence[tuple[Action, Callable[[], object]]]:
        return cast(HasCommands, self.app).palette_commands()

    async def discover(self) -> Hits:
        for action, run in self._commands():
            yield DiscoveryHit(action.title, run, help=_help(action))

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for action, run in self._commands():
            score = max(matcher.match(action.title), matcher.match(action.help) * 0.5)
            if score > 0:
                yield Hit(score, matcher.highlight(action.title), run, help=_help(action))


def _help(action: Action) -> str:
    """The palette's help line: what it does, and its keys (as text, not markup)."""
    text = f"{action.help}  [{action.keys}]" if action.keys else action.help
    return text.replace("[", r"\[")


def help_rows(groups: Iterable[Sequence[Action]]) -> Iterator[tuple[str, str]]:
    """(keys, what) for the help, the groups one after the other."""
    for group in groups:
        for action in group:
            if action.keys:
                yield action.keys, action.help
