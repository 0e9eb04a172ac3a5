"""Frozen run configuration.

Precedence (lowest to highest): built-in defaults < ``ftkit.toml`` (``[ftkit]`` table) <
``FTKIT_*`` environment variables < keyword arguments of :meth:`Config.load`.
"""
from __future__ import annotations

import dataclasses
import getpass
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftkit import levelnames
from ftkit.errors import ConfigError
from ftkit.faults import parse_faults
from ftkit.jobdir import paths
from ftkit.jobdir.fatal import env_rank, recorded

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: ``FTKIT_START``: ``resume`` continues from the newest committed step; ``fresh`` starts
#: over (what happens to existing steps is the Checkpointer's business).
START_MODES = ("resume", "fresh")
#: FTKIT_PFS_BACKPRESSURE: what a step due at ``pfs`` does while the previous flush runs
#: (``ftkit.flushes.Flushes.schedule``): ``delay`` it (training never waits; a newer due step
#: skips a delayed one) or ``wait`` for the previous flush (every due step is flushed).
BACKPRESSURE_MODES = ("delay", "wait")
#: ``FTKIT_PFS_FILES``: how a PFS step is laid out in files: ``rank`` (every rank writes its
#: own ``rank-<r>.h5``, the default) or ``shared`` (one ``ranks.h5``: rank 0 creates every
#: rank's datasets, each rank writes its own bytes into it: ``ftkit.storage.pfs.h5shared``)
PFS_FILES_MODES = ("rank", "shared")
#: ``FTKIT_SHARE_REPLICAS``: whether the data-parallel replicas of a shard share one
#: node-local snapshot, each keeping 2/D of the tensors they hold alike
#: (:mod:`ftkit.storage.replicas`); ``off`` (every rank keeps its whole shard) until the
#: restore reads shared shards
SHARE_MODES = ("off", "on")
#: ``FTKIT_TIMEOUT`` bounds, seconds: below 1 s a busy node misses control messages; past
#: 7 days a stuck phase is never noticed (and a bogus ``inf`` or ``1e-9`` is a typo).
MIN_TIMEOUT, MAX_TIMEOUT = 1.0, 7 * 86400.0
#: Largest Reed-Solomon set: data plus parity members index a GF(256) Cauchy matrix.
MAX_RS_SET = 256


def _default_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def parse_levels(text: str) -> tuple[tuple[str, int], ...]:
    """Parse ``"local:1,partner:1,pfs:50"`` into ``(("local", 1), ...)``."""
    out: list[tuple[str, int]] = []
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        name, sep, every = item.partition(":")
        if name not in levelnames.names():
            raise ConfigError(f"FTKIT_LEVELS: unknown level {name!r} in {text!r}; "
                              f"valid levels: {', '.join(levelnames.names())}")
        try:
            interval = int(every) if sep else 1
        except ValueError:
            raise ConfigError(f"FTKIT_LEVELS: interval of {name!r} must be a positive integer, "
                              f"got {every!r} in {text!r}") from None
        if interval < 1:
            raise ConfigError(f"FTKIT_LEVELS: interval of {name!r} must be >= 1, got {interval}")
        if any(n == name for n, _ in out):
            raise ConfigError(f"FTKIT_LEVELS: level {name!r} given twice in {text!r}")
        out.append((name, interval))
    if not out:
        raise ConfigError(f"FTKIT_LEVELS: no level given in {text!r}; "
                          f"format is level:every[,level:every...]")
    return tuple(out)


DEFAULT_LEVELS = (("local", 1), ("partner", 1), ("pfs", 50))
DEFAULT_JOB = "local"       # the job of a direct launch (mpiexec/srun) that names none


