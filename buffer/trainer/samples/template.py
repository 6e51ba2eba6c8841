"""What a chat template writes around an assistant message, found by rendering probe conversations.

Each converter probes its tokenizer's template once, for what cannot be read off one conversation alone:

- the generation prompt: what ``add_generation_prompt=True`` appends ("<|im_start|>assistant\\n",
  "<|start_header_id|>assistant<|end_header_id|>\\n\\n", Qwen3's "<|im_start|>assistant\\n<think>\\n"); some
  templates have none (Mistral's: the reply follows "[/INST]" directly);
- the end-of-turn tokens: the added token the template writes after a reply, after a reply followed by more
  messages, and after a tool call ("<|im_end|>"; gpt-oss writes "<|return|>", "<|end|>" and "<|call|>");
- the reasoning slot: what the template writes before and after a message's ``reasoning_content`` (Qwen3's
  "<think>\\n" and "\\n</think>\\n\\n"), so that the empty block it writes for a reply without reasoning can
  be told from what the model generated;
- how tool-call arguments go in: as objects (templates that ``tojson`` them), or as the JSON strings of the
  OpenAI format (templates that concatenate them, DeepSeek's);
- the markers a template wraps around a tool-call message's content (Llama 4's "<|python_start|>" and
  "<|python_end|>", written even around no content): the template's, not known to be the model's;
- for a template that closes no reply (GLM-4.5), the marker that opens the next message after a reply and
  after a tool call ("<|user|>", "<|observation|>"): the token such a model samples to end its turn.

Nothing here is a table of known templates: each is read off the tokenizer's own template.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any, Literal, Protocol

from buffer.trainer.samples.sample import SampleConversionError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_QUESTION = "ROLLOUT_BUFFER_PROBE_QUESTION"
_FOLLOW_UP = "ROLLOUT_BUFFER_PROBE_FOLLOW_UP"
_REPLY = "ROLLOUT_BUFFER_PROBE_REPLY"
_REASONING = "ROLLOUT_BUFFER_PROBE_REASONING"
_TOOL = "rollout_buffer_probe_tool"
_CALL_ID = "probe0001"  # nine characters: Mistral's templates insist on it
_RESULT = "ROLLOUT_BUFFER_PROBE_RESULT"

ArgumentsForm = Literal["object", "string"]


@dataclass(frozen=True, slots=True)
class ReasoningSlot:
    """What the template writes around a reply's reasoning, after the header and before the content."""

    opening: str  # "" where the generation prompt opens it (Qwen3's "<think>\\n")
    closing: str

    @property
    def empty_block(self) -> str:
        """What it writes for a reply without reasoning: scaffolding, never the model's."""
        return self.opening + self.closing


@dataclass(frozen=True, slots=True)
class ChatTemplateAnalysis:
    """What one tokenizer's chat template writes around an assistant turn."""

    generation_prompt: str
    end_of_turn: tuple[str, ...]  # longest first
    reply_ends_with_token: bool  # False: the template writes nothing after the last reply (GLM-4.5)
    reasoning: ReasoningSlot | None
    tool_arguments: ArgumentsForm | None  # None: the template renders no tool call
    markers: tuple[str, ...]  # the tokenizer's added tokens, longest first
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)  # e.g. {"enable_thinking": False}
    #: The markers around a tool-call message's content (Llama 4: "<|python_start|>", "<|python_end|>").
    call_content_wrapper: tuple[str, str] | None = None
    #: A template that closes no reply: the marker after a reply ("<|user|>") and after a tool call
    #: ("<|observation|>"), which the model samples to end its turn. None where the template closes replies.
    reply_stop: str | None = None
    call_stop: str | None = None

    @property
    def header_prefixes(self) -> tuple[str, ...]:
        """The generation prompt, and its shorter prefixes that end where one of its markers starts or ends.

        A template may write a shorter header before replies in the history than the one it prompts with
        (Qwen3 writes "<|im_start|>assistant\\n" without "<think>\\n"). Cutting only at marker boundaries,
        never before the first marker and the role name after it, keeps "<|im_start|>", a lone "\\n" or a
        "<" from passing for one.
        """
        prompt = self.generation_prompt
        cuts = {len(prompt)}
        position = 0
        while position < len(prompt):
            marker = next((m for m in self.markers if prompt.startswith(m, position)), None)
            if marker is None:
                position += 1
                continue
            cuts.update((position, position + len(marker)))
            position += len(marker)
        least = min(
            (c for c in cuts if c > 0 and any(prompt[:c].endswith(m) for m in self.markers)),
            default=len(prompt),
        )
        while least < len(prompt) and least not in cuts:  # and the role name after it ("assistant\\n")
            least += 1
        return tuple(prompt[:cut] for cut in sorted(cuts, reverse=True) if cut >= least and cut)


Tools = Sequence[Mapping[str, Any]]


class _Render(Protocol):
    def __call__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Tools | None = None,
        add_generation_prompt: bool = False,
    ) -> str: ...


