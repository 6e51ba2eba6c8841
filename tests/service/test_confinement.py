"""What a service confines clients to wherever it was started: the input roots it defaults to,
and the host names it answers to (DNS rebinding)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from buffer import paths
from buffer.errors import InvalidInput
from buffer.service.job_policy import JobPolicy
from buffer.service.security import host_name
from buffer.service.settings import Settings
from tests.support.factories import trajectory

SERVICE_URL = "http://127.0.0.1:8889"
IDLE = """
TASK_TYPE = "idle"

def run_rollout(data):
    pass
"""


@pytest.fixture(autouse=True)
def no_key_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLOUT_BUFFER_API_KEY", raising=False)


def roots_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "buffer.service.settings" and r.levelno >= logging.WARNING
    ]


# -- the input roots ----------------------------------------------------------------------


@pytest.mark.parametrize("folder", ["/", "/etc", "/etc/ssl", "/usr", "/var", "/home", "/tmp", "/root/x"])
def test_the_system_folders_are_too_broad(folder: str) -> None:
    assert paths.too_broad(Path(folder))


def test_a_home_and_what_holds_it_are_too_broad_a_project_folder_is_not(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    home = tmp_path / "home" / "someone"
    (home / "project").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    assert paths.too_broad(home)
    assert paths.too_broad(home.parent)
    assert not paths.too_broad(home / "project")


@pytest.mark.parametrize("start_in", ["/", "home"])
def test_a_service_started_from_a_broad_folder_confines_input_files_to_the_generator_data(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    generator_dir: Path,
    start_in: str,
) -> None:
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("secret\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir("/" if start_in == "/" else home)
    (generator_dir / "data").mkdir()
    (generator_dir / "data" / "rows.jsonl").write_text('{"prompt": "a"}\n')
    with caplog.at_level(logging.WARNING):
        policy = JobPolicy.from_settings(Settings(generator_dir=generator_dir, host="127.0.0.1"))
    assert policy.input_roots == ((generator_dir / "data").resolve(),)
    (warning,) = roots_warnings(caplog)
    assert "is not an input root" in warning
    assert "--input-roots" in warning
    for secret in ("/etc/passwd", str(home / ".ssh" / "id_ed25519"), ".ssh/id_ed25519", "etc/passwd"):
        with pytest.raises(InvalidInput, match="input roots"):
            policy.check_blocking({"input_file": secret}, SERVICE_URL)
    rows = str(generator_dir / "data" / "rows.jsonl")
    assert policy.check_blocking({"input_file": rows}, SERVICE_URL)["input_file"] == rows


def test_a_project_folder_stays_an_input_root_without_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path, generator_dir: Path
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "rows.jsonl").write_text('{"prompt": "a"}\n')
    monkeypatch.chdir(project)
    with caplog.at_level(logging.WARNING):
        policy = JobPolicy.from_settings(Settings(generator_dir=generator_dir, host="127.0.0.1"))
    assert project.resolve() in policy.input_roots
    assert roots_warnings(caplog) == []
    checked = policy.check_blocking({"input_file": "rows.jsonl"}, SERVICE_URL)
    assert checked["input_file"] == str(project.resolve() / "rows.jsonl")


def test_an_explicit_root_of_slash_is_the_operators_choice(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, generator_dir: Path
) -> None:
    monkeypatch.chdir("/")
    with caplog.at_level(logging.WARNING):
        policy = JobPolicy.from_settings(Settings(generator_dir=generator_dir, input_roots=[Path("/")]))
    assert policy.input_roots == (Path("/"),)
    assert roots_warnings(caplog) == []
    assert policy.check_blocking({"input_file": "/etc/passwd"}, SERVICE_URL)["input_file"] == "/etc/passwd"


def test_start_rollout_from_a_service_started_in_slash_refuses_etc_passwd(
    monkeypatch: pytest.MonkeyPatch, make_client: Callable[..., TestClient], generator_dir: Path
) -> None:
    (generator_dir / "idle_generator.py").write_text(IDLE)
    monkeypatch.chdir("/")
    client = make_client()
    for path in ("/etc/passwd", "etc/passwd"):
        response = client.post("/start_rollout", json={"task_type": "idle", "input_file": path})
        assert response.status_code == 422, response.text
        assert "--input-roots" in response.json()["message"]


# -- the Host header -------------------------------------------------------------------

EVIL = "rebind.evil.example:8889"
#: What a page of EVIL's sends once its name resolves to this machine: it is its own origin.
AS_ITS_PAGE = {"host": EVIL, "origin": f"http://{EVIL}", "sec-fetch-site": "same-origin"}
#: The request kinds a page would send: reads, writes, the job API, the dashboard, the docs.
KINDS = [
    ("GET", "/buffer/stats", None),
    ("POST", "/buffer/write", trajectory("q1")),
    ("POST", "/get_rollout_data", {}),
    ("POST", "/start_rollout", {"task_type": "idle"}),
    ("GET", "/jobs", None),
    ("GET", "/metrics", None),
]


def written(client: TestClient) -> int:
    response = client.get("/buffer/stats", headers={"host": "127.0.0.1:8889"})
    assert response.status_code == 200, response.text
    total: int = response.json()["data"]["data"][0]["total_written"]
    return total


@pytest.mark.parametrize(("method", "path", "body"), KINDS)
def test_a_rebound_name_gets_421_naming_the_host_and_the_setting(
    make_client: Callable[..., TestClient], method: str, path: str, body: object
) -> None:
    for bind in ("127.0.0.1", "0.0.0.0"):
        client = make_client(host=bind, group_size=1)
        for headers in (AS_ITS_PAGE, {"host": EVIL, "sec-fetch-site": "none"}):
            response = client.request(method, path, json=body, headers=headers)
            assert response.status_code == 421, (bind, headers, response.text)
            message = response.json()["message"]
            assert "rebind.evil.example" in message
            assert "--allowed-hosts" in message
        assert written(client) == 0


def test_loopback_names_and_the_bind_address_pass(make_client: Callable[..., TestClient]) -> None:
    client = make_client(host="127.0.0.1", group_size=1)
    for host in ("127.0.0.1:8889", "localhost:8889", "[::1]:8889", "LOCALHOST", "127.0.0.2"):
        headers = {"host": host, "origin": f"http://{host}", "sec-fetch-site": "same-origin"}
        assert client.post("/buffer/write", json=trajectory("q1"), headers=headers).status_code == 200, host
    # A client, not a browser, is held to the names too when the service listens on one address.
    assert client.get("/buffer/stats", headers={"host": EVIL}).status_code == 421


def test_on_every_interface_clients_use_any_name_and_browsers_the_machines(
    make_client: Callable[..., TestClient],
) -> None:
    """slime's users start ``python buffer.py`` on 0.0.0.0 and reach it by the machine's name."""
    client = make_client(host="0.0.0.0", group_size=1)
    for host in ("gpu-node-3.cluster.example:8889", EVIL, "10.1.2.3:8889"):  # no browser markers
        assert client.post("/buffer/write", json=trajectory(host), headers={"host": host}).status_code == 200
    for host in (f"{socket.gethostname()}:8889", "gpu-node-3:8889", "10.1.2.3:8889", "[fe80::1]:8889"):
        page = {"host": host, "origin": f"http://{host}", "sec-fetch-site": "same-origin"}
        assert client.post("/buffer/write", json=trajectory(host), headers=page).status_code == 200, host
    assert client.get("/dashboard", headers={"host": EVIL, "sec-fetch-site": "none"}).status_code == 421


def test_allowed_hosts_names_the_hosts_and_star_any(make_client: Callable[..., TestClient]) -> None:
    named = make_client(host="0.0.0.0", allowed_hosts=["buffer.lab.example"], group_size=1)
    page = {"host": "buffer.lab.example:8889", "origin": "http://buffer.lab.example:8889"}
    assert named.post("/buffer/write", json=trajectory("q1"), headers=page).status_code == 200
    assert named.get("/buffer/stats", headers={"host": "localhost"}).status_code == 200  # loopback: always
    # Named explicitly, the hosts hold every request, a client's too.
    assert named.get("/buffer/stats", headers={"host": "gpu-node-3"}).status_code == 421
    anyone = make_client(host="127.0.0.1", allowed_hosts=["*"], group_size=1)
    assert anyone.get("/buffer/stats", headers=AS_ITS_PAGE).status_code == 200


def test_with_an_api_key_any_host_passes(make_client: Callable[..., TestClient]) -> None:
    client = make_client(host="127.0.0.1", api_key="k3y", group_size=1)
    keyed = {**AS_ITS_PAGE, "authorization": "Bearer k3y"}
    assert client.get("/buffer/stats", headers=keyed).status_code == 200
    assert client.get("/buffer/stats", headers=AS_ITS_PAGE).status_code == 401  # the key still holds


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("localhost:8889", "localhost"),
        ("[::1]:8889", "::1"),
        ("::1", "::1"),
        ("Example.COM.", "example.com"),
        ("10.0.0.1", "10.0.0.1"),
    ],
)
def test_host_names_lose_port_brackets_case_and_trailing_dot(header: str, name: str) -> None:
    assert host_name(header) == name
