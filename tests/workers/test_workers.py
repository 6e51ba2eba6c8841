"""Generators in worker processes: hostile ones leave the service serving and their job marked
with what happened; a cancel stops every process a generator started; a killed worker loses
no group. Each test runs a real service process (workers need a port to write back to)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from buffer.core.hook_guard import GuardedHook, HookTimeout, guard_hooks
from buffer.core.hooks import bind_hooks
from buffer.paths import ROOT
from buffer.processes import free_port, started, wait_ready
from buffer.service.jobs import MAX_WORKERS
from buffer.workers.process import group_alive
from tests.support.calls import wait_for

SINK_WRITES = """
from buffer.toolkit.sink import open_sink

async def write_group(data, instance_id, size=2):
    sink = await open_sink(data["remote_buffer_url"])
    for repeat in range(size):
        await sink.write({
            "instance_id": instance_id,
            "uid": f"{instance_id}-{repeat}",
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "reward": float(repeat),
            "extra_info": {"repeat": repeat},
        })
    await sink.aclose()
"""

#: What a /health round trip stays well under while nothing blocks the service (a loaded machine
#: included); a hook or generator blocking it would hold it for 30 s or more.
SERVING_S = 10.0

GENERATORS = {
    # time.sleep in an async run_rollout: blocks the worker's loop, never the service's; until
    # a file next to it says to end.
    "sleepy": SINK_WRITES
    + """
import pathlib, time
TASK_TYPE = "sleepy"

async def run_rollout(data):
    await write_group(data, "s1")
    release = pathlib.Path(__file__).with_suffix(".release")
    while not release.exists():
        time.sleep(0.1)
""",
    # A hook that blocks: the group is set aside after the time limit, the service serves.
    "blocking_hook": SINK_WRITES
    + """
import time
TASK_TYPE = "blocking_hook"

def is_valid_group(group, min_valid_group_size, task_type):
    time.sleep(30)
    return True, True

async def run_rollout(data):
    await write_group(data, "b1")
    await write_group(data, "b2")
""",
    "exiting": """
import os
TASK_TYPE = "exiting"

async def run_rollout(data):
    os._exit(3)
""",
    "interrupting": """
TASK_TYPE = "interrupting"

def run_rollout(data):
    raise KeyboardInterrupt
""",
    "leaking": """
import time
TASK_TYPE = "leaking"
HOARD = []

def run_rollout(data):
    HOARD.append(bytearray(200 * 2**20))
    while True:
        time.sleep(0.1)
""",
    # Catches every cancellation and carries on. (Each of these two says, in a file next to
    # it, that it is in its loop: the test cancels it then.)
    "stubborn": """
import asyncio, pathlib, signal
TASK_TYPE = "stubborn"

async def run_rollout(data):
    pathlib.Path(__file__).with_suffix(".ready").touch()
    while True:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            continue
""",
    # Ignores SIGTERM outright, in a sync generator.
    "deaf": """
import pathlib, signal, time
TASK_TYPE = "deaf"

def run_rollout(data):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pathlib.Path(__file__).with_suffix(".ready").touch()
    while True:
        time.sleep(0.1)
""",
    # As slime's own generator: sync, a multiprocessing pool of writers that never stop.
    "slime_like": """
import itertools, multiprocessing, os, time, uuid
import httpx
TASK_TYPE = "slime_like"

def writer(url, n):
    with httpx.Client(trust_env=False) as client:
        for i in itertools.count():
            item = {
                "instance_id": f"w{n}-{i}",
                "uid": uuid.uuid4().hex,
                "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                "reward": 1.0,
            }
            client.post(url + "/buffer/write", json=item)
            time.sleep(0.02)

