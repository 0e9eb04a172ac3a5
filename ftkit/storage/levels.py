"""The levels of one rank, built from the configuration (a collective: communicators)."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ftkit import levelnames
from ftkit.comm.dist import DistComm
from ftkit.comm.topology import Topology
from ftkit.config import Config
from ftkit.errors import ConfigError
from ftkit.faults import Faults
from ftkit.storage import registry
from ftkit.storage.level import Cover, Level, Redundancy
from ftkit.storage.local import LocalLevel
from ftkit.storage.site import Site


@dataclasses.dataclass
class Levels:
    local: LocalLevel
    #: the configured redundancy levels by name, in encode order
    redundant: dict[str, Redundancy]

    @classmethod
    def build(cls, topo: Topology, config: Config, dc: DistComm, local: LocalLevel,
              faults: Faults) -> Levels:
        """Create the configured levels. All ranks call (communicators are split here);
        an impossible placement raises the same ConfigError on every rank."""
        site = Site(topo, config, dc, local, faults)
        configured = dict(config.levels)
        redundant: dict[str, Redundancy] = {}
        for name in (n for n in levelnames.redundancy() if n in configured):
            try:
                build = registry.builder(name)
            except KeyError as exc:
                raise ConfigError(f"FTKIT_LEVELS: {exc.args[0]}") from None
            redundant[name] = build(site)
        return cls(local, redundant)

    def free(self) -> None:
        """Release the communicators the levels own and unmap the local level's slots
        (local call)."""
        self.local.close()
        for level in self.redundant.values():
            level.free()

    def by_name(self) -> dict[str, Level]:
        return {"local": self.local, **self.redundant}

    def redundancy(self, names: Sequence[str]) -> list[Redundancy]:
        """Redundancy level objects among ``names``, in encode order."""
        return [level for name, level in self.redundant.items() if name in names]

    def covers(self) -> list[Cover]:
        """Every configured redundancy level's cover, in encode order."""
        return [level.cover for level in self.redundant.values()]