def template_tools(tools: Tools | None) -> list[dict[Any, Any] | Callable[..., Any]] | None:
    """Tool schemas as ``apply_chat_template`` takes them."""
    return None if tools is None else [dict(tool) for tool in tools]


@cache
def template_errors() -> tuple[type[Exception], ...]:
    """What a failing chat template raises: jinja2's errors (its raise_exception too), and bad input."""
    errors: tuple[type[Exception], ...] = (ValueError, TypeError, KeyError, AttributeError, IndexError)
    try:
        from jinja2 import TemplateError
    except ImportError:  # pragma: no cover - transformers renders templates with jinja2
        return errors
    return (TemplateError, *errors)


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Tools | None = None,
    add_generation_prompt: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The conversation as the chat template writes it; ``template_kwargs`` go to the template."""
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=template_tools(tools),
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **dict(template_kwargs or {}),
    )
    if not isinstance(text, str):
        raise SampleConversionError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}")
    return text


def added_token_strings(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The tokenizer's added and special tokens: the markers a template writes between messages.

    Not only those flagged special: real tokenizers add "<｜Assistant｜>" or "<think>" as plain added tokens.
    """
    strings = {str(token) for token in tokenizer.added_tokens_decoder.values()}
    strings.update(str(token) for token in tokenizer.all_special_tokens)
    return sorted((s for s in strings if s), key=len, reverse=True)


def analyse_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    *,
    tools: Tools | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> ChatTemplateAnalysis:
    """Render a few probe conversations and read the assistant turn's delimiters off them.

    ``template_kwargs`` are the extra variables the trainer renders with (slime's
    ``apply_chat_template_kwargs``, e.g. ``{"enable_thinking": False}``); every rendering uses them.
    """
    kwargs = dict(template_kwargs or {})

    def render(
        tokenizer: PreTrainedTokenizerBase,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Tools | None = None,
        add_generation_prompt: bool = False,
    ) -> str:
        return render_chat(
            tokenizer,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            template_kwargs=kwargs,
        )

    try:
        return _analyse(tokenizer, tools, render, kwargs)
    except SampleConversionError:
        raise
    except template_errors() as exc:
        raise SampleConversionError(f"the chat template cannot render a probe conversation: {exc}") from exc


def _analyse(
    tokenizer: PreTrainedTokenizerBase, tools: Tools | None, render_chat: _Render, kwargs: dict[str, Any]
) -> ChatTemplateAnalysis:
    question = {"role": "user", "content": _QUESTION}
    reply = {"role": "assistant", "content": _REPLY}
    follow_up = {"role": "user", "content": _FOLLOW_UP}
    markers = added_token_strings(tokenizer)

    bare = render_chat(tokenizer, [question], tools=tools)
    prompted = render_chat(tokenizer, [question], tools=tools, add_generation_prompt=True)
    # Phi-3 ends a conversation without the generation prompt with its eos token: what follows the
    # messages in both renderings is the generation prompt.
    common = _common_prefix(bare, prompted)
    for marker in markers:  # never split a marker ("<|endoftext|>" and "<|assistant|>" share "<|")
        for at in range(max(common - len(marker) + 1, 0), common):
            if prompted.startswith(marker, at):
                common = min(common, at)
    if common < bare.index(_QUESTION) + len(_QUESTION):
        raise SampleConversionError("the chat template's generation prompt rewrites the messages before it")
    generation_prompt = prompted[common:]

    last = render_chat(tokenizer, [question, reply], tools=tools)
    if _REPLY not in last:
        raise SampleConversionError("the chat template does not write an assistant message's content")
    if not generation_prompt and any(m in last[common : last.index(_REPLY)] for m in markers):
        raise SampleConversionError(
            "the chat template writes no generation prompt (add_generation_prompt=True adds nothing), yet "
            "writes a header before a reply, so where the model's reply starts cannot be found"
        )
    after_last = last[last.index(_REPLY) + len(_REPLY) :]
    ends: set[str] = set()
    last_end = _marker_at_start(after_last, markers)
    if last_end:
        ends.add(last_end)
    history = render_chat(tokenizer, [question, reply, follow_up], tools=tools)
    between = history[history.index(_REPLY) + len(_REPLY) : history.index(_FOLLOW_UP)]
    history_end = _marker_at_start(between, markers)
    if history_end and _count_markers(between, markers) > 1:  # else it is the next message's header
        ends.add(history_end)
    arguments, call_end = _probe_tool_calls(tokenizer, question, markers, render_chat)
    if call_end:
        ends.add(call_end)
    wrapper, call_stop = _probe_call_message(tokenizer, question, markers, render_chat, arguments)
    if not ends:
        raise SampleConversionError(
            "the chat template writes no added or special token after an assistant message, "
            "so the end of an assistant turn cannot be found"
        )
    return ChatTemplateAnalysis(
        generation_prompt=generation_prompt,
        end_of_turn=tuple(sorted(ends, key=len, reverse=True)),
        reply_ends_with_token=bool(last_end),
        reasoning=_probe_reasoning(tokenizer, question, prompted, tools, render_chat),
        tool_arguments=arguments,
        markers=tuple(markers),
        template_kwargs=kwargs,
        call_content_wrapper=wrapper,
        reply_stop=None if last_end else _marker_at_start(between, markers),
        call_stop=None if last_end else call_stop,
    )