@dataclasses.dataclass(frozen=True)
class Config:
    """Immutable ftkit settings; see the Configuration section of docs/guide.md for the meaning of every field."""

    job: str = ""                    # "" = DEFAULT_JOB (ftkit run makes a new id instead)
    local_dir: str = ""
    pfs_dir: str = "./ftkit-ckpt"
    levels: tuple[tuple[str, int], ...] = ()    # () = DEFAULT_LEVELS, see fit_to_nodes
    xor_set: int = 4
    rs_set: int = 4
    rs_parity: int = 2
    pfs_keep: int = 2                # committed PFS steps kept (older ones removed)
    pfs_backpressure: str = "delay"  # a flush still running: delay the next, or wait
    pfs_files: str = "rank"          # a file per rank, or one shared file of all ranks
    share_replicas: str = "off"      # DP replicas share one node-local snapshot
    ranks_per_node: int = 0          # 0 = detect real nodes
    async_: bool = True
    timeout: float = 120.0
    heartbeat: float = 30.0          # in-job: a process silent this long is ended; 0 = off
    faults: str = ""
    attempt: int = 0
    log_level: str = "WARNING"
    start: str = "resume"
    #: the fields among ``job`` and ``levels`` that nobody gave (neither FTKIT_*, Slurm,
    #: ftkit.toml nor an argument): ftkit chose them (:meth:`fit_to_nodes`, ``ftkit run``)
    defaulted: frozenset[str] = dataclasses.field(default=frozenset(), init=False,
                                                  compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "defaulted", frozenset(
            name for name, unset in (("job", not self.job), ("levels", not self.levels))
            if unset))
        if not self.local_dir:
            object.__setattr__(self, "local_dir", f"/dev/shm/ftkit-{_default_user()}")
        object.__setattr__(self, "job", self.job or DEFAULT_JOB)
        if "/" in self.job or self.job in (".", ".."):
            raise ConfigError(f"FTKIT_JOB: {self.job!r} is not a valid directory name")
        for key in ("xor_set", "rs_set"):
            if getattr(self, key) < 2:
                raise ConfigError(f"FTKIT_{key.upper()}: must be >= 2, got {getattr(self, key)}")
        if self.rs_set > MAX_RS_SET:
            raise ConfigError(f"FTKIT_RS_SET: must be <= {MAX_RS_SET} (Reed-Solomon over "
                              f"GF(256)), got {self.rs_set}")
        if not 1 <= self.rs_parity < self.rs_set:
            raise ConfigError(f"FTKIT_RS_PARITY: must be in [1, FTKIT_RS_SET-1="
                              f"{self.rs_set - 1}], got {self.rs_parity}")
        if self.pfs_keep < 1:
            raise ConfigError(f"FTKIT_PFS_KEEP: must be >= 1 (committed PFS steps kept), "
                              f"got {self.pfs_keep}")
        if self.ranks_per_node < 0:
            raise ConfigError(f"FTKIT_RANKS_PER_NODE: must be >= 1, got {self.ranks_per_node}")
        if not MIN_TIMEOUT <= self.timeout <= MAX_TIMEOUT:      # False for nan too
            raise ConfigError(f"FTKIT_TIMEOUT: must be a number of seconds in "
                              f"[{MIN_TIMEOUT:g}, {MAX_TIMEOUT:g}] (1 s to 7 days), "
                              f"got {self.timeout}")
        if not (self.heartbeat == 0 or MIN_TIMEOUT <= self.heartbeat <= MAX_TIMEOUT):
            raise ConfigError(f"FTKIT_HEARTBEAT: must be 0 (off) or a number of seconds in "
                              f"[{MIN_TIMEOUT:g}, {MAX_TIMEOUT:g}], got {self.heartbeat}")
        if self.attempt < 0:
            raise ConfigError(f"FTKIT_ATTEMPT: must be >= 0, got {self.attempt}")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ConfigError(f"FTKIT_LOG_LEVEL: {self.log_level!r}; valid: {', '.join(LOG_LEVELS)}")
        object.__setattr__(self, "log_level", self.log_level.upper())
        for field, modes in (("start", START_MODES), ("pfs_backpressure", BACKPRESSURE_MODES),
                             ("pfs_files", PFS_FILES_MODES), ("share_replicas", SHARE_MODES)):
            object.__setattr__(self, field, _one_of(getattr(self, field), modes, field))
        text = ",".join(f"{name}:{every}" for name, every in self.levels or DEFAULT_LEVELS)
        object.__setattr__(self, "levels", parse_levels(text))
        self._check_schedule()
        if self.faults:
            parse_faults(self.faults)   # validate early; raises ConfigError

    def _check_schedule(self) -> None:
        """Redundancy levels encode the node-local shard: local must be due whenever they are."""
        every = dict(self.levels)
        for name in (*levelnames.redundancy(), levelnames.PFS):
            if name not in every:
                continue
            if "local" not in every:
                raise ConfigError(f"FTKIT_LEVELS: level {name!r} needs the 'local' level "
                                  f"(e.g. local:1,{name}:{every[name]})")
            if every[name] % every["local"]:
                raise ConfigError(f"FTKIT_LEVELS: interval of {name!r} ({every[name]}) must be "
                                  f"a multiple of the interval of 'local' ({every['local']})")

    def fit_to_nodes(self, nodes: int) -> tuple[Config, str | None]:
        """This Config for a job on ``nodes`` nodes, and a warning when it had to change.

        A redundancy level of the *default* levels that cannot be placed (a partner copy needs
        a second node) is dropped; levels the user asked for are kept (and refused later, with
        a clear error, when they cannot be placed). Pure.
        """
        if "levels" not in self.defaulted or nodes >= 2 or "partner" not in dict(self.levels):
            return self, None
        kept = tuple((name, every) for name, every in self.levels if name != "partner")
        text = ",".join(f"{name}:{every}" for name, every in kept)
        return dataclasses.replace(self, levels=kept), (
            f"FTKIT_LEVELS is not set and every rank runs on one node: the default 'partner' "
            f"level (a copy on another node) is left out, levels are {text}. Set FTKIT_LEVELS "
            f"to choose them (FTKIT_RANKS_PER_NODE makes virtual nodes for a test)")

    # ----------------------------------------------------------------- derived
    def interval(self, level: str) -> int:
        """Interval of ``level`` or 0 when the level is not configured."""
        return dict(self.levels).get(level, 0)

    def levels_all(self) -> tuple[str, ...]:
        """Every configured level, in the order they are written."""
        names = {name for name, _ in self.levels}
        return tuple(name for name in levelnames.names() if name in names)

    def levels_due(self, step: int) -> tuple[str, ...]:
        """Levels whose interval divides ``step``, in the order they are written."""
        due = {name for name, every in self.levels if step % every == 0}
        return tuple(name for name in levelnames.names() if name in due)

    @property
    def job_local_dir(self) -> Path:
        return Path(self.local_dir) / self.job

    def node_dir(self, node: int, host: str | None = None) -> Path:
        """Node-local directory of (virtual) node ``node``. Under Slurm ``host`` is the Slurm
        node name (``SLURMD_NODENAME``): each Slurm node keeps its own tree, so several
        slurmd's on one machine behave like separate machines."""
        base = Path(self.local_dir) / host if host else Path(self.local_dir)
        return base / self.job / f"node-{node}"

    @property
    def job_pfs_dir(self) -> Path:
        return Path(self.pfs_dir) / self.job

    @property
    def events_path(self) -> Path:
        return self.job_pfs_dir / paths.EVENTS

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, toml_path: str | os.PathLike[str] | None = None,
             env: Mapping[str, str] | None = None, **overrides: Any) -> Config:
        """Build a Config from defaults, ``ftkit.toml``, ``FTKIT_*`` variables and overrides.

        ``toml_path`` defaults to ``$FTKIT_CONFIG`` or ``./ftkit.toml`` when that exists.
        A :class:`ConfigError` is also recorded for ``ftkit run`` (``$FTKIT_FATAL_DIR``, see
        :mod:`ftkit.jobdir.fatal`): a relaunch would fail the same way.
        """
        env = os.environ if env is None else env
        with recorded(lambda: env_rank(env), ConfigError, env=env):
            return cls._load(toml_path, env, overrides)

    @classmethod
    def _load(cls, toml_path: str | os.PathLike[str] | None, env: Mapping[str, str],
              overrides: Mapping[str, Any]) -> Config:
        values: dict[str, Any] = {}
        if "SLURM_JOB_ID" in env:
            values["job"] = env["SLURM_JOB_ID"]
        path = Path(toml_path) if toml_path else Path(env.get("FTKIT_CONFIG", "ftkit.toml"))
        if path.is_file():
            values.update(_from_toml(path))
        elif toml_path is not None or "FTKIT_CONFIG" in env:
            raise ConfigError(f"config file {path} does not exist")
        values.update(_from_env(env))
        for key, raw in overrides.items():
            field = _KWARG_ALIASES.get(key, key)
            if field not in _FIELDS:
                raise ConfigError(f"Config.load: unknown option {key!r}; valid: "
                                  f"{', '.join(sorted(_FIELDS))}")
            values[field] = _coerce(field, raw, f"Config.load({key}=...)")
        return cls(**values)


