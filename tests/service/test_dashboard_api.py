"""The dashboard's JSON and /docs, through the app: incremental history, the viewer's groups and
their tokens' texts, what the trainer is doing, the redirect of ``/dashboard/``."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urljoin

import pytest
from fastapi.testclient import TestClient

from buffer.service.history import History
from buffer.service.routes.dashboard import TRAINER_BEHIND_S, _since_last_read
from tests.support.calls import read, write_all
from tests.support.factories import group, write_generator


def test_data_since_sends_only_the_newer_history_samples(client: TestClient) -> None:
    history: History = client.app.state.services.history  # type: ignore[attr-defined]
    history._interval_s = 0.0  # every call samples
    write_all(client, group("q1", [0, 1, 0, 1]))
    first = history.sample(client.app.state.services.buffer)  # type: ignore[attr-defined]
    write_all(client, group("q2", [1, 1, 0, 0]))
    second = history.sample(client.app.state.services.buffer)  # type: ignore[attr-defined]
    assert first is not None
    assert second is not None
    everything = client.get("/dashboard/data").json()["history"]
    newer = client.get("/dashboard/data", params={"since": first["t"]}).json()["history"]
    assert len(everything) >= 2
    assert newer == [sample for sample in everything if sample["t"] > first["t"]]
    assert newer[-1]["tasks"]["default"]["reward_count"] == 8
    assert newer[-1]["tasks"]["default"]["reward_sum"] == 4.0


def test_the_viewer_lists_ready_groups_and_opens_one_with_its_token_records(client: TestClient) -> None:
    turn = {
        "prompt_ids": [1, 2, 3],
        "output_ids": [7, 8],
        "output_logprobs": [-0.5, -0.25],
        "finish_reason": "stop",
        "message_index": 1,
    }
    write_all(client, group("q1", [0, 1, 0, 1], task_type="math"))
    write_all(client, group("q2", [1, 0, 0, 0], task_type="math", turns=[turn]))
    listed = client.get("/dashboard/groups", params={"task_type": "math"}).json()["groups"]
    assert [(g["instance_id"], g["size"], g["raw_rewards"]) for g in listed] == [
        ("q2", 4, [1, 0, 0, 0]),
        ("q1", 4, [0, 1, 0, 1]),
    ]
    assert listed[0]["rewards"][0] > 1  # normalized within its group, as the trainer gets it
    opened = client.get("/dashboard/group", params={"task_type": "math", "instance_id": "q2"}).json()
    assert [t["raw_reward"] for t in opened["trajectories"]] == [1, 0, 0, 0]
    assert opened["trajectories"][0]["turns"][0]["output_ids"] == [7, 8]
    missing = client.get("/dashboard/group", params={"task_type": "math", "instance_id": "nope"})
    assert missing.status_code == 404
    unknown = client.get("/dashboard/groups", params={"task_type": "no-such-task"})
    assert unknown.status_code == 404


def test_docs_loads_swagger_ui_from_the_service_by_relative_urls(client: TestClient) -> None:
    page = client.get("/docs")
    assert page.status_code == 200
    sources = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert "dashboard/static/vendor/swagger-ui/swagger-ui-bundle.js" in sources
    assert not [source for source in sources if "//" in source]  # nothing from another host
    for source in sources:
        if source.startswith("dashboard/"):
            asset = client.get("/" + source)
            assert asset.status_code == 200, source
            assert len(asset.content) > 100_000
    assert "url: 'openapi.json'" in page.text or '"openapi.json"' in page.text
    assert client.get("/redoc").status_code == 404  # ReDoc only exists on a CDN


def test_assets_outside_the_list_are_never_served(client: TestClient) -> None:
    assert client.get("/dashboard/static/vendor/uplot/LICENSE").status_code == 404
    assert client.get("/dashboard/static/../settings.py").status_code == 404
    assert client.get("/dashboard/static/vendor/uplot/uPlot.iife.min.js").status_code == 200


def test_dashboard_with_a_slash_redirects_by_a_relative_url_that_works_under_a_proxy_prefix(
    client: TestClient,
) -> None:
    answer = client.get("/dashboard/", follow_redirects=False)
    assert answer.status_code == 307
    # Behind a proxy serving the service under /buffer-7/, "../dashboard" from
    # /buffer-7/dashboard/ is /buffer-7/dashboard; an absolute URL would name the service's own.
    assert answer.headers["location"] == "../dashboard"
    assert urljoin("http://proxy/buffer-7/dashboard/", answer.headers["location"]) == (
        "http://proxy/buffer-7/dashboard"
    )
    with_query = client.get("/dashboard/", params={"x": "1"}, follow_redirects=False)
    assert with_query.headers["location"] == "../dashboard?x=1"
    assert client.get("/dashboard/").text.startswith("<!doctype html>")


def test_data_says_when_the_trainer_last_read_and_which_task_it_is_behind_on(client: TestClient) -> None:
    services = client.app.state.services  # type: ignore[attr-defined]
    history: History = services.history
    history._interval_s = 0.0  # every call samples
    write_all(client, group("q1", [0, 1, 0, 1]))
    history.sample(services.buffer)
    trainer = client.get("/dashboard/data").json()["trainer"]
    assert trainer["last_read_age_s"] is None  # never read
    assert trainer["behind"] == []
    assert trainer["tasks"]["default"]["ready_groups"] == 1
    assert 0 <= trainer["tasks"]["default"]["oldest_ready_age_s"] < TRAINER_BEHIND_S

    # The group finished two minutes ago, and no read has taken it since.
    (oldest,) = services.buffer.peek("default", 1)
    oldest.ready_at -= 2 * TRAINER_BEHIND_S
    trainer = client.get("/dashboard/data").json()["trainer"]
    assert trainer["behind"] == ["default"]
    assert trainer["tasks"]["default"]["oldest_ready_age_s"] >= 2 * TRAINER_BEHIND_S

    read(client)  # the trainer takes it: nothing ready, nothing behind, a read just now
    history.sample(services.buffer)
    trainer = client.get("/dashboard/data").json()["trainer"]
    assert trainer["behind"] == []
    assert trainer["tasks"] == {}
    assert trainer["last_read_age_s"] is not None
    assert trainer["last_read_age_s"] < TRAINER_BEHIND_S
    assert trainer["at_least"] is False


def test_since_last_read_is_a_lower_bound_when_the_history_holds_no_read() -> None:
    history = [{"t": 100.0, "total_read": 4}, {"t": 101.0, "total_read": 4}, {"t": 102.0, "total_read": 8}]
    assert _since_last_read(history, 8, now=110.0) == (8.0, False)
    assert _since_last_read(history, 12, now=110.0) == (0.0, False)  # read after the last sample
    assert _since_last_read(history[:2], 4, now=110.0) == (10.0, True)
    assert _since_last_read(history, 0, now=110.0) == (None, False)


# A job of the task that ends at once: what the viewer needs is its /start_rollout payload.
IDLE_MATH = """
TASK_TYPE = "math"


