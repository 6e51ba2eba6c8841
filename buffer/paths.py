"""Where the package is, in one place: the folders the service, its workers and the example
run find by their position beside the code; and the folders no project lives in (``too_broad``),
which the service never lets clients read from unless told to."""

from __future__ import annotations

from pathlib import Path

#: The ``buffer`` package itself.
PACKAGE = Path(__file__).resolve().parent
#: The folder holding it, with ``buffer.py``, ``default_func.py`` and ``generator/``: the checkout,
#: or site-packages for an installed copy. Workers get it first on their ``PYTHONPATH``.
ROOT = PACKAGE.parent
#: The generators shipped with the package (``--generator-dir`` by default).
GENERATOR_DIR = ROOT / "generator"

#: Folders that hold the system, or everyone's files: none is a project's folder, and an input
#: root there would let a client read what lies anywhere in it (``/etc/passwd``, a user's keys).
SYSTEM_FOLDERS = frozenset(
    Path(folder)
    for folder in (
        "/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32",
        "/media", "/mnt", "/opt", "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/tmp",
        "/usr", "/usr/bin", "/usr/lib", "/usr/local", "/usr/share", "/var", "/var/lib", "/var/log",
        "/var/tmp", "/Applications", "/Library", "/private", "/System", "/Users", "/Volumes",
    )
)  # fmt: skip
#: Folders whose every subfolder is the system's too.
SYSTEM_TREES = tuple(Path(folder) for folder in ("/boot", "/dev", "/etc", "/proc", "/root", "/sys"))


def too_broad(folder: Path) -> bool:
    """Whether ``folder`` (resolved) is ``/``, a system folder, the user's home or a folder
    holding it: too much to let clients read anything under it by default."""
    if folder in SYSTEM_FOLDERS or any(folder.is_relative_to(tree) for tree in SYSTEM_TREES):
        return True
    try:
        home = Path.home().resolve()
    except (RuntimeError, KeyError):  # no HOME and no user entry: no home to protect
        return False
    return home.is_relative_to(folder)
