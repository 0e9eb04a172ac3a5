"""What a redundancy level is built from (the registry's builders take a :class:`Site`)."""
from __future__ import annotations

import dataclasses

from ftkit.comm.dist import DistComm
from ftkit.comm.topology import Topology
from ftkit.config import Config
from ftkit.faults import Faults
from ftkit.storage.local import LocalLevel


@dataclasses.dataclass(frozen=True)
class Site:
    """What a redundancy level is built from (:mod:`ftkit.storage.registry`): the job's
    topology and configuration, the job's communicator (a level splits or duplicates its
    own), this rank's local level and the fault injection."""

    topo: Topology
    config: Config
    dc: DistComm
    local: LocalLevel
    faults: Faults
