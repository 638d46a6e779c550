"""Token ids of chat messages as the tokenizer's own chat template renders them, for the agent loop.

The prompt is the template over the sample's messages with the tools' schemas (`tools=`) and the
generation prompt, as the data set tokenizes it. What is appended between turns (tool answers) is the
*delta* verl's agent loop appends: the template over the new messages alone, with the generation
prompt, minus the system block the template puts in front of any conversation (verl's
`initialize_system_prompt`: the template of one empty user message, less the part a second one adds).
For Qwen's template a tool answer becomes `<|im_start|>user\\n<tool_response>\\n...\\n</tool_response>
<|im_end|>\\n<|im_start|>assistant\\n`, and the next turn starts right after the generation prompt.

The delta is taken on the rendered text and then tokenized (without special tokens added), as the
data set tokenizes prompts, so a prompt and its appended turns split text the same way.
"""

from __future__ import annotations

from typing import Any


def render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """The chat template over `messages` as text."""
    return str(tokenizer.apply_chat_template(messages, tokenize=False, **kwargs))


def system_block(tokenizer: Any) -> str:
    """The text the template puts before the first message when no system message is given (a default
    system prompt, a BOS token, or nothing), as verl's `initialize_system_prompt` finds it."""
    one = render(tokenizer, [{"role": "user", "content": ""}], add_generation_prompt=False)
    two = render(tokenizer, [{"role": "user", "content": ""}] * 2, add_generation_prompt=False)
    per_message = len(two) - len(one)
    return one[: len(one) - per_message]


class ChatDelta:
    """The ids the agent loop appends for new messages (tool answers, user turns) of a conversation."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.prefix = system_block(tokenizer)

    def encode(self, text: str) -> list[int]:
        """`text` as token ids, no special tokens added (the template wrote them)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def appended_text(self, messages: list[dict[str, Any]]) -> str:
        """The template over `messages` with the generation prompt, less the system block in front."""
        text = render(self.tokenizer, messages, add_generation_prompt=True)
        if not text.startswith(self.prefix):
            raise ValueError(
                "the chat template does not start every conversation with the same system block, so the "
                f"tokens of a tool answer cannot be cut from it (expected {self.prefix[:60]!r} in front)"
            )
        return text[len(self.prefix) :]

    def appended_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The token ids of `appended_text(messages)`."""
        return self.encode(self.appended_text(messages))
