"""``ftkit clean JOB``: delete one job's checkpoint data on this host, and nothing else.

The directory trees are built as docs/formats.md lays them out (a real job's tree is cleaned in
tests/e2e/test_no_retry.py).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ftkit.cli.main import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """(PFS root, node-local root) of a clean ftkit environment under tmp_path."""
    for key in list(os.environ):
        if key.startswith(("FTKIT_", "SLURM")):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    pfs, local = tmp_path / "pfs", tmp_path / "local"
    monkeypatch.setenv("FTKIT_PFS_DIR", str(pfs))
    monkeypatch.setenv("FTKIT_LOCAL_DIR", str(local))
    return pfs, local


def _write(path: Path, data: bytes = b"") -> None:
    """Write a file; directories are created private (0700), as ftkit creates them."""
    missing = [p for p in path.parents if not p.exists()]
    for d in reversed(missing):
        d.mkdir(mode=0o700)
    path.write_bytes(data)


def make_job(pfs: Path, local: Path, job: str, nodes: int = 2) -> None:
    """A job's trees: two node-local steps per virtual node, a PFS step, the event log."""
    for node in range(nodes):
        for step in (4, 5):
            d = local / job / f"node-{node}" / f"step-{step}"
            _write(d / f"rank-{2 * node}.ftk", b"x" * 1000)
            _write(d / f"partner-{2 * node + 1}.ftk", b"x" * 1000)
            _write(d / "COMMITTED", b"{}")
        _write(local / job / f"node-{node}" / "parked-step-3" / "rank-0.ftk", b"p")
    _write(pfs / job / "step-5" / "ftkit.h5", b"h" * 2048)
    _write(pfs / job / "step-5" / "node-0.h5", b"h" * 4096)
    _write(pfs / job / "step-5" / "COMMITTED", b"{}")
    _write(pfs / job / "events.jsonl", b'{"event": "launch"}\n')
    _write(pfs / job / "RUN", b'{"run": "x"}')
    _write(pfs / job / ".done-attempt-0", b"{}")
    _write(pfs / job / "slurm-slots.json", b"{}")
    (pfs / job / "attempt-1.fatal").mkdir(exist_ok=True)
    _write(pfs / job / ".early" / ".rank-1.h5.x1y2.tmp", b"e")     # an early write cut short


def test_removes_both_trees_and_only_that_job(roots: tuple[Path, Path],
                                              capsys: pytest.CaptureFixture) -> None:
    pfs, local = roots
    make_job(pfs, local, "j1")
    make_job(pfs, local, "j2")
    assert main(["clean", "j1"]) == 0
    out = capsys.readouterr().out
    assert not (pfs / "j1").exists() and not (local / "j1").exists()
    assert (pfs / "j2" / "step-5" / "ftkit.h5").is_file()
    assert (local / "j2" / "node-1" / "step-5" / "rank-2.ftk").is_file()
    assert f"ftkit clean: removed {pfs / 'j1'} (" in out
    assert f"ftkit clean: removed {local / 'j1'} (" in out
    assert f"removed {pfs / 'j1'} (6.0 KiB)" in out      # 2048+4096+2+20+12+2+2 bytes
    assert f"removed {local / 'j1'} (7.8 KiB)" in out    # 2 nodes x (2 x 2002 + 1) bytes


def test_dry_run_lists_and_removes_nothing(roots: tuple[Path, Path],
                                           capsys: pytest.CaptureFixture) -> None:
    pfs, local = roots
    make_job(pfs, local, "j1")
    before = sorted(p for p in (pfs.parent).rglob("*"))
    assert main(["clean", "--dry-run", "j1"]) == 0
    out = capsys.readouterr().out
    assert f"would remove {pfs / 'j1'}" in out and f"would remove {local / 'j1'}" in out
    assert "removed" not in out.replace("would remove", "")
    assert sorted(p for p in (pfs.parent).rglob("*")) == before


def test_nothing_there_is_fine(roots: tuple[Path, Path], capsys: pytest.CaptureFixture) -> None:
    pfs, local = roots
    assert main(["clean", "never-ran"]) == 0
    out = capsys.readouterr().out
    assert "nothing to remove for job never-ran" in out
    assert str(pfs / "never-ran") in out and str(local / "never-ran") in out


@pytest.mark.parametrize("job", ["", "a/b", "..", "../pfs", "x..y", ".", "/etc"])
def test_bad_job_names_are_refused(roots: tuple[Path, Path], job: str,
                                   capsys: pytest.CaptureFixture) -> None:
    pfs, local = roots
    make_job(pfs, local, "j1")
    assert main(["clean", job]) == 2
    err = capsys.readouterr().err
    assert "ftkit clean: error:" in err and repr(job) in err and "nothing removed" in err
    assert (pfs / "j1" / "events.jsonl").is_file() and (local / "j1" / "node-0").is_dir()


@pytest.mark.parametrize("where, name, is_dir", [
    ("pfs", "notes.txt", False),
    ("pfs", "my-model", True),
    ("local", "data.bin", False),
    ("local", "node-0/results", True),
    ("local", "node-1/train.log", False),
])
def test_foreign_entries_are_listed_and_refused_unless_forced(
        roots: tuple[Path, Path], where: str, name: str, is_dir: bool,
        capsys: pytest.CaptureFixture) -> None:
    pfs, local = roots
    make_job(pfs, local, "j1")
    base = (pfs if where == "pfs" else local) / "j1"
    if is_dir:
        (base / name).mkdir(parents=True)
    else:
        _write(base / name, b"keep me")
    assert main(["clean", "j1"]) == 1
    err = capsys.readouterr().err
    assert f"refused: {base} holds entries ftkit does not create: {name}" in err
    assert "nothing removed" in err and "--force" in err
    assert (base / name).exists()
    assert (pfs / "j1" / "step-5").is_dir() and (local / "j1" / "node-0" / "step-4").is_dir()
    assert main(["clean", "--force", "j1"]) == 0
    assert not (pfs / "j1").exists() and not (local / "j1").exists()


