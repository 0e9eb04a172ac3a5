"""``ftkit inspect/verify/export`` on hostile and damaged HDF5 input (ftkit.cli.sandbox,
scan, export).

Every case is written by the test with ftkit's own writers (``write_step``), then damaged with
h5py or raw file operations. A damaged file must never hang the CLI, kill it, make it read a
dataset's declared size into memory, or end in a traceback: one line naming the file, exit 1
(unusable input) or 2 (usage). Commands that could hang or crash on a regression run in a
subprocess with a timeout (and an address-space limit where a regression would allocate
gigabytes).
"""
from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from ftkit.cli import sandbox
from ftkit.cli.main import build_parser, main
from ftkit.storage.pfs import h5files, hdf5
from tests.unit.test_hdf5_meta import write_step

REPO = Path(__file__).resolve().parents[2]
GIB = 1 << 30


# ----------------------------------------------------------------------------- helpers

def _states(world: int = 2) -> list[dict[str, Any]]:
    return [{"model": {"a": np.arange(6, dtype=np.float32).reshape(2, 3) + r,
                       "n": np.arange(4, dtype=np.int32)},
             "data": {"pos": 1234}} for r in range(world)]


def _step(tmp_path: Path, states: list[dict[str, Any]] | None = None, *, step: int = 1,
          **kw: Any) -> Path:
    """``job/step-<step>`` (committed, with file digests); its directory."""
    d = tmp_path / "job" / f"step-{step}"
    write_step(d, _states() if states is None else states, step=step, **kw)
    return d


def recommit(path: Path) -> None:
    """Record a changed file's digest in COMMITTED, as a buggy writer would: only the checks
    inside the files can catch what changed."""
    record = hdf5.read_commit(path.parent)
    record["files"][path.name] = h5files.file_digest(path)
    hdf5.write_commit(path.parent, record)


def _edit(path: Path, fn: Callable[[Any], None], *, seal: str | None = None) -> None:
    """Change an HDF5 file of a step with h5py, reseal ``seal`` (a rank group, or "/" for the
    root) so that only the cross-checks can catch it, and recommit."""
    with h5py.File(path, "r+") as h5:
        fn(h5)
        if seal is not None:
            hdf5.seal(h5 if seal == "/" else h5[seal])
    recommit(path)


