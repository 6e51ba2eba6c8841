"""The dashboard, end to end: the real service in a subprocess, the page in headless Chromium.

The test writes trajectories over HTTP while the page polls, and checks that the charts hold
drawn pixels, that what the page drew changes as samples arrive, that hovering a chart shows its
values, that the trajectory viewer opens a group with its tokens and loss mask, that the
generator which failed to import is listed and that the job list shows the job. It saves a
screenshot in its temporary folder, or in ``docs/dashboard.png`` for the README when
``UPDATE_SCREENSHOT=1``. Chromium resolves no host but the loopback one: the pages must work
with no network (``/docs`` too).
"""

from __future__ import annotations

import itertools
import os
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from buffer.processes import free_port, started, wait_ready
from tests.support.paths import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

#: How long the page may take to show something: generous, for a loaded machine.
WAIT_S = 60.0

REPO_ROOT = REPO
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
README_SCREENSHOT = REPO_ROOT / "docs" / "dashboard.png"
CHARTS = ("chart-rate", "chart-groups", "chart-delivered", "chart-reward", "chart-lag")

BROKEN_GENERATOR = """
TASK_TYPE = "broken"
raise RuntimeError("broken on purpose: the dashboard lists me")
"""

# Imports fine, fails when run: a job with an error for the job table.
MATH_GENERATOR = """
TASK_TYPE = "math"


def run_rollout(data):
    raise RuntimeError("no policy server in this test")
"""

# Count the canvas pixels that are not transparent.
PAINTED_PIXELS = """
const canvas = document.querySelector(`#${arguments[0]} canvas`);
if (!canvas || !canvas.width || !canvas.height) return 0;
const pixels = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
let painted = 0;
for (let i = 3; i < pixels.length; i += 4) if (pixels[i] !== 0) painted++;
return painted;
"""

_uids = itertools.count()


def _trajectory(task_type: str, instance: int, k: int) -> dict[str, Any]:
    return {
        "instance_id": f"{task_type}-{instance}",
        "uid": f"uid-{next(_uids)}",
        "task_type": task_type,
        "messages": [
            {"role": "user", "content": "What is 1 + 1?"},
            {"role": "assistant", "content": "\\boxed{2}"},
        ],
        "reward": ((instance + k) % 3) / 2 if task_type == "math" else 0.25 + ((instance + k) % 4) / 8,
        "extra_info": {},
    }


@pytest.fixture
def service(tmp_path: Path) -> Iterator[str]:
    generators = tmp_path / "generators"
    generators.mkdir()
    (generators / "broken_generator.py").write_text(textwrap.dedent(BROKEN_GENERATOR))
    (generators / "math_generator.py").write_text(textwrap.dedent(MATH_GENERATOR))
    port = free_port()
    command = [sys.executable, "buffer.py", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--generator-dir", str(generators), "--group-size", "2", "--log-level", "warning"]
    command += ["--sweep-interval-s", "0.2"]
    url = f"http://127.0.0.1:{port}"
    with started(command, "rollout buffer", tmp_path / "buffer.log") as process:
        wait_ready(f"{url}/health", process, 120, "the rollout buffer")
        yield url


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    if not CHROMIUM.exists() or not CHROMEDRIVER.exists():
        pytest.skip(f"needs {CHROMIUM} and {CHROMEDRIVER} (apt-get install chromium chromium-driver)")
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--window-size=1400,1380",
        # No network: every host but the service's loopback address fails to resolve.
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        f"--user-data-dir={tmp_path / 'chromium'}",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(str(CHROMEDRIVER)))
    try:
        yield driver
    finally:
        driver.quit()


def _state(driver: Any) -> dict[str, Any]:
    state: dict[str, Any] = driver.execute_script("return window.dashboardState")
    return state


def _wait_for(driver: Any, condition: str, timeout_s: float = WAIT_S) -> None:
    """Poll a JavaScript expression until it is true (the page's own state, never a fixed sleep)."""
    deadline = time.monotonic() + timeout_s
    while not driver.execute_script(f"return Boolean({condition})"):
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout_s} s: {condition}; state {_state(driver)}")
        time.sleep(0.1)


