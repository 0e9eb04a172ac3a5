"""A hostile shared ``/dev/shm`` cannot redirect, hide or read a job's node-local checkpoints.

``/dev/shm`` is world-writable: another user can pre-create the default
``FTKIT_LOCAL_DIR`` (``/dev/shm/ftkit-$USER``) as a 0777 directory, as a directory of their
own, or as a symbolic link to one. ftkit must refuse such a base directory (ConfigError that
``ftkit run`` does not retry, naming path, owner and mode), and never follow a symbolic link
inside its tree (job, node, step directories, temp files, records, shards).

The "other user" cases run as root only: a child process switches to uid/gid 65534
(``nobody``) to plant the hostile entries in a fresh sticky 0o1777 directory, like
``/dev/shm`` itself. The same cases planted by this user run everywhere.
"""
from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ftkit.config import Config
from ftkit.errors import ConfigError, CorruptCheckpointError
from ftkit.faults import Faults
from ftkit.fs import write_atomic, write_record
from ftkit.jobdir.fatal import recurs
from ftkit.storage.local import COMMITTED, LocalLevel
from tests.unit.test_local_level import _commit, _level, _load, _write

NOBODY = 65534
Plant = Callable[[str], None]


@pytest.fixture
def shared() -> Iterator[Path]:
    """A fresh world-writable sticky directory (what ``/dev/shm`` is)."""
    parent = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = Path(tempfile.mkdtemp(prefix="ftkit-hostile-", dir=parent))
    os.chmod(path, 0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _shell(uid: int | None) -> Plant:
    """Run a shell command as ``uid`` (None: this process's user)."""
    def run(command: str) -> None:
        extra: dict[str, Any] = {} if uid is None else {"user": uid, "group": uid,
                                                         "extra_groups": []}
        subprocess.run(["sh", "-c", command], check=True, timeout=30, capture_output=True,
                       **extra)
    return run


@pytest.fixture
def other_user() -> Plant:
    """Plant entries as uid 65534; skipped where this process cannot switch to it."""
    if os.geteuid() != 0:
        pytest.skip("acting as a second user (uid 65534) needs root")
    plant = _shell(NOBODY)
    try:
        plant("true")
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot run a process as uid {NOBODY}: {exc}")
    return plant


@pytest.fixture(params=["self", "other-user"])
def attacker(request: pytest.FixtureRequest) -> tuple[Plant, int]:
    """Who plants the hostile entries: this user (runs everywhere) or uid 65534 (root)."""
    if request.param == "self":
        return _shell(None), os.geteuid()
    return request.getfixturevalue("other_user"), NOBODY


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "?"


def _refused(exc: BaseException, path: Path, uid: int, mode: str) -> str:
    """Assert ``exc`` is the refusal: names path, owner (name and uid) and mode; is a
    ConfigError that ``ftkit run`` does not retry and an OSError (so the Checkpointer's
    collective directory check reports it on every rank)."""
    text = str(exc)
    assert isinstance(exc, ConfigError) and isinstance(exc, OSError), repr(exc)
    assert recurs(exc), "a refused local directory must not be retried"
    for part in (str(path), f"{_user(uid)} (uid {uid})", f"mode {mode}"):
        assert part in text, (part, text)
    return text


def _attacker_dir(shared: Path, plant: Plant, name: str = "attacker") -> Path:
    target = shared / name
    plant(f"mkdir -m 0777 '{target}'")
    return target


def _listing(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


# ------------------------------------------------------------------ the base
def test_base_symlink_is_refused(shared: Path, attacker: tuple[Plant, int]) -> None:
    plant, uid = attacker
    target = _attacker_dir(shared, plant)
    base = shared / "ftkit-victim"
    plant(f"ln -s '{target}' '{base}'")
    level = _level(base / "job" / "node-0")
    with pytest.raises(ConfigError) as info:
        level.prepare()
    text = _refused(info.value, base, uid, "0777")
    assert "symbolic link" in text and "FTKIT_LOCAL_DIR" in text and "remove" in text
    with pytest.raises(OSError, match="symbolic link"):
        _write(level, 1)
    assert _listing(target) == []                # nothing of the victim landed there


def test_base_open_to_others_is_refused(shared: Path, attacker: tuple[Plant, int]) -> None:
    plant, uid = attacker
    base = _attacker_dir(shared, plant, "ftkit-victim")
    level = _level(base / "job" / "node-0")
    with pytest.raises(ConfigError) as info:
        level.prepare()
    text = _refused(info.value, base, uid, "0777")
    assert "FTKIT_LOCAL_DIR" in text
    with pytest.raises(OSError):
        _write(level, 1)
    assert _listing(base) == []
    assert stat.S_IMODE(os.lstat(base).st_mode) == 0o777     # not silently "fixed"


def test_base_owned_by_another_user_is_refused(shared: Path, other_user: Plant) -> None:
    base = shared / "ftkit-victim"
    other_user(f"mkdir -m 0700 '{base}'")
    level = _level(base / "job" / "node-0")
    with pytest.raises(ConfigError) as info:
        level.prepare()
    text = _refused(info.value, base, NOBODY, "0700")
    assert "owned by" in text and "FTKIT_LOCAL_DIR" in text
    with pytest.raises(OSError):
        _write(level, 1)
    assert _listing(base) == []


def test_config_entry_point_refuses_the_base(shared: Path, attacker: tuple[Plant, int]
                                             ) -> None:
    """The level the Checkpointer builds from a Config: under Slurm the host directory sits
    between FTKIT_LOCAL_DIR and the job, and FTKIT_LOCAL_DIR is still the one checked."""
    plant, uid = attacker
    target = _attacker_dir(shared, plant)
    base = shared / "ftkit-victim"
    plant(f"ln -s '{target}' '{base}'")
    config = Config(job="j", local_dir=str(base))
    for host in (None, "n7"):
        level = LocalLevel.for_config(config, 0, host=host, rank=0, node_leader=True,
                                      faults=Faults("", rank=0, node=0, attempt=0))
        assert level.root == config.node_dir(0, host)
        with pytest.raises(ConfigError) as info:
            level.prepare()
        _refused(info.value, base, uid, "0777")
    assert _listing(target) == []


# ---------------------------------------------------------- inside the tree
def _private_base(shared: Path) -> Path:
    base = shared / "ftkit-victim"
    base.mkdir(mode=0o700)
    return base


def test_job_dir_symlink_is_refused(shared: Path, attacker: tuple[Plant, int]) -> None:
    plant, _ = attacker
    target = _attacker_dir(shared, plant)
    base = _private_base(shared)
    (base / "job").symlink_to(target)            # planted while the tree was open
    level = _level(base / "job" / "node-0")
    with pytest.raises(ConfigError) as info:
        level.prepare()
    _refused(info.value, base / "job", os.geteuid(), "0777")
    with pytest.raises(OSError, match="symbolic link"):
        _write(level, 1)
    assert _listing(target) == []


def test_job_dir_open_to_others_is_refused(shared: Path) -> None:
    base = _private_base(shared)
    (base / "job").mkdir()
    os.chmod(base / "job", 0o777)
    with pytest.raises(ConfigError) as info:
        _level(base / "job" / "node-0").prepare()
    _refused(info.value, base / "job", os.geteuid(), "0777")


def test_step_dir_symlink_is_refused_and_not_followed(shared: Path,
                                                      attacker: tuple[Plant, int]) -> None:
    plant, _ = attacker
    target = _attacker_dir(shared, plant)
    base = _private_base(shared)
    level = _level(base / "job" / "node-0")
    level.prepare()
    _write(level, 1)                              # a real committed step 1 ...
    _commit(level, 1)
    for name in ("rank-0.ftk", COMMITTED):        # ... copied by the attacker as "step 2"
        shutil.copyfile(level.step_dir(1) / name, target / name)
    before = _listing(target)
    level.step_dir(2).symlink_to(target)
    assert not level.is_committed(2)              # the attacker's record is not read
    assert level.record_info(2)["w"] is None
    assert level.inventory()[2] == {"committed": False, "have": False}
    with pytest.raises(CorruptCheckpointError, match="step-2"):
        level.open_shard(2)
    with pytest.raises(OSError) as info:
        _write(level, 2)
    assert "symbolic link" in str(info.value) and str(level.step_dir(2)) in str(info.value)
    level.discard(2)                               # nothing is removed through the link
    assert _listing(target) == before
    level.retain({1})                              # retention drops the link, not its target
    assert not os.path.lexists(level.step_dir(2))
    assert _listing(target) == before
    assert _load(level, 1)["step"] == 1


def test_planted_temp_file_symlink_is_not_written_through(shared: Path,
                                                           attacker: tuple[Plant, int]) -> None:
    plant, _ = attacker
    target = _attacker_dir(shared, plant)
    bait = target / "bait"
    plant(f"printf attacker > '{bait}' && chmod 0666 '{bait}'")
    base = _private_base(shared)
    level = _level(base / "job" / "node-0")
    level.prepare()
    level.ensure_step_dir(1)
    for name in ("rank-0.ftk", COMMITTED):
        (level.step_dir(1) / f".{name}.tmp").symlink_to(bait)
    _write(level, 1)
    _commit(level, 1)
    assert bait.read_text() == "attacker"         # never written through
    for name in ("rank-0.ftk", COMMITTED):
        st = os.lstat(level.step_dir(1) / name)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, name
    assert _load(level, 1)["step"] == 1 and level.is_committed(1)
    assert _listing(target) == ["bait"]


def test_write_atomic_never_follows_a_planted_temp_name(tmp_path: Path) -> None:
    bait = tmp_path / "bait"
    bait.write_text("keep")
    (tmp_path / "d").mkdir(mode=0o700)
    path = tmp_path / "d" / "REC"
    (path.parent / ".REC.tmp").symlink_to(bait)
    write_atomic(path, [b"new"])
    write_record(path, {"a": 1})
    assert bait.read_text() == "keep"
    assert stat.S_ISREG(os.lstat(path).st_mode) and path.read_text() == '{"a": 1}'


def test_probe_symlink_is_not_written_through(shared: Path) -> None:
    base = _private_base(shared)
    bait = shared / "bait"
    bait.write_text("precious")
    level = _level(base / "job" / "node-0")
    level.prepare()
    (level.root / ".probe-rank-0").symlink_to(bait)
    level.prepare()
    assert bait.read_text() == "precious"
    assert not os.path.lexists(level.root / ".probe-rank-0")


def test_planted_record_and_shard_symlinks_are_not_read(shared: Path) -> None:
    base = _private_base(shared)
    level = _level(base / "job" / "node-0")
    level.prepare()
    _write(level, 1)
    _commit(level, 1)
    elsewhere = shared / "elsewhere"
    elsewhere.mkdir()
    for name in ("rank-0.ftk", COMMITTED):
        shutil.copyfile(level.step_dir(1) / name, elsewhere / name)
    level.ensure_step_dir(2)
    for name in ("rank-0.ftk", COMMITTED):
        (level.step_dir(2) / name).symlink_to(elsewhere / name)
    assert not level.is_committed(2)
    assert level.record_info(2)["w"] is None
    assert level.inventory()[2] == {"committed": False, "have": False}
    with pytest.raises(CorruptCheckpointError, match="symbolic link") as info:
        level.open_shard(2)
    assert info.value.step == 2 and info.value.rank == 0
    with pytest.raises(CorruptCheckpointError, match="symbolic link"):
        level.check_shard(2, 4)
