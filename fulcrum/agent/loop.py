"""The tool agent loop, as verl's `ToolAgentLoop`: per conversation, generate a turn, run the tool calls
it holds, append the answers and generate again, over the native engine's request API.

One conversation (`ToolAgentLoop.converse`):

    prompt (chat template with tools=) ─► turn 1 (KV kept) ─► parse <tool_call>s ─► run them ─►
    tool messages as the template renders them (delta ids, loss mask 0) ─► resume ─► turn 2 ─► ...

It stops, as verl's does, when a turn holds no call; when `max_assistant_turns` turns were generated or
`max_user_turns` tool answers or user turns appended; when the response (every turn, tool tokens
included) reaches `response_length`; or when a tool answer would take it there (the answer is then not
appended). Each turn may sample at most what is left of that budget, so nothing is cut afterwards; the
sample's KV blocks are released at the end.

With an interaction (verl's simulated user, fulcrum.agent.interaction) a turn without calls does not
end the conversation: the row's interaction answers it, its message is appended as a user turn
(template delta, loss mask 0, its turn score kept in `turn_scores`) and the model goes on, unless the
interaction says to stop or a limit is reached. As verl does, the user turn is appended even then (cut
to the budget), so a response may end in masked tokens. An interaction call that raises, returns
something that is not a reply, or runs past `multi_turn.call_timeout` ends the conversation there (no
user turn appended; a failing `start_interaction` leaves the conversation without one) and counts
`interaction/errors` and `interaction/errors/{failed,timeout}`; the step goes on.

All conversations run at once on one `AsyncRollout`: while one awaits its tools the others decode, and
every turn in flight shares the engine's steps. The `n` samples of a prompt are one request (their
prompt's blocks are shared) and then go their own ways. A row whose `agent_name` is
`single_turn_agent` gets one turn and no tools, as verl's `SingleTurnAgentLoop`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar
from uuid import uuid4

from fulcrum.agent.calls import ToolSet
from fulcrum.agent.chat import ChatDelta
from fulcrum.agent.guard import CallTimeout
from fulcrum.agent.interaction import BaseInteraction, InteractionSession
from fulcrum.agent.interaction_config import pick_interaction
from fulcrum.agent.metrics import sum_metrics
from fulcrum.rollout.base import SamplingParams, SequenceOutput
from fulcrum.rollout.driver import AsyncRollout

log = logging.getLogger("fulcrum.agent")
T = TypeVar("T")

TOOL_AGENT = "tool_agent"
SINGLE_TURN_AGENT = "single_turn_agent"
AGENT_NAMES = (TOOL_AGENT, SINGLE_TURN_AGENT)


@dataclass(frozen=True)
class LoopLimits:
    """When a conversation ends: its response budget in tokens (every turn, tool tokens included) and
    verl's turn limits (None: no limit)."""

    response_length: int
    max_assistant_turns: int | None = None
    max_user_turns: int | None = None

    @classmethod
    def from_config(cls, multi_turn: Any, response_length: int) -> LoopLimits:
        """From `actor_rollout_ref.rollout.multi_turn` and the rollout's response length."""
        return cls(
            response_length=int(response_length),
            max_assistant_turns=getattr(multi_turn, "max_assistant_turns", None),
            max_user_turns=getattr(multi_turn, "max_user_turns", None),
        )

    def reached(self, used: int, assistant_turns: int, user_turns: int) -> bool:
        """Whether a conversation with `used` response tokens and these turns ends here (verl's order:
        the budget, then the assistant turns, then the user turns)."""
        if used >= self.response_length:
            return True
        if self.max_assistant_turns and assistant_turns >= self.max_assistant_turns:
            return True
        return bool(self.max_user_turns and user_turns >= self.max_user_turns)


@dataclass
class ConversationRequest:
    """One prompt of the batch: its ids (templated with the tools), its messages and the data's kwargs."""

    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    tools_kwargs: dict[str, Any] = field(default_factory=dict)
    interaction_kwargs: dict[str, Any] = field(default_factory=dict)
    agent_name: str = TOOL_AGENT


