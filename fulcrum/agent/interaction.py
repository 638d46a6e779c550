"""The interaction interface users subclass, as verl's `BaseInteraction` (`verl/interactions/base.py`):
a simulated user that answers the model's turns.

An interaction lives for the whole run; each conversation that uses it is one instance:

    await interaction.start_interaction(instance_id, **interaction_kwargs)   # the row's kwargs
    should_terminate, content, turn_score, extra = await interaction.generate_response(
        instance_id, messages, **interaction_kwargs)                           # after each plain turn
    await interaction.finalize_interaction(instance_id)                       # when it ends

The agent loop asks it after every assistant turn without tool calls: `content` becomes the next user
message (appended as the chat template renders it, masked out of the loss); `should_terminate` ends
the conversation; `turn_score` (a float, or None for none) is kept per conversation as `turn_scores`.
Porting a verl interaction means changing its import to `from fulcrum.agent.interaction import
BaseInteraction`; the methods, their arguments and the constructor `(config)` are verl's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import uuid4

from fulcrum.agent.guard import DEFAULT_TIMEOUT_S, CallGuard


class BaseInteraction:
    """A simulated user. Subclass it and override `generate_response` (and the others as needed).

    `config` is the entry's `config` mapping from the interaction-config YAML, with `name` added (the
    name rows pick it by, in `extra_info.interaction_kwargs.name`).
    """

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.name: str = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Start an instance for one conversation; returns its id."""
        return instance_id if instance_id is not None else str(uuid4())

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float | None, dict[str, Any]]:
        """The user's answer to the conversation so far: (should_terminate, content, turn score, extra).

        verl's default: carry on, "Your current result seems acceptable.", 0.8.
        """
        return False, "Your current result seems acceptable.", 0.8, {}

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        """A score of the instance's current state."""
        return 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        """Forget the instance."""


@dataclass(frozen=True)
class Reply:
    """One user turn: whether the conversation ends, the message, and its turn score (None: none)."""

    should_terminate: bool
    content: str
    score: float | None


def as_reply(value: Any, where: str) -> Reply:
    """`generate_response`'s return value as a Reply, or a TypeError naming `where` and what came."""
    if not (isinstance(value, tuple) and len(value) == 4):
        raise TypeError(
            f"{where}: generate_response must return (should_terminate, content, turn_score, extra); "
            f"got {value!r}"
        )
    should_terminate, content, score, _extra = value
    if not isinstance(content, str):
        raise TypeError(f"{where}: generate_response's content must be a string, got {content!r}")
    return Reply(bool(should_terminate), content, None if score is None else float(score))


class InteractionSession:
    """One conversation's instance of an interaction: started once, asked after each plain turn,
    finalized at the end (the instance id is the conversation's request id, as verl passes it). Each call
    runs under `guard`'s time limit (fulcrum.agent.guard; CallTimeout past it)."""

    def __init__(
        self,
        interaction: BaseInteraction,
        instance_id: str,
        kwargs: dict[str, Any],
        guard: CallGuard | None = None,
    ) -> None:
        self.interaction = interaction
        self.instance_id = instance_id
        self.kwargs = kwargs
        self.guard = guard or CallGuard(DEFAULT_TIMEOUT_S)
        self.where = f"interaction {interaction.name!r} ({type(interaction).__name__})"

    async def start(self) -> None:
        """verl's `start_interaction(request_id, **interaction_kwargs)`."""
        it = self.interaction
        await self.guard.run(
            it,
            lambda: it.start_interaction(self.instance_id, **self.kwargs),
            f"{self.where}.start_interaction",
        )

    async def reply(self, messages: list[dict[str, Any]]) -> Reply:
        """The user's answer to `messages` (the conversation so far, the last assistant turn included)."""
        it = self.interaction
        value = await self.guard.run(
            it,
            lambda: it.generate_response(self.instance_id, messages, **self.kwargs),
            f"{self.where}.generate_response",
        )
        return as_reply(value, self.where)

    async def finish(self) -> None:
        """Release the instance. verl's tool agent loop never does, so verl's instances pile up."""
        it = self.interaction
        await self.guard.run(
            it, lambda: it.finalize_interaction(self.instance_id), f"{self.where}.finalize_interaction"
        )
