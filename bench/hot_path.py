"""The write path's costs: service CPU per recorded token, collector pauses, a write against a bare endpoint.

Modes (``--mode``, default all three):

- ``tokens``: a fresh server (``--group-size``, default 8) per size in ``--tokens`` (default 2000 and
  8000 recorded token ids per trajectory: prompt ids and output ids, each output id with its logprob, as
  ``token_records.py`` makes them, scaled). One client writes whole groups (so every group finishes and
  goes through the default hooks), and every ``--read-every`` groups reads all that is ready through
  ``/get_rollout_data``. ``--write batch``: each group in one ``POST /buffer/write_batch`` (a JSON list),
  as the toolkit's ``HttpSink`` sends it (generators outside the service, worker processes: the runner
  flushes the sink at a group's last write); ``--write single``: a ``POST /buffer/write`` per
  trajectory. Reports the server's CPU seconds over the recorded tokens written: the service's cost per
  token, writes, group completion and reads together. ``--checks free`` (or ``real,free``, the two
  interleaved per size) runs the service with the checks of the ids and logprobs replaced by a count
  (``unchecked_buffer.py``): the cost of everything else, what is left when those checks cost nothing.
- ``gc``: in this process, a ``RolloutBuffer`` set up as ``rollout-buffer serve`` sets the collector up
  (thresholds 50,000/20/20, ``gc.freeze()`` at start, and again once its task exists where the
  service's sweeper does that, ``buffer.service.app._freeze_new_tasks``), filled with ``--pending``
  (default 100k, 300k, 1M) small trajectories, one per instance: pending groups. Every collection's
  pause is timed through ``gc.callbacks``; reports the longest and a full collection
  (``gc.collect()``) at the end: the longest pause the event loop can see with that much buffered.
- ``stack``: in this process, the service's ASGI app (lifespan started, no HTTP server) answers
  ``--requests`` single writes of a ~2 KB trajectory, against a bare Starlette app whose one route returns a
  constant: microseconds of CPU per request, the best of ``--repeats``. The difference is what the framework,
  the middlewares, validation and the write itself cost on top of what any endpoint costs. Where the app
  has hot routes (``ServiceApp``), also the same writes sent FastAPI's way (its layers, the guard, the
  router: what the hot path skips) and the write's endpoint called directly (no ASGI layer at all).
- ``layers``: in this process, what each layer costs a request: the same constant endpoint (a raw ASGI
  callable that reads the body and answers 16 bytes) bare, as a Starlette app's route, as a FastAPI app's
  route, and behind each of the service's own layers alone and stacked, microseconds per request, the
  best of ``--repeats`` passes of ``--requests``.

Run (from the repository root, with the dev venv):

    .venv/bin/python bench/hot_path.py
    .venv/bin/python bench/hot_path.py --mode tokens --tokens 2000,8000 --groups 200 --write batch,single
    .venv/bin/python bench/hot_path.py --mode tokens --tokens 2000 --groups 400 --checks real,free
    .venv/bin/python bench/hot_path.py --mode gc --pending 1000000
    .venv/bin/python bench/hot_path.py --mode stack --requests 2000 --repeats 5
    .venv/bin/python bench/hot_path.py --mode layers

Another checkout's figures: copy this file into its ``bench/`` and run it there (the script's folder comes
first on ``sys.path``; ``common.Server`` starts that checkout's ``buffer.py``):

    git worktree add /tmp/before-hot HEAD && cp bench/hot_path.py /tmp/before-hot/bench/
    cd /tmp/before-hot && /work/main/.venv/bin/python bench/hot_path.py
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import time
from typing import Any

import common
import orjson

# -- service CPU per recorded token ---------------------------------------------------------------


def token_trajectory(instance_id: str, uid: str, tokens: int, reward: float, seed: int) -> dict[str, Any]:
    """A 3-turn trajectory whose turns hold ``tokens`` ids in all: 30% in the first prompt, 5% in each of
    the two observations, 20% sampled per turn (each with its logprob), over ~2 KB of messages."""
    rng = random.Random(seed)
    base = common.make_trajectory(instance_id, uid, reward, common.DEFAULT_TRAJECTORY_BYTES, seed=seed)
    system, user, reply = (message["content"] for message in base["messages"])
    third = len(reply) // 3
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": user},
    ]
    turns: list[dict[str, Any]] = []
    held = 0
    output = tokens // 5
    for n in range(3):
        messages.append(
            {"role": "assistant", "content": reply[n * third : (n + 1) * third], "generated": True}
        )
        if n < 2:
            messages.append({"role": "tool", "content": f"result {seed}-{n}"})
        prompt = tokens * 3 // 10 if n == 0 else tokens // 20
        turns.append(
            {
                "prompt_ids": [rng.randrange(151_000) for _ in range(prompt)],
                "prompt_offset": held,
                "output_ids": [rng.randrange(151_000) for _ in range(output)],
                "output_logprobs": [-rng.expovariate(2.0) for _ in range(output)],
                "finish_reason": "tool_calls" if n < 2 else "stop",
                "message_index": 2 + 2 * n,
                "weight_version": "3",
            }
        )
        held += prompt + output
    return {**base, "messages": messages, "turns": turns}


def recorded(trajectory: dict[str, Any]) -> int:
    return sum(len(turn["prompt_ids"]) + len(turn["output_ids"]) for turn in trajectory["turns"])


#: ``--checks free``: the service with its token lists' checks made free (``unchecked_buffer.py``).
UNCHECKED = common.REPO / "bench" / "unchecked_buffer.py"


def tokens_run(args: argparse.Namespace, tokens: int, write: str, checks: str = "real") -> dict[str, Any]:
    size = args.group_size
    batch = write == "batch"
    # A few templates, their ids replaced per write: the client's own encoding stays out of the timing.
    templates = [token_trajectory("@@I@@", "@@U@@", tokens, 0.0, seed) for seed in range(size)]
    per_trajectory = recorded(templates[0])
    parts = []
    for n, template in enumerate(templates):
        template["reward"] = n / size  # distinct rewards: every group is valid, normalised and served
        head, middle, tail = (
            orjson.dumps(template).replace(b'"@@I@@"', b"@@").replace(b'"@@U@@"', b"@@").split(b"@@")
        )
        parts.append((head, middle, tail))
    with (
        common.Server(
            size,
            common.server_args(args.server_args),
            entry=UNCHECKED if checks == "free" else common.REPO / "buffer.py",
        ) as server,
        common.RawClient(server.port) as client,
    ):
        read = orjson.dumps({"batch_size": -1})
        written = served = 0

        def write_groups(count: int, prefix: str) -> None:
            nonlocal written, served
            for g in range(count):
                instance = b'"%s-%d"' % (prefix.encode(), g)
                bodies = [
                    head + instance + middle + b'"%s-%d-%d"' % (prefix.encode(), g, n) + tail
                    for n, (head, middle, tail) in enumerate(parts)
                ]
                if batch:  # the group in one POST, a JSON list: what ``HttpSink`` sends at its flush
                    status, _, _, _ = client.request(
                        "POST", "/buffer/write_batch", b"[%s]" % b",".join(bodies)
                    )
                    assert status == 200, status
                else:
                    for body in bodies:
                        status, _, _, _ = client.request("POST", "/buffer/write", body)
                        assert status == 200, status
                written += len(bodies)
                if (g + 1) % args.read_every == 0 or g == count - 1:
                    status, _, _, body = client.request("POST", "/get_rollout_data", read)
                    assert status == 200, body[:200]
                    served += len(orjson.loads(body)["data"]["data"])

        write_groups(max(1, args.groups // 10), "warm")
        written = served = 0
        cpu_before = common.cpu_seconds(server.pid)
        start = time.monotonic()
        write_groups(args.groups, "run")
        elapsed = time.monotonic() - start
        cpu = common.cpu_seconds(server.pid) - cpu_before
    return {
        "write": write,
        "checks": checks,
        "tokens": per_trajectory,
        "json_bytes": len(parts[0][0]) + len(parts[0][1]) + len(parts[0][2]),
        "trajectories": written,
        "served": served,
        "server_cpu_s": cpu,
        "cpu_ms_per_trajectory": cpu / written * 1e3,
        "us_per_token": cpu / (written * per_trajectory) * 1e6,
        "writes_per_s": written / elapsed,
    }


# -- collector pauses ---------------------------------------------------------------------------------


def gc_run(pending: int, batch: int) -> dict[str, Any]:
    from buffer.core.rollout_buffer import RolloutBuffer
    from buffer.core.task import TaskSettings
    from buffer.service import app

    pauses: list[float] = []
    started = [0.0]

    def timing(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - started[0])

    gc.collect()
    gc.set_threshold(50_000, 20, 20)  # as ``rollout-buffer serve`` sets it
    gc.freeze()
    buffer = RolloutBuffer(TaskSettings(group_size=8))
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    buffer.write_many([{"instance_id": "first", "messages": messages, "reward": 0.5}])  # the task made
    if hasattr(app, "_freeze_new_tasks"):  # as the service's sweeper does once a task is new
        app._freeze_new_tasks(buffer, -1)
    gc.callbacks.append(timing)
    try:
        start = time.perf_counter()
        for first in range(0, pending, batch):
            buffer.write_many(
                [
                    {"instance_id": f"g{n}", "uid": f"u{n}", "messages": messages, "reward": 0.5}
                    for n in range(first, min(pending, first + batch))
                ]
            )
        fill_s = time.perf_counter() - start
        longest_fill = max(pauses, default=0.0)
        collections = len(pauses)
        start = time.perf_counter()
        gc.collect()
        full = time.perf_counter() - start
    finally:
        gc.callbacks.remove(timing)
        del buffer
        gc.unfreeze()
        gc.collect()
    return {
        "pending": pending,
        "fill_s": fill_s,
        "collections": collections,
        "longest_pause_ms": longest_fill * 1e3,
        "full_collection_ms": full * 1e3,
    }


# -- a write against a bare endpoint --------------------------------------------------------------


async def _asgi_times(
    app: Any,
    path: str,
    bodies: list[bytes],
    repeats: int,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
) -> float:
    """The best mean microseconds per request over ``repeats`` passes of ``bodies``: this thread's CPU
    time (the calls run on it), which other work on the machine disturbs far less than the clock."""
    best = float("inf")
    done: list[int] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            done.append(message["status"])

    for _ in range(repeats):
        start = time.thread_time()
        for body in bodies:
            sent = False

            async def receive(body: bytes = body) -> dict[str, Any]:
                nonlocal sent
                if sent:
                    await asyncio.sleep(3600)  # a disconnect only once the response is out
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}

            scope = {
                "type": "http",
                "asgi": {"version": "3.0"},
                "http_version": "1.1",
                "method": "POST",
                "scheme": "http",
                "path": path,
                "raw_path": path.encode(),
                "query_string": b"",
                "root_path": "",
                "headers": [
                    (b"host", b"127.0.0.1:8000"),
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    *(extra_headers or ()),
                ],
                "client": ("127.0.0.1", 40000),
                "server": ("127.0.0.1", 8000),
                "state": {},
            }
            await app(scope, receive, send)
        best = min(best, (time.thread_time() - start) / len(bodies))
    assert set(done) == {200}, set(done)
    return best * 1e6


async def _stack(args: argparse.Namespace) -> dict[str, float]:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from buffer.service.app import create_app
    from buffer.service.settings import Settings

    async def bare(request: Any) -> Response:
        await request.body()
        return Response(b'{"success":true}', media_type="application/json")

    bare_app = Starlette(routes=[Route("/buffer/write", bare, methods=["POST"])])
    app = create_app(Settings())
    messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    answers: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    await messages.put({"type": "lifespan.startup"})
    lifespan = asyncio.create_task(
        app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, messages.get, answers.put)
    )
    assert (await answers.get())["type"] == "lifespan.startup.complete"
    hot = hasattr(app, "routed")  # this checkout's app answers hot routes ahead of FastAPI's layers
    ways = ["write", *(["routed", "endpoint"] if hot else [])]
    try:
        count = args.requests
        bodies = [
            orjson.dumps(
                common.make_trajectory(
                    f"s{n % (count // 8 or 1)}-{r}-{w}", f"s{n}-{r}-{w}", n % 8 / 8, seed=n
                )
            )
            for w in range(len(ways))
            for r in range(args.repeats)
            for n in range(count)
        ]
        # Each pass writes fresh uids: a pass of its own bodies, so none is a duplicate.
        best = dict.fromkeys(ways, float("inf"))
        for r in range(args.repeats):
            for w, way in enumerate(ways):
                chunk = bodies[(w * args.repeats + r) * count : (w * args.repeats + r + 1) * count]
                if way == "write":
                    us = await _asgi_times(app, "/buffer/write", chunk, 1)
                elif way == "routed":  # FastAPI's layers, the guard, the router, the route
                    us = await _asgi_times(app.routed, "/buffer/write", chunk, 1)
                else:
                    us = await _endpoint_times(app, Request, chunk)
                best[way] = min(best[way], us)
        bare_us = await _asgi_times(bare_app, "/buffer/write", bodies[:count], args.repeats)
    finally:
        await messages.put({"type": "lifespan.shutdown"})
        await lifespan
    result = {"write_us": best["write"], "bare_us": bare_us, "ratio": best["write"] / bare_us}
    if hot:
        result["routed_us"] = best["routed"]
        result["endpoint_us"] = best["endpoint"]
    return result


async def _endpoint_times(app: Any, request_type: Any, bodies: list[bytes]) -> float:
    """Mean microseconds of the write's endpoint called directly, its response built, not sent."""
    from buffer.service.routes import writes

    scope = {"type": "http", "method": "POST", "path": "/buffer/write", "headers": [], "app": app}
    start = time.thread_time()
    for body in bodies:
        response = await writes.write(request_type(scope), body)
        assert response.status_code == 200
    return (time.thread_time() - start) / len(bodies) * 1e6


