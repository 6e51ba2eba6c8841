"""What the service lets in and what it lets out.

In: the API key is asked of every request but ``GET /`` and ``GET /health`` (``Authorization:
Bearer <key>``, or HTTP Basic with the key as password so a browser can open the dashboard); a
POST from another web origin is refused (403), and a body not sent as JSON (415), so a page the
operator visits cannot write to or drain the buffer with a "simple" cross-origin request, key or
no key; a body larger than ``max_request_bytes`` gets a 413 before the route sees it; a ``Host``
the service does not answer to (``--allowed-hosts``) gets a 421, so a page whose name is made to
resolve to this machine (DNS rebinding) cannot talk to it as its own origin.

``ServiceGuard`` makes every one of those checks, and gives the request its id (``buffer.logs``),
in one pure-ASGI layer and one pass over the headers: the service's app runs it once, in front of
FastAPI's routes and in front of its hot routes alike (``buffer.service.app``). The same checks
one layer each (``ApiKeyMiddleware``, ``BrowserGuardMiddleware``, ``BodySizeLimitMiddleware``,
``HostGuardMiddleware``) remain for apps that take some of them: the gateway processes'
(``buffer.service.gateway_process``). Both share the rules below, so they answer alike.

Out: no traceback reaches a client; the API names where an error happened instead
(``buffer.core.registry.where``) and the log keeps the whole traceback. Unexpected errors are a bare
500 (``buffer.service.app``).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import logging
import socket
from dataclasses import dataclass

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from buffer.keys import API_KEY_VARIABLE
from buffer.logs import MAX_REQUEST_ID_LENGTH, request_id, with_request_id
from buffer.service.responses import envelope
from buffer.service.settings import Settings

logger = logging.getLogger(__name__)

#: Open without the key: liveness probes and load balancers know no keys.
OPEN_PATHS = frozenset({"/", "/health"})
OPEN_METHODS = frozenset({"GET", "HEAD"})
#: Pages a browser opens: their 401 asks for Basic credentials, which makes it show a login form.
BROWSER_PREFIX = "/dashboard"
BASIC_CHALLENGE = 'Basic realm="rollout-buffer"'
MISSING_KEY = "missing API key: send 'Authorization: Bearer <key>'"
MISSING_LOGIN = "missing API key: log in with any user name and the API key as password"

_DISCONNECT: Message = {"type": "http.disconnect"}


def required_key(settings: Settings) -> str | None:
    """The key the service requires, or None: an empty key is no key."""
    key = settings.api_key.get_secret_value() if settings.api_key is not None else ""
    return key or None


def warn_if_exposed(settings: Settings) -> None:
    """Log a warning when the service listens beyond this machine without an API key."""
    if required_key(settings) is None and not is_loopback(settings.host):
        logger.warning(
            "listening on %s:%s without an API key: anyone who can reach this port can read and write "
            "the buffer and start generators. Set a key with --api-key or %s (clients read the same "
            "variable), or listen on this machine only with --host 127.0.0.1",
            settings.host,
            settings.port,
            API_KEY_VARIABLE,
        )


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address (``127.0.0.0/8``, ``::1``, bracketed or not)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# -- the API key ------------------------------------------------------------------------


def _is_session_api(path: str) -> bool:
    """A gateway session's OpenAI-compatible root: the agent sends its session's key, which
    the gateway checks (``buffer.service.gateway.service``), never the service's."""
    return path.startswith("/sessions/") and "/v1/" in path


def _key_is_asked(scope: Scope) -> bool:
    """Every request asks for the key but a probe's (``GET /``, ``GET /health``) and a gateway
    session's API calls; a lifespan is no request."""
    return not (
        scope["type"] == "lifespan"
        or (scope.get("method") in OPEN_METHODS and scope["path"] in OPEN_PATHS)
        or _is_session_api(scope["path"])
    )


