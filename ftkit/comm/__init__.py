"""MPI communicator layer: exception-robust collectives (:mod:`.dist`: ``DistComm``), the
DP/TP/PP groups and nodes (:mod:`.topology`: ``Topology``), partner and erasure placement
(:mod:`.placement`) and the process-wide failure flag every wait consults (:mod:`.flag`).
Nothing is imported here: :mod:`.flag` is usable without mpi4py."""
