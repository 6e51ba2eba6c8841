"""A full disk under the gateway's images: a 507 that says so, and no partial file left."""

from __future__ import annotations

import base64
import errno
from pathlib import Path
from typing import Any

import pytest

from buffer.processes import free_port


def test_a_full_disk_answers_507_and_leaves_no_partial_image(
    make_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = make_client(group_size=2, data_dir=tmp_path / "data")
    directory = client.app.state.gateway.images.directory
    engine = f"http://127.0.0.1:{free_port()}"  # never asked: the image is kept first
    opened = client.post(
        "/sessions", json={"task_type": "agent", "instance_id": "q1", "remote_engine_url": engine}
    )
    session = opened.json()["data"]
    written = Path.write_bytes

    def disk_full(path: Path, data: Any) -> int:
        if path.parent == directory:
            written(path, bytes(data)[:100])  # part of it reached the disk
            raise OSError(errno.ENOSPC, "No space left on device")
        return written(path, data)

    monkeypatch.setattr(Path, "write_bytes", disk_full)
    large = "data:image/png;base64," + base64.b64encode(b"\x89PNG" + bytes(range(256)) * 400).decode()
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": large}}]
    answer = client.post(
        f"/sessions/{session['session_id']}/v1/chat/completions",
        json={"model": "policy", "messages": [{"role": "user", "content": content}]},
    )
    assert answer.status_code == 507, answer.text
    assert "no space left" in answer.json()["message"]
    assert list(directory.iterdir()) == []  # no partial file, no image