class _Key:
    """The API key, and what a request's ``Authorization`` header lacks to match it."""

    def __init__(self, api_key: str) -> None:
        if not api_key:
            raise ValueError("api_key must not be empty")
        self._key = api_key.encode()
        self._bearer = b"Bearer " + self._key  # what the clients send: checked first, as a whole

    def problem(self, authorization: bytes | None) -> str | None:
        """None when the key is right, else what is missing or wrong (never the key sent);
        ``authorization``: the request's first such header."""
        if authorization is None:
            return MISSING_KEY
        if hmac.compare_digest(authorization, self._bearer):
            return None
        scheme, _, credentials = authorization.strip().partition(b" ")
        scheme = scheme.lower()
        if scheme == b"bearer":
            return self._check(credentials.strip())
        if scheme == b"basic":
            try:
                decoded = base64.b64decode(credentials.strip(), validate=True)
            except binascii.Error:
                return "malformed Basic credentials: expected base64 of 'user:key'"
            return self._check(decoded.partition(b":")[2])
        return "unsupported Authorization scheme: send 'Authorization: Bearer <key>'"

    def _check(self, key: bytes) -> str | None:
        return None if hmac.compare_digest(key, self._key) else "wrong API key"

    @staticmethod
    async def refuse(scope: Scope, receive: Receive, send: Send, problem: str) -> None:
        if scope["type"] != "http":  # a websocket: close it before accepting it
            await send({"type": "websocket.close", "code": 1008, "reason": problem})
            return
        client = scope.get("client")
        address = client[0] if client else "?"
        logger.info("refused %s %s from %s: %s", scope["method"], scope["path"], address, problem)
        await _unauthorized(problem, scope["path"])(scope, receive, send)


