"""A chat client for the policy server: SGLang, vLLM, or ``buffer.simulator``.

It speaks the OpenAI Chat Completions protocol over one shared ``httpx.AsyncClient`` whose
transport is aiohttp's (``httpx-aiohttp``). httpx's own connection pool collapses at the
hundreds of concurrent requests a generator keeps in flight (encode/httpx#3215; measured
here: 64 requests of 0.2 s over reused connections take 2.5 s, 0.26 s with aiohttp), and
the ``openai`` package rides on the same pool. SGLang's extensions are plain JSON fields
anyway. Tests pass ``transport=httpx.AsyncHTTPTransport()``, which respx intercepts.

Two kinds of failure are handled here, so generators never see them:

- transport errors (a refused or dropped connection), timeouts, 429 and 5xx are retried
  (tenacity) for as long as ``RetryPolicy.max_retry_s`` allows, two minutes by default, so a
  policy server that restarts or is overloaded for a while is waited out; each wait is random
  (full jitter) up to an exponential backoff capped at ``max_backoff_s``, so a thousand
  requests in flight do not come back at once, and never shorter than a ``Retry-After``;
- an answer that ends with ``finish_reason: "abort"`` (SGLang aborts requests around weight
  updates) is continued: the text so far goes back as the final assistant message with
  ``continue_final_message``, within what is left of the ``max_tokens`` budget, after an
  asynchronous pause (slime's ``query_single_turn`` sleeps 10 s in a worker process).

Every request and every failed one is counted on ``ChatClient.stats`` as it happens, so an
outage shows on a job's progress while it lasts, not only once its answers come.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from httpx_aiohttp import AiohttpTransport
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    stop_before_delay,
    wait_random_exponential,
)
from tenacity.stop import stop_base

from buffer.toolkit.types import Completion, Message

RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
RETRY_AFTER_CAP_S = 60.0  # a server's Retry-After is honoured up to this


class LLMError(Exception):
    """The policy server did not answer usably, after any retries."""


class _RetryableStatus(Exception):
    def __init__(self, response: httpx.Response) -> None:
        super().__init__(f"HTTP {response.status_code}: {response.text[:300]}")
        self.retry_after_s = _retry_after_s(response)


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
    """How aborted answers are continued. vLLM also wants ``"add_generation_prompt": False``
    in ``request_fields``; SGLang (and slime) send ``continue_final_message`` alone."""

    max_continuations: int = 8
    delay_s: float = 1.0
    request_fields: dict[str, Any] = field(default_factory=lambda: {"continue_final_message": True})


def engine_base_url(url: str) -> str:
    """slime's rule: the engine URL is used as is when it names ``/v1``, else ``/v1`` is added."""
    url = url.rstrip("/")
    return url if "/v1" in url else url + "/v1"