@dataclass
class AgentData:
    """What a tool's `execute(..., agent_data=...)` sees of its conversation, with verl's names: the
    messages so far (assistant turns decoded, tool answers), the data's kwargs, the turn counts, and
    `extra_fields` for a tool's own session state."""

    messages: list[dict[str, Any]]
    request_id: str
    tools_kwargs: dict[str, Any]
    interaction_kwargs: dict[str, Any]
    metrics: dict[str, float] = field(default_factory=dict)
    tool_rewards: list[float] = field(default_factory=list)
    turn_scores: list[float] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    extra_fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class Conversation:
    """One sample's rollout: response ids over all turns, log-probs (0.0 on appended tokens), the loss
    mask (1 = sampled by the policy), the tools' step rewards, turn counts and counters, and the
    interaction's turn scores."""

    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int]
    finish_reason: str
    assistant_turns: int
    user_turns: int
    tool_rewards: list[float]
    metrics: dict[str, float]
    turn_scores: list[float] = field(default_factory=list)

    @property
    def num_turns(self) -> int:
        """verl's count: user (tool) turns + assistant turns + the prompt."""
        return self.user_turns + self.assistant_turns + 1


def turn_params(params: SamplingParams, n: int, used: int, response_length: int) -> SamplingParams:
    """`params` for a turn of `n` samples that may use what is left of the response budget."""
    return replace(params, n=n, max_tokens=response_length - used)


class ToolAgentLoop:
    """Conversations with tools over an `AsyncRollout` (see the module docstring)."""

    def __init__(
        self,
        tools: ToolSet,
        tokenizer: Any,
        limits: LoopLimits,
        interactions: dict[str, BaseInteraction] | None = None,
    ) -> None:
        self.tools = tools
        self.tokenizer = tokenizer
        self.limits = limits
        self.delta = ChatDelta(tokenizer)
        self.interactions = interactions or {}

    async def run(
        self, rollout: AsyncRollout, request: ConversationRequest, params: SamplingParams, prompt_index: int
    ) -> list[Conversation]:
        """The `params.n` conversations of one prompt, in sample order."""
        multi = request.agent_name == TOOL_AGENT
        # Picked before generating, so a row naming no or an unknown interaction costs no engine time.
        interaction = (
            pick_interaction(self.interactions, request.interaction_kwargs, str(prompt_index))
            if multi and self.interactions
            else None
        )
        first_params = turn_params(params, params.n, 0, self.limits.response_length)
        tick = time.perf_counter()
        firsts = await rollout.generate(request.prompt_ids, first_params, keep=multi)
        first_s = time.perf_counter() - tick
        if not multi:
            return [self._single(prompt_index, out, first_s) for out in firsts]
        return list(
            await asyncio.gather(
                *(
                    self.converse(rollout, out, request, params, prompt_index, first_s, interaction)
                    for out in firsts
                )
            )
        )

    def _single(self, prompt_index: int, out: SequenceOutput, generate_s: float) -> Conversation:
        """A one-turn conversation (single_turn_agent)."""
        return Conversation(
            prompt_index,
            out.token_ids,
            out.logprobs,
            out.loss_mask,
            out.finish_reason,
            1,
            0,
            [],
            {"agent_loop/generate_sequences": generate_s, "agent_loop/tool_calls": 0.0},
        )

    async def converse(
        self,
        rollout: AsyncRollout,
        first: SequenceOutput,
        request: ConversationRequest,
        params: SamplingParams,
        prompt_index: int,
        generate_s: float,
        interaction: BaseInteraction | None = None,
    ) -> Conversation:
        """Continue one held sample turn after turn until a limit, a turn without calls (and no
        interaction to answer it) or the interaction's stop; release it."""
        data = AgentData(
            messages=list(request.messages),
            request_id=uuid4().hex,
            tools_kwargs=request.tools_kwargs,
            interaction_kwargs=request.interaction_kwargs,
            assistant_turns=1,
        )
        session = None
        counters: list[dict[str, float]] = []
        if interaction is not None:
            session = InteractionSession(
                interaction, data.request_id, request.interaction_kwargs, self.tools.guard
            )
            started, _ = await interaction_call(session.start(), counters)
            if not started:
                session = None
        budget = self.limits.response_length
        out, tool_s, cut, tail = first, 0.0, False, []
        try:
            while not self.limits.reached(len(out.token_ids), data.assistant_turns, data.user_turns):
                text = self.tokenizer.decode(out.last_turn, skip_special_tokens=True)
                data.messages.append({"role": "assistant", "content": text})
                calls = self.tools.parse_message(text).calls
                if calls:
                    tick = time.perf_counter()
                    answers = await self._tool_answers(calls, data, counters)
                    tool_s += time.perf_counter() - tick
                    appended = self.delta.appended_ids(answers)
                    if len(out.token_ids) + len(appended) >= budget:
                        cut = True  # verl: an answer that would fill the budget ends the conversation unsent
                        break
                elif session is not None:
                    answered, turn = await interaction_call(self._user_turn(session, data), counters)
                    if not answered or turn is None:
                        break
                    stop, appended = turn
                    if stop or len(out.token_ids) + len(appended) >= budget:
                        # verl appends and counts this last user turn too, then cuts to the budget.
                        tail = appended[: budget - len(out.token_ids)]
                        data.user_turns += 1
                        break
                else:
                    break
                data.user_turns += 1
                tick = time.perf_counter()
                used = len(out.token_ids) + len(appended)
                out = await rollout.resume(
                    out.seq_id, appended, turn_params(params, 1, used, budget), keep=True
                )
                generate_s += time.perf_counter() - tick
                data.assistant_turns += 1
        finally:
            rollout.release(out.seq_id)
            if session is not None:
                await interaction_call(session.finish(), counters)
        metrics = {
            "tools/calls": 0.0,
            "tools/errors": 0.0,
            **sum_metrics(counters),
            "agent_loop/generate_sequences": generate_s,
            "agent_loop/tool_calls": tool_s,
        }
        full = cut or len(out.token_ids) + len(tail) >= budget
        return Conversation(
            prompt_index,
            out.token_ids + tail,
            out.logprobs + [0.0] * len(tail),
            out.loss_mask + [0] * len(tail),
            "length" if full else out.finish_reason,
            data.assistant_turns,
            data.user_turns,
            data.tool_rewards,
            metrics,
            data.turn_scores,
        )

    async def _tool_answers(
        self, calls: list[Any], data: AgentData, counters: list[dict[str, float]]
    ) -> list[dict[str, Any]]:
        """Run one turn's calls; their messages join the conversation, rewards and counters are kept."""
        results = await self.tools.run_turn(calls, data.tools_kwargs, agent_data=data)
        answers = [result.message() for result in results]
        data.messages.extend(answers)
        data.tool_rewards += [float(r.reward) for r in results if r.reward is not None]
        counters += [result.metrics for result in results]
        return answers

    async def _user_turn(self, session: InteractionSession, data: AgentData) -> tuple[bool, list[int]]:
        """Ask the interaction (verl's INTERACTING state): its message joins the conversation as a user
        turn, its score the turn scores; returns whether it ends the conversation and the ids to append."""
        reply = await session.reply(data.messages)
        message = {"role": "user", "content": reply.content}
        data.messages.append(message)
        if reply.score is not None:
            data.turn_scores.append(reply.score)
        return reply.should_terminate, self.delta.appended_ids([message])