def test_dashboard_draws_live_charts_jobs_and_failed_generators(
    service: str, browser: Any, tmp_path: Path
) -> None:
    with httpx.Client(base_url=service, timeout=30.0, trust_env=False) as client:
        data = client.get("/dashboard/data").json()
        assert set(data) == {
            "history",
            "stats",
            "trainer",
            "policy",
            "jobs",
            "generators",
            "generator_errors",
        }
        assert [error["task_type"] for error in data["generator_errors"]] == ["broken"]

        started_rollout = client.post("/start_rollout", json={"task_type": "math"}).json()
        assert started_rollout["success"], started_rollout

        browser.get(f"{service}/dashboard")
        _wait_for(browser, "window.dashboardState && window.dashboardState.updates >= 1")
        first = _state(browser)

        # Write, reading now and then, until the page has drawn three more samples: every chart
        # has something to show, however slowly the machine runs.
        deadline = time.monotonic() + WAIT_S
        instance = 0
        while _state(browser)["samples"] < first["samples"] + 3:
            assert time.monotonic() < deadline, f"the page drew no new samples: {_state(browser)}"
            batch = [_trajectory(task, instance, k) for task in ("math", "code") for k in range(2)]
            assert client.post("/buffer/write_batch", json=batch).json()["success"]
            if instance % 5 == 4:
                read = client.post("/get_rollout_data", json={"task_type": "math", "batch_size": 4})
                assert read.status_code == 200, read.text
            instance += 1
            time.sleep(0.05)

        # The page keeps polling: it has drawn newer samples than at first, with the writes in them.
        _wait_for(
            browser,
            f"window.dashboardState.samples >= {first['samples'] + 3}"
            " && window.dashboardState.charts['chart-reward'].series === 2",
        )
        last = _state(browser)
        assert last["updates"] > first["updates"]
        assert last["lastSampleT"] > (first["lastSampleT"] or 0)
        for chart in CHARTS:
            assert last["charts"][chart]["points"] > 0, chart
            assert browser.execute_script(PAINTED_PIXELS, chart) > 500, f"{chart} is blank"

        # Hovering a chart shows the values under the cursor in its legend.
        from selenium.webdriver.common.action_chains import ActionChains

        over = browser.find_element("css selector", "#chart-rate .u-over")
        ActionChains(browser).move_to_element_with_offset(over, over.size["width"] // 2 - 5, 0).perform()
        _wait_for(
            browser,
            "[...document.querySelectorAll('#chart-rate .u-legend .u-series .u-value')]"
            ".some((cell) => /[0-9]/.test(cell.textContent))",
        )

        # Each poll carries only the samples newer than the page's last one, not the history again.
        state = _state(browser)
        assert state["samples"] >= 4
        # (however late a poll comes on a loaded machine, it brings fewer than the page holds)
        assert all(poll["samples"] < state["samples"] for poll in state["polls"][-3:]), state["polls"]
        full = len(client.get("/dashboard/data").content)
        assert max(poll["bytes"] for poll in state["polls"][-3:]) < full

        # The viewer: a task, one of its ready groups, its messages and the tokens the trainer gets.
        turns_group = [
            {
                **_trajectory("code", 999, k),
                "instance_id": "code-turns",
                "turns": [
                    {
                        "prompt_ids": [11, 12, 13],
                        "output_ids": [21, 22, 23, 24],
                        "output_logprobs": [-0.1, -0.2, -0.3, -0.4],
                        "finish_reason": "stop",
                        "message_index": 1,
                    }
                ],
            }
            for k in range(2)
        ]
        assert client.post("/buffer/write_batch", json=turns_group).json()["success"]
        from selenium.webdriver.support.ui import Select

        _wait_for(
            browser,
            "[...document.querySelectorAll('#viewer-task option')].some((o) => o.value === 'code')",
        )
        Select(browser.find_element("id", "viewer-task")).select_by_value("code")
        _wait_for(
            browser,
            "[...document.querySelectorAll('#viewer-group option')].some((o) => o.value === 'code-turns')",
        )
        Select(browser.find_element("id", "viewer-group")).select_by_value("code-turns")
        _wait_for(browser, "document.querySelectorAll('#viewer-body .trajectory').length === 2")
        first_trajectory = browser.find_elements("css selector", "#viewer-body .trajectory")[0]
        # The messages by default; the tokens only as a summary until asked for.
        assert "\\boxed{2}" in first_trajectory.text
        assert not first_trajectory.find_elements("css selector", ".tokens")
        assert "7 tokens, 4 under the loss mask" in first_trajectory.text
        # As text: no job of the task named a tokenizer, so the ids, and why.
        Select(browser.find_element("id", "viewer-tokens")).select_by_value("text")
        _wait_for(browser, "document.querySelectorAll('#viewer-body .no-decode').length === 2")
        assert "no job of this task named a tokenizer_path" in browser.find_element("id", "viewer-body").text
        Select(browser.find_element("id", "viewer-tokens")).select_by_value("ids")
        _wait_for(browser, "document.querySelectorAll('#viewer-body .no-decode').length === 0")
        first_trajectory = browser.find_elements("css selector", "#viewer-body .trajectory")[0]
        masked = [span.text for span in first_trajectory.find_elements("css selector", ".tokens .m1")]
        unmasked = [span.text for span in first_trajectory.find_elements("css selector", ".tokens .m0")]
        assert (unmasked, masked) == (["11", "12", "13"], ["21", "22", "23", "24"])
        # A group written without token records says where its tokens come from instead.
        other = next(
            o.get_attribute("value")
            for o in browser.find_elements("css selector", "#viewer-group option")
            if o.get_attribute("value") not in ("", "code-turns")
        )
        Select(browser.find_element("id", "viewer-group")).select_by_value(other)
        _wait_for(browser, "document.querySelectorAll('#viewer-body .no-tokens').length === 2")

        # A group of equal rewards is discarded by the default is_valid_group: said in words.
        equal = [{**_trajectory("math", 500, k), "reward": 1.0} for k in range(2)]
        assert client.post("/buffer/write_batch", json=equal).json()["success"]
        _wait_for(
            browser,
            "[...document.querySelectorAll('#tasks [data-reason=invalid_group]')]"
            ".some((cell) => cell.textContent.startsWith('equal rewards (no learning signal): 1'))",
        )

        failed = browser.find_elements("css selector", "#generator-errors li.generator-error")
        assert len(failed) == 1
        assert "broken" in failed[0].text
        assert "broken on purpose" in failed[0].text

        jobs = browser.find_element("id", "job-progress").text
        assert "job-1" in jobs
        assert "no policy server in this test" in jobs

        tasks = browser.find_element("css selector", "#tasks tbody").text
        assert "math" in tasks
        assert "code" in tasks

        # A test run leaves the checkout alone unless asked to refresh the README's picture.
        screenshot = (
            README_SCREENSHOT if os.environ.get("UPDATE_SCREENSHOT") == "1" else tmp_path / "dashboard.png"
        )
        screenshot.parent.mkdir(exist_ok=True)
        browser.execute_script("window.scrollTo(0, 0)")
        assert browser.save_screenshot(str(screenshot))


def test_docs_render_with_no_network(service: str, browser: Any) -> None:
    """Swagger UI's files come from the service, not from a CDN the machine cannot reach."""
    browser.get(f"{service}/docs")
    _wait_for(browser, "document.querySelectorAll('.swagger-ui .opblock').length > 10")
    paths = browser.execute_script(
        "return [...document.querySelectorAll('.opblock-summary-path')].map((e) => e.textContent)"
    )
    assert any("/get_rollout_data" in path for path in paths), paths


def test_history_samples_task_counters_once_per_interval_and_keeps_the_last() -> None:
    from buffer.core.rollout_buffer import RolloutBuffer
    from buffer.core.task import TaskSettings
    from buffer.service.history import History

    clock = [0.0]
    history = History(keep=3, interval_s=1.0, clock=lambda: clock[0])
    buffer = RolloutBuffer(TaskSettings(group_size=2))
    buffer.write_many([_trajectory("math", 0, 0), _trajectory("math", 0, 1)])

    first = history.sample(buffer)
    assert first is not None
    assert first["total_written"] == 2
    assert first["total_read"] == 0
    assert first["tasks"]["math"] == {
        "written": 2,
        "delivered_items": 0,
        "pending_groups": 0,
        "ready_groups": 1,
        "delivered_groups": 0,
        "reward_mean": 0.25,
        "reward_std": pytest.approx(0.3535, abs=1e-3),
        "reward_count": 2,
        "reward_sum": 0.5,
        "served_age_s_sum": 0.0,
        "served_age_count": 0,
    }
    clock[0] = 0.5
    assert history.sample(buffer) is None  # a sweeper faster than the interval adds nothing
    for step in range(1, 5):
        clock[0] = float(step)
        assert history.sample(buffer) is not None
    assert len(history.snapshot()) == 3


def test_the_page_says_engine_down_and_trainer_behind(service: str, browser: Any) -> None:
    """The page's verdicts over what it polled: a running job's request failures with nothing
    answered (the counters over a window, as the page keeps them from poll to poll), and the
    tasks /dashboard/data lists as behind."""
    browser.get(f"{service}/dashboard")
    _wait_for(browser, "window.dashboardState && window.dashboardState.updates >= 1")
    assert _state(browser)["alerts"] == []
    assert not browser.find_elements("css selector", "#alerts .alert")

    def verdict(job: dict[str, Any], series: list[dict[str, Any]]) -> Any:
        return browser.execute_script("return window.dashboardTest.engineVerdict(...arguments)", job, series)

    running = {
        "status": "running",
        "progress": {"request_failures_by_kind": {"ConnectError": 40, "HTTP 503": 2}},
    }

    def sample(t: float, failures: int, answers: int, completed: int) -> dict[str, Any]:
        return {"t": t, "failures": failures, "answers": answers, "completed": completed}

    never = verdict(running, [sample(0, 42, 0, 0)])
    assert never["kind"] == "engine-down"
    assert never["text"] == "42 LLM requests failed (mostly ConnectError), none answered yet"
    # It answered before; over the last 30 s, 40 failures and no answer: down.
    down = verdict(running, [sample(0, 2, 100, 20), sample(15, 20, 100, 20), sample(30, 42, 100, 20)])
    assert down["kind"] == "engine-down"
    assert "40 LLM requests failed" in down["text"]
    # Failures among answers: errors, not down; no failure in the window: nothing.
    failing = verdict(running, [sample(0, 2, 100, 20), sample(30, 5, 160, 32)])
    assert failing["kind"] == "engine-failing"
    assert verdict(running, [sample(0, 2, 100, 20), sample(30, 2, 160, 32)]) is None
    # Too short a window to tell, and a job that has ended: nothing.
    assert verdict(running, [sample(0, 2, 100, 20), sample(3, 9, 100, 20)]) is None
    assert verdict({**running, "status": "failed"}, [sample(0, 42, 0, 0)]) is None

    trainer = {
        "last_read_age_s": 80.0,
        "at_least": False,
        "behind_after_s": 60.0,
        "behind": ["math"],
        "tasks": {
            "math": {"ready_groups": 12, "oldest_ready_age_s": 120.0},
            "code": {"ready_groups": 1, "oldest_ready_age_s": 3.0},
        },
    }
    alerts = browser.execute_script("return window.dashboardTest.trainerAlerts(arguments[0])", trainer)
    assert [(alert["kind"], alert["task"]) for alert in alerts] == [("trainer-behind", "math")]
    assert alerts[0]["text"] == "12 groups ready, the oldest for 2 min; its last read was 80 s ago"
    never_read = browser.execute_script(
        "return window.dashboardTest.trainerAlerts(arguments[0])", {**trainer, "last_read_age_s": None}
    )
    assert never_read[0]["text"].endswith("it has never read")

    # Drawn at the top of the page (in one script: the next poll draws what the service says).
    banner = browser.execute_script(
        "renderAlerts([{id: 'job-9', task_type: 'math', status: 'running', progress: {}}], arguments[0]);"
        " return document.getElementById('alerts').innerText",
        trainer,
    )
    assert "trainer behind" in banner
    assert "12 groups ready" in banner


def test_the_token_view_shows_each_token_decoded_with_its_id_on_hover(service: str, browser: Any) -> None:
    browser.get(f"{service}/dashboard")
    _wait_for(browser, "window.dashboardState && window.dashboardState.updates >= 1")
    spans = browser.execute_script(
        "const box = renderTokens([{tokens: [1, 2, 9], mask: [0, 1, 1]}], 'text',"
        " {tokenizer: '/m', texts: {'1': 'what', '2': ' is', '9': ' two'}});"
        " return [...box.querySelectorAll('.tokens span')].map((s) => [s.className, s.textContent, s.title]);"
    )
    assert spans == [["m0", "what", "id 1"], ["m1", " is", "id 2"], ["m1", " two", "id 9"]]
    ids = browser.execute_script(
        "const box = renderTokens([{tokens: [1, 2], mask: [0, 1]}], 'ids', {texts: {'1': 'what'}});"
        " return [...box.querySelectorAll('.tokens span')].map((s) => s.textContent);"
    )
    assert ids == ["1", "2"]