def run_rollout(data):
    pass
"""


@pytest.fixture
def word_tokenizer(tmp_path: Path) -> Path:
    """A served model's tokenizer folder: tokenizer.json of a tiny word-level vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "what": 1, "is": 2, "two": 3, "answer": 7, "four": 8}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path / "model"
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def test_the_viewer_decodes_token_ids_with_the_tokenizer_a_job_of_the_task_named(
    make_client: Callable[..., TestClient], generator_dir: Path, word_tokenizer: Path, tmp_path: Path
) -> None:
    write_generator(generator_dir, "math_generator.py", IDLE_MATH)
    client = make_client(group_size=4)
    turn = {"prompt_ids": [1, 2, 3], "output_ids": [7, 8], "finish_reason": "stop", "message_index": 1}
    write_all(client, group("q0", [1, 0, 0, 0], turns=[turn]))  # the default task: no job
    opened = client.get("/dashboard/group", params={"task_type": "default", "instance_id": "q0"}).json()
    assert opened["tokens"]["texts"] is None
    assert "no job of this task named a tokenizer_path" in opened["tokens"]["why"]

    start = {
        "task_type": "math",
        "num_repeat_per_sample": 4,
        "tokenizer_path": str(word_tokenizer),
    }
    started = client.post("/start_rollout", json=start)
    assert started.status_code == 200, started.text
    write_all(client, group("q1", [1, 0, 0, 0], task_type="math", turns=[turn]))
    opened = client.get("/dashboard/group", params={"task_type": "math", "instance_id": "q1"}).json()
    assert opened["tokens"]["tokenizer"] == str(word_tokenizer)
    assert opened["tokens"]["texts"] == {"1": "what", "2": "is", "3": "two", "7": "answer", "8": "four"}
    assert opened["trajectories"][0]["turns"][0]["output_ids"] == [7, 8]  # the records, as written


def test_a_tokenizer_that_cannot_load_leaves_the_ids_and_says_why(
    make_client: Callable[..., TestClient], generator_dir: Path, tmp_path: Path
) -> None:
    write_generator(generator_dir, "math_generator.py", IDLE_MATH)
    client = make_client(group_size=4)
    start = {
        "task_type": "math",
        "num_repeat_per_sample": 4,
        "tokenizer_path": str(tmp_path / "no-such-model"),
    }
    assert client.post("/start_rollout", json=start).status_code == 200
    turn = {"prompt_ids": [1], "output_ids": [2], "finish_reason": "stop", "message_index": 1}
    write_all(client, group("q1", [1, 0, 0, 0], task_type="math", turns=[turn]))
    opened = client.get("/dashboard/group", params={"task_type": "math", "instance_id": "q1"})
    assert opened.status_code == 200
    assert opened.json()["tokens"]["texts"] is None
    assert opened.json()["tokens"]["why"].startswith("cannot load it:")
