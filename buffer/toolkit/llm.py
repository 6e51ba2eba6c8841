"""The chat client for the policy server: SGLang, vLLM, or ``buffer.simulator``.

It speaks the OpenAI Chat Completions protocol over plain HTTP/1.1 on asyncio (``http11``;
``https://`` engines through aiohttp): httpx over aiohttp cost two thirds of the service's busy
time, aiohttp's own session still twice this transport's CPU per request, and httpx's own pool
collapses at the hundreds of concurrent requests a generator keeps in flight
(encode/httpx#3215). SGLang's extensions are plain JSON fields anyway. Tests pass
``transport=httpx.AsyncHTTPTransport()``, which respx intercepts. Several engine URLs make a
pool (``pool``): least in flight, a group's samples on one engine, dead engines taken out.

Two kinds of failure are handled here, so generators never see them:

- a failed request is retried as ``retries.RetryPolicy`` says: outages, overloads and 429 for
  two minutes, a 500 until the engine gives it the same way three times in a row (an error it
  gives that request every time fails then, with its message), a 4xx not at all;
- an answer that ends with ``finish_reason: "abort"`` (SGLang aborts requests around weight
  updates, vLLM on ``/pause``) is continued at once, within what is left of the ``max_tokens``
  budget, from its token ids: the first prompt's ids and the ids sampled so far go to the
  engine's token route (SGLang's ``/generate``, vLLM's ``/v1/completions``), so the rest is
  sampled after exactly the tokens the sample holds. Continuing as text
  (``continue_final_message``) makes the engine render the reply so far again through the chat
  template, which is another context (Qwen3's template writes an empty think block before it;
  vLLM refuses a reply it cannot find again with a 400): it is only the fallback, where the
  engine gave no ids or has no token route, and its part is recorded from the prompt the engine
  reports for it, never spliced onto the first (``continued``). Only an abort that brought no
  new token is followed by a wait (``ContinuePolicy``): a fixed pause per abort cost 40% of
  throughput at 10% aborts. A continuation the engine refuses leaves the answer as it was,
  aborted, rather than failing it.

Every request and every failed one is counted on ``ChatClient.stats`` as it happens, so an
outage shows on a job's progress while it lasts, not only once its answers come.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import httpx
import orjson

from buffer.policy.gate import Gate
from buffer.toolkit.engines import (
    CHAT_ONLY_FIELDS,
    TOKEN_ROUTE_MISSING,
    AnswerShapeError,
    Dialect,
    Engine,
    Generated,
    ToolCallParser,
    answer_engine,
    chat_tokens,
    dialect,
    error_message,
    hermes_tool_calls,
)
from buffer.toolkit.http11 import Http11Transport
from buffer.toolkit.parts import continued, entered, step_of, versioned
from buffer.toolkit.pool import EnginePool, routing_key
from buffer.toolkit.retries import (
    RETRYABLE_STATUS,
    LLMError,
    RetryableStatus,
    RetryPolicy,
    SameError,
    retrying,
)
from buffer.toolkit.transport import (
    ROUTING_KEY_HEADER,
    HttpxTransport,
    Reply,
    Transport,
    Unreachable,
)
from buffer.toolkit.types import Completion, Message, TokenCapture

logger = logging.getLogger(__name__)

__all__ = [
    "RETRYABLE_STATUS",
    "ChatClient",
    "ContinuePolicy",
    "EngineClient",
    "LLMError",
    "LLMStats",
    "RetryPolicy",
    "continued",
    "engine_base_url",
    "engine_root_url",
]


@dataclass(slots=True)
class LLMStats:
    """What one client has asked of the policy server, counted as it happens.

    A failure is an HTTP request that got no usable answer: a retryable or a client error
    status (``"HTTP 503"``), a transport error (``"ConnectError"``, ``"ReadTimeout"``, ...), or
    an answer that is no JSON (``"invalid JSON"``); retried or not."""

    requests: int = 0
    failures: int = 0
    failures_by_kind: Counter[str] = field(default_factory=Counter)

    def failed(self, kind: str) -> None:
        self.failures += 1
        self.failures_by_kind[kind] += 1

    def copy(self) -> LLMStats:
        return LLMStats(self.requests, self.failures, Counter(self.failures_by_kind))


@dataclass(frozen=True, slots=True)
class ContinuePolicy:
    """How aborted answers are continued: at once while an abort brings new tokens, and after a
    wait (``delay_s``, doubled each time up to ``max_delay_s``) only when one brought none, for
    at most ``max_continuations`` continuations. ``request_fields`` replace the engine's own
    fields that continue a chat answer as text, where it cannot be continued from its ids
    (``None``: the engine's, see ``engines``)."""

    max_continuations: int = 8
    delay_s: float = 0.5
    max_delay_s: float = 10.0
    request_fields: dict[str, Any] | None = None

    def backoff_s(self, empty_in_a_row: int) -> float:
        """The wait before a continuation, after ``empty_in_a_row`` aborts that brought nothing."""
        if empty_in_a_row <= 0:
            return 0.0
        return float(min(self.max_delay_s, self.delay_s * 2 ** (empty_in_a_row - 1)))


def engine_base_url(url: str) -> str:
    """slime's rule: the engine URL is used as is when it names ``/v1``, else ``/v1`` is added."""
    url = url.rstrip("/")
    return url if "/v1" in url else url + "/v1"


def engine_root_url(url: str) -> str:
    """The server's root, where SGLang's native ``/generate`` is: the URL without ``/v1``."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class EngineClient:
    """One shared HTTP client to the policy server(s), with retries and counting: what the chat
    client and the token client (``tito.TokenClient``) have in common.

    ``transport`` replaces the HTTP transport (``http11``): a ``transport.Transport``, or any
    ``httpx.AsyncBaseTransport`` (tests: respx, an ASGI app). Several engine URLs make a pool
    (``pool.EnginePool``); each request carries the task's routing key (``pool.routing_key``),
    in the SGLang router's header too."""

    #: How its prompts reach the engine (``Completion.mode``): "chat" or "token"; None: unsaid.
    mode: str | None = None

    def __init__(
        self,
        *,
        api_key: str | None = None,
        max_connections: int = 1000,
        timeout_s: float = 600.0,
        retry: RetryPolicy | None = None,
        continuation: ContinuePolicy | None = None,
        transport: httpx.AsyncBaseTransport | Transport | None = None,
        health_interval_s: float = 2.0,
        routed_experts: bool = False,
    ) -> None:
        self.retry = retry or RetryPolicy()
        self.routed_experts = routed_experts  # ask SGLang's token route for them (MoE routing replay)
        self.continuation = continuation or ContinuePolicy()
        self.stats = LLMStats()
        #: Closed while the trainer updates the weights (``buffer.policy``): every request
        #: waits at it, and time spent closed counts against no retry budget.
        self.gate: Gate | None = None
        self._headers = {"content-type": "application/json"}
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"
        if transport is None:
            self._transport: Transport = Http11Transport(max_connections=max_connections, timeout_s=timeout_s)
        elif isinstance(transport, httpx.AsyncBaseTransport):
            self._transport = HttpxTransport(transport, timeout_s=timeout_s)
        else:
            self._transport = transport
        self._health_interval_s = health_interval_s
        self.pool = EnginePool(["http://unset"], self._transport)  # the subclass's _engines() sets it
        self._bases: list[str] = []
        self._urls: list[str] = []
        self._token_routes: dict[str, list[str]] = {}
        #: What this client has logged once (each kind of surprise is said once, then counted).
        self._told: set[str] = set()

    def _pauses(self) -> int:
        """The gate's pauses so far: an answer aborted while this moved was aborted by the
        trainer's pause, a continuation no ``max_continuations`` counts."""
        return self.gate.closures if self.gate is not None else 0

    def _engines(self, base_url: str | Sequence[str], request_url: Callable[[str], str]) -> None:
        """The engines behind ``base_url`` (one URL, or several: a pool), each asked at
        ``request_url(url)``."""
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        self.pool = EnginePool(urls, self._transport, health_interval_s=self._health_interval_s)
        self._bases = urls
        self._urls = [request_url(url) for url in urls]

    def _token_route(self, route: Dialect) -> list[str]:
        """The URL of ``route``'s token endpoint on each engine."""
        urls = self._token_routes.get(route.name)
        if urls is None:
            at = engine_base_url if route.token_path_under_v1 else engine_root_url
            urls = self._token_routes[route.name] = [at(url) + route.token_path for url in self._bases]
        return urls

    async def _generate(
        self,
        route: Dialect,
        model: str,
        prompt_ids: list[int],
        max_tokens: int | None,
        sampling: dict[str, Any],
        seed: int | None,
    ) -> tuple[Generated, int]:
        """One answer of ``route``'s token endpoint to ``prompt_ids``, and the HTTP requests made."""
        body = route.token_request(model, prompt_ids, max_tokens, sampling, seed)
        if self.routed_experts and route.token_path == "/generate":
            body["return_routed_experts"] = True
        answer, tries = await self._post(body, self._token_route(route))
        try:
            return route.read_tokens(answer), tries
        except AnswerShapeError as exc:
            raise LLMError(f"the policy server's answer is malformed: {exc}") from exc

    def _tell_once(self, kind: str, message: str, *args: object) -> None:
        """Log a warning the first time this client meets ``kind``; later ones are only counted."""
        if kind not in self._told:
            self._told.add(kind)
            logger.warning(message, *args)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.pool.aclose()
        await self._transport.aclose()

    async def complete(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        seed: int | None = None,
        previous: Completion | None = None,
        **sampling: Any,
    ) -> Completion:
        """One answer to ``messages`` (``previous``: this conversation's last completion)."""
        raise NotImplementedError

    async def _post(
        self, body: dict[str, Any], urls: Sequence[str] | None = None
    ) -> tuple[dict[str, Any], int]:
        """POST to an engine with retries; returns the decoded answer and the number of HTTP
        requests made (a request moved to another engine at once counts as one more).
        ``urls``: each engine's URL for this request (default: the client's own route)."""
        content = orjson.dumps(body)
        key = routing_key.get()
        headers = self._headers if key is None else {**self._headers, ROUTING_KEY_HEADER: key}
        route = self._urls if urls is None else urls
        sent = [0]
        same = SameError(self.retry.same_error_limit)
        # Most requests succeed at once; only failures pay for tenacity (~120 us a call here).
        try:
            return await self._send(content, headers, key, sent, route), sent[0]
        except (RetryableStatus, Unreachable) as exc:
            same.check(exc)  # the same 500 too often: an LLMError, not retried
            first_failure: BaseException | None = exc
        first_failed_at = time.monotonic()
        try:
            async for attempt in retrying(self.retry, self.gate, sent):
                with attempt:
                    if first_failure is not None:  # attempt 1 was made above: replay its failure
                        failure, first_failure = first_failure, None
                        raise failure
                    try:
                        return await self._send(content, headers, key, sent, route), sent[0]
                    except (RetryableStatus, Unreachable) as exc:
                        same.check(exc)
                        raise
        except (RetryableStatus, Unreachable) as exc:
            elapsed_s = time.monotonic() - first_failed_at
            times = "once" if sent[0] == 1 else f"{sent[0]} times"
            raise LLMError(f"the policy server failed {times} over {elapsed_s:.1f} s; last: {exc!r}") from exc
        raise AssertionError("unreachable: tenacity either returns or raises")  # pragma: no cover

    async def _send(
        self, content: bytes, headers: dict[str, str], key: str | None, sent: list[int], urls: Sequence[str]
    ) -> dict[str, Any]:
        """One attempt: to the engine the pool picks, and at once to another one while the
        picked engine cannot be reached and another is healthy."""
        while True:
            if self.gate is not None:  # paused for a weight update: nothing is sent until resumed
                entered(await self.gate.enter())  # the version this request is sampled under
            engine = self.pool.pick(key)
            self.stats.requests += 1
            sent[0] += 1
            try:
                reply = await self._transport.post(urls[engine.index], content, headers)
            except Unreachable as exc:
                self.stats.failed(exc.kind)
                limit = self.retry.max_attempts
                if (
                    exc.kind != "ReadTimeout"  # a slow engine is not a dead one
                    and self.pool.failed(engine, exc)
                    and (limit is None or sent[0] < limit)
                ):
                    continue
                raise
            finally:
                self.pool.release(engine)
                if self.gate is not None:
                    self.gate.leave()
            return self._answer(reply)

    def _answer(self, reply: Reply) -> dict[str, Any]:
        if reply.is_error:
            self.stats.failed(f"HTTP {reply.status}")
            if reply.status in RETRYABLE_STATUS:
                raise RetryableStatus(reply)
            said = error_message(reply.body)
            raise LLMError(
                f"HTTP {reply.status} from the policy server: {said}",
                status=reply.status,
                engine_message=said,
            )
        try:
            answer: Any = orjson.loads(reply.body)
        except orjson.JSONDecodeError as exc:
            self.stats.failed("invalid JSON")
            raise LLMError(f"the policy server answered invalid JSON: {exc}") from exc
        if not isinstance(answer, dict):
            self.stats.failed("invalid JSON")
            raise LLMError(f"the policy server answered no JSON object: {str(answer)[:300]}")
        return answer


class ChatClient(EngineClient):
    """The OpenAI chat protocol, with token capture.

    With ``capture`` (the default) every request asks for the prompt's token ids, the sampled
    ids and their logprobs in the ``engine``'s dialect, and each ``Completion`` carries them
    (``Completion.tokens``), or ``None`` from a server that ignores the fields.

    An aborted answer is continued from its ids on the engine's token route (``engine`` names
    it; with ``auto``, the engine the first answer's shape shows), so its record is one prompt
    and all the ids sampled after it. The continuation's raw text is read as the engine's
    parsers read a chat answer: the rest of an unfinished ``<think>`` is reasoning, and the
    content's tool calls are parsed with ``tool_parser`` (Hermes/Qwen ``<tool_call>`` by default)
    unless the engine parsed some itself. Only without ids, or where the token route is not
    found, is it continued as text (``continue_final_message``); then each part's record is
    checked against the answer's so far (``continued``), and a part sampled after another
    prompt becomes the record, from its own prompt, counted in
    ``Completion.mismatched_continuations`` and logged once."""

    mode = "chat"

    def __init__(
        self,
        base_url: str | Sequence[str],
        *,
        model: str = "default",
        engine: Engine = "auto",
        capture: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tool_parser: ToolCallParser = hermes_tool_calls,
        **client: Any,
    ) -> None:
        self.dialect = dialect(engine)  # ValueError for a name the table does not have, before any I/O
        super().__init__(**client)
        self.model = model
        self.engine = engine
        self.capture = capture
        self.chat_template_kwargs = chat_template_kwargs or None
        self.tool_parser = tool_parser
        self._engines(base_url, lambda url: engine_base_url(url) + "/chat/completions")
        #: Token routes found missing (by dialect name): their answers are continued as text.
        self._missing_routes: set[str] = set()

    async def complete(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        seed: int | None = None,
        previous: Completion | None = None,
        **sampling: Any,
    ) -> Completion:
        """One answer to ``messages``; aborted answers are continued, failures retried.

        ``sampling`` holds the request's sampling fields (``max_tokens``, ``temperature``,
        ``top_p``, ...) and any server extension, passed through as they are. ``previous``
        (this conversation's last completion) is the token client's; it is not needed here.
        """
        del previous
        started = time.monotonic()
        budget = sampling.get("max_tokens", sampling.get("max_completion_tokens"))
        base: dict[str, Any] = {"model": self.model, **sampling, "stream": False}
        if seed is not None:
            base["seed"] = seed
        if tools:
            base["tools"] = list(tools)
        if self.chat_template_kwargs:
            base.setdefault("chat_template_kwargs", self.chat_template_kwargs)
        if self.capture:
            for key, value in self.dialect.chat_capture.items():
                base.setdefault(key, value)
        wire = [_on_the_wire(message) for message in messages]
        reply = _Reply()
        pauses = self._pauses()
        answer, tries = await self._post(dict(base, messages=list(wire)))
        reply.attempts += tries
        self._take_chat(reply, answer, first=True)
        continuations = counted = 0  # counted: those of aborts no pause made
        while reply.finish_reason == "abort":
            if budget is not None and reply.generated >= budget:
                reply.finish_reason = "length"  # the budget ran out while aborted: it is truncated
                break
            by_pause, pauses = self._pauses() != pauses, self._pauses()
            if not by_pause and counted >= self.continuation.max_continuations:
                break
            continuations += 1
            counted += not by_pause
            wait_s = self.continuation.backoff_s(reply.empty_in_a_row)
            if wait_s:
                await asyncio.sleep(wait_s)
            remaining = None if budget is None else budget - reply.generated
            try:
                await self._continue(reply, base, wire, remaining, sampling, seed)
            except LLMError as exc:
                if exc.status is None:
                    raise  # an outage outlasted its retries: the answer fails
                # Refused (vLLM's 400 for a reply its template cannot find again): the answer
                # so far is kept, still aborted, rather than lost.
                reply.finish_reason = "abort"
                self._tell_once(
                    "continuation refused",
                    "the policy server refused to continue an aborted answer (%s); it is kept as "
                    "it was, aborted (said once; the job's progress counts aborted trajectories)",
                    exc,
                )
                break
        content, reasoning, tool_calls = reply.text(self.tool_parser)
        if reply.tokens is not None:  # which engine answered: what its logprobs are depends on it
            reply.tokens.engine = reply.engine if self.dialect.name == "auto" else self.dialect.name
        finish_reason = reply.finish_reason
        if tool_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return Completion(
            text=content,
            finish_reason=finish_reason,
            tool_calls=tool_calls,
            usage=reply.usage,
            latency_s=time.monotonic() - started,
            attempts=reply.attempts,
            continuations=continuations,
            reasoning_content=reasoning,
            tokens=reply.tokens,
            sampling=_sampling_record(sampling, seed),
            mode="chat",
            text_continuations=reply.text_continuations,
            mismatched_continuations=reply.mismatched,
        )

    async def _continue(
        self,
        reply: _Reply,
        base: dict[str, Any],
        wire: list[Message],
        remaining: int | None,
        sampling: dict[str, Any],
        seed: int | None,
    ) -> None:
        """One continuation of an aborted answer: from its ids where the engine takes them, else as text."""
        route = self._route_for(reply)
        if route is not None:
            assert reply.tokens is not None
            held = [*reply.tokens.prompt_ids, *reply.tokens.output_ids]
            fields = {**route.chat_text, **{k: v for k, v in sampling.items() if k not in CHAT_ONLY_FIELDS}}
            try:
                part, tries = await self._generate(route, self.model, held, remaining, fields, seed)
            except LLMError as exc:
                if exc.status not in TOKEN_ROUTE_MISSING:
                    raise
                self._missing_routes.add(route.name)
                self._tell_once(
                    "no token route",
                    "the policy server has no %s (HTTP %s): aborted answers are continued as text "
                    "(continue_final_message), each part recorded from the prompt the engine reports",
                    route.token_path,
                    exc.status,
                )
            else:
                reply.attempts += tries
                self._take_ids(reply, part, held)
                return
        continue_fields: Mapping[str, Any] | None = self.continuation.request_fields
        if continue_fields is None:
            continue_fields = self.dialect.chat_continue
        reply.settle()
        body = dict(base, messages=[*wire, {"role": "assistant", "content": reply.content}])
        body.update(continue_fields)
        if remaining is not None:
            body["max_tokens"] = remaining
        answer, tries = await self._post(body)
        reply.attempts += tries
        reply.text_continuations += 1
        self._take_chat(reply, answer, first=False)

    def _route_for(self, reply: _Reply) -> Dialect | None:
        """The token route that continues ``reply`` from its ids, if there is one."""
        if reply.tokens is None:
            return None  # no ids (capture off, or the engine gave none): text is all there is
        name = reply.engine if self.dialect.name == "auto" else self.dialect.name
        if name is None or name in self._missing_routes:
            return None
        return dialect(name)

    def _take_chat(self, reply: _Reply, answer: dict[str, Any], *, first: bool) -> None:
        choice, message = _first_choice(answer)
        reply.finish_reason = choice.get("finish_reason") or "stop"
        piece = message.get("content") or ""
        thought = message.get("reasoning_content")
        if not thought:  # vLLM >= 0.11 says "reasoning"
            thought = message.get("reasoning", thought)
        reply.tool_calls = message.get("tool_calls") or reply.tool_calls
        step_usage = answer.get("usage") or {}
        for key, value in step_usage.items():
            if isinstance(value, int):
                reply.usage[key] = reply.usage.get(key, 0) + value
        step = self._tokens(answer, choice) if self.capture else None
        new_tokens = step_usage.get("completion_tokens")
        if not isinstance(new_tokens, int):
            new_tokens = len(step.output_ids) if step else len(piece)
        reply.generated += new_tokens
        reply.empty_in_a_row = 0 if new_tokens or piece else reply.empty_in_a_row + 1
        reply.content += piece
        if isinstance(thought, str) and thought:
            reply.reasoning = (reply.reasoning or "") + thought
        # Stopped inside the reasoning (a reasoning field, even empty, and no content yet): what a
        # continuation from ids brings up to ``</think>`` is reasoning too.
        reply.in_reasoning = isinstance(thought, str) and not reply.content and not reply.tool_calls
        if first:
            reply.tokens = step
            reply.engine = answer_engine(answer, choice)
        elif reply.tokens is None or step is None:
            reply.tokens = None  # a part without ids: the record would be incomplete, so there is none
        else:
            self._extend(reply, step)

    def _take_ids(self, reply: _Reply, part: Generated, sent: list[int]) -> None:
        self._extend(reply, step_of(part, sent))
        reply.finish_reason = part.finish_reason
        reply.tail += part.text
        reply.from_ids = True
        new_tokens = len(part.output_ids)
        reply.generated += new_tokens
        reply.empty_in_a_row = 0 if new_tokens else reply.empty_in_a_row + 1
        for key, value in (("prompt_tokens", len(sent)), ("completion_tokens", new_tokens)):
            reply.usage[key] = reply.usage.get(key, 0) + value
        reply.usage["total_tokens"] = reply.usage.get("total_tokens", 0) + len(sent) + new_tokens

    def _extend(self, reply: _Reply, step: TokenCapture) -> None:
        assert reply.tokens is not None
        reply.tokens, extended = continued(reply.tokens, step)
        if not extended:
            reply.mismatched += 1
            self._tell_once(
                "continuation mismatch",
                "a continuation of an aborted answer was sampled after a prompt that is not the answer's "
                "so far (the engine re-rendered it); it is recorded from its own prompt, never spliced "
                "(said once; extra_info.mismatched_continuations counts them)",
            )

    def _tokens(self, answer: dict[str, Any], choice: dict[str, Any]) -> TokenCapture | None:
        try:
            step = chat_tokens(answer, choice)
        except AnswerShapeError as exc:
            raise LLMError(f"the policy server's token ids are malformed: {exc}") from exc
        return None if step is None else versioned(step)


@dataclass(slots=True)
class _Reply:
    """A chat answer as its parts come in."""

    content: str = ""
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    #: The raw text of parts continued from ids, not yet read into content and reasoning.
    tail: str = ""
    in_reasoning: bool = False  # the last chat part stopped inside the reasoning
    from_ids: bool = False  # a part was continued from ids: its raw text is parsed here
    finish_reason: str = "stop"
    tokens: TokenCapture | None = None
    engine: str | None = None  # the engine the first answer's shape shows
    usage: dict[str, int] = field(default_factory=dict)
    generated: int = 0
    attempts: int = 0
    empty_in_a_row: int = 0
    text_continuations: int = 0
    mismatched: int = 0

    def settle(self) -> None:
        """Read the raw text continued from ids into the content, as the engine's reasoning parser
        would: where the chat part stopped inside the reasoning, the text up to ``</think>`` is
        reasoning, the rest content."""
        tail, self.tail = self.tail, ""
        if not tail:
            return
        if self.in_reasoning:
            thought, end, rest = tail.partition("</think>")
            self.reasoning = (self.reasoning or "") + (thought.rstrip("\n") if end else thought)
            self.content = rest.lstrip("\n")
            self.in_reasoning = not end
        else:
            self.content += tail

    def text(self, parser: ToolCallParser) -> tuple[str, str | None, list[dict[str, Any]] | None]:
        """Content, reasoning and tool calls: the engine's, and any in the text continued from ids."""
        self.settle()
        if self.from_ids and not self.tool_calls:
            content, calls = parser(self.content)
            if calls:
                return content, self.reasoning, calls
        return self.content, self.reasoning, self.tool_calls


def _on_the_wire(message: Message) -> Message:
    """A message as the engine gets it: without the toolkit's own ``generated`` mark."""
    if "generated" not in message:
        return message
    return {key: value for key, value in message.items() if key != "generated"}


def _sampling_record(sampling: dict[str, Any], seed: int | None) -> dict[str, Any]:
    record = {key: value for key, value in sampling.items() if _is_plain(value)}
    if seed is not None:
        record["seed"] = seed
    return record


def _is_plain(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool, list, dict))


def _first_choice(answer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not choices or not isinstance(choices[0], dict):
        raise LLMError(f"the policy server's answer has no choices: {str(answer)[:300]}")
    choice = choices[0]
    message = choice.get("message")
    return choice, message if isinstance(message, dict) else {}