class ChatClient:
    def __init__(
        self,
        base_url: str,
        *,
        model: str = "default",
        api_key: str | None = None,
        max_connections: int = 1000,
        timeout_s: float = 600.0,
        retry: RetryPolicy | None = None,
        continuation: ContinuePolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.model = model
        self.retry = retry or RetryPolicy()
        self.continuation = continuation or ContinuePolicy()
        self.stats = LLMStats()
        self._headers = {"content-type": "application/json"}
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"
        self._url = engine_base_url(base_url) + "/chat/completions"
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._client = httpx.AsyncClient(
            transport=transport or AiohttpTransport(limits=limits, trust_env=False),
            timeout=httpx.Timeout(timeout_s, connect=30.0),
            trust_env=False,
        )

    async def __aenter__(self) -> ChatClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def complete(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        seed: int | None = None,
        **sampling: Any,
    ) -> Completion:
        """One answer to ``messages``; aborted answers are continued, failures retried.

        ``sampling`` holds the request's sampling fields (``max_tokens``, ``temperature``,
        ``top_p``, ...) and any server extension, passed through as they are.
        """
        started = time.monotonic()
        budget = sampling.get("max_tokens", sampling.get("max_completion_tokens"))
        base: dict[str, Any] = {"model": self.model, **sampling, "stream": False}
        if seed is not None:
            base["seed"] = seed
        if tools:
            base["tools"] = list(tools)
        text = ""
        generated = 0
        attempts = 0
        continuations = 0
        usage: dict[str, int] = {}
        token_ids: list[int] = []
        logprobs: list[float] = []
        while True:
            body = dict(base, messages=list(messages))
            if continuations:
                body["messages"].append({"role": "assistant", "content": text})
                body.update(self.continuation.request_fields)
                if budget is not None:
                    body["max_tokens"] = budget - generated
            answer, tries = await self._post(body)
            attempts += tries
            choice, message = _first_choice(answer)
            finish_reason = choice.get("finish_reason") or "stop"
            text += message.get("content") or ""
            step_usage = answer.get("usage") or {}
            for key, value in step_usage.items():
                if isinstance(value, int):
                    usage[key] = usage.get(key, 0) + value
            step_logprobs = _logprobs(choice)
            logprobs.extend(step_logprobs)
            token_ids.extend(choice.get("token_ids") or ())
            generated += step_usage.get("completion_tokens", len(step_logprobs))
            if finish_reason == "abort":
                if budget is not None and generated >= budget:
                    finish_reason = "length"  # the budget ran out while aborted: it is truncated
                elif continuations < self.continuation.max_continuations:
                    continuations += 1
                    await asyncio.sleep(self.continuation.delay_s)
                    continue
            return Completion(
                text=text,
                finish_reason=finish_reason,
                tool_calls=message.get("tool_calls") or None,
                usage=usage,
                latency_s=time.monotonic() - started,
                attempts=attempts,
                continuations=continuations,
                token_ids=token_ids or None,
                logprobs=logprobs or None,
            )

    async def _post(self, body: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """POST with retries; returns the decoded answer and the number of attempts."""
        content = orjson.dumps(body)
        # Most requests succeed at once; only failures pay for tenacity (~120 us a call here).
        try:
            return await self._send(content), 1
        except (_RetryableStatus, httpx.TransportError) as exc:
            first_failure: BaseException | None = exc
        policy = self.retry
        stop: stop_base = stop_before_delay(policy.max_retry_s)
        if policy.max_attempts is not None:
            stop = stop | stop_after_attempt(policy.max_attempts)
        retrying = AsyncRetrying(
            stop=stop,
            wait=_Wait(policy.backoff_s, policy.max_backoff_s),
            retry=retry_if_exception(_is_retryable),
            reraise=True,
        )
        attempts = 1
        first_failed_at = time.monotonic()
        try:
            async for attempt in retrying:
                with attempt:
                    attempts = attempt.retry_state.attempt_number
                    if first_failure is not None:  # attempt 1 was made above: replay its failure
                        failure, first_failure = first_failure, None
                        raise failure
                    return await self._send(content), attempts
        except (_RetryableStatus, httpx.TransportError) as exc:
            elapsed_s = time.monotonic() - first_failed_at
            times = "once" if attempts == 1 else f"{attempts} times"
            raise LLMError(f"the policy server failed {times} over {elapsed_s:.1f} s; last: {exc!r}") from exc
        raise AssertionError("unreachable: tenacity either returns or raises")  # pragma: no cover

    async def _send(self, content: bytes) -> dict[str, Any]:
        self.stats.requests += 1
        try:
            response = await self._client.post(self._url, content=content, headers=self._headers)
        except httpx.TransportError as exc:
            self.stats.failed(type(exc).__name__)
            raise
        if response.is_error:
            self.stats.failed(f"HTTP {response.status_code}")
            if response.status_code in RETRYABLE_STATUS:
                raise _RetryableStatus(response)
            raise LLMError(f"HTTP {response.status_code} from the policy server: {response.text[:500]}")
        try:
            answer: dict[str, Any] = orjson.loads(response.content)
        except orjson.JSONDecodeError as exc:
            self.stats.failed("invalid JSON")
            raise LLMError(f"the policy server answered invalid JSON: {exc}") from exc
        return answer


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
    return isinstance(exc, (_RetryableStatus, httpx.TransportError))


def _retry_after_s(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
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


def _logprobs(choice: dict[str, Any]) -> list[float]:
    content = (choice.get("logprobs") or {}).get("content") or ()
    return [entry["logprob"] for entry in content if isinstance(entry, dict) and "logprob" in entry]