def _first_authorization(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name == b"authorization":
            return value
    return None


class ApiKeyMiddleware:
    """Answers 401 to a request without the right key. Added only when a key is configured."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = _Key(api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        problem = self._key.problem(_first_authorization(scope["headers"])) if _key_is_asked(scope) else None
        if problem is None:
            await self.app(scope, receive, send)
        else:
            await _Key.refuse(scope, receive, send, problem)


def _unauthorized(problem: str, path: str) -> Response:
    in_browser = path == BROWSER_PREFIX or path.startswith(BROWSER_PREFIX + "/")
    message = MISSING_LOGIN if in_browser and problem == MISSING_KEY else problem
    response = envelope(False, message, status_code=401)
    response.headers["www-authenticate"] = BASIC_CHALLENGE if in_browser else "Bearer"
    return response


# -- browsers ---------------------------------------------------------------------------

#: Methods a page can send cross-origin without asking first, and that change nothing here.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
#: ``Sec-Fetch-Site`` values of a request some other site's page made.
OTHER_SITES = frozenset({b"cross-site", b"same-site"})  # same-site: another port or subdomain
NOT_JSON = "the body must be JSON: send 'Content-Type: application/json'"


class BrowserGuardMiddleware:
    """Refuses what only a browser on another origin's page sends: a POST whose ``Origin`` is
    not the service's own (or ``Sec-Fetch-Site`` says another site) gets 403 unless the origin
    is allowed (``--allowed-origins``, ``*`` for any); a body whose ``Content-Type`` is not
    JSON gets 415. A cross-origin ``fetch`` or form can send ``text/plain`` or a form without
    asking first (no CORS preflight), and the buffer would take it; clients (the trainer, the
    generators, curl with ``-H 'content-type: application/json'``) send no ``Origin``, and JSON.
    """

    def __init__(self, app: ASGIApp, allowed_origins: list[str] | None = None) -> None:
        self.app = app
        self._origins = _Origins(allowed_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in SAFE_METHODS:
            await self.app(scope, receive, send)
            return
        origin = site = host = content_type = None
        for name, value in scope["headers"]:
            if name == b"content-type":
                content_type = value
            elif name == b"origin":
                origin = value
            elif name == b"sec-fetch-site":
                site = value
            elif name == b"host":
                host = value
        refusal = self._origins.refusal(scope, origin, site, host, content_type)
        if refusal is None:
            await self.app(scope, receive, send)
        else:
            await _Origins.refuse(scope, receive, send, *refusal)


class _Origins:
    """The origins a browser's POST may come from, and the answer to one that may not
    (``BrowserGuardMiddleware``'s rule)."""

    def __init__(self, allowed_origins: list[str] | None = None) -> None:
        allowed = allowed_origins or []
        self._any_origin = "*" in allowed
        self._allowed = frozenset(origin.rstrip("/").lower().encode() for origin in allowed)

    def refusal(
        self,
        scope: Scope,
        origin: bytes | None,
        site: bytes | None,
        host: bytes | None,
        content_type: bytes | None,
    ) -> tuple[int, str] | None:
        """None for a request that may pass (of a method not in ``SAFE_METHODS``), else the
        status and the reason; the headers' values are their last."""
        if not self._any_origin and self._foreign(scope, origin, site, host):
            shown = (origin or b"another site").decode("latin-1")
            return 403, f"a browser request from {shown} is refused: allow its origin with --allowed-origins"
        if not _is_json(content_type):
            return 415, NOT_JSON
        return None

    def _foreign(self, scope: Scope, origin: bytes | None, site: bytes | None, host: bytes | None) -> bool:
        if site == b"same-origin":
            return False
        if origin is not None:
            origin = origin.rstrip(b"/").lower()
            own = scope.get("scheme", "http").encode() + b"://" + (host or b"").lower()
            return origin != own and origin not in self._allowed
        return site in OTHER_SITES

    @staticmethod
    async def refuse(scope: Scope, receive: Receive, send: Send, status: int, problem: str) -> None:
        logger.info("refused %s %s: %s", scope["method"], scope["path"], problem)
        await envelope(False, problem, status_code=status)(scope, receive, send)


def _is_json(content_type: bytes | None) -> bool:
    """``application/json`` or a ``+json`` type, parameters (``; charset=utf-8``) aside; or none
    at all, taken as JSON as FastAPI (and slime's buffer) take it: a client posting
    ``data=json.dumps(...)`` sends none, and a browser sending none sends an ``Origin``."""
    if content_type is None:
        return True
    media_type = content_type.partition(b";")[0].strip().lower()
    return media_type == b"application/json" or (
        media_type.startswith(b"application/") and media_type.endswith(b"+json")
    )


# -- the Host header --------------------------------------------------------------------

#: Names only this machine answers to: no page elsewhere is ever served under one of them.
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
#: ``--host`` values that listen on every interface.
EVERY_INTERFACE = frozenset({"", "0.0.0.0", "::"})
#: Headers only a browser sends: a page's request carries one of them.
BROWSER_MARKERS = frozenset({b"origin", b"sec-fetch-site"})


@dataclass(frozen=True, slots=True)
class HostRule:
    """The names (lower case, no port, no brackets) the service answers to, loopback names
    always among them. ``browsers_only``: a request without browser markers passes whatever its
    ``Host``, and a browser's may name an IP address or a name without a dot too: DNS rebinding
    needs a name with a dot in its attacker's DNS; the machine's clients name it as they like."""

    names: frozenset[str]
    browsers_only: bool = False

    def allows(self, host: str) -> bool:
        if host in self.names or is_loopback(host):
            return True
        return self.browsers_only and ("." not in host or _is_address(host))


def host_rule(settings: Settings) -> HostRule | None:
    """The ``Host`` check the settings ask for; None: any host (an API key already authenticates)."""
    if settings.allowed_hosts is not None:
        names = host_names(settings.allowed_hosts)
        return None if "*" in names else HostRule(names | LOOPBACK_NAMES)
    if required_key(settings) is not None:
        return None
    if settings.host in EVERY_INTERFACE:  # slime's users reach it by the machine's name
        return HostRule(LOOPBACK_NAMES | host_names([socket.gethostname()]), browsers_only=True)
    return HostRule(LOOPBACK_NAMES | host_names([settings.host]))


def host_names(entries: list[str]) -> frozenset[str]:
    return frozenset(name for entry in entries if (name := host_name(entry)))


def host_name(host: str) -> str:
    """``Host``'s name: lower case, without its port, brackets or trailing dot."""
    host = host.strip().lower()
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class HostGuardMiddleware:
    """Answers 421 (a websocket: closes it) to a request whose ``Host`` is not one the service
    answers to (``HostRule``). A request with no ``Host`` passes: no browser sends one so."""

    def __init__(self, app: ASGIApp, rule: HostRule) -> None:
        self.app = app
        self.rule = rule

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = None
        marked = False
        for name, value in scope["headers"]:
            if name == b"host":
                host = value
            elif name in BROWSER_MARKERS:
                marked = True
        problem = _host_problem(self.rule, host, marked)
        if problem is None:
            await self.app(scope, receive, send)
        else:
            await _refuse_host(scope, receive, send, problem)


def _host_problem(rule: HostRule, host: bytes | None, marked: bool) -> str | None:
    """Why a request whose last ``Host`` is ``host`` is refused, or None; ``marked``: it carries
    a browser's headers (``BROWSER_MARKERS``)."""
    if host is None or (rule.browsers_only and not marked):
        return None
    name = host.decode("latin-1")
    if rule.allows(host_name(name)):
        return None
    return (
        f"this service does not answer to the host {name[:200]!r}: if that name is this "
        "service's, add it to --allowed-hosts (ROLLOUT_BUFFER_ALLOWED_HOSTS)"
    )


async def _refuse_host(scope: Scope, receive: Receive, send: Send, problem: str) -> None:
    logger.info("refused %s %s: %s", scope.get("method", "websocket"), scope["path"], problem)
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008, "reason": problem[:120]})
    else:
        await envelope(False, problem, status_code=421)(scope, receive, send)