def _cli(*argv: str, timeout: float = 120, prelude: str = "", limit_as: int | None = None,
         env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """``ftkit ARGV`` in a subprocess (after ``prelude``; address space limited to
    ``limit_as`` bytes): (status, stdout, stderr). A hang fails the test (timeout)."""
    script = textwrap.dedent("""
        import resource, sys
        limit = int(sys.argv[1])
        if limit:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    """) + textwrap.dedent(prelude) + textwrap.dedent("""
        from ftkit.cli.main import main
        sys.exit(main(sys.argv[2:]))
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(limit_as or 0), *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, **(env or {})})
    return proc.returncode, proc.stdout, proc.stderr


def _one_line_error(err: str, command: str, *needles: str) -> None:
    """stderr is exactly one ``ftkit COMMAND: error: ...`` line holding every needle."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ftkit {command}: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, err)


# ----------------------------------------------------------------------------- sandbox

def test_sandbox_returns_json_and_reraises_expected_errors() -> None:
    assert sandbox.run(lambda rep: {"a": [1, 2.5, "x", None]}, timeout=30,
                       what="w") == {"a": [1, 2.5, "x", None]}

    def fail(rep: sandbox.Reporter) -> None:
        rep.progress("f.h5:/rank/0")
        raise ValueError("bad value")
    with pytest.raises(ValueError, match="^bad value$"):
        sandbox.run(fail, timeout=30, what="w", passthrough=(ValueError,))
    with pytest.raises(sandbox.Failed) as err:
        sandbox.run(fail, timeout=30, what="w")
    assert err.value.where == "f.h5:/rank/0" and "ValueError: bad value" in err.value.why
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(sandbox.Failed, match="RecursionError"):     # JSON cannot encode it
        sandbox.run(lambda rep: deep, timeout=30, what="w")


def test_sandbox_stops_a_child_that_makes_no_progress() -> None:
    """The child reports what it reads, then blocks forever (a libhdf5 loop)."""
    def hang(rep: sandbox.Reporter) -> None:
        rep.progress("node-0.h5:/rank/3")
        signal.pause()
    t0 = time.monotonic()
    with pytest.raises(sandbox.Stalled) as err:
        sandbox.run(hang, timeout=0.5, what="w")
    assert time.monotonic() - t0 < 15
    assert err.value.where == "node-0.h5:/rank/3"
    assert "did not progress within 0.5 s" in err.value.why


def test_sandbox_deadline_restarts_on_every_report() -> None:
    """Slow work that keeps reporting outlives the deadline many times over."""
    def slow(rep: sandbox.Reporter) -> int:
        for _ in range(8):
            time.sleep(0.25)                  # the simulated work, not synchronisation
            rep.progress(nbytes=10, datasets=1)
        return 42
    seen: list[tuple[int, int]] = []
    assert sandbox.run(slow, timeout=1.0, what="w",
                       on_progress=lambda b, d: seen.append((b, d))) == 42
    assert seen == [(10, 1)] * 8


def test_sandbox_reports_a_crash_with_its_signal() -> None:
    def crash(rep: sandbox.Reporter) -> None:
        rep.progress("node-1.h5")
        os.kill(os.getpid(), signal.SIGSEGV)
    with pytest.raises(sandbox.Crashed) as err:
        sandbox.run(crash, timeout=30, what="w")
    assert err.value.signum == signal.SIGSEGV
    assert str(err.value) == ("node-1.h5: the HDF5 library crashed reading it (signal 11, "
                              "SIGSEGV)")


# ----------------------------------------------------------------------------- CLI deadline

_BLOCK_STEP_2 = """
    import signal
    from ftkit.storage.pfs import h5read
    _group = h5read.StepReader.group
    def group(self, rank):
        if self.step == 2:
            signal.pause()                        # a read that never ends
        return _group(self, rank)
    h5read.StepReader.group = group
"""
_CRASH = """
    import os, signal
    from ftkit.storage.pfs import h5read
    def group(self, rank):
        os.kill(os.getpid(), signal.SIGSEGV)      # libhdf5 segfaults on a damaged byte
    h5read.StepReader.group = group
"""


def test_verify_stops_a_stalled_step_and_goes_on(tmp_path: Path) -> None:
    """Before: a read that never returned hung verify forever (there was no --timeout)."""
    _step(tmp_path, step=1)
    _step(tmp_path, step=2)
    job = tmp_path / "job"
    rc, out, err = _cli("verify", str(job), "--timeout", "1", prelude=_BLOCK_STEP_2)
    assert rc == 1, (out, err)
    assert "step 1: ok" in out and "step 2: BAD" in out, out
    line = next(ln for ln in out.splitlines() if "did not progress" in ln)
    assert f"{job / 'step-2' / 'node-0.h5'}:/rank/0" in line and "within 1 s" in line
    rc, out, err = _cli("export", str(job), "--step", "2", "--out", str(tmp_path / "x.st"),
                        "--format", "safetensors", "--timeout", "1", prelude=_BLOCK_STEP_2)
    _one_line_error(err, "export", "step 2", "did not progress within 1 s", "node-0.h5")
    assert rc == 1 and sorted(os.listdir(tmp_path)) == ["job"]      # nothing left behind


def test_a_crashing_reader_is_one_line_and_exit_1(tmp_path: Path) -> None:
    """Before: the segfault killed the ftkit process itself."""
    step_dir = _step(tmp_path)
    for argv in (["inspect", str(step_dir)], ["inspect", str(step_dir), "--json"],
                 ["export", str(step_dir), "--out", str(tmp_path / "x.pt")]):
        rc, _, err = _cli(*argv, prelude=_CRASH)
        _one_line_error(err, argv[0], "the HDF5 library crashed reading",
                        f"{step_dir / 'node-0.h5'}:/rank/0", "(signal 11, SIGSEGV)")
        assert rc == 1
    assert not (tmp_path / "x.pt").exists() and sorted(os.listdir(tmp_path)) == ["job"]
    rc, out, err = _cli("verify", str(step_dir), prelude=_CRASH)
    assert rc == 1 and "step 1: BAD" in out and "crashed reading it (signal 11" in out


def test_timeout_option_and_variable(tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    step_dir = _step(tmp_path)
    for bad in ("0", "-1", "x"):
        assert main(["verify", str(step_dir), "--timeout", bad]) == 2
    capsys.readouterr()
    rc, _, err = _cli("verify", str(step_dir), env={"FTKIT_TIMEOUT": "-3"})
    _one_line_error(err, "verify", "FTKIT_TIMEOUT")
    assert rc == 2
    rc, out, _ = _cli("verify", str(step_dir), env={"FTKIT_TIMEOUT": "30"})
    assert rc == 0 and "step 1: ok" in out


@pytest.mark.timeout(600)
def test_byte_flips_in_an_unchecked_index_never_hang_or_kill_the_cli(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every ``FLIP_STRIDE``-th byte (default 7, about 30 s) of the ftkit.h5 of a step without
    COMMITTED (no digest: libhdf5 parses whatever is there), flipped one at a time: inspect
    always ends, with exit 0 (what could be read, problems listed) or 1 and one line (the
    reader stopped), never a traceback. Measured with h5py 3.16 / libhdf5 2.0.0, every byte:
    6784 flips, 9 make libhdf5 loop, 4 crash it (SIGSEGV); every 7th: 2 loops, 1 crash.
    Before: a loop hung inspect forever, a crash killed it."""
    stride = int(os.environ.get("FLIP_STRIDE", "7"))
    step_dir = _step(tmp_path, [{"w": np.arange(3, dtype=np.float32), "data": {"pos": 1}}],
                     ranks_per_node=1)
    (step_dir / "COMMITTED").unlink()
    index = step_dir / "ftkit.h5"
    original = index.read_bytes()
    stopped = []
    for pos in range(0, len(original), stride):
        flipped = bytearray(original)
        flipped[pos] ^= 0xFF
        index.write_bytes(flipped)
        rc = main(["inspect", str(step_dir), "--json", "--timeout", "2"])
        out, err = capsys.readouterr()
        assert rc in (0, 1) and "Traceback" not in err, (pos, err)
        assert json.loads(out)["steps"][0]["dir"] == str(step_dir)
        if rc:
            _one_line_error(err, "inspect", str(step_dir))
            stopped.append(pos)
    print(f"{len(original) // stride} flips; reader stopped at {stopped}")


# ----------------------------------------------------------------------------- regular files

def test_a_fifo_in_a_step_is_refused_not_waited_on(tmp_path: Path) -> None:
    """Before: libhdf5 opened the FIFO through the index's link and waited for a writer."""
    step_dir = _step(tmp_path, ranks_per_node=1)
    node = step_dir / "node-0.h5"
    node.unlink()
    os.mkfifo(node)
    rc, out, err = _cli("verify", str(tmp_path / "job"), timeout=60)
    assert rc == 1 and "step 1: BAD" in out, (out, err)
    assert f"{node}: is not a regular file" in out, out
    rc, out, err = _cli("inspect", str(step_dir), "--json", timeout=60)
    assert rc == 0, err
    problems = json.loads(out)["steps"][0]["problems"]
    assert any(p.startswith(f"{node}: is not a regular file") for p in problems), problems
    rc, _, err = _cli("export", str(step_dir), "--out", str(tmp_path / "x.st"), "--format",
                      "safetensors", timeout=60)
    _one_line_error(err, "export", str(node), "not a regular file")
    assert rc == 1


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_path_that_is_not_a_regular_file(tmp_path: Path, kind: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ftkit.h5"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path = Path(os.devnull)
    for command in ("inspect", "verify"):
        rc = main([command, str(path)])
        _one_line_error(capsys.readouterr().err, command, str(path),
                        "is a FIFO" if kind == "fifo" else "is a character device",
                        "not a regular file or directory")
        assert rc == 1


@pytest.mark.parametrize("name", ["ftkit.h5", "node-0.h5", "COMMITTED"])
def test_a_directory_where_a_file_belongs(tmp_path: Path, name: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Before: a directory ftkit.h5 was reported as "ftkit.h5 missing", a directory COMMITTED
    as "no COMMITTED record"; now each says what it is."""
    step_dir = _step(tmp_path)
    (step_dir / name).unlink()
    (step_dir / name).mkdir()
    rc = main(["verify", str(tmp_path / "job")])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert (f"{step_dir / name}: is a directory" in out if name != "COMMITTED" else
            "incomplete: COMMITTED is a directory" in out), out
    rc = main(["export", str(step_dir), "--out", str(tmp_path / "x.st"), "--format",
               "safetensors"])
    _one_line_error(capsys.readouterr().err, "export", "is a directory")
    assert rc == 1 and not (tmp_path / "x.st").exists()


# ----------------------------------------------------------------------------- sizes

def _declare_8_gib(node: Path) -> None:
    """Replace ``/rank/0/model/a`` by a float32 dataset of 2**31 elements (8 GiB) that has
    no storage in the file, with attributes that agree (a resealed group)."""
    def edit(h5: Any) -> None:
        grp = h5["rank/0"]
        attrs = {k: grp["model/a"].attrs[k] for k in grp["model/a"].attrs}
        del grp["model/a"]
        ds = grp.create_dataset("model/a", shape=(2 * GIB,), dtype="<f4")   # never written
        ds.attrs.update({**attrs, "ftkit_shape": np.array([2 * GIB], dtype=np.int64),
                         "global_shape": [2 * GIB]})
    _edit(node, edit, seal="rank/0")


def test_a_dataset_larger_than_its_file_is_refused_before_reading(tmp_path: Path) -> None:
    """Before: verify read 8 GiB of fill values (and called it a checksum mismatch), export
    allocated 8 GiB (MemoryError under this address-space limit)."""
    step_dir = _step(tmp_path)
    node = step_dir / "node-0.h5"
    _declare_8_gib(node)
    assert node.stat().st_size < 64 << 10
    where = f"{node}:/rank/0/model/a"
    for path in (step_dir, node):                   # with COMMITTED digests, and the file alone
        t0 = time.monotonic()
        rc, out, err = _cli("verify", str(path), limit_as=3 * GIB)
        assert rc == 1 and f"{where}: bad dataset" in out, (out, err)
        assert f"needs {8 * GIB} bytes but only 0 bytes of data are stored" in out
        rc, out, err = _cli("export", str(path), "--out", str(tmp_path / "x.st"), "--format",
                            "safetensors", limit_as=3 * GIB)
        _one_line_error(err, "export", where, f"needs {8 * GIB} bytes")
        assert rc == 1 and time.monotonic() - t0 < 60
        rc, out, err = _cli("inspect", str(path), limit_as=3 * GIB)
        assert rc == 0 and f"{where}: bad dataset" in out, (out, err)
    assert sorted(os.listdir(tmp_path)) == ["job"]


# ----------------------------------------------------------------------------- the tree count

def test_export_writes_every_tensor_of_the_tree_or_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: a tensor torch has no dtype for was skipped and export said 0 (18 of 19)."""
    state = {"w": np.ones((2, 2), dtype=np.float32), "when": np.array(["2020-01-01"],
                                                                      dtype="datetime64[D]")}
    step_dir = _step(tmp_path, [state])
    for fmt in ("pt", "safetensors"):
        out = tmp_path / f"x.{fmt}"
        rc = main(["export", str(step_dir), "--out", str(out), "--format", fmt])
        _one_line_error(capsys.readouterr().err, "export", "'when'", "<M8[D]")
        assert rc == 1 and not out.exists()


def test_export_refuses_a_tp_step_whose_topology_has_no_dp_0(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: no rank had dp_idx 0, so nothing was merged and an empty file was written."""
    step_dir = _step(tmp_path, tp=2)
    topo = json.dumps({"dp_idx": 1, "tp_idx": 0, "pp_idx": 0, "node": 0})
    for rank in (0, 1):
        _edit(step_dir / "node-0.h5", lambda h5, r=rank: h5[f"rank/{r}"].attrs.update(
            {"topology": topo}), seal=f"rank/{rank}")
    out = tmp_path / "x.pt"
    rc = main(["export", str(step_dir), "--out", str(out)])
    _one_line_error(capsys.readouterr().err, "export", "have dp_idx 0", "tp x pp = 2")
    assert rc == 1 and not out.exists()


# ----------------------------------------------------------------------------- streaming

def _load_safetensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """{name: (dtype, shape, bytes)} of a safetensors file, parsed by its specification."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    assert (8 + n) % 8 == 0
    body = data[8 + n:]
    out = {}
    end = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        start, stop = t["data_offsets"]
        assert start == end                    # contiguous, in header order
        end = stop
        out[name] = (t["dtype"], t["shape"], body[start:stop])
    assert end == len(body)
    return out


_EXPORT_UNDER_DATA_LIMIT = """
    import resource, sys
    import torch, h5py, numpy
    def vm_data():
        for line in open("/proc/self/status"):
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    limit = vm_data() + int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    from ftkit.cli.main import main
    sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_export_streams_with_memory_for_about_one_tensor(tmp_path: Path, fmt: str) -> None:
    """16 tensors of 16 MiB (256 MiB) export with the private data of the process limited to
    4 tensors more than it had after importing torch and h5py (RLIMIT_DATA; file mappings do
    not count). Before: every tensor was read into memory, then copied, and the export
    failed with MemoryError."""
    tensor = 16 << 20
    rng = np.random.default_rng(0)
    state = {f"t{i}": rng.integers(0, 255, tensor, dtype=np.uint8).view(np.float32)
             .reshape(1024, -1) for i in range(16)}
    step_dir = _step(tmp_path, [state])
    out = tmp_path / f"x.{fmt}"
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_EXPORT_UNDER_DATA_LIMIT),
                           str(4 * tensor), "export", str(step_dir), "--out", str(out),
                           "--format", fmt], cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "16 tensors (256.0 MiB)" in proc.stdout
    if fmt == "pt":
        import torch
        sd = torch.load(out, weights_only=True)
        got = {k: v.numpy().tobytes() for k, v in sd.items()}
        assert all(v.dtype == torch.float32 and list(v.shape) == [1024, 4096]
                   for v in sd.values())
    else:
        parsed = _load_safetensors(out)
        assert {v[:2] == ("F32", [1024, 4096]) for v in parsed.values()} == {True}
        got = {k: v[2] for k, v in parsed.items()}
    assert list(got) == list(state) and all(got[k] == state[k].tobytes() for k in state)


def test_safetensors_dtypes_and_byte_order(tmp_path: Path) -> None:
    """bfloat16 (raw in HDF5), bool, scalars, empty tensors, big-endian numpy arrays."""
    torch = pytest.importorskip("torch")
    state = {"bf": torch.arange(6, dtype=torch.float32).reshape(2, 3).to(torch.bfloat16),
             "mask": torch.tensor([True, False]), "s": torch.tensor(2.5, dtype=torch.float64),
             "e": torch.zeros(0, 3), "be": np.arange(5, dtype=">i4")}
    step_dir = _step(tmp_path, [state])
    out = tmp_path / "x.safetensors"
    assert main(["export", str(step_dir), "--out", str(out)]) == 0
    got = _load_safetensors(out)
    assert got["bf"] == ("BF16", [2, 3], state["bf"].view(torch.int16).numpy().tobytes())
    assert got["mask"] == ("BOOL", [2], b"\x01\x00")
    assert got["s"] == ("F64", [], struct.pack("<d", 2.5))
    assert got["e"] == ("F32", [0, 3], b"")
    assert got["be"] == ("I32", [5], np.arange(5, dtype="<i4").tobytes())
    sd = torch.load(_pt(tmp_path, step_dir), weights_only=True)
    assert torch.equal(sd["bf"], state["bf"]) and sd["be"].tolist() == list(range(5))
    # the safetensors library itself reads ftkit's file (the test extra installs it)
    st = pytest.importorskip("safetensors.torch")
    loaded = st.load_file(str(out))
    assert sorted(loaded) == sorted(sd)
    assert all(torch.equal(loaded[k], sd[k]) and loaded[k].dtype == sd[k].dtype for k in sd)


def _pt(tmp_path: Path, step_dir: Path) -> Path:
    out = tmp_path / "x.pt"
    assert main(["export", str(step_dir), "--out", str(out)]) == 0
    return out


# ----------------------------------------------------------------------------- malformed input

def _index(step_dir: Path, attrs: dict[str, Any]) -> None:
    _edit(step_dir / "ftkit.h5", lambda h5: h5.attrs.update(attrs), seal="/")


#: case -> (damage, exit status of inspect, verify, export, text every error names)
MALFORMED: dict[str, tuple[Callable[[Path], None], tuple[int, int, int], str]] = {
    "index tp not an int": (lambda d: _index(d, {"tp": "x"}), (0, 0, 1), "ftkit.h5"),
    "index world 10**12": (lambda d: _index(d, {"world": 10 ** 12}), (0, 1, 1), "world"),
    "index time 1e300": (lambda d: _index(d, {"time": 1e300}), (0, 0, 0), ""),
    "index job a list": (lambda d: _index(d, {"job": [1, 2]}), (0, 1, 1), "job"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_attributes_give_one_line_and_an_exit_status(
        tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Index attributes with wrong types or values, resealed and recommitted (a buggy or
    hostile writer). Before: tracebacks (int('x') in export, an overflowing time and a list
    as a set member in inspect) and list(range(10**12)) (MemoryError) in verify. (Malformed
    rank-group attributes are refused by h5group.RankGroup.load: tests/unit/test_hdf5_meta.py.)"""
    damage, (inspect_rc, verify_rc, export_rc), needle = MALFORMED[case]
    step_dir = _step(tmp_path)
    damage(step_dir)
    for argv, want in ((["inspect", str(step_dir)], inspect_rc),
                       (["inspect", str(step_dir), "--json"], inspect_rc),
                       (["verify", str(step_dir)], verify_rc),
                       (["export", str(step_dir), "--out", str(tmp_path / "x.pt")],
                        export_rc)):
        rc = main(argv)
        out, err = capsys.readouterr()
        assert rc == want, (argv, out, err)
        assert "Traceback" not in out + err
        if argv[0] == "inspect" and "--json" in argv:
            json.loads(out)
        if argv[0] == "verify" and rc:
            assert needle in out, (argv, out)
        if argv[0] == "export" and rc:
            _one_line_error(err, "export", needle)
    assert (tmp_path / "x.pt").exists() == (export_rc == 0)


def test_exit_statuses_are_documented() -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name in ("inspect", "verify", "export"):
        text = sub.choices[name].description           # type: ignore[attr-defined]
        for status in ("Exit 0:", "1:", "2: usage"):
            assert status in text, (name, status)
        assert "--timeout" in text and "signal" in text, name


def test_version_and_a_reader_that_is_gone(tmp_path: Path) -> None:
    """``ftkit --version`` answers; ``ftkit inspect --json`` into a pipe whose reader has
    closed (``| head``) ends quietly with 141, as a shell reports SIGPIPE — no traceback."""
    version = subprocess.run([sys.executable, "-m", "ftkit.cli.main", "--version"],
                             check=False, capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("ftkit "), version
    _step(tmp_path)
    read, write = os.pipe()
    os.close(read)                       # the reader is gone before anything is written
    try:
        proc = subprocess.run([sys.executable, "-m", "ftkit.cli.main", "inspect", "--json",
                               str(tmp_path / "job")], check=False, stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr
