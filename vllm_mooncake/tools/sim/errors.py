"""The simulator's errors; each names the scenario field at fault."""

from __future__ import annotations


class ScenarioError(ValueError):
    """A scenario file is malformed: ``<field>: <what is wrong>``.

    ``field`` is the dotted path inside the file (``ranks.decode``,
    ``requests[3].load.tokens``); ``source`` (the file) is prefixed when known.
    """

    def __init__(self, field: str, message: str, source: str | None = None) -> None:
        self.field = field
        self.message = message
        self.source = source
        text = f"{field}: {message}" if field else message
        super().__init__(f"{source}: {text}" if source else text)

    def with_source(self, source: str) -> ScenarioError:
        return ScenarioError(self.field, self.message, source)


class SimulationError(RuntimeError):
    """The simulation reached a state it cannot continue from (a bug)."""
