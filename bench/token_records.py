"""What token records cost: validation, single-write rate and memory, with and without ``turns``.

Two kinds of trajectory, written alike:

- "text": ``common.make_trajectory``'s ~2 KB chat trajectory (the other benchmarks' figure).
- "tokens": a typical multi-turn record from the token-in/token-out toolkit: the same ~2 KB of
  messages as three assistant turns with two tool results, plus ``turns``: 3 turns whose prompts add
  up to 600 ids (400 for the first, then 100 observation ids each, written as deltas with
  ``prompt_offset``) and 3 x 200 sampled ids, each with its logprob (full doubles, as engines return them).

Modes (``--mode``, default all three):

- ``validate``: in this process, ``buffer.service.models.TRAJECTORY.validate_json`` on the request bytes,
  microseconds per trajectory, the best of ``--repeats`` timings (the edge's whole per-write
  validation; no server). Run it with another checkout first on ``PYTHONPATH`` to compare commits.
- ``write``: a fresh server per run, ``--clients`` processes each posting one trajectory at a time
  to ``POST /buffer/write`` (fresh ids, so every write opens a pending group) for ``--duration``
  seconds. Reports requests/s and requests per second of server CPU (``per_cpu_s``: what one whole
  core would do, the figure least disturbed by other work on the machine). The clients are Python:
  where ``wrk`` is at hand, ``bench/write_rate.py`` measures the text kind's ceiling better.
- ``memory``: a fresh server per kind; resident memory per buffered trajectory, as ``bench/memory.py``
  measures it (``--count`` pending trajectories through ``/buffer/write_batch``).

Runs of the two kinds alternate, so slow drift of the machine affects both alike.

Run (from the repository root, with the dev venv):

    .venv/bin/python bench/token_records.py
    .venv/bin/python bench/token_records.py --mode write --runs 3 --duration 10
    .venv/bin/python bench/token_records.py --mode memory --count 20000
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import signal
import statistics
import time
from typing import Any

import common
import httpx
import memory
import orjson

KINDS = ("text", "tokens")
PLACEHOLDER = "@@ID@@"
FIRST_PROMPT_IDS = 400
OBSERVATION_IDS = 100
OUTPUT_IDS = 200


def make_token_trajectory(
    instance_id: str | int, uid: str | None, reward: float = 0.5, seed: int = 0
) -> dict[str, Any]:
    """A 3-turn trajectory with its token records: ~2 KB of messages, 600 prompt ids, 3 x 200 sampled."""
    rng = random.Random(seed)
    base = common.make_trajectory(instance_id, uid, reward, common.DEFAULT_TRAJECTORY_BYTES, seed=seed)
    system, user, reply = (message["content"] for message in base["messages"])
    third = len(reply) // 3
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": user},
    ]
    for n in range(3):
        messages.append(
            {"role": "assistant", "content": reply[n * third : (n + 1) * third], "generated": True}
        )
        if n < 2:
            messages.append({"role": "tool", "content": f"result {seed}-{n}"})
    turns: list[dict[str, Any]] = []
    held = 0
    for n in range(3):
        prompt = FIRST_PROMPT_IDS if n == 0 else OBSERVATION_IDS
        turns.append(
            {
                "prompt_ids": [rng.randrange(151_000) for _ in range(prompt)],
                "prompt_offset": held,
                "output_ids": [rng.randrange(151_000) for _ in range(OUTPUT_IDS)],
                "output_logprobs": [-rng.expovariate(2.0) for _ in range(OUTPUT_IDS)],
                "finish_reason": "tool_calls" if n < 2 else "stop",
                "message_index": 2 + 2 * n,
                "weight_version": "3",
                "sampling": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 1024},
            }
        )
        held += prompt + OUTPUT_IDS
    return {**base, "messages": messages, "turns": turns}


def make(kind: str, instance_id: str | int, uid: str | None, seed: int = 0) -> dict[str, Any]:
    if kind == "tokens":
        return make_token_trajectory(instance_id, uid, seed=seed)
    return common.make_trajectory(instance_id, uid, 0.5, common.DEFAULT_TRAJECTORY_BYTES, seed=seed)


# -- validation, in this process --------------------------------------------------------------


def validate_times(kinds: tuple[str, ...], repeats: int) -> dict[str, float]:
    """The fastest of ``repeats`` timings of 64 validations, per trajectory, kinds interleaved.

    The fastest, not the mean: on a shared machine the slower runs measure the neighbours.
    """
    from buffer.service.models import TRAJECTORY

    bodies = {kind: [orjson.dumps(make(kind, f"i{n}", f"u{n}", seed=n)) for n in range(64)] for kind in kinds}
    best = dict.fromkeys(kinds, float("inf"))
    for _ in range(repeats):
        for kind in kinds:
            start = time.perf_counter()
            for body in bodies[kind]:
                TRAJECTORY.validate_json(body)
            best[kind] = min(best[kind], (time.perf_counter() - start) / len(bodies[kind]))
    return best


# -- single writes through the server -----------------------------------------------------------


def _client(port: int, head: bytes, middle: bytes, tail: bytes, prefix: str, stop_at: float) -> int:
    """One client process: post trajectories one at a time until ``stop_at``; the 2xx count."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the pool's workers: no KeyboardInterrupt on exit
    ok = 0
    n = 0
    with common.RawClient(port) as client:
        while time.time() < stop_at:
            n += 1
            ident = f"{prefix}-{n}".encode()
            status, _, _, _ = client.request("POST", "/buffer/write", head + ident + middle + ident + tail)
            ok += 200 <= status < 300
    return ok