async def interaction_call(call: Awaitable[T], counters: list[dict[str, float]]) -> tuple[bool, T | None]:
    """`(True, await call)`; `(False, None)`, the failure counted in `counters` and logged, when it
    raised, returned something that is not a reply, or ran past its time limit."""
    try:
        return True, await call
    except CallTimeout as err:
        kind, said = "timeout", str(err)
    except (Exception, SystemExit) as err:
        kind, said = "failed", f"{type(err).__name__}: {err}"
    log.warning("%s; the conversation ends here", said)
    counters.append({"interaction/errors": 1.0, f"interaction/errors/{kind}": 1.0})
    return False, None


def request_of(item: Mapping[str, Any], prompt_ids: list[int] | None = None) -> ConversationRequest:
    """The conversation request of a data item (fulcrum.data.dataset): its prompt ids, raw chat, and
    `extra_info.tools_kwargs` / `interaction_kwargs`; `agent_name` from its column or `extra_info`
    (none: the tool agent, since multi_turn is on)."""
    info = item.get("extra_info") or {}
    name = item.get("agent_name") or info.get("agent_name") or TOOL_AGENT
    if name not in AGENT_NAMES:
        raise ValueError(
            f"agent_name {name!r} (data row {item.get('source', '?')}) is not an agent loop fulcrum has; "
            f"known: {', '.join(AGENT_NAMES)}"
        )
    return ConversationRequest(
        prompt_ids=list(prompt_ids if prompt_ids is not None else item["input_ids"]),
        messages=list(item.get("raw_prompt") or []),
        tools_kwargs=dict(info.get("tools_kwargs") or {}),
        interaction_kwargs=dict(info.get("interaction_kwargs") or {}),
        agent_name=name,
    )