def run_rollout(data):
    processes = [
        multiprocessing.Process(target=writer, args=(data["remote_buffer_url"], n)) for n in range(4)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
""",
    # Worker 0 blocks its event loop for good after a few trajectories: alive, no heartbeat.
    "hanging": """
import time
from buffer.toolkit import run_rollouts
TASK_TYPE = "hanging"

async def run_rollout(data):
    first = data["leases"]["worker"].endswith("/0.0")
    scored = 0

    async def reward(sample, episode):
        nonlocal scored
        scored += 1
        if first and scored == 6:
            time.sleep(600)
        return float(sample.repeat)

    await run_rollouts(data, reward=reward)
""",
    # The toolkit against the simulator; rewards differ by repeat so every group is valid.
    "toolkit": """
from buffer.toolkit import run_rollouts
TASK_TYPE = "toolkit"

async def run_rollout(data):
    await run_rollouts(data, reward=lambda sample, episode: float(sample.repeat))
""",
}


class Service:
    def __init__(self, url: str, pid: int, data: Path) -> None:
        self.data = data  # the generator folder's data, an input root
        self.url = url
        self.pid = pid
        self.http = httpx.Client(base_url=url, timeout=30.0, trust_env=False)

    def start(self, task: str, **fields: Any) -> dict[str, Any]:
        response = self.http.post("/start_rollout", json={"task_type": task, **fields})
        assert response.status_code == 200, response.text
        job: dict[str, Any] = response.json()["job"]
        return job

    def job(self, job_id: str) -> dict[str, Any]:
        data: dict[str, Any] = self.http.get(f"/jobs/{job_id}").json()["data"]
        return data

    def wait_job(
        self, job_id: str, until: Callable[[dict[str, Any]], bool], timeout_s: float = 60
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if until(job):
                return job
            time.sleep(0.1)
        raise AssertionError(f"job {job_id} never got there: {self.job(job_id)}")

    def wait_done(self, job_id: str, timeout_s: float = 60) -> dict[str, Any]:
        return self.wait_job(job_id, lambda job: job["status"] != "running", timeout_s)

    def cancel(self, job_id: str) -> dict[str, Any]:
        response = self.http.post(f"/jobs/{job_id}/cancel")
        assert response.status_code == 200, response.text
        data: dict[str, Any] = response.json()["data"]
        return data

    def health_latency_s(self) -> float:
        started_at = time.monotonic()
        assert self.http.get("/health").status_code == 200
        return time.monotonic() - started_at

    def rss_bytes(self) -> int:
        return _rss(self.pid)


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def simulated_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    command = [sys.executable, "-m", "buffer.simulator", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--latency-mean-s", "0.3", "--accuracy", "1.0", "--seed", "0", "--log-level", "warning"]
    with started(command, "simulator", tmp_path_factory.mktemp("sim") / "sim.log") as process:
        wait_ready(f"http://127.0.0.1:{port}/health", process, 60, "the simulator")
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    directory = tmp_path_factory.mktemp("workers")
    generators = directory / "generator"
    (generators / "data").mkdir(parents=True)
    for name, source in GENERATORS.items():
        (generators / f"{name}_generator.py").write_text(source)
    shutil.copy(ROOT / "generator" / "data" / "math.jsonl", generators / "data" / "math.jsonl")
    port = free_port()
    command = [sys.executable, "-m", "buffer", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--generator-dir", str(generators), "--group-size", "2", "--worker-grace-s", "1"]
    command += ["--hook-timeout-s", "0.5", "--strict-tasks"]
    with started(command, "service", directory / "service.log") as process:
        wait_ready(f"http://127.0.0.1:{port}/health", process, 60, "the service")
        running = Service(f"http://127.0.0.1:{port}", process.pid, generators / "data")
        yield running
        running.http.close()
        assert process.poll() is None, "the service died"


def test_time_sleep_in_an_async_generator_does_not_block_the_service(service: Service) -> None:
    release = service.data.parent / "sleepy_generator.release"
    release.unlink(missing_ok=True)
    job = service.start("sleepy")
    service.wait_job(job["id"], lambda job: job["counters"]["written"] == 2)
    assert service.job(job["id"])["status"] == "running"  # it sleeps now, in its worker
    # A service it blocked would not answer before the release (the client gives up at 30 s).
    assert max(service.health_latency_s() for _ in range(5)) < SERVING_S
    release.touch()
    done = service.wait_done(job["id"])
    assert done["status"] == "succeeded"
    assert done["workers"][0]["exit"] == "exited with code 0"


def test_a_hook_that_blocks_sets_its_groups_aside_and_the_service_serves(service: Service) -> None:
    job = service.start("blocking_hook")
    done = service.wait_done(job["id"])
    assert done["status"] == "succeeded"
    assert service.health_latency_s() < SERVING_S
    aside = service.http.get("/buffer/set_aside", params={"task_type": "blocking_hook"}).json()["data"][
        "groups"
    ]
    assert len(aside) == 2
    assert all("is_valid_group" in str(group) for group in aside)


def test_a_generator_that_exits_fails_its_job_with_the_exit_code(service: Service) -> None:
    job = service.start("exiting")
    done = service.wait_done(job["id"])
    assert done["status"] == "failed"
    assert "exited with code 3" in done["error"]
    assert service.health_latency_s() < SERVING_S


def test_keyboard_interrupt_fails_the_job_not_the_service(service: Service) -> None:
    job = service.start("interrupting")
    done = service.wait_done(job["id"])
    assert done["status"] == "failed"
    assert done["error"].startswith("KeyboardInterrupt")
    assert done["where"].endswith("interrupting_generator.py:5 in run_rollout")
    assert service.health_latency_s() < SERVING_S


def test_a_leaking_generator_grows_its_worker_not_the_service(service: Service) -> None:
    before = service.rss_bytes()
    job = service.start("leaking")
    running = service.wait_job(
        job["id"], lambda job: ((job["workers"] and job["workers"][0]["rss_bytes"]) or 0) > 150 * 2**20
    )
    assert service.rss_bytes() - before < 50 * 2**20
    pid = running["workers"][0]["pid"]
    assert service.cancel(job["id"])["status"] == "cancelled"
    assert not group_alive(pid)


@pytest.mark.parametrize("task", ["stubborn", "deaf"])
def test_a_generator_that_ignores_cancellation_is_killed_after_the_grace_period(
    service: Service, task: str
) -> None:
    ready = service.data.parent / f"{task}_generator.ready"
    ready.unlink(missing_ok=True)
    job = service.start(task)
    pid = service.wait_job(job["id"], lambda job: bool(job["workers"]))["workers"][0]["pid"]
    wait_for(ready.exists, 60, "the generator in its loop, deaf to the cancel")
    started_at = time.monotonic()
    cancelled = service.cancel(job["id"])
    assert 1.0 <= time.monotonic() - started_at < 30  # the grace (1 s) given, then the kill
    assert cancelled["status"] == "cancelled"
    assert cancelled["workers"][0]["exit"] == "was killed by SIGKILL"
    assert not group_alive(pid)


def test_a_multiprocessing_generator_stops_writing_on_cancel_and_restarts_alone(service: Service) -> None:
    first = service.start("slime_like")

    def written() -> int:
        count: int = service.job(first["id"])["counters"]["written"]
        return count

    pid = service.wait_job(first["id"], lambda job: job["counters"]["written"] >= 20)["workers"][0]["pid"]
    assert service.cancel(first["id"])["status"] == "cancelled"
    assert not group_alive(pid)  # the pool's processes too: they are in the worker's group
    after_cancel = written()
    time.sleep(1.0)
    assert written() == after_cancel

    second = service.start("slime_like")
    assert second["id"] != first["id"]
    restarted = service.http.post("/start_rollout", json={"task_type": "slime_like", "restart": True}).json()
    assert restarted["job_id"] != second["id"]
    assert service.job(second["id"])["status"] == "cancelled"
    assert not group_alive(service.job(second["id"])["workers"][0]["pid"])
    running = [job for job in service.http.get("/jobs").json()["data"]["jobs"] if job["status"] == "running"]
    assert [job["id"] for job in running if job["task_type"] == "slime_like"] == [restarted["job_id"]]
    third = service.wait_job(restarted["job_id"], lambda job: job["counters"]["written"] >= 10)
    assert service.cancel(third["id"])["status"] == "cancelled"


def start_on_math(service: Service, task: str, engine: str, **extra: Any) -> dict[str, Any]:
    """A job of ``task`` on the 64 math prompts, 2 samples each, in two workers of 8 in flight."""
    return service.start(
        task,
        input_file=str(service.data / "math.jsonl"),
        remote_engine_url=engine,
        num_repeat_per_sample=2,
        num_process=8,
        num_workers=2,
        group_timeout_seconds=600,
        **extra,
    )


def assert_every_group_once(service: Service, task: str) -> None:
    """What the buffer holds of ``task``: each of the 64 math prompts once, with both samples."""
    items = service.http.post("/get_rollout_data", json={"task_type": task}).json()["data"]["data"]
    instances = Counter(item["instance_id"] for item in items)
    assert len(instances) == 64
    assert set(instances.values()) == {2}


def test_a_worker_killed_mid_run_loses_no_group_and_makes_none_twice(
    service: Service, simulated_engine: str
) -> None:
    job = start_on_math(service, "toolkit", simulated_engine)
    running = service.wait_job(job["id"], lambda job: job["counters"]["written"] >= 16)
    os.kill(running["workers"][0]["pid"], signal.SIGKILL)
    done = service.wait_done(job["id"], timeout_s=120)
    assert done["status"] == "succeeded", done
    assert done["worker_restarts"] == 1
    # The other worker ran on, untouched; a new one took the lost one's place and leases.
    lost, other, new = done["workers"]
    assert lost["exit"] == "was killed by SIGKILL"
    assert (other["pid"], other["status"]) == (running["workers"][1]["pid"], "succeeded")
    assert (new["index"], new["status"]) == (0, "succeeded")
    assert done["progress"]["completed"] > 0  # the workers' counts, added up
    assert done["counters"]["written"] == 64 * 2
    assert_every_group_once(service, "toolkit")


def test_a_hung_worker_is_stopped_and_its_items_made_by_others_once(
    service: Service, simulated_engine: str
) -> None:
    job = start_on_math(service, "hanging", simulated_engine, lease_ttl_s=2)
    done = service.wait_done(job["id"], timeout_s=120)
    assert done["status"] == "succeeded", done
    assert done["worker_restarts"] == 1
    assert done["workers"][0]["exit"] == "was killed by SIGKILL"  # it never ended by itself
    assert done["counters"]["written"] == 64 * 2
    assert_every_group_once(service, "hanging")


def test_sigterm_stops_the_service_and_its_workers(tmp_path: Path) -> None:
    generators = tmp_path / "generator"
    generators.mkdir()
    (generators / "deaf_generator.py").write_text(GENERATORS["deaf"])
    port = free_port()
    command = [sys.executable, "-m", "buffer", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--generator-dir", str(generators), "--worker-grace-s", "1"]
    with started(command, "service", tmp_path / "service.log") as process:
        wait_ready(f"http://127.0.0.1:{port}/health", process, 60, "the service")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=30) as http:
            job = http.post("/start_rollout", json={"task_type": "deaf"}).json()["job"]
            workers = wait_for(
                lambda: http.get(f"/jobs/{job['id']}").json()["data"]["workers"], 60, "workers"
            )
        wait_for((generators / "deaf_generator.ready").exists, 60, "the worker ignoring SIGTERM")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        assert not group_alive(workers[0]["pid"])


class TestHookGuard:
    def test_a_hook_that_returns_in_time_answers_as_itself(self) -> None:
        hook = GuardedHook("is_valid_group", lambda group, size, task: (True, True), 1.0)
        assert hook(("q", []), 2, "math") == (True, True)

    def test_a_hook_error_reaches_the_caller(self) -> None:
        def broken(*_: Any) -> None:
            raise ValueError("bad group")

        with pytest.raises(ValueError, match="bad group"):
            GuardedHook("filter_item", broken, 1.0)({}, "math")

    def test_a_stuck_hook_times_out_then_fails_at_once_until_it_returns(self) -> None:
        release = threading.Event()
        calls: list[int] = []

        def stuck(n: int) -> int:
            calls.append(n)
            if n == 0:
                release.wait(120)
            return n

        hook = GuardedHook("transform_group", stuck, 1.0)
        started_at = time.monotonic()
        with pytest.raises(HookTimeout, match=r"within 1 s"):
            hook(0)
        assert 1.0 <= time.monotonic() - started_at < 60  # its limit, not the stuck call's 120 s
        started_at = time.monotonic()
        with pytest.raises(HookTimeout, match="still in a call"):
            hook(1)
        assert time.monotonic() - started_at < 1.0  # at once: no second wait of its limit

        def serves() -> bool:
            try:
                return bool(hook(2) == 2)
            except HookTimeout:
                return False

        release.set()
        wait_for(serves, 30, "the hook serving again once the stuck call returned", 0.05)
        assert calls == [0, 2]

    def test_only_overridden_hooks_are_guarded(self) -> None:
        hooks = guard_hooks(bind_hooks({"is_valid_group": lambda group, size, task: (True, True)}), 1.0)
        assert isinstance(hooks.is_valid_group, GuardedHook)
        assert not isinstance(hooks.filter_item, GuardedHook)


def remote_workers(
    service: Service,
    engine: str,
    tmp_path: Path,
    task: str,
    *,
    num_process: int,
    flags: tuple[str, ...] = (),
) -> list[subprocess.Popen[bytes]]:
    """Two ``rollout-buffer worker`` processes running the toolkit generator on the shipped math
    data (64 prompts, 2 samples each) for ``task``."""
    generator = tmp_path / "remote_generator.py"
    generator.write_text(GENERATORS["toolkit"])
    data = {
        "input_file": str(ROOT / "generator" / "data" / "math.jsonl"),
        "remote_engine_url": engine,
        "num_repeat_per_sample": 2,
        "num_process": num_process,
    }
    command = [sys.executable, "-m", "buffer", "worker", "--buffer", service.url, "--task", task]
    command += ["--generator", str(generator), "--data", json.dumps(data), "--num-workers", "2", *flags]
    return [
        subprocess.Popen([*command, "--worker-index", str(index)], cwd=ROOT, env=dict(os.environ))
        for index in range(2)
    ]


def test_remote_workers_fill_a_strict_task_with_exact_counts(
    service: Service, simulated_engine: str, tmp_path: Path
) -> None:
    # The service runs with --strict-tasks: each worker configures the task first (PUT /tasks).
    workers = remote_workers(service, simulated_engine, tmp_path, "remote_math", num_process=32)
    assert [worker.wait(timeout=120) for worker in workers] == [0, 0]
    assert_every_group_once(service, "remote_math")


def test_the_strict_service_refuses_a_write_to_a_task_never_configured(service: Service) -> None:
    response = service.http.post(
        "/buffer/write",
        json={
            "instance_id": "q",
            "task_type": "never",
            "messages": [{"role": "user", "content": "q"}],
            "reward": 1,
        },
    )
    assert response.status_code == 422


def test_workers_write_back_to_a_service_that_requires_a_key(tmp_path: Path) -> None:
    generators = tmp_path / "generator"
    generators.mkdir()
    (generators / "sleepy_generator.py").write_text(GENERATORS["sleepy"])
    (generators / "sleepy_generator.release").touch()  # it ends once it has written
    port = free_port()
    command = [sys.executable, "-m", "buffer", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--generator-dir", str(generators), "--group-size", "2", "--api-key", "s3cret"]
    with started(command, "service", tmp_path / "service.log") as process:
        wait_ready(f"http://127.0.0.1:{port}/health", process, 60, "the service")
        headers = {"authorization": "Bearer s3cret"}
        with httpx.Client(
            base_url=f"http://127.0.0.1:{port}", headers=headers, trust_env=False, timeout=30
        ) as http:
            job = http.post("/start_rollout", json={"task_type": "sleepy"}).json()["job"]
            deadline = time.monotonic() + 60
            while (state := http.get(f"/jobs/{job['id']}").json()["data"])["status"] == "running":
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert state["status"] == "succeeded", state
        assert state["counters"]["written"] == 2


def test_num_workers_is_checked_before_a_job_starts(
    make_client: Callable[..., Any], generator_dir: Path
) -> None:
    (generator_dir / "exiting_generator.py").write_text(GENERATORS["exiting"])
    client = make_client(job_isolation="process")
    for bad in (0, MAX_WORKERS + 1, "two", True):
        response = client.post("/start_rollout", json={"task_type": "exiting", "num_workers": bad})
        assert response.status_code == 422, bad
        assert response.json()["errors"][0]["field"] == "num_workers"
    inline = make_client()  # the tests' in-process app: no worker processes there
    response = inline.post("/start_rollout", json={"task_type": "exiting", "num_workers": 2})
    assert response.status_code == 422


def test_a_lease_worker_killed_mid_run_has_its_share_made_by_the_other(
    service: Service, simulated_engine: str, tmp_path: Path
) -> None:
    workers = remote_workers(
        service, simulated_engine, tmp_path, "leased", num_process=8, flags=("--leases", "--lease-ttl-s", "2")
    )

    def written() -> int:
        tasks = service.http.get("/buffer/stats").json()["data"]["meta_info"]["tasks"]
        count: int = tasks.get("leased", {}).get("total_written", 0)
        return count

    deadline = time.monotonic() + 60
    while written() < 20:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    workers[0].kill()  # its leased, unwritten items go to the other after 2 s
    assert workers[1].wait(timeout=120) == 0
    workers[0].wait()
    assert written() == 64 * 2  # none made twice
    assert_every_group_once(service, "leased")
