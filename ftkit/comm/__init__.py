"""MPI communicator layer: exception-robust collectives (DistComm) and Topology."""
from ftkit.comm.dist import DistComm, install_abort_hooks
from ftkit.comm.topology import Topology

__all__ = ["DistComm", "Topology", "install_abort_hooks"]