async def _layers(args: argparse.Namespace) -> list[tuple[str, float]]:
    """Microseconds per request of one constant endpoint behind each layer or stack of layers."""
    from fastapi import FastAPI
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    from buffer.logs import RequestIdMiddleware
    from buffer.service import security
    from buffer.service.settings import Settings

    answer = b'{"success":true}'

    async def raw(scope: Any, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"16")],
            }
        )
        await send({"type": "http.response.body", "body": answer})

    async def endpoint(request: Any) -> Response:
        await request.body()
        return Response(answer, media_type="application/json")

    def starlette_app() -> Any:
        return Starlette(routes=[Route("/buffer/write", endpoint, methods=["POST"])])

    def fastapi_app() -> Any:
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
        app.router.routes[:0] = [Route("/buffer/write", endpoint, methods=["POST"])]
        return app

    settings = Settings(host="127.0.0.1")  # a Host rule: loopback names, checked on every request
    hosts, limit = security.host_rule(settings), settings.max_request_bytes
    assert hosts is not None
    key = "bench-key"

    def separate(app: Any, with_key: bool) -> Any:
        """The service's checks one layer each, stacked as the service stacked them before."""
        app = security.BodySizeLimitMiddleware(app, max_bytes=limit)
        app = security.BrowserGuardMiddleware(app)
        app = security.HostGuardMiddleware(app, rule=hosts)
        if with_key:
            app = security.ApiKeyMiddleware(app, api_key=key)
        return RequestIdMiddleware(app)

    rows: list[tuple[str, Any, bool]] = [
        ("a raw ASGI endpoint (the floor)", raw, False),
        ("the same as a Starlette app's route", starlette_app(), False),
        ("the same as a FastAPI app's route", fastapi_app(), False),
        ("raw + RequestIdMiddleware", RequestIdMiddleware(raw), False),
        ("raw + HostGuardMiddleware", security.HostGuardMiddleware(raw, rule=hosts), False),
        ("raw + BrowserGuardMiddleware", security.BrowserGuardMiddleware(raw), False),
        ("raw + BodySizeLimitMiddleware", security.BodySizeLimitMiddleware(raw, max_bytes=limit), False),
        ("raw + ApiKeyMiddleware", security.ApiKeyMiddleware(raw, api_key=key), True),
        ("raw + the five above, stacked (no key: four)", separate(raw, False), False),
        ("raw + the five above, stacked, with a key", separate(raw, True), True),
    ]
    if hasattr(security, "ServiceGuard"):
        guard = security.ServiceGuard
        rows += [
            ("raw + ServiceGuard (the same checks, no key)", guard(raw, max_bytes=limit, hosts=hosts), False),
            ("raw + ServiceGuard, with a key", guard(raw, max_bytes=limit, hosts=hosts, api_key=key), True),
        ]
    body = orjson.dumps(common.make_trajectory("i", "u", 0.5, seed=1))
    bodies = [body] * args.requests
    results = []
    for name, app, keyed in rows:
        headers = [(b"authorization", b"Bearer " + key.encode())] if keyed else []
        results.append((name, await _asgi_times(app, "/buffer/write", bodies, args.repeats, headers)))
    return results


