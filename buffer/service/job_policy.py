"""What a client may make a generator job of this service read and call.

A ``/start_rollout`` payload names files the job reads and URLs it calls, on the service's
machine and with its network; ``JobPolicy.check`` refuses, with a 422 naming the field, what
the operator did not allow:

- ``input_file`` must lie under one of the ``input_roots`` (by default the generator folder's
  ``data`` and the service's working folder, unless that is ``/``, a home or a system folder:
  ``buffer.paths.too_broad``), symbolic links resolved, and be a regular file
  if it exists: no ``/etc/...`` read back through an evaluation rollout, no ``/dev/zero`` read
  until memory runs out; and it must exist and be readable by the service: a start refused at
  once, naming ``input_file``, rather than a job that fails after the trainer was told it
  started. The job gets the resolved path.
- every URL (a field named ``*_url``, or ``*_urls`` holding a list; a ``*_url`` may hold a
  list too: ``remote_engine_url`` naming an engine pool) must be http(s), and with
  ``engine_hosts`` set, name one of those hosts or this service itself. Unset, any host is
  allowed (slime's trainers name their engines freely), with a warning at start-up when the
  service listens beyond this machine.

The service's own API key (``ROLLOUT_BUFFER_API_KEY``) is sent to a ``remote_buffer_url``
only when it is this service or one of the ``api_key_hosts``: a client that names another
buffer sends that buffer's key itself (``buffer_api_key``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from buffer.errors import InvalidInput
from buffer.service.security import is_loopback
from buffer.service.settings import Settings
from buffer.toolkit.sink import same_service

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class JobPolicy:
    input_roots: tuple[Path, ...]
    #: Hosts (lower case) a job may call; None: any.
    engine_hosts: frozenset[str] | None = None
    #: Hosts a job's ``remote_buffer_url`` may name to be sent the service's own API key.
    api_key_hosts: frozenset[str] = frozenset()

    @classmethod
    def from_settings(cls, settings: Settings) -> JobPolicy:
        policy = cls(
            tuple(Path(root).resolve() for root in settings.input_folders()),
            _hosts(settings.allowed_engine_hosts) if settings.allowed_engine_hosts is not None else None,
            _hosts(settings.send_api_key_to),
        )
        if policy.engine_hosts is None and not is_loopback(settings.host):
            logger.warning(
                "listening on %s: a client may make generator jobs call any host it names "
                "(remote_engine_url, reward model URLs); name the hosts allowed with "
                "--allowed-engine-hosts",
                settings.host,
            )
        return policy

    def may_send_api_key(self, url: str) -> bool:
        return (urlsplit(url).hostname or "").lower() in self.api_key_hosts

    async def check(self, data: Mapping[str, Any], service_url: str) -> dict[str, Any]:
        """``data`` with its ``input_file`` resolved, or ``InvalidInput`` naming the field.
        Looks at the disk and resolves host names: in a thread."""
        return await asyncio.to_thread(self.check_blocking, data, service_url)

    def check_blocking(self, data: Mapping[str, Any], service_url: str) -> dict[str, Any]:
        checked = dict(data)
        input_file = data.get("input_file")
        if input_file is not None:
            checked["input_file"] = str(self._input_file(input_file))
        for field, value in data.items():
            if field.endswith("_url") and not isinstance(value, list):
                self._url(field, value, service_url)
            elif field.endswith(("_url", "_urls")) and isinstance(value, list):
                for index, url in enumerate(value):
                    self._url(f"{field}.{index}", url, service_url)
        return checked

    def _input_file(self, value: Any) -> Path:
        if not isinstance(value, str) or not value or "\0" in value:
            raise InvalidInput.one("input_file", "must be a file path")
        path = Path(value).expanduser()
        named = path if path.is_absolute() else Path.cwd() / path
        resolved = named.resolve()
        if not any(resolved.is_relative_to(root) for root in self.input_roots):
            roots = ", ".join(str(root) for root in self.input_roots)
            raise InvalidInput.one(
                "input_file",
                f"must lie under the service's input roots ({roots}): start the service with "
                f"--input-roots {named.parent} (or ROLLOUT_BUFFER_INPUT_ROOTS) to read from there",
            )
        try:
            mode = os.stat(resolved).st_mode
        except FileNotFoundError:
            raise InvalidInput.one("input_file", f"no such file: {resolved}") from None
        except OSError as exc:
            raise InvalidInput.one("input_file", f"cannot be read: {exc.strerror}") from None
        if not stat.S_ISREG(mode):
            raise InvalidInput.one("input_file", "must be a regular file, not a device, a pipe or a folder")
        if not os.access(resolved, os.R_OK):
            raise InvalidInput.one("input_file", f"cannot be read by the service: {resolved}")
        return resolved

    def _url(self, field: str, value: Any, service_url: str) -> None:
        if value is None:
            return
        parts = urlsplit(value) if isinstance(value, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidInput.one(field, "must be an http:// or https:// URL with a host")
        if self.engine_hosts is None or parts.hostname.lower() in self.engine_hosts:
            return
        if not same_service(value, service_url):
            raise InvalidInput.one(
                field, f"host {parts.hostname!r} is not one the service may call (--allowed-engine-hosts)"
            )


def _hosts(names: Iterable[str]) -> frozenset[str]:
    return frozenset(name.strip().lower().strip("[]") for name in names if name.strip())