# -- the request size -------------------------------------------------------------------


class BodySizeLimitMiddleware:
    """Answers 413 to a body larger than ``max_bytes``, before the route reads any of it.

    A ``Content-Length`` is checked up front; the server's HTTP parser delivers no more than it
    declares, so such a request passes with nothing wrapped. A body of unknown length (chunked) is
    counted as it arrives: past the limit the client gets its 413 at once, and the route's next
    ``receive`` reports a disconnect, so it stops reading and writes nothing of what it got. (Had
    the route already started its response, the rest of it is dropped: the server then closes the
    connection, and the client sees a failed request, never a complete-looking answer.)

    The 413 closes the connection: the server would otherwise read, and throw away, the rest of a
    body of any length. A client that is still sending reads the 413 once its write fails
    (httpx does).
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self._limit = _BodyLimit(max_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length: int | None = None
        chunked = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                length, chunked = _declared(value, length, chunked)
            elif name == b"transfer-encoding":
                chunked = True
        await self._limit.run(self.app, scope, receive, send, length, chunked)


def _declared(value: bytes, length: int | None, chunked: bool) -> tuple[int | None, bool]:
    """The body's length and whether it is counted as it arrives, once a ``Content-Length`` of
    ``value`` is read: a value that is no number leaves the length as it was and counts the body
    (the server refuses such a request first)."""
    try:
        return int(value), chunked
    except ValueError:
        return length, True


class _BodyLimit:
    """``BodySizeLimitMiddleware``'s rule: what a body's declared length lets through, and the
    count of a body whose length is not declared."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._message = f"request body is larger than max_request_bytes ({max_bytes} bytes)"

    async def run(
        self, app: ASGIApp, scope: Scope, receive: Receive, send: Send, length: int | None, chunked: bool
    ) -> None:
        """Run ``app`` on an HTTP request whose ``Content-Length`` is ``length`` (None: none, or
        none that reads as a number: ``chunked`` then) within the limit."""
        if length is not None and length > self.max_bytes:
            await self._refuse(scope, receive, send)
        elif length is not None and not chunked:
            await app(scope, receive, send)
        else:
            await self._counted(app, scope, receive, send)

    async def _counted(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app on a body whose length is known only once it has all arrived."""
        received = 0
        refused = False
        response_started = False

        async def counting_receive() -> Message:
            nonlocal received, refused
            if refused:
                return _DISCONNECT
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    if response_started:  # too late for a 413: the response stays unfinished
                        logger.warning("cut %s %s short: %s", scope["method"], scope["path"], self._message)
                    else:
                        await self._refuse(scope, receive, send)
                    return _DISCONNECT
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal response_started
            if refused:  # the 413 is sent, or the response is cut short
                return
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await app(scope, counting_receive, guarded_send)
        except Exception:
            if not refused:
                raise
            # What the route made of its cut body (a ClientDisconnect, say) is moot: the client has its 413.
            logger.debug(
                "%s %s failed after its body was refused", scope["method"], scope["path"], exc_info=True
            )

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        logger.warning("refused %s %s: %s", scope["method"], scope["path"], self._message)
        response = envelope(False, self._message, status_code=413)
        response.headers["connection"] = "close"
        await response(scope, receive, send)


# -- all of them in one layer -----------------------------------------------------------

#: Set in a request's scope by a ``ServiceGuard`` that has checked it: another guard further in
#: (the app's own, when a hot route hands a request it is not sure of to FastAPI's routes) lets
#: it through as it is, its id kept.
CHECKED = "rollout_buffer.checked"


class ServiceGuard:
    """Every check of the service's, in one pure-ASGI layer and one pass over the headers.

    What it answers, and in which order, is what ``RequestIdMiddleware`` (``buffer.logs``),
    ``ApiKeyMiddleware`` (with ``api_key``), ``HostGuardMiddleware`` (with ``hosts``),
    ``BrowserGuardMiddleware`` and ``BodySizeLimitMiddleware`` answer stacked in that order, the
    first outermost: every HTTP request gets its id (the client's ``X-Request-ID`` when usable,
    else a fresh one) in ``buffer.logs.request_id`` and on its response, a refusal included; then
    the key, the ``Host``, a browser's origin and content type (methods not in ``SAFE_METHODS``)
    and the body's size are checked, each refusal logged as those layers log it. A websocket is
    asked for the key and the ``Host`` (and closed, not answered, when refused); a lifespan passes.
    The five layers cost five coroutine calls and as many scans of the headers a request; this
    one costs one of each (``bench/hot_path.py --mode layers``).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_bytes: int,
        allowed_origins: list[str] | None = None,
        hosts: HostRule | None = None,
        api_key: str | None = None,
    ) -> None:
        self.app = app
        self._key = _Key(api_key) if api_key else None
        self._hosts = hosts
        self._origins = _Origins(allowed_origins)
        self._limit = _BodyLimit(max_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind != "http" or CHECKED in scope:
            if kind == "websocket":
                await self._websocket(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        authorization = raw_id = host = origin = site = content_type = None
        length: int | None = None
        chunked = id_seen = False
        for name, value in scope["headers"]:  # first authorization and X-Request-ID, last of the rest
            if name == b"content-type":
                content_type = value
            elif name == b"content-length":
                length, chunked = _declared(value, length, chunked)
            elif name == b"host":
                host = value
            elif name == b"authorization":
                if authorization is None:
                    authorization = value
            elif name == b"x-request-id":
                if not id_seen:
                    id_seen = True
                    raw_id = _usable_id(value)
            elif name == b"origin":
                origin = value
            elif name == b"sec-fetch-site":
                site = value
            elif name == b"transfer-encoding":
                chunked = True
        rid, send_with_id = with_request_id(raw_id, send)
        token = request_id.set(rid)
        scope[CHECKED] = True
        if self._key is not None and _key_is_asked(scope):
            problem = self._key.problem(authorization)
            if problem is not None:
                await _Key.refuse(scope, receive, send_with_id, problem)
                request_id.reset(token)
                return
        if self._hosts is not None:
            problem = _host_problem(self._hosts, host, origin is not None or site is not None)
            if problem is not None:
                await _refuse_host(scope, receive, send_with_id, problem)
                request_id.reset(token)
                return
        if scope["method"] not in SAFE_METHODS:
            refusal = self._origins.refusal(scope, origin, site, host, content_type)
            if refusal is not None:
                await _Origins.refuse(scope, receive, send_with_id, *refusal)
                request_id.reset(token)
                return
        await self._limit.run(self.app, scope, receive, send_with_id, length, chunked)
        # Reset only on success, as RequestIdMiddleware: an exception goes on to the 500 handler
        # outside this layer, whose log line should carry the id too. The context is this
        # request's own, so leaving the id set there cannot mislabel another request.
        request_id.reset(token)

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = scope["headers"]
        if self._key is not None and _key_is_asked(scope):
            problem = self._key.problem(_first_authorization(headers))
            if problem is not None:
                await _Key.refuse(scope, receive, send, problem)
                return
        if self._hosts is not None:
            host = None
            marked = False
            for name, value in headers:
                if name == b"host":
                    host = value
                elif name in BROWSER_MARKERS:
                    marked = True
            problem = _host_problem(self._hosts, host, marked)
            if problem is not None:
                await _refuse_host(scope, receive, send, problem)
                return
        await self.app(scope, receive, send)


def _usable_id(value: bytes) -> bytes | None:
    """A client's ``X-Request-ID`` if it is printable ASCII of at most 128 characters (as
    ``buffer.logs.RequestIdMiddleware`` takes it)."""
    value = value.strip()
    if 0 < len(value) <= MAX_REQUEST_ID_LENGTH and value.isascii() and value.decode().isprintable():
        return value
    return None