# -- the script ----------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    modes = ["tokens", "gc", "stack", "layers"] if args.mode == "all" else [args.mode]
    result: dict[str, Any] = {}
    if "tokens" in modes:
        rows = [
            tokens_run(args, int(tokens), write, checks)
            for write in args.write.split(",")
            for tokens in args.tokens.split(",")
            for checks in args.checks.split(",")
        ]
        columns = [
            "write",
            "checks",
            "tokens",
            "json_bytes",
            "trajectories",
            "served",
            "server_cpu_s",
            "cpu_ms_per_trajectory",
            "us_per_token",
        ]
        print(common.table(columns, ([row[c] for c in columns] for row in rows)))
        result["tokens"] = rows
    if "gc" in modes:
        rows = [gc_run(int(pending), args.batch_size) for pending in args.pending.split(",")]
        columns = ["pending", "fill_s", "collections", "longest_pause_ms", "full_collection_ms"]
        print(common.table(columns, ([row[c] for c in columns] for row in rows)))
        result["gc"] = rows
    if "stack" in modes:
        times = asyncio.run(_stack(args))
        print(
            f"stack: a write {times['write_us']:,.0f} us, a bare endpoint {times['bare_us']:,.0f} us "
            f"({times['ratio']:.1f}x), in-process ASGI calls, best of {args.repeats}"
        )
        if "routed_us" in times:
            print(
                f"stack: the same writes FastAPI's way {times['routed_us']:,.0f} us; "
                f"the write's endpoint alone {times['endpoint_us']:,.0f} us"
            )
        result["stack"] = times
    if "layers" in modes:
        costs = asyncio.run(_layers(args))
        floor = costs[0][1]
        print(
            common.table(
                ["what answers a 2 KB POST", "us", "over the floor"],
                ([name, us, us - floor] for name, us in costs),
            )
        )
        result["layers"] = dict(costs)
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=["all", "tokens", "gc", "stack", "layers"], default="all")
    parser.add_argument(
        "--tokens", default="2000,8000", help="recorded token ids per trajectory, comma-separated"
    )
    parser.add_argument(
        "--write",
        default="batch,single",
        help="for --mode tokens: batch (each group one POST /buffer/write_batch, as HttpSink sends it), "
        "single (a POST /buffer/write per trajectory), or both, comma-separated (default both)",
    )
    parser.add_argument(
        "--checks",
        default="real",
        help="for --mode tokens: real (the service as it is), free (its token lists' checks replaced by a "
        "count: bench/unchecked_buffer.py, what the rest of the path costs), or both, comma-separated",
    )
    parser.add_argument("--groups", type=int, default=150, help="groups written per token size (default 150)")
    parser.add_argument("--read-every", type=int, default=10, help="groups between reads (default 10)")
    parser.add_argument(
        "--pending", default="100000,300000,1000000", help="pending trajectories for --mode gc"
    )
    parser.add_argument(
        "--batch-size", type=int, default=1000, help="trajectories per write_many for --mode gc"
    )
    parser.add_argument(
        "--requests", type=int, default=2000, help="requests per pass for --mode stack and layers"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="passes for --mode stack and layers (the best is kept)"
    )
    common.add_server_arguments(parser)
    return parser


def main() -> None:
    common.raise_on_sigterm()
    run(build_parser().parse_args())


if __name__ == "__main__":
    main()