def write_run(args: argparse.Namespace, kind: str, index: int) -> dict[str, Any]:
    template = orjson.dumps(make(kind, PLACEHOLDER, PLACEHOLDER, seed=index))
    head, middle, tail = template.split(PLACEHOLDER.encode())
    with (
        common.Server(args.group_size, common.server_args(args.server_args)) as server,
        httpx.Client(base_url=server.url, timeout=60.0) as http,
    ):
        context = multiprocessing.get_context("fork")
        with context.Pool(args.clients) as pool:
            warm_until = time.time() + args.warmup
            pool.starmap(
                _client,
                [
                    (server.port, head, middle, tail, f"w{index}{kind}{c}", warm_until)
                    for c in range(args.clients)
                ],
            )
            written_before = common.settle(lambda: common.buffer_stats(http)["total_written"])
            cpu_before = common.cpu_seconds(server.pid)
            start = time.monotonic()
            stop_at = time.time() + args.duration
            counts = pool.starmap(
                _client,
                [
                    (server.port, head, middle, tail, f"r{index}{kind}{c}", stop_at)
                    for c in range(args.clients)
                ],
            )
            elapsed = time.monotonic() - start
            server_cpu = common.cpu_seconds(server.pid) - cpu_before
        landed = common.settle(lambda: common.buffer_stats(http)["total_written"]) - written_before
    requests = sum(counts)
    return {
        "kind": kind,
        "bytes": len(template),
        "rate": requests / elapsed,
        "requests": requests,
        "landed": landed,
        "server_cpu": server_cpu / elapsed,
        "per_cpu_s": requests / server_cpu if server_cpu else 0.0,
    }


# -- memory per buffered trajectory ---------------------------------------------------------------


def memory_run(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    def trajectory(prefix: str, n: int) -> dict[str, Any]:
        return make(kind, f"{prefix}-{n}", f"{prefix}-u{n}", seed=n)

    result = memory.measure(args, trajectory, args.count, args.warmup_count)
    return {"kind": kind, **{name: result[name] for name in ("bytes_per_trajectory", "json_bytes", "ratio")}}


# -- the script ----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    modes = ["validate", "write", "memory"] if args.mode == "all" else [args.mode]
    result: dict[str, Any] = {}
    for kind in KINDS:
        body = orjson.dumps(make(kind, "i", "u"))
        print(f"{kind:>6}: {len(body):,} bytes of JSON per trajectory")
    if "validate" in modes:
        best = validate_times(KINDS, args.repeats)
        for kind in KINDS:
            print(f"validate {kind:>6}: {best[kind] * 1e6:,.1f} us per trajectory (best of {args.repeats})")
        result["validate"] = best
    if "write" in modes:
        runs = [write_run(args, kind, index) for index in range(args.runs) for kind in KINDS]
        columns = ["kind", "bytes", "rate", "requests", "landed", "server_cpu", "per_cpu_s"]
        print(common.table(columns, ([r[c] for c in columns] for r in runs)))
        for kind in KINDS:
            mine = [r for r in runs if r["kind"] == kind]
            print(
                f"write {kind:>6}: median {statistics.median(r['rate'] for r in mine):,.0f} requests/s, "
                f"{statistics.median(r['per_cpu_s'] for r in mine):,.0f} per server CPU second"
            )
        result["write"] = runs
    if "memory" in modes:
        memories = [memory_run(args, kind) for kind in KINDS]
        for row in memories:
            print(
                f"memory {row['kind']:>6}: {row['bytes_per_trajectory']:,.0f} B of RSS per trajectory for "
                f"{row['json_bytes']:,.0f} B of JSON ({row['ratio']:.2f}x)"
            )
        result["memory"] = memories
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=["all", "validate", "write", "memory"], default="all")
    parser.add_argument("--runs", type=int, default=3, help="runs of each kind (default 3)")
    parser.add_argument("--repeats", type=int, default=200, help="timings of 64 validations, per kind")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per write run (default 5)")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of writes before measuring")
    parser.add_argument("--clients", type=int, default=4, help="client processes writing (default 4)")
    parser.add_argument("--count", type=int, default=20_000, help="trajectories buffered for memory")
    parser.add_argument("--warmup-count", type=int, default=2000, help="trajectories before the RSS baseline")
    parser.add_argument("--batch-size", type=int, default=500, help="trajectories per write_batch request")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds idle before each RSS reading")
    common.add_server_arguments(parser)
    return parser


def main() -> None:
    common.raise_on_sigterm()
    run(build_parser().parse_args())


if __name__ == "__main__":
    main()
