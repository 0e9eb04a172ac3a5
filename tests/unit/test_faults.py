"""ftkit.faults: FTKIT_FAULTS parsing (docs/protocol.md) and injection."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from ftkit import faults as faults_mod
from ftkit.errors import ConfigError, InjectedFault
from ftkit.faults import Fault, Faults, flip_byte, parse_faults

SPEC_EXAMPLE = "kill:rank=3:step=7:phase=encode;corrupt:rank=1:step=9:level=local"


# ------------------------------------------------------------------ parsing
def test_parse_design_example() -> None:
    kill, corrupt = parse_faults(SPEC_EXAMPLE)
    assert kill == Fault(kind="kill", rank=3, step=7, phase="encode")
    assert corrupt == Fault(kind="corrupt", rank=1, step=9, level="local")
    assert kill.attempt == 0 and kill.code == 1
    assert kill.node is None and kill.level is None


def test_parse_every_key_and_kind() -> None:
    (f,) = parse_faults("exit:rank=2:node=1:step=5:phase=commit:attempt=2:code=7")
    assert (f.kind, f.rank, f.node, f.step, f.phase, f.attempt, f.code) == (
        "exit", 2, 1, 5, "commit", 2, 7)
    kinds = [f.kind for f in parse_faults(
        "kill;exit;raise;hang;corrupt:rank=0;node:rank=1")]
    assert kinds == ["kill", "exit", "raise", "hang", "corrupt", "node"]


def test_parse_empty_and_whitespace() -> None:
    assert parse_faults("") == ()
    assert parse_faults(" ; ;") == ()
    assert len(parse_faults(" raise:rank=1 ; kill:rank=2 ")) == 2


def test_corrupt_defaults_to_local_level() -> None:
    (f,) = parse_faults("corrupt:rank=1:step=2")
    assert f.level == "local"


@pytest.mark.parametrize(("spec", "needle"), [
    ("explode:rank=1", "explode"),                    # unknown kind
    ("kill:rnak=1", "rnak"),                          # unknown key
    ("kill:rank", "rank"),                            # key without value
    ("kill:phase=encoding", "encoding"),              # unknown phase
    ("kill:rank=one", "rank"),                        # non-int rank
    ("kill:rank=", "rank"),                           # empty int
    ("kill:step=1.5", "step"),                        # non-int step
    ("exit:code=x", "code"),                          # non-int code
    ("kill:attempt=a", "attempt"),                    # non-int attempt
    ("corrupt:rank=1:level=tape", "tape"),            # unknown level
    ("node:step=3", "node"),                          # node fault without a victim
    ("kill:rank=1;bogus", "bogus"),                   # bad second entry
])
def test_bad_specs_raise_config_error(spec: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_faults(spec)
    msg = str(info.value)
    assert "FTKIT_FAULTS" in msg
    assert needle in msg


def test_every_level_can_be_corrupted() -> None:
    for level in ("local", "partner", "xor", "rs", "pfs"):
        (fault,) = parse_faults(f"corrupt:rank=1:level={level}")
        assert fault.level == level


def test_faults_constructor_validates() -> None:
    with pytest.raises(ConfigError):
        Faults("kill:phase=nope", rank=0, node=0, attempt=0)
    assert not Faults("", rank=0, node=0, attempt=0)
    assert Faults("raise:rank=0", rank=0, node=0, attempt=0)


# ----------------------------------------------------------------- matching
def _injector(spec: str, rank: int = 1, node: int = 0, attempt: int = 0) -> Faults:
    return Faults(spec, rank=rank, node=node, attempt=attempt)


def test_raise_fires_on_matching_rank_step_phase() -> None:
    f = _injector("raise:rank=1:step=4:phase=vote")
    f.fire("vote", 3)              # wrong step
    f.fire("encode", 4)            # wrong phase
    _injector("raise:rank=1:step=4:phase=vote", rank=2).fire("vote", 4)   # wrong rank
    with pytest.raises(InjectedFault) as info:
        f.fire("vote", 4)
    assert "rank 1" in str(info.value) and "vote" in str(info.value)


def test_fires_at_most_once() -> None:
    f = _injector("raise:rank=1:phase=capture")
    with pytest.raises(InjectedFault):
        f.fire("capture", 1)
    f.fire("capture", 1)           # already fired: no second exception
    f.fire("capture", 2)


def test_unspecified_keys_match_anything() -> None:
    with pytest.raises(InjectedFault):
        _injector("raise", rank=5).fire("commit", 99)
    with pytest.raises(InjectedFault):
        _injector("raise:step=3", rank=0).fire("restore-load", 3)


def test_node_key_restricts_to_that_node() -> None:
    _injector("raise:node=2", node=1).fire("encode", 1)
    with pytest.raises(InjectedFault):
        _injector("raise:node=2", node=2).fire("encode", 1)


def test_attempt_default_zero_does_not_fire_on_relaunch() -> None:
    _injector("raise:rank=1:step=4", attempt=1).fire("vote", 4)
    with pytest.raises(InjectedFault):
        _injector("raise:rank=1:step=4", attempt=0).fire("vote", 4)


def test_attempt_key_selects_the_attempt() -> None:
    _injector("raise:rank=1:attempt=2", attempt=0).fire("vote", 4)
    _injector("raise:rank=1:attempt=2", attempt=1).fire("vote", 4)
    with pytest.raises(InjectedFault):
        _injector("raise:rank=1:attempt=2", attempt=2).fire("vote", 4)


def test_only_matching_entry_fires_among_several() -> None:
    f = _injector("raise:rank=0;raise:rank=1:step=2", rank=1)
    f.fire("encode", 1)
    with pytest.raises(InjectedFault):
        f.fire("encode", 2)


def test_corrupt_does_not_fire_at_phase_start(tmp_path: Path) -> None:
    f = _injector("corrupt:rank=1:step=2")
    f.fire("write-local", 2)       # no exception, no effect


def test_hang_sleeps_forever(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[float] = []

    class Stop(Exception):
        pass

    def fake_sleep(secs: float) -> None:
        calls.append(secs)
        if len(calls) == 3:
            raise Stop

    monkeypatch.setattr(faults_mod.time, "sleep", fake_sleep)
    with pytest.raises(Stop):
        _injector("hang:rank=1:phase=vote").fire("vote", 1)
    assert len(calls) == 3 and all(s > 0 for s in calls)


def test_node_fault_wipes_dir_and_kills(tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    node_dir = tmp_path / "node-1"
    (node_dir / "step-1").mkdir(parents=True)
    (node_dir / "step-1" / "rank-2.ftk").write_bytes(b"x")
    kills: list[tuple[int, int]] = []
    monkeypatch.setattr(faults_mod.os, "kill", lambda pid, sig: kills.append((pid, sig)))
    # rank 2 lives on node 1; this process is rank 3, also on node 1: it dies too
    f = Faults("node:rank=2:step=4", rank=3, node=1, attempt=0,
               rank_node=[0, 0, 1, 1], node_dir=node_dir)
    f.fire("encode", 3)
    assert kills == [] and node_dir.exists()
    f.fire("encode", 4)
    assert kills == [(os.getpid(), signal.SIGKILL)]
    assert not node_dir.exists()
    # a rank on another node is untouched
    other = Faults("node:rank=2:step=4", rank=0, node=0, attempt=0,
                   rank_node=[0, 0, 1, 1], node_dir=tmp_path / "node-0")
    other.fire("encode", 4)
    assert len(kills) == 1


# --------------------------------------------------- exit / kill (subprocess)
def _run_fault(spec: str, phase: str = "encode", step: int = 7,
               attempt: int = 0) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(f"""
        from ftkit.faults import Faults
        f = Faults({spec!r}, rank=3, node=0, attempt={attempt})
        f.fire({phase!r}, {step})
        print("survived")
    """)
    return subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                          text=True, timeout=60)


def test_exit_default_code_is_1() -> None:
    proc = _run_fault("exit:rank=3:step=7:phase=encode")
    assert proc.returncode == 1
    assert "survived" not in proc.stdout


def test_exit_with_code() -> None:
    proc = _run_fault("exit:rank=3:code=42")
    assert proc.returncode == 42
    assert "survived" not in proc.stdout


def test_kill_sigkills_itself() -> None:
    proc = _run_fault(SPEC_EXAMPLE)
    assert proc.returncode == -signal.SIGKILL
    assert "survived" not in proc.stdout


def test_kill_not_on_relaunch_attempt() -> None:
    proc = _run_fault(SPEC_EXAMPLE, attempt=1)
    assert proc.returncode == 0
    assert "survived" in proc.stdout


# -------------------------------------------------------------------- corrupt
def _diff_positions(a: bytes, b: bytes) -> list[int]:
    assert len(a) == len(b)
    return [i for i, (x, y) in enumerate(zip(a, b)) if x != y]


def test_corrupt_after_write_flips_exactly_one_byte(tmp_path: Path) -> None:
    path = tmp_path / "rank-1.ftk"
    original = bytes(range(256)) * 8
    path.write_bytes(original)
    f = _injector("corrupt:rank=1:step=9:level=local")
    f.after_write(path, level="local", step=8)       # wrong step: untouched
    assert path.read_bytes() == original
    f.after_write(path, level="local", step=9)
    changed = path.read_bytes()
    (pos,) = _diff_positions(original, changed)
    assert changed[pos] == original[pos] ^ 0xFF
    f.after_write(path, level="local", step=9)       # fires at most once
    assert path.read_bytes() == changed


def test_corrupt_only_matching_rank_and_level(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"abcdefgh")
    _injector("corrupt:rank=1", rank=2).after_write(path, level="local", step=1)
    _injector("corrupt:rank=1").after_write(path, level="pfs", step=1)
    _injector("corrupt:rank=1", attempt=1).after_write(path, level="local", step=1)
    assert path.read_bytes() == b"abcdefgh"


def test_flip_byte_explicit_offset_and_empty(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"\x00\x01\x02")
    assert flip_byte(path, 1) == 1
    assert path.read_bytes() == b"\x00\xfe\x02"
    empty = tmp_path / "e"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        flip_byte(empty)


def test_node_fault_with_rank_node_list_as_topology_gives_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kills: list[int] = []
    monkeypatch.setattr(faults_mod.os, "kill", lambda pid, sig: kills.append(sig))
    rank_node: Any = [0, 0, 1, 1]                # Topology.rank_node: node of every rank
    f = Faults("node:rank=2", rank=3, node=1, attempt=0, rank_node=rank_node,
               node_dir=tmp_path / "node-1")
    f.fire("encode", 1)
    assert kills == [signal.SIGKILL]


def test_corrupt_buffer_flips_one_byte_of_received_data() -> None:
    """partner/xor/rs: the fault strikes data as it is received (a corrupted transfer)."""
    import numpy as np
    f = _injector("corrupt:rank=1:step=5:level=partner")
    buf = np.arange(64, dtype=np.uint8)
    original = buf.copy()
    assert not f.corrupt_buffer(buf, level="partner", step=4)        # wrong step
    assert not f.corrupt_buffer(buf, level="xor", step=5)            # wrong level
    assert not f.corrupt_buffer(buf[:0], level="partner", step=5)    # empty: never hit
    assert np.array_equal(buf, original)
    assert f.corrupt_buffer(buf, level="partner", step=5)
    (pos,) = np.flatnonzero(buf != original)
    assert buf[pos] == original[pos] ^ 0xFF and pos == 64 - 1 - 64 // 4
    assert not f.corrupt_buffer(buf, level="partner", step=5)        # fires once
    assert not _injector("corrupt:rank=1:level=partner", rank=2).corrupt_buffer(
        buf, level="partner", step=5)                                # other rank
