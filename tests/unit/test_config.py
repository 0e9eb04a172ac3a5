"""ftkit.config: defaults < ftkit.toml < FTKIT_* env < kwargs, validation, derived values."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from ftkit.config import Config, parse_levels
from ftkit.errors import ConfigError


@pytest.fixture(autouse=True)
def _clean_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run every test in an empty directory, so no stray ./ftkit.toml is picked up."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _toml(path: Path, body: str) -> Path:
    path.write_text(body)
    return path


# ------------------------------------------------------------------ defaults
def test_defaults() -> None:
    cfg = Config.load(env={})
    assert cfg.job == "local"
    assert cfg.local_dir.startswith("/dev/shm/ftkit-")
    assert cfg.local_dir != "/dev/shm/ftkit-"
    assert cfg.pfs_dir == "./ftkit-ckpt"
    assert cfg.levels == (("local", 1), ("partner", 1), ("pfs", 50))
    assert (cfg.xor_set, cfg.rs_set, cfg.rs_parity) == (4, 4, 2)
    assert cfg.ranks_per_node == 0
    assert cfg.async_ is True
    assert cfg.timeout == 120.0
    assert cfg.faults == ""
    assert cfg.attempt == 0
    assert cfg.log_level == "WARNING"
    assert cfg == Config()


def test_derived_paths() -> None:
    cfg = Config.load(env={"FTKIT_JOB": "j1", "FTKIT_LOCAL_DIR": "/l", "FTKIT_PFS_DIR": "/p"})
    assert cfg.job_local_dir == Path("/l/j1")
    assert cfg.job_pfs_dir == Path("/p/j1")
    assert cfg.events_path == Path("/p/j1/events.jsonl")


def test_config_is_frozen() -> None:
    cfg = Config.load(env={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.timeout = 5.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.levels = (("local", 1),)  # type: ignore[misc]
    assert hash(cfg) == hash(Config.load(env={}))


# ---------------------------------------------------------------- precedence
def test_toml_overrides_defaults(tmp_path: Path) -> None:
    _toml(tmp_path / "ftkit.toml", '[ftkit]\ntimeout = 7\nlevels = "local:2"\nasync = false\n'
                                   'job = "fromtoml"\n')
    cfg = Config.load(env={})
    assert cfg.timeout == 7.0
    assert cfg.levels == (("local", 2),)
    assert cfg.async_ is False
    assert cfg.job == "fromtoml"
    assert cfg.xor_set == 4          # untouched keys keep their defaults


def test_toml_other_tables_are_ignored(tmp_path: Path) -> None:
    _toml(tmp_path / "ftkit.toml", '[other]\nbogus = 1\n[ftkit]\nxor_set = 3\n')
    assert Config.load(env={}).xor_set == 3


def test_toml_via_ftkit_config_env(tmp_path: Path) -> None:
    sub = tmp_path / "elsewhere"
    sub.mkdir()
    cfg_file = _toml(sub / "custom.toml", "[ftkit]\nrs_set = 6\nrs_parity = 3\n")
    cfg = Config.load(env={"FTKIT_CONFIG": str(cfg_file)})
    assert (cfg.rs_set, cfg.rs_parity) == (6, 3)


def test_toml_explicit_path_argument(tmp_path: Path) -> None:
    cfg_file = _toml(tmp_path / "x.toml", "[ftkit]\nattempt = 4\n")
    assert Config.load(cfg_file, env={}).attempt == 4
    with pytest.raises(ConfigError, match="does not exist"):
        Config.load(tmp_path / "missing.toml", env={})


def test_env_overrides_toml(tmp_path: Path) -> None:
    _toml(tmp_path / "ftkit.toml", '[ftkit]\ntimeout = 7\nlevels = "local:2"\njob = "t"\n')
    cfg = Config.load(env={"FTKIT_TIMEOUT": "9.5", "FTKIT_LEVELS": "local:3,pfs:9"})
    assert cfg.timeout == 9.5
    assert cfg.levels == (("local", 3), ("pfs", 9))
    assert cfg.job == "t"            # from toml, not overridden


def test_kwargs_override_env_and_toml(tmp_path: Path) -> None:
    _toml(tmp_path / "ftkit.toml", "[ftkit]\ntimeout = 7\nxor_set = 3\n")
    env = {"FTKIT_TIMEOUT": "9", "FTKIT_ASYNC": "1", "FTKIT_XOR_SET": "5"}
    overrides: dict[str, Any] = {"async": False}   # `async` is a keyword: pass it by dict
    cfg = Config.load(env=env, timeout=11, **overrides)
    assert cfg.timeout == 11.0
    assert cfg.async_ is False
    assert cfg.xor_set == 5          # env beats toml when no kwarg is given
    assert Config.load(env=env, async_=False).async_ is False
    assert Config.load(env=env, levels="local:1,xor:2").levels == (("local", 1), ("xor", 2))


def test_kwargs_unknown_option() -> None:
    with pytest.raises(ConfigError, match="bogus") as info:
        Config.load(env={}, bogus=1)
    assert "timeout" in str(info.value)


def test_process_environment_is_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTKIT_XOR_SET", "7")
    assert Config.load().xor_set == 7


# --------------------------------------------------------------------- job
def test_slurm_job_id_names_the_job() -> None:
    assert Config.load(env={"SLURM_JOB_ID": "4242"}).job == "4242"


def test_ftkit_job_beats_slurm_job_id() -> None:
    assert Config.load(env={"SLURM_JOB_ID": "4242", "FTKIT_JOB": "mine"}).job == "mine"


@pytest.mark.parametrize("job", ["a/b", ".", ".."])
def test_bad_job_name(job: str) -> None:
    with pytest.raises(ConfigError, match="FTKIT_JOB"):
        Config.load(env={"FTKIT_JOB": job})


# --------------------------------------------------------------- unknown keys
def test_unknown_env_key_names_key_and_lists_valid_ones() -> None:
    with pytest.raises(ConfigError) as info:
        Config.load(env={"FTKIT_TIMEOUTT": "5"})
    msg = str(info.value)
    assert "FTKIT_TIMEOUTT" in msg
    for valid in ("FTKIT_TIMEOUT", "FTKIT_LEVELS", "FTKIT_LOCAL_DIR", "FTKIT_FAULTS"):
        assert valid in msg


def test_reserved_and_foreign_env_vars_are_ignored() -> None:
    env = {"FTKIT_DONE_FILE": "/x", "FTKIT_ROOT": "/r", "PATH": "/bin", "XFTKIT_FOO": "1"}
    assert Config.load(env=env) == Config()


def test_unknown_toml_key(tmp_path: Path) -> None:
    _toml(tmp_path / "ftkit.toml", "[ftkit]\ntimeoutt = 3\n")
    with pytest.raises(ConfigError, match="timeoutt") as info:
        Config.load(env={})
    assert "timeout" in str(info.value).split("valid")[-1]


def test_unparsable_toml(tmp_path: Path) -> None:
    _toml(tmp_path / "ftkit.toml", "[ftkit\ntimeout = \n")
    with pytest.raises(ConfigError, match="ftkit.toml"):
        Config.load(env={})


# ----------------------------------------------------------- malformed values
@pytest.mark.parametrize(("key", "value"), [
    ("FTKIT_TIMEOUT", "abc"),
    ("FTKIT_TIMEOUT", "0"),
    ("FTKIT_TIMEOUT", "-3"),
    ("FTKIT_TIMEOUT", "nan"),
    ("FTKIT_LEVELS", "local:0"),
    ("FTKIT_LEVELS", "foo:1"),
    ("FTKIT_LEVELS", "local:x"),
    ("FTKIT_LEVELS", "local:1,local:2"),
    ("FTKIT_LEVELS", ""),
    ("FTKIT_LEVELS", "local:-1"),
    ("FTKIT_ASYNC", "maybe"),
    ("FTKIT_ASYNC", "2"),
    ("FTKIT_XOR_SET", "1"),
    ("FTKIT_XOR_SET", "four"),
    ("FTKIT_RS_SET", "1"),
    ("FTKIT_RS_PARITY", "0"),
    ("FTKIT_RS_PARITY", "4"),
    ("FTKIT_RS_PARITY", "5"),
    ("FTKIT_RANKS_PER_NODE", "-1"),
    ("FTKIT_RANKS_PER_NODE", "2.5"),
    ("FTKIT_ATTEMPT", "-1"),
    ("FTKIT_LOG_LEVEL", "LOUD"),
    ("FTKIT_FAULTS", "explode:rank=1"),
])
def test_malformed_env_value_names_the_key(key: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config.load(env={key: value})
    assert key in str(info.value)


def test_rs_parity_must_be_below_rs_set() -> None:
    with pytest.raises(ConfigError, match="FTKIT_RS_PARITY") as info:
        Config.load(env={"FTKIT_RS_SET": "6", "FTKIT_RS_PARITY": "6"})
    assert "5" in str(info.value)    # names the valid upper bound RS_SET-1
    assert Config.load(env={"FTKIT_RS_SET": "6", "FTKIT_RS_PARITY": "5"}).rs_parity == 5


def test_malformed_value_lists_valid_values() -> None:
    with pytest.raises(ConfigError) as info:
        Config.load(env={"FTKIT_LEVELS": "foo:1"})
    for name in ("local", "partner", "xor", "rs", "pfs"):
        assert name in str(info.value)
    with pytest.raises(ConfigError, match="0 or 1"):
        Config.load(env={"FTKIT_ASYNC": "maybe"})


def test_malformed_toml_value_names_the_key(tmp_path: Path) -> None:
    _toml(tmp_path / "ftkit.toml", '[ftkit]\ntimeout = "abc"\n')
    with pytest.raises(ConfigError, match="timeout"):
        Config.load(env={})


def test_malformed_kwarg_names_the_key() -> None:
    with pytest.raises(ConfigError, match="xor_set"):
        Config.load(env={}, xor_set="many")


@pytest.mark.parametrize(("raw", "want"), [
    ("1", True), ("true", True), ("YES", True), (" on ", True),
    ("0", False), ("false", False), ("No", False), ("off", False),
])
def test_async_spellings(raw: str, want: bool) -> None:
    assert Config.load(env={"FTKIT_ASYNC": raw}).async_ is want


def test_log_level_is_normalised() -> None:
    assert Config.load(env={"FTKIT_LOG_LEVEL": "debug"}).log_level == "DEBUG"


def test_valid_faults_accepted() -> None:
    spec = "kill:rank=3:step=7:phase=encode;corrupt:rank=1:step=9:level=local"
    assert Config.load(env={"FTKIT_FAULTS": spec}).faults == spec


# ----------------------------------------------------------------- levels
def test_parse_levels() -> None:
    assert parse_levels("local:1, partner:1 ,pfs:50") == (
        ("local", 1), ("partner", 1), ("pfs", 50))
    assert parse_levels("local") == (("local", 1),)
    assert parse_levels("rs:3,") == (("rs", 3),)


def test_levels_due() -> None:
    cfg = Config.load(env={"FTKIT_LEVELS": "local:1,partner:2,xor:3,pfs:50"})
    assert cfg.levels_due(1) == ("local",)
    assert cfg.levels_due(2) == ("local", "partner")
    assert cfg.levels_due(3) == ("local", "xor")
    assert cfg.levels_due(6) == ("local", "partner", "xor")
    assert cfg.levels_due(50) == ("local", "partner", "pfs")
    assert cfg.levels_due(150) == ("local", "partner", "xor", "pfs")
    assert cfg.levels_due(7) == ("local",)
    sparse = Config.load(env={"FTKIT_LEVELS": "local:5,pfs:10"})
    assert sparse.levels_due(4) == ()
    assert sparse.levels_due(5) == ("local",)
    assert sparse.levels_due(20) == ("local", "pfs")


@pytest.mark.parametrize("levels,needle", [
    ("xor:2", "needs the 'local' level"),
    ("partner:1", "needs the 'local' level"),
    ("local:2,partner:3", "must be a multiple of the interval of 'local'"),
    ("local:3,pfs:10", "must be a multiple of the interval of 'local'"),
])
def test_redundancy_schedule_must_follow_local(levels: str, needle: str) -> None:
    """Redundancy levels encode the node-local shard, so local is due whenever they are."""
    with pytest.raises(ConfigError, match=needle):
        Config.load(env={"FTKIT_LEVELS": levels})


def test_interval() -> None:
    cfg = Config.load(env={"FTKIT_LEVELS": "local:1,pfs:25"})
    assert cfg.interval("local") == 1
    assert cfg.interval("pfs") == 25
    assert cfg.interval("partner") == 0


# ------------------------------------------------------------ known bugs
def test_levels_sequence_is_validated() -> None:
    with pytest.raises(ConfigError, match="levels|LEVELS"):
        Config.load(env={}, levels=[("local", 0)])


def test_levels_sequence_unknown_name_is_rejected() -> None:
    with pytest.raises(ConfigError):
        Config.load(env={}, levels=[("floppy", 1)])


def test_toml_ftkit_not_a_table(tmp_path: Path) -> None:
    _toml(tmp_path / "ftkit.toml", "ftkit = 1\n")
    with pytest.raises(ConfigError, match="ftkit"):
        Config.load(env={})


def test_ftkit_config_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="missing.toml"):
        Config.load(env={"FTKIT_CONFIG": str(tmp_path / "missing.toml")})


# ------------------------------------------------- FTKIT_START and launcher-set keys
def test_start_defaults_to_resume() -> None:
    assert Config.load(env={}).start == "resume"
    assert Config().start == "resume"


@pytest.mark.parametrize("raw, want", [("fresh", "fresh"), ("resume", "resume"),
                                       ("Fresh", "fresh"), (" RESUME ", "resume")])
def test_start_from_env(raw: str, want: str) -> None:
    assert Config.load(env={"FTKIT_START": raw}).start == want


def test_start_from_toml_and_kwargs(tmp_path: Path) -> None:
    _toml(tmp_path / "ftkit.toml", '[ftkit]\nstart = "fresh"\n')
    assert Config.load(env={}).start == "fresh"
    assert Config.load(env={"FTKIT_START": "resume"}).start == "resume"    # env beats toml
    assert Config.load(env={}, start="resume").start == "resume"


@pytest.mark.parametrize("raw", ["restart", "", "1"])
def test_start_invalid_names_key_and_valid_values(raw: str) -> None:
    with pytest.raises(ConfigError, match="FTKIT_START") as info:
        Config.load(env={"FTKIT_START": raw})
    assert "resume" in str(info.value) and "fresh" in str(info.value)


@pytest.mark.parametrize("field, raw, want, bad, valid", [
    ("pfs_backpressure", None, "delay", "block", "delay, wait"),
    ("pfs_backpressure", "wait", "wait", "block", "delay, wait"),
    ("pfs_backpressure", " Delay ", "delay", "block", "delay, wait"),
    ("pfs_files", None, "rank", "node", "rank, shared"),
    ("pfs_files", "shared", "shared", "node", "rank, shared"),
    ("pfs_files", " Rank ", "rank", "node", "rank, shared"),
])
def test_mode_fields(field: str, raw: str | None, want: str, bad: str, valid: str) -> None:
    """FTKIT_PFS_BACKPRESSURE and FTKIT_PFS_FILES: a default, case and blanks ignored, and
    a value outside the modes named with the valid ones."""
    key = f"FTKIT_{field.upper()}"
    env = {} if raw is None else {key: raw}
    assert getattr(Config.load(env=env), field) == want
    with pytest.raises(ConfigError, match=f"{key}: '{bad}'; valid: {valid}"):
        Config.load(env={key: bad})


def test_fatal_dir_is_a_launcher_set_variable() -> None:
    """``ftkit run`` sets FTKIT_FATAL_DIR for the ranks; Config must not reject it."""
    env = {"FTKIT_FATAL_DIR": "/tmp/x/attempt-0.fatal", "FTKIT_DONE_FILE": "/x",
           "FTKIT_STOP_FILE": "/y"}
    assert Config.load(env=env) == Config()
