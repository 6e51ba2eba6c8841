"""Read latency: one ``POST /get_rollout_data`` returning ``--groups`` ready groups (figure 4).

Each repeat fills the server (``--group-size 8``) with ``--groups`` complete groups of 8 ~2 KB
trajectories through ``POST /buffer/write_batch``. Rewards vary within each group (the default
``is_valid_group`` discards a group whose rewards are all equal), so the default hooks keep
every group. Once ``/buffer/stats`` shows them all ready, the script times a single
``POST /get_rollout_data`` with body ``{}`` from an httpx client (connection already open):

- ``first byte``: until the response headers arrive. The server builds the whole body before it
  sends the headers, so this is about the server's time.
- ``total``: until the whole body has been read (not parsed) by the client.

Two clients take turns (``--client``): httpx, and ``raw``, a bare socket that reads the body into
one preallocated buffer, to show how much of ``total`` is the client's own work. The response is
then parsed and checked (all items returned). Repeats use the same server with fresh fills;
min and median are reported per client.

Run (from the repository root, with the dev venv):

    .venv/bin/python bench/read_latency.py                  # 1,000 groups of 8, 5 reads per client
    .venv/bin/python bench/read_latency.py --groups 2000 --repeats 10
"""

from __future__ import annotations

import argparse
import random
import time
import uuid
from typing import Any

import common
import httpx
import orjson


def group_rewards(rng: random.Random, size: int) -> list[float]:
    rewards = [round(rng.random(), 4) for _ in range(size)]
    if size > 1 and len(set(rewards)) == 1:
        rewards[0] = 1.0 - rewards[0] if rewards[0] != 0.5 else 0.0
    return rewards


def timed_read(client: httpx.Client, raw: common.RawClient, kind: str) -> tuple[float, float, bytes]:
    """One ``POST /get_rollout_data`` with ``{}``: (ms to the headers, ms in all, body)."""
    if kind == "raw":
        status, headers_s, total_s, body = raw.request("POST", "/get_rollout_data", b"{}")
        if status != 200:
            raise RuntimeError(f"/get_rollout_data answered {status}")
        return headers_s * 1000, total_s * 1000, body
    start = time.perf_counter()
    with client.stream(
        "POST", "/get_rollout_data", content=b"{}", headers={"content-type": "application/json"}
    ) as response:
        headers_at = time.perf_counter()
        body = response.read()
    done_at = time.perf_counter()
    response.raise_for_status()
    return (headers_at - start) * 1000, (done_at - start) * 1000, body


def run(args: argparse.Namespace) -> dict[str, Any]:
    kinds = ["httpx", "raw"] if args.client == "both" else [args.client]
    print(
        f"read_latency: {args.groups:,} ready groups of {args.group_size} ~{args.size} B trajectories, "
        f"{args.repeats} timed reads per client ({', '.join(kinds)})"
    )
    rng = random.Random(42)
    timings: dict[str, dict[str, list[float]]] = {kind: {"first_byte": [], "total": []} for kind in kinds}
    response_bytes = 0
    with (
        common.Server(args.group_size, common.server_args(args.server_args)) as server,
        httpx.Client(base_url=server.url, timeout=120.0) as client,
        common.RawClient(server.port) as raw,
    ):
        rounds = [(kinds[0], True)] * args.warmup + [
            (kind, False) for _ in range(args.repeats) for kind in kinds
        ]
        for kind, warmup in rounds:
            tag = uuid.uuid4().hex[:8]
            trajectories = [
                common.make_trajectory(f"{tag}-{g}", f"{tag}-{g}-{i}", reward, args.size, seed=g * 8 + i)
                for g in range(args.groups)
                for i, reward in enumerate(group_rewards(rng, args.group_size))
            ]
            common.fill(client, trajectories)
            common.wait_for(
                lambda: common.buffer_stats(client)["task"].get("ready_groups", 0) >= args.groups,
                what=f"{args.groups} ready groups",
            )
            ready = common.buffer_stats(client)["task"]["ready_groups"]
            fb_ms, total_ms, body = timed_read(client, raw, kind)
            payload = orjson.loads(body)
            items = payload["data"]["data"]
            expected = ready * args.group_size
            if not payload["success"] or len(items) != expected:
                raise RuntimeError(f"expected {expected} items, got {len(items)}: {payload['message']}")
            response_bytes = len(body)
            print(
                f"  {'warm-up' if warmup else kind:>7}: {ready:,} groups ready, {len(items):,} items, "
                f"{len(body) / 1e6:.1f} MB; first byte {fb_ms:.1f} ms, total {total_ms:.1f} ms"
            )
            if not warmup:
                timings[kind]["first_byte"].append(fb_ms)
                timings[kind]["total"].append(total_ms)
        left = common.buffer_stats(client)["task"].get("ready_groups", 0)
    print(f"  ready groups left after the reads: {left}")
    result: dict[str, Any] = {"response_bytes": response_bytes}
    for kind in kinds:
        fb, total = common.summary(timings[kind]["first_byte"]), common.summary(timings[kind]["total"])
        result[kind] = {"first_byte_ms": fb, "total_ms": total}
        print(
            f"{kind:>5} client: first byte min {fb['min']:.1f} ms, median {fb['median']:.1f} ms; "
            f"total min {total['min']:.1f} ms, median {total['median']:.1f} ms "
            f"(all: {', '.join(f'{ms:.0f}' for ms in timings[kind]['total'])})"
        )
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=1000, help="ready groups per read (default 1000)")
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed reads, each after a fresh fill (default 5)"
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed fill-and-read rounds first (default 1)"
    )
    parser.add_argument(
        "--client", choices=["both", "httpx", "raw"], default="both", help="which client times the reads"
    )
    parser.add_argument("--size", type=int, default=common.DEFAULT_TRAJECTORY_BYTES, help="trajectory bytes")
    common.add_server_arguments(parser)
    return parser


def main() -> None:
    common.raise_on_sigterm()
    run(build_parser().parse_args())


if __name__ == "__main__":
    main()