def _one_of(raw: str, modes: tuple[str, ...], field: str) -> str:
    """``raw`` as one of ``modes`` (case and surrounding blanks ignored); ConfigError naming
    the variable and the valid values else."""
    value = raw.strip().lower()
    if value not in modes:
        raise ConfigError(f"FTKIT_{field.upper()}: {raw!r}; valid: {', '.join(modes)}")
    return value


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}
_KWARG_ALIASES = {"async": "async_"}
# environment / toml key -> field name
_KEYS = {
    "JOB": "job", "LOCAL_DIR": "local_dir", "PFS_DIR": "pfs_dir", "LEVELS": "levels",
    "XOR_SET": "xor_set", "RS_SET": "rs_set", "RS_PARITY": "rs_parity", "PFS_KEEP": "pfs_keep",
    "RANKS_PER_NODE": "ranks_per_node", "ASYNC": "async_", "TIMEOUT": "timeout",
    "HEARTBEAT": "heartbeat",
    "FAULTS": "faults", "ATTEMPT": "attempt", "LOG_LEVEL": "log_level", "START": "start",
    "PFS_BACKPRESSURE": "pfs_backpressure", "PFS_FILES": "pfs_files",
    "SHARE_REPLICAS": "share_replicas",
}
#: FTKIT_* variables that are not configuration but are set by ftkit itself.
_RESERVED_ENV = {"FTKIT_CONFIG", "FTKIT_DONE_FILE", "FTKIT_FATAL_DIR", "FTKIT_ROOT",
                 "FTKIT_STOP_FILE", "FTKIT_LAUNCH_ID", "FTKIT_TIDY_LOCAL", "FTKIT_SPARE_RANKS"}