def _common_prefix(a: str, b: str) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


def _marker_at_start(text: str, markers: Sequence[str]) -> str | None:
    """The added token that ``text`` starts with, past whitespace; None if it starts with anything else."""
    stripped = text.lstrip()
    return next((m for m in markers if stripped.startswith(m)), None)


def _count_markers(text: str, markers: Sequence[str]) -> int:
    count, position = 0, 0
    while position < len(text):
        marker = next((m for m in markers if text.startswith(m, position)), None)
        if marker is None:
            position += 1
        else:
            count += 1
            position += len(marker)
    return count


def _probe_reasoning(
    tokenizer: PreTrainedTokenizerBase,
    question: dict[str, Any],
    prompted: str,
    tools: Tools | None,
    render_chat: _Render,
) -> ReasoningSlot | None:
    """Where the template puts a last reply's reasoning; None if it renders none.

    The reasoning goes in under both names templates read it from: ``reasoning_content`` (Qwen3, GLM) and
    ``thinking`` (gpt-oss).
    """
    reply = {"role": "assistant", "content": _REPLY, "reasoning_content": _REASONING, "thinking": _REASONING}
    try:
        text = render_chat(tokenizer, [question, reply], tools=tools)
    except template_errors():
        return None
    at, content_at = text.find(_REASONING), text.find(_REPLY)
    if at < 0 or content_at < at or not text.startswith(prompted) or len(prompted) > at:
        return None
    return ReasoningSlot(opening=text[len(prompted) : at], closing=text[at + len(_REASONING) : content_at])


def _probe_call_message(
    tokenizer: PreTrainedTokenizerBase,
    question: dict[str, Any],
    markers: Sequence[str],
    render_chat: _Render,
    arguments: ArgumentsForm | None,
) -> tuple[tuple[str, str] | None, str | None]:
    """The markers the template wraps around a tool-call message's content, and the marker that opens
    the message after a tool call (a tool result)."""
    if arguments is None:
        return None, None
    schema = _probe_schema()
    call = {
        "id": _CALL_ID,
        "type": "function",
        "function": {"name": _TOOL, "arguments": {"n": 1} if arguments == "object" else '{"n": 1}'},
    }
    message = {"role": "assistant", "content": _REPLY, "tool_calls": [call]}
    result = {"role": "tool", "tool_call_id": _CALL_ID, "content": _RESULT}
    wrapper = stop = None
    try:
        prompted = render_chat(tokenizer, [question], tools=[schema], add_generation_prompt=True)
        text = render_chat(tokenizer, [question, message], tools=[schema])
        followed = render_chat(tokenizer, [question, message, result], tools=[schema])
    except template_errors():
        return None, None
    if text.startswith(prompted) and _REPLY in text[len(prompted) :]:
        opening = text[len(prompted) : text.index(_REPLY)]
        after = text[text.index(_REPLY) + len(_REPLY) :]
        closing = ""
        while marker := next((m for m in markers if after.startswith(m, len(closing))), None):
            closing += marker
        if opening and closing and _count_markers(opening, markers) and _only_markers(opening, markers):
            wrapper = (opening, closing)
    if followed.startswith(text.rstrip()):
        stop = _marker_at_start(followed[len(text.rstrip()) :], markers)
    return wrapper, stop


def _only_markers(text: str, markers: Sequence[str]) -> bool:
    position = 0
    while position < len(text):
        marker = next((m for m in markers if text.startswith(m, position)), None)
        if marker is None:
            return False
        position += len(marker)
    return True


def _probe_schema() -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": _TOOL,
            "description": "A probe.",
            "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}},
        },
    }


def _probe_tool_calls(
    tokenizer: PreTrainedTokenizerBase, question: dict[str, Any], markers: Sequence[str], render_chat: _Render
) -> tuple[ArgumentsForm | None, str | None]:
    """How the template takes tool-call arguments, and the token it ends a tool-call message with."""
    schema = _probe_schema()
    for form, arguments in (("object", {"n": 1}), ("string", '{"n": 1}')):
        call = {"id": _CALL_ID, "type": "function", "function": {"name": _TOOL, "arguments": arguments}}
        message = {"role": "assistant", "content": "", "tool_calls": [call]}
        try:
            text = render_chat(tokenizer, [question, message], tools=[schema])
        except template_errors():
            continue
        rendered = text[text.find(_QUESTION) :]
        if _TOOL not in rendered or "'n'" in rendered:  # dropped, or a Python repr of a dict
            continue
        tail = text[text.rindex(_TOOL) :].rstrip()
        end = next((m for m in markers if tail.endswith(m)), None)
        return ("object" if form == "object" else "string"), end
    return None, None
