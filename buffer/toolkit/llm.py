"""The chat client for the policy server: SGLang, vLLM, or ``buffer.simulator``.

It speaks the OpenAI Chat Completions protocol over plain HTTP/1.1 on asyncio (``http11``;
``https://`` engines through aiohttp): httpx over aiohttp cost two thirds of the service's busy
time, aiohttp's own session still twice this transport's CPU per request, and httpx's own pool
collapses at the hundreds of concurrent requests a generator keeps in flight
(encode/httpx#3215). SGLang's extensions are plain JSON fields anyway. Tests pass
``transport=httpx.AsyncHTTPTransport()``, which respx intercepts. Several engine URLs make a
pool (``pool``): least in flight, a group's samples on one engine, dead engines taken out.

Two kinds of failure are handled here, so generators never see them:

- transport errors (a refused or dropped connection), timeouts, 429 and 5xx are retried
  (tenacity) for as long as ``RetryPolicy.max_retry_s`` allows, two minutes by default, so a
  policy server that restarts or is overloaded for a while is waited out; each wait is random
  (full jitter) up to an exponential backoff capped at ``max_backoff_s``, so a thousand
  requests in flight do not come back at once, and never shorter than a ``Retry-After``;
- an answer that ends with ``finish_reason: "abort"`` (SGLang aborts requests around weight
  updates) is continued at once, within what is left of the ``max_tokens`` budget: here the
  text so far goes back as the final assistant message with ``continue_final_message``; the
  token client continues from the token ids. Only an abort that brought no new token is
  followed by a wait (``ContinuePolicy``): a fixed pause per abort cost 40% of throughput at
  10% aborts. A 4xx is not retried: it is the request, or the engine's configuration (a wrong
  model name), and ``LLMError.status`` / ``engine_message`` say which.

Every request and every failed one is counted on ``ChatClient.stats`` as it happens, so an
outage shows on a job's progress while it lasts, not only once its answers come.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import httpx
import orjson
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_before_delay,
    wait_random_exponential,
)
from tenacity.stop import stop_base

from buffer.policy.gate import Gate
from buffer.toolkit.engines import AnswerShapeError, Engine, chat_tokens, dialect, error_message
from buffer.toolkit.http11 import Http11Transport
from buffer.toolkit.pool import EnginePool, routing_key
from buffer.toolkit.transport import (
    ROUTING_KEY_HEADER,
    HttpxTransport,
    Reply,
    Transport,
    Unreachable,
)
from buffer.toolkit.types import Completion, Message, TokenCapture

RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
RETRY_AFTER_CAP_S = 60.0  # a server's Retry-After is honoured up to this


class LLMError(Exception):
    """The policy server did not answer usably, after any retries.

    ``status`` is the HTTP status of a refused request (a 4xx, not retried) and
    ``engine_message`` the engine's own words for it; both ``None`` for other failures."""

    def __init__(self, message: str, *, status: int | None = None, engine_message: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.engine_message = engine_message


class _RetryableStatus(Exception):
    def __init__(self, reply: Reply) -> None:
        super().__init__(f"HTTP {reply.status}: {reply.text[:300]}")
        self.retry_after_s = _retry_after_s(reply.retry_after)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How a failed request is retried: until ``max_retry_s`` have passed since it first failed
    (no further attempt starts after that), and at most ``max_attempts`` attempts if set. The
    n-th wait is random, between 0 and ``backoff_s * 2 ** (n - 1)`` capped at ``max_backoff_s``:
    the cap bounds how long a request waits after the server is back. ``max_retry_s=0``: no retry.
    """

    max_retry_s: float = 120.0
    max_attempts: int | None = None
    backoff_s: float = 0.5
    max_backoff_s: float = 5.0


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
    fields that continue a chat answer as text (``None``: the engine's, see ``engines``)."""

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
    ) -> None:
        self.retry = retry or RetryPolicy()
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
        self._urls: list[str] = []

    def _engines(self, base_url: str | Sequence[str], request_url: Callable[[str], str]) -> None:
        """The engines behind ``base_url`` (one URL, or several: a pool), each asked at
        ``request_url(url)``."""
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        self.pool = EnginePool(urls, self._transport, health_interval_s=self._health_interval_s)
        self._urls = [request_url(url) for url in urls]

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

    async def _post(self, body: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """POST to an engine with retries; returns the decoded answer and the number of HTTP
        requests made (a request moved to another engine at once counts as one more)."""
        content = orjson.dumps(body)
        key = routing_key.get()
        headers = self._headers if key is None else {**self._headers, ROUTING_KEY_HEADER: key}
        sent = [0]
        # Most requests succeed at once; only failures pay for tenacity (~120 us a call here).
        try:
            return await self._send(content, headers, key, sent), sent[0]
        except (_RetryableStatus, Unreachable) as exc:
            first_failure: BaseException | None = exc
        policy = self.retry
        stop: stop_base = (
            stop_before_delay(policy.max_retry_s) if self.gate is None else _StopOpenTime(policy, self.gate)
        )
        if policy.max_attempts is not None:
            stop = stop | _StopAfterSent(sent, policy.max_attempts)
        retrying = AsyncRetrying(
            stop=stop,
            wait=_Wait(policy.backoff_s, policy.max_backoff_s),
            retry=retry_if_exception(_is_retryable),
            reraise=True,
        )
        first_failed_at = time.monotonic()
        try:
            async for attempt in retrying:
                with attempt:
                    if first_failure is not None:  # attempt 1 was made above: replay its failure
                        failure, first_failure = first_failure, None
                        raise failure
                    return await self._send(content, headers, key, sent), sent[0]
        except (_RetryableStatus, Unreachable) as exc:
            elapsed_s = time.monotonic() - first_failed_at
            times = "once" if sent[0] == 1 else f"{sent[0]} times"
            raise LLMError(f"the policy server failed {times} over {elapsed_s:.1f} s; last: {exc!r}") from exc
        raise AssertionError("unreachable: tenacity either returns or raises")  # pragma: no cover

    async def _send(
        self, content: bytes, headers: dict[str, str], key: str | None, sent: list[int]
    ) -> dict[str, Any]:
        """One attempt: to the engine the pool picks, and at once to another one while the
        picked engine cannot be reached and another is healthy."""
        while True:
            if self.gate is not None:  # paused for a weight update: nothing is sent until resumed
                await self.gate.enter()
            engine = self.pool.pick(key)
            self.stats.requests += 1
            sent[0] += 1
            try:
                reply = await self._transport.post(self._urls[engine.index], content, headers)
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
                raise _RetryableStatus(reply)
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
    (``Completion.tokens``), or ``None`` from a server that ignores the fields. An aborted answer
    is continued as text (``continue_final_message``); its ids and logprobs are concatenated.
    Continuing from the exact token ids is the token client's (``tito.TokenClient``)."""

    def __init__(
        self,
        base_url: str | Sequence[str],
        *,
        model: str = "default",
        engine: Engine = "auto",
        capture: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        **client: Any,
    ) -> None:
        self.dialect = dialect(engine)  # ValueError for a name the table does not have, before any I/O
        super().__init__(**client)
        self.model = model
        self.engine = engine
        self.capture = capture
        self.chat_template_kwargs = chat_template_kwargs or None
        self._engines(base_url, lambda url: engine_base_url(url) + "/chat/completions")

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
        continue_fields: Mapping[str, Any] | None = self.continuation.request_fields
        if continue_fields is None:
            continue_fields = self.dialect.chat_continue
        text = ""
        reasoning: str | None = None
        generated = 0
        attempts = 0
        continuations = 0
        empty_in_a_row = 0
        usage: dict[str, int] = {}
        tokens: TokenCapture | None = None
        tool_calls: list[dict[str, Any]] | None = None
        wire = [_on_the_wire(message) for message in messages]
        while True:
            body = dict(base, messages=list(wire))
            if continuations:
                body["messages"].append({"role": "assistant", "content": text})
                body.update(continue_fields)
                if budget is not None:
                    body["max_tokens"] = budget - generated
            answer, tries = await self._post(body)
            attempts += tries
            choice, message = _first_choice(answer)
            finish_reason = choice.get("finish_reason") or "stop"
            piece = message.get("content") or ""
            text += piece
            thought = message.get("reasoning_content") or message.get("reasoning")
            if isinstance(thought, str) and thought:
                reasoning = (reasoning or "") + thought
            tool_calls = message.get("tool_calls") or tool_calls
            step_usage = answer.get("usage") or {}
            for key, value in step_usage.items():
                if isinstance(value, int):
                    usage[key] = usage.get(key, 0) + value
            step = self._tokens(answer, choice) if self.capture else None
            tokens = _joined(tokens, step, first=continuations == 0)
            new_tokens = step_usage.get("completion_tokens")
            if not isinstance(new_tokens, int):
                new_tokens = len(step.output_ids) if step else len(piece)
            generated += new_tokens
            if finish_reason == "abort":
                if budget is not None and generated >= budget:
                    finish_reason = "length"  # the budget ran out while aborted: it is truncated
                elif continuations < self.continuation.max_continuations:
                    continuations += 1
                    empty_in_a_row = 0 if new_tokens or piece else empty_in_a_row + 1
                    wait_s = self.continuation.backoff_s(empty_in_a_row)
                    if wait_s:
                        await asyncio.sleep(wait_s)
                    continue
            return Completion(
                text=text,
                finish_reason=finish_reason,
                tool_calls=tool_calls,
                usage=usage,
                latency_s=time.monotonic() - started,
                attempts=attempts,
                continuations=continuations,
                reasoning_content=reasoning,
                tokens=tokens,
                sampling=_sampling_record(sampling, seed),
            )

    def _tokens(self, answer: dict[str, Any], choice: dict[str, Any]) -> TokenCapture | None:
        try:
            return chat_tokens(answer, choice)
        except AnswerShapeError as exc:
            raise LLMError(f"the policy server's token ids are malformed: {exc}") from exc


def _joined(so_far: TokenCapture | None, step: TokenCapture | None, *, first: bool) -> TokenCapture | None:
    """An answer's tokens after one more part: the first part's prompt, all parts' output."""
    if first or so_far is None:
        return step if first else None
    if step is None:
        return None  # a part without ids: the record would be incomplete, so there is none
    logprobs = None
    if so_far.output_logprobs is not None and step.output_logprobs is not None:
        logprobs = so_far.output_logprobs + step.output_logprobs
    return TokenCapture(
        so_far.prompt_ids,
        so_far.output_ids + step.output_ids,
        logprobs,
        step.weight_version if step.weight_version is not None else so_far.weight_version,
    )


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


class _StopOpenTime(stop_base):
    """``stop_before_delay`` on the time the gate was open: a pause spends no retry budget."""

    def __init__(self, policy: RetryPolicy, gate: Gate) -> None:
        self._max_s = policy.max_retry_s
        self._gate = gate
        self._started = time.monotonic()

    def __call__(self, retry_state: RetryCallState) -> bool:
        now = time.monotonic()
        open_s = now - self._started - self._gate.paused_between(self._started, now)
        return open_s + (retry_state.upcoming_sleep or 0.0) >= self._max_s


class _Wait:
    """Exponential backoff with full jitter, but never shorter than the server's Retry-After."""

    def __init__(self, backoff_s: float, max_backoff_s: float) -> None:
        self._jitter = wait_random_exponential(multiplier=backoff_s, max=max_backoff_s)

    def __call__(self, state: RetryCallState) -> float:
        wait: float = self._jitter(state)
        outcome = state.outcome
        error = outcome.exception() if outcome is not None else None
        if isinstance(error, _RetryableStatus) and error.retry_after_s is not None:
            wait = max(wait, min(error.retry_after_s, RETRY_AFTER_CAP_S))
        return wait


def _is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, (_RetryableStatus, Unreachable))


class _StopAfterSent(stop_base):
    """Stop once ``max_attempts`` HTTP requests were made (a move to another engine counts)."""

    def __init__(self, sent: list[int], max_attempts: int) -> None:
        self.sent = sent
        self.max_attempts = max_attempts

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self.sent[0] >= self.max_attempts


def _retry_after_s(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _first_choice(answer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not choices or not isinstance(choices[0], dict):
        raise LLMError(f"the policy server's answer has no choices: {str(answer)[:300]}")
    choice = choices[0]
    message = choice.get("message")
    return choice, message if isinstance(message, dict) else {}
