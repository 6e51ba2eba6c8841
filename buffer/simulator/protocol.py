"""The requests the simulator reads, and the error bodies it answers with.

Chat completions (both engines), vLLM's ``/v1/completions`` and SGLang's ``/generate``. Fields
the simulator does not use (``temperature``, ``top_p``, ...) are accepted and ignored, as a real
server accepts them. The README lists what each engine returns.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as plain text: the text parts of a list content, joined."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(str(part.get("text", "")) for part in self.content if part.get("type") == "text")


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    parameters: dict[str, Any] | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str = "function"
    function: FunctionSpec


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = ""
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=128)
    seed: int | None = None
    stream: bool = False
    # Kept as sent: the chat template renders each tool's JSON with its keys in their order.
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream_options: StreamOptions | None = None
    # SGLang's extension: continue the final assistant message instead of starting a new one.
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    skip_special_tokens: bool = True
    # Token ids: vLLM's return_token_ids (both, in vLLM's places); SGLang's three return_* fields.
    return_token_ids: bool | None = None
    return_prompt_token_ids: bool = False
    return_meta_info: bool = False

    @field_validator("tools")
    @classmethod
    def _tools_are_functions(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for tool in tools or []:
            ToolSpec.model_validate(tool)
        return tools

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def identity(self) -> dict[str, Any]:
        """What a request's ``seed`` is combined with: the request as it has always been read.

        Fields added later count only when sent, and tools as parsed, so a seeded request gets
        the reply it got from earlier versions of the simulator (runs replay, seeded tests hold)."""
        unsent = {name for name in _LATER_FIELDS if name not in self.model_fields_set}
        identity = self.model_dump(mode="json", exclude=unsent)
        if self.tools is not None:
            identity["tools"] = [ToolSpec.model_validate(tool).model_dump(mode="json") for tool in self.tools]
        return identity


_LATER_FIELDS = frozenset(
    {
        "stop",
        "stop_token_ids",
        "stream_options",
        "add_generation_prompt",
        "chat_template_kwargs",
        "skip_special_tokens",
        "return_token_ids",
        "return_prompt_token_ids",
        "return_meta_info",
    }
)


class CompletionRequest(BaseModel):
    """vLLM's ``/v1/completions``; the simulator takes a token-id prompt (or a rendered text)."""

    model_config = ConfigDict(extra="allow")

    model: str = ""
    prompt: list[int] | str
    max_tokens: int | None = Field(16, ge=1)
    n: int = Field(1, ge=1, le=128)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    return_token_ids: bool | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


class GenerateRequest(BaseModel):
    """SGLang's native ``/generate``, one request (token ids or a rendered text)."""

    model_config = ConfigDict(extra="allow")

    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    stream: bool = False
    rid: str | None = None
    return_routed_experts: bool = False


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def error_body(
    message: str, error_type: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def flat_error_body(message: str, error_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    """SGLang's (and older vLLM's) shape: ``{"object": "error", "message", "type", "param", "code"}``."""
    return {"object": "error", "message": message, "type": error_type, "param": param, "code": code}
