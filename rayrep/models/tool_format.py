"""How a policy's turns call a tool and read its output (`ToolFormat`): the call's markup, and
the text its chat template frames a tool's output with. The generators append a tool's output
to an answer so (`rayrep.generator.turns`), and the tiny policy's warm start writes its tool
trajectories so (`rayrep.models.tiny`): the two agree token for token."""

from __future__ import annotations

from dataclasses import dataclass

from rayrep.errors import InputError

TRUNCATED = " [output truncated]"
"""What ends a tool's output that was cut at `tools.max_output_chars`."""

_PROBE = ("Q", "X", "\x00tool-output\x00")
"""A user message, an assistant message and a tool output the template is rendered with, to
read how it frames a tool message (`ToolFormat.of`)."""


@dataclass(frozen=True)
class ToolFormat:
    """How a policy's turns call a tool and read its output: the call's markup, and the text
    around a tool's output (read from the policy's chat template)."""

    call_start: str
    call_end: str
    head: str
    """The text between the end of the policy's turn and the tool's output: the rest of the
    template's closing of an assistant message, and its opening of a tool message."""
    tail: str
    """The text after the tool's output: its closing of the tool message and the next
    assistant turn's generation prompt."""
    max_output_chars: int
    stop_token: int | None = None
    """The call's closing markup as one token of the vocabulary, which ends a turn (sampling
    stops there); None: a turn ends where the policy ends its message."""

    @classmethod
    def of(cls, tokenizer, call_start: str, call_end: str, max_output_chars: int, name: str = "the policy") -> "ToolFormat":
        """The format of `tokenizer`'s chat template (an InputError, naming `name`, when the
        template has no tool role, or renders a tool message other than as an addition to
        the conversation before it)."""
        if not call_start or not call_end:
            raise InputError("tools.call_start and tools.call_end must both be set: the markup around a tool call")
        question, answer, output = _PROBE
        conversation = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]

        def render(messages, prompt: bool) -> str:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)

        if getattr(tokenizer, "chat_template", None) is None:
            raise InputError(f"{name}'s tokenizer has no chat template: a tool's output joins an answer as the chat "
                             "template frames a tool message")
        before = render(conversation, False)
        try:
            after = render(conversation + [{"role": "tool", "content": output}], True)
        except Exception as err:  # (a template that raises on a role it does not know)
            raise InputError(f"{name}'s chat template has no tool role ({type(err).__name__}: {err}): a tool's output "
                             "joins an answer as a tool message") from None
        as_other = [render(conversation + [{"role": role, "content": output}], True) for role in ("assistant", "user")]
        if output not in after or after in as_other:
            raise InputError(f"{name}'s chat template has no tool role: it renders a tool message as "
                             f"{'nothing' if output not in after else 'another role'}'s (a tool's output joins an answer "
                             "as a tool message)")
        if not after.startswith(before) or answer not in before:
            raise InputError(f"{name}'s chat template renders a tool message other than after the conversation "
                             "before it: rayrep cannot append a tool's output to an answer with it")
        closing = before[before.rindex(answer) + len(answer):]
        head, tail = after[len(before):].split(output, 1)
        end_ids = tokenizer(call_end, add_special_tokens=False)["input_ids"]
        return cls(call_start, call_end, closing + head, tail, max_output_chars,
                   stop_token=end_ids[0] if len(end_ids) == 1 else None)

    def call(self, turn: str) -> str | None:
        """The first complete call in a turn's text (what is between its markup), or None."""
        start = turn.find(self.call_start)
        if start < 0:
            return None
        end = turn.find(self.call_end, start + len(self.call_start))
        return None if end < 0 else turn[start + len(self.call_start) : end]

    def output_text(self, output: str, turn_end: str) -> str:
        """The text a tool's `output` joins the answer as, after a turn whose last token reads
        `turn_end` (the end-of-sequence token the template's closing starts with is the
        policy's own already)."""
        if len(output) > self.max_output_chars:
            output = output[: self.max_output_chars] + TRUNCATED
        head = self.head[len(turn_end):] if turn_end and self.head.startswith(turn_end) else self.head
        return head + output + self.tail

    def output_ids(self, tokenizer, output: str, last_token: int | None) -> list[int]:
        """The token ids a tool's `output` joins the answer as, after a turn whose last token is
        `last_token` (None: an empty answer): what the generators append, and what the tiny
        policy's warm start writes."""
        turn_end = tokenizer.decode([last_token], skip_special_tokens=False) if last_token is not None else ""
        return tokenizer(self.output_text(output, turn_end), add_special_tokens=False)["input_ids"]

    def framing_tokens(self, tokenizer) -> int:
        """Tokens of the framing of an empty output: the least a tool's turn adds."""
        return len(tokenizer(self.head + self.tail, add_special_tokens=False)["input_ids"])
