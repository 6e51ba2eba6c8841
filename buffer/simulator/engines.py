"""The engines the simulator imitates (``--engine``), by name, in one table: ``DIALECTS``.

Every generation route is served whichever engine is imitated (``/generate`` is SGLang's and
``/v1/completions`` vLLM's, and ``shapes.py`` writes them); the pause routes are the imitated
engine's only (``control.py``). What the engine changes is a chat answer, an error and what its
logprobs are (``reported_logprobs``: vLLM's before temperature and filters unless
``--logprobs-mode processed_logprobs``, SGLang's after temperature and before its filters;
``sampling.py``), one class per engine:

- vLLM puts ``prompt_token_ids`` at the top level and ``token_ids`` in the choice (with
  ``return_token_ids``), the reasoning in ``message.reasoning`` and its older name
  ``reasoning_content``, and the matched stop in ``stop_reason``; it answers an unknown model
  with a 404 and errors as ``{"error": {...}}``, and refuses ``continue_final_message`` with
  ``add_generation_prompt``. It continues a final assistant message through the chat template
  (transformers' ``continue_final_message``): the template writes the reply so far again (Qwen3's
  an empty think block before it), and a reply it does not find again is a 400.
- SGLang puts ``prompt_token_ids`` (``return_prompt_token_ids``), ``token_ids``
  (``return_token_ids``) and ``meta_info`` (``return_meta_info``) in the choice, the reasoning
  in ``reasoning_content``, the matched stop (the end-of-turn id, or the string) in
  ``matched_stop``, ``metadata.weight_version`` at the top level (of a ``/v1/completions`` answer
  too) and an ``index`` in each tool call; it serves any model name, answers errors flat
  (``{"object": "error", ...}``), and refuses the ``return_*`` fields with ``stream``. It
  continues a final assistant message by rendering the conversation before it with the
  generation prompt and appending the reply's text (``serving_chat.py``: ``_handle_last_assistant_message``).

Adding an engine dialect: write one ``Dialect`` subclass here with what the engine does
differently (the base class is what both engines above share), and add an instance to
``DIALECTS``; ``--engine`` accepts its name from then on (``Engine``). The simulator stands
alone: it keeps its own copy of each engine's shapes, which the toolkit's dialect table
(``buffer.toolkit.engines``) is tested against.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from buffer.simulator.protocol import ChatRequest, flat_error_body
from buffer.simulator.replies import Generation
from buffer.simulator.sampling import SamplingFields, sampling_logprob, tempered_logprob
from buffer.simulator.shapes import ChatChoice, meta_info, stop_reason, tool_calls_body


class Dialect:
    """Where one engine puts what in a chat answer and an error; the base is what all share."""

    name: ClassVar[str]
    #: ``error.type`` of a request whose body does not validate.
    invalid_request_type: ClassVar[str] = "BadRequestError"
    #: How ``continue_final_message`` renders the reply so far: through the chat template
    #: (``"template"``), or as its text after the generation prompt (``"prefix"``).
    continues_by: ClassVar[Literal["template", "prefix"]] = "template"

    def reported_logprobs(
        self, raw: list[float], fields: SamplingFields, others: int, mode: str | None
    ) -> list[float]:
        """The logprobs the engine returns for sampled tokens whose raw logprobs are ``raw``, with
        ``mode`` its logprobs mode (``--logprobs-mode``; None: the engine's default)."""
        return raw

    def error_body(self, message: str, error_type: str, status: int, param: str | None) -> dict[str, Any]:
        """OpenAI's nested error shape, with the status as its code."""
        return {"error": {"message": message, "type": error_type, "param": param, "code": status}}

    def refuses_model(self, model: str, served: str) -> bool:
        """Whether a request naming ``model`` is answered 404 (this server serves ``served``)."""
        return False

    def chat_refusal(self, request: ChatRequest) -> str | None:
        """Why the engine refuses this chat request with a 400, or None."""
        return None

    def message(self, choice: ChatChoice) -> dict[str, Any]:
        """A chat choice's ``message``."""
        message: dict[str, Any] = {"role": "assistant", "content": choice.output.content}
        message.update(self.reasoning_fields(choice.output.reasoning))
        calls = self.tool_calls(choice)
        if calls:
            message["tool_calls"] = calls
        return message

    def reasoning_fields(self, reasoning: str | None) -> dict[str, Any]:
        """The reasoning fields of a ``message``."""
        return {"reasoning_content": reasoning}

    def reasoning_delta(self, reasoning: str) -> dict[str, Any]:
        """The reasoning fields of a streamed chunk's delta."""
        return {"reasoning_content": reasoning}

    def tool_calls(self, choice: ChatChoice) -> list[dict[str, Any]]:
        return tool_calls_body(choice)

    def choice_fields(
        self,
        request: ChatRequest,
        generation: Generation,
        prompt_ids: list[int],
        eos_id: int,
        weight_version: str,
        started: float,
    ) -> dict[str, Any]:
        """The fields of a chat choice after its ``finish_reason``."""
        return {}

    def answer_fields(
        self, request: ChatRequest, prompt_ids: list[int], weight_version: str
    ) -> dict[str, Any]:
        """The fields of a chat answer after its ``usage``."""
        return {}

    def stream_prompt_ids(self, request: ChatRequest, prompt_ids: list[int]) -> list[int] | None:
        """The prompt's ids a streamed answer sends in its first chunk (then each chunk's ids), or None."""
        return None

    def stop_field(self, generation: Generation, eos_id: int) -> dict[str, Any]:
        """What a completion's choice (and the last chunk of a streamed choice) says of the stop
        it matched."""
        return {}

    def completion_fields(self, weight_version: str) -> dict[str, Any]:
        """The fields of a ``/v1/completions`` answer after its ``usage``."""
        return {}


class VLLM(Dialect):
    name = "vllm"

    def reported_logprobs(
        self, raw: list[float], fields: SamplingFields, others: int, mode: str | None
    ) -> list[float]:
        """Before temperature and filters (``raw_logprobs``, the default), or after them all
        (``processed_logprobs``): ``v1/sample/sampler.py``, ``Sampler.forward``."""
        if mode not in ("processed_logprobs", "processed_logits"):
            return raw
        return [sampling_logprob(value, others, fields) for value in raw]

    def refuses_model(self, model: str, served: str) -> bool:
        return bool(model) and model != served

    def chat_refusal(self, request: ChatRequest) -> str | None:
        if request.continue_final_message and request.add_generation_prompt:
            return "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        return None

    def reasoning_fields(self, reasoning: str | None) -> dict[str, Any]:
        return {"reasoning": reasoning, "reasoning_content": reasoning}

    def reasoning_delta(self, reasoning: str) -> dict[str, Any]:
        return {"reasoning_content": reasoning, "reasoning": reasoning}

    def choice_fields(
        self,
        request: ChatRequest,
        generation: Generation,
        prompt_ids: list[int],
        eos_id: int,
        weight_version: str,
        started: float,
    ) -> dict[str, Any]:
        fields: dict[str, Any] = {"stop_reason": stop_reason(generation, eos_id)}
        if request.return_token_ids:
            fields["token_ids"] = generation.ids
        return fields

    def answer_fields(
        self, request: ChatRequest, prompt_ids: list[int], weight_version: str
    ) -> dict[str, Any]:
        return {"prompt_token_ids": prompt_ids} if request.return_token_ids else {}

    def stream_prompt_ids(self, request: ChatRequest, prompt_ids: list[int]) -> list[int] | None:
        return prompt_ids if request.return_token_ids else None

    def stop_field(self, generation: Generation, eos_id: int) -> dict[str, Any]:
        return {"stop_reason": stop_reason(generation, eos_id)}


class SGLang(Dialect):
    name = "sglang"
    invalid_request_type = "invalid_request_error"
    continues_by = "prefix"

    def reported_logprobs(
        self, raw: list[float], fields: SamplingFields, others: int, mode: str | None
    ) -> list[float]:
        """After temperature, before top-p, top-k and min-p; before temperature too with
        ``SGLANG_RETURN_ORIGINAL_LOGPROB`` (``raw_logprobs``): ``layers/sampler.py``."""
        if mode == "raw_logprobs" or fields.greedy:
            return raw
        return [tempered_logprob(value, others, fields.temperature) for value in raw]

    def error_body(self, message: str, error_type: str, status: int, param: str | None) -> dict[str, Any]:
        return flat_error_body(message, error_type, status, param)

    def chat_refusal(self, request: ChatRequest) -> str | None:
        if request.stream and (
            request.return_prompt_token_ids or request.return_token_ids or request.return_meta_info
        ):
            return (
                "return_prompt_token_ids, return_token_ids and return_meta_info are not supported with stream"
            )
        return None

    def message(self, choice: ChatChoice) -> dict[str, Any]:
        message = super().message(choice)
        message.setdefault("tool_calls", None)  # null when there are none
        return message

    def tool_calls(self, choice: ChatChoice) -> list[dict[str, Any]]:
        calls = tool_calls_body(choice)
        for index, call in enumerate(calls):
            call["index"] = index
        return calls

    def choice_fields(
        self,
        request: ChatRequest,
        generation: Generation,
        prompt_ids: list[int],
        eos_id: int,
        weight_version: str,
        started: float,
    ) -> dict[str, Any]:
        fields: dict[str, Any] = {"matched_stop": generation.matched_stop}
        if request.return_prompt_token_ids:
            fields["prompt_token_ids"] = prompt_ids
        if request.return_token_ids:
            fields["token_ids"] = generation.ids
        if request.return_meta_info:
            fields["meta_info"] = meta_info(
                generation, len(prompt_ids), weight_version, request.logprobs, started
            )
        return fields

    def answer_fields(
        self, request: ChatRequest, prompt_ids: list[int], weight_version: str
    ) -> dict[str, Any]:
        return {"metadata": {"weight_version": weight_version}}

    def stop_field(self, generation: Generation, eos_id: int) -> dict[str, Any]:
        return {"matched_stop": generation.matched_stop}

    def completion_fields(self, weight_version: str) -> dict[str, Any]:
        return {"metadata": {"weight_version": weight_version}}  # ``serving_completions.py``


#: The engines by name, in the order ``--help`` lists them.
DIALECTS: dict[str, Dialect] = {entry.name: entry for entry in (VLLM(), SGLang())}

if TYPE_CHECKING:
    Engine = str
else:
    #: The names ``--engine`` accepts: those of ``DIALECTS`` (a ``Literal`` of them, for the flags' choices).
    Engine = Literal[tuple(DIALECTS)]
