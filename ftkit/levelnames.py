"""The names of ftkit's storage levels, shared by the configuration (``FTKIT_LEVELS``) and
the fault injection (``FTKIT_FAULTS``'s ``level=``) without either importing the other."""
from __future__ import annotations

#: every level name, in the order levels are written
LEVEL_NAMES = ("local", "partner", "xor", "rs", "pfs")
#: Levels this build implements; the others are accepted by the parser but rejected at use.
IMPLEMENTED_LEVELS = ("local", "partner", "xor", "rs", "pfs")
#: levels that copy or encode the node-local shard onto other nodes
REDUNDANCY_LEVELS = ("partner", "xor", "rs")
