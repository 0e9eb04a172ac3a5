"""The levels of one rank, built from the configuration (a collective: communicators)."""
from __future__ import annotations

import dataclasses

from ftkit.comm.dist import DistComm
from ftkit.comm.placement import set_of
from ftkit.comm.topology import Topology
from ftkit.config import Config
from ftkit.faults import Faults
from ftkit.storage.level import Level
from ftkit.storage.local import LocalLevel
from ftkit.storage.redundancy.erasure import ErasureLevel
from ftkit.storage.redundancy.partner import PartnerLevel


@dataclasses.dataclass
class Levels:
    local: LocalLevel
    partner: PartnerLevel | None
    erasure: dict[str, ErasureLevel]
    sets: dict[str, list[list[int]]]
    parity: dict[str, int]
    partners: list[int] | None

    @classmethod
    def build(cls, topo: Topology, config: Config, dc: DistComm, local: LocalLevel,
              faults: Faults) -> Levels:
        """Create the configured levels. All ranks call (communicators are split here);
        an impossible placement raises the same ConfigError on every rank."""
        names = dict(config.levels)
        partners = topo.partner_map() if "partner" in names else None
        sets, parity, erasure = {}, {}, {}
        for name, size, p in (("xor", config.xor_set, 1),
                              ("rs", config.rs_set, config.rs_parity)):
            if name in names:
                sets[name] = topo.erasure_sets(size, minimum=p + 1, what=name)
                parity[name] = p
        partner = PartnerLevel(local, DistComm(dc.comm, dc.timeout), partners, faults) \
            if partners is not None else None
        for name, members in sets.items():
            sid, idx = set_of(members, topo.rank)
            erasure[name] = ErasureLevel(name, local, dc.split(sid, idx), sid, members[sid],
                                         parity[name], faults)
        return cls(local, partner, erasure, sets, parity, partners)

    def free(self) -> None:
        """Release the communicators the levels own and unmap the local level's slots
        (local call)."""
        self.local.close()
        if self.partner is not None:
            self.partner.close()
            self.partner.dc.free()
        for level in self.erasure.values():
            level.close()
            level.sdc.free()

    def by_name(self) -> dict[str, Level]:
        out: dict[str, Level] = {"local": self.local}
        if self.partner is not None:
            out["partner"] = self.partner
        out.update(self.erasure)
        return out

    def redundancy(self, names: list[str] | tuple[str, ...]) -> list[Level]:
        """Redundancy level objects among ``names``, in encode order."""
        table = self.by_name()
        return [table[n] for n in ("partner", "xor", "rs") if n in names and n in table]