def _coerce(field: str, raw: Any, where: str) -> Any:
    kind = _FIELDS[field].type
    try:
        if field == "levels":
            return parse_levels(raw) if isinstance(raw, str) else tuple(
                (str(n), int(e)) for n, e in raw)
        if field == "async_":
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind in ("int", int, "float", float):
            return _number(raw, float if kind in ("float", float) else int)
        return str(raw)
    except ConfigError:
        raise
    except (TypeError, ValueError):
        valid = {"async_": "0 or 1", "levels": "level:every[,level:every...]"}.get(
            field, "an integer" if kind in ("int", int) else "a number")
        raise ConfigError(f"{where}: malformed value {raw!r}; expected {valid}") from None


def _number(raw: Any, kind: type[int | float]) -> int | float:
    """``raw`` as ``kind``: a string is parsed; a TOML boolean, or a fraction for an integer
    key, is refused (ValueError) instead of being truncated to ``1`` or ``2``."""
    if isinstance(raw, bool) or (kind is int and isinstance(raw, float)):
        raise ValueError(raw)
    return kind(raw)


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, raw in env.items():
        if not key.startswith("FTKIT_") or key in _RESERVED_ENV:
            continue
        short = key[len("FTKIT_"):]
        if short not in _KEYS:
            raise ConfigError(f"unknown environment variable {key}; valid: "
                              + ", ".join(f"FTKIT_{k}" for k in _KEYS))
        out[_KEYS[short]] = _coerce(_KEYS[short], raw, key)
    return out


def _from_toml(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    table = data.get("ftkit", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: 'ftkit' must be a table ([ftkit]), got {table!r}")
    out: dict[str, Any] = {}
    for key, raw in table.items():
        short = key.upper()
        if short not in _KEYS:
            raise ConfigError(f"{path}: unknown key {key!r} in [ftkit]; valid: "
                              + ", ".join(k.lower() for k in _KEYS))
        out[_KEYS[short]] = _coerce(_KEYS[short], raw, f"{path}: {key}")
    return out