def test_a_link_or_file_named_like_the_job_is_never_removed(
        roots: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pfs, local = roots
    precious = tmp_path / "precious"
    _write(precious / "node-0" / "step-1" / "rank-0.ftk", b"mine")
    local.mkdir()
    (local / "j1").symlink_to(precious)
    _write(pfs / "j1", b"a file, not a job directory")
    for force in ([], ["--force"]):
        assert main(["clean", *force, "j1"]) == 1
        err = capsys.readouterr().err
        assert f"refused: {local / 'j1'} is not a directory ftkit created" in err
        assert f"refused: {pfs / 'j1'} is not a directory ftkit created" in err
    assert (precious / "node-0" / "step-1" / "rank-0.ftk").read_bytes() == b"mine"
    assert (pfs / "j1").is_file() and (local / "j1").is_symlink()


def test_slurm_node_directory_is_cleaned_too(roots: tuple[Path, Path],
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture) -> None:
    """Under Slurm each node keeps $FTKIT_LOCAL_DIR/<node name>/<job> (Config.node_dir)."""
    pfs, local = roots
    make_job(pfs, local / "n3", "77")
    make_job(pfs, local / "n4", "77")
    monkeypatch.setenv("SLURMD_NODENAME", "n3")
    assert main(["clean", "77"]) == 0
    assert not (local / "n3" / "77").exists() and not (pfs / "77").exists()
    assert (local / "n4" / "77" / "node-0").is_dir()        # another node's: its own clean
    assert f"removed {local / 'n3' / '77'}" in capsys.readouterr().out


def test_same_root_for_pfs_and_local(roots: tuple[Path, Path], tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """FTKIT_PFS_DIR == FTKIT_LOCAL_DIR: one job directory holding both layouts."""
    both = tmp_path / "both"
    monkeypatch.setenv("FTKIT_PFS_DIR", str(both))
    monkeypatch.setenv("FTKIT_LOCAL_DIR", str(both))
    make_job(both, both, "j1")
    assert main(["clean", "j1"]) == 0
    assert not (both / "j1").exists()


def test_help_says_to_run_it_on_every_node(capsys: pytest.CaptureFixture) -> None:
    assert main(["clean", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "srun" in out and "on every node" in out
    assert "--dry-run" in out and "--force" in out


def test_clean_imports_neither_mpi4py_nor_torch(tmp_path: Path) -> None:
    code = ("import sys; from ftkit.cli.main import main; "
            "assert main(['clean', '--dry-run', 'nojob']) == 0; "
            "bad = {'mpi4py', 'torch', 'h5py'} & set(sys.modules); assert not bad, bad")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTKIT_")}
    env.update(PYTHONPATH=str(REPO), FTKIT_PFS_DIR=str(tmp_path / "p"),
               FTKIT_LOCAL_DIR=str(tmp_path / "l"))
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=env)


def test_refuses_a_local_job_directory_that_is_not_private(roots: tuple[Path, Path],
                                                           capsys: pytest.CaptureFixture) -> None:
    """On a shared /dev/shm the job directory may be another user's (or opened up): before,
    clean deleted whatever was in it."""
    pfs, local = roots
    make_job(pfs, local, "j1")
    (local / "j1").chmod(0o777)
    assert main(["clean", "j1"]) == 1
    err = capsys.readouterr().err
    assert f"refused: {local / 'j1'}" in err and "open to group/others" in err
    assert "mode 0777" in err and (local / "j1" / "node-0" / "step-4").is_dir()
    assert (pfs / "j1" / "step-5").is_dir()                # nothing removed at all


@pytest.mark.parametrize("where", ["pfs", "local"])
def test_running_job_is_refused(roots: tuple[Path, Path], where: str,
                                capsys: pytest.CaptureFixture[str]) -> None:
    """A job whose lock (PFS ``LOCK`` or a node's ``node-<id>/LOCK``) is held by a live
    process is running: clean removes nothing and names the holder; once the holder is gone,
    the lock files are ftkit's own and go with the rest."""
    pfs, local = roots
    make_job(pfs, local, "j")
    lock = pfs / "j" / "LOCK" if where == "pfs" else local / "j" / "node-1" / "LOCK"
    hold = ("import sys; from pathlib import Path; from ftkit.jobdir.lock import JobLock, "
            "holder_record; l = JobLock(Path(sys.argv[1]), 'j'); "
            "l.acquire(holder_record('ftkit run'), what='t'); print('locked', flush=True); "
            "sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", hold, str(lock)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "locked"
        assert main(["clean", "j"]) == 1
        err = capsys.readouterr().err
        assert f"job j is running: ftkit run pid {child.pid}" in err and str(lock) in err
        assert (pfs / "j" / "step-5" / "COMMITTED").exists()
        assert (local / "j" / "node-0" / "step-5" / "COMMITTED").exists()
    finally:
        child.communicate("", timeout=30)
    assert main(["clean", "j"]) == 0
    assert not (pfs / "j").exists() and not (local / "j").exists()
