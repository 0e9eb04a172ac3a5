"""``ftkit run`` inside a Slurm allocation: ranks on healthy nodes, spares, exclusion, requeue.

The job's nodes are *slots* ``0..N-1`` (N = ranks / tasks per node); slot k is a Slurm node
and holds ranks ``k*T .. k*T+T-1`` (``FTKIT_RANKS_PER_NODE=T``, by-slot placement), so the
node-local directory ``$FTKIT_LOCAL_DIR/<Slurm node>/<job>/node-<k>`` follows the slot. The
remaining nodes of the allocation are spares. After a failed attempt the classifier
(:mod:`ftkit.slurm.health`) names failed nodes; each failed slot takes a spare (its ranks'
state is then rebuilt from the redundancy levels), and the next attempt is launched on the
new node list. With ``--shrink`` (:attr:`SlurmLauncher.shrink`: the rank count's multiple), a
failure that leaves too few spares does not requeue: the next attempt runs on fewer nodes
(the healthy slots in their order, then the spares left), as many as keep the rank count a
multiple of ``shrink``; the ranks restore the newest PFS step resharded to the smaller world
(node-local steps of the larger one do not fit it), and the nodes left over stay spares. The
slot map is kept in ``$FTKIT_PFS_DIR/<job>/slurm-slots.json`` so a
requeued job puts slots back on the nodes that still hold their data.

The relaunch loop itself is :func:`ftkit.launch.relaunch.run_job`, shared with plain mpiexec:
an attempt whose ranks recorded an error that would recur (:mod:`ftkit.jobdir.fatal`) ends the
run before :meth:`SlurmLauncher.after_failure` is asked, so no spare is taken and the job is
not requeued for it.

Ranks are started by the MPI's ``mpiexec`` with ``--host node:T,...`` (Open MPI's PRRTE
launches its per-node daemons with ``srun``, so every rank runs inside the allocation and sees
its node's ``SLURMD_NODENAME``). A direct ``srun`` of the ranks needs a Slurm built with the
MPI's PMIx, which this launcher does not assume.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from ftkit.errors import LaunchError
from ftkit.fs import write_text_atomic
from ftkit.jobdir import paths
from ftkit.jobdir.env import SPARES_ENV
from ftkit.jobdir.events import read_events
from ftkit.launch.base import Launcher, Recovery, Request
from ftkit.launch.mpiexec import ULFM_ARGS, MpiexecLauncher, build_command, launch_env
from ftkit.slurm.env import SlurmEnv, compress_hostlist
from ftkit.slurm.health import SlurmTools

log = logging.getLogger(__name__)


class SlurmLauncher(Launcher):
    """Launches attempts on the allocation's healthy nodes; see the module docstring."""

    name = "srun"
    recovers = True

    @staticmethod
    def detect(request: Request) -> bool:
        """``--launcher auto`` picks Slurm inside an allocation unless ``--mpiexec`` names
        an mpiexec."""
        return ("SLURM_JOB_ID" in request.env or "SLURM_JOBID" in request.env) \
            and not request.mpiexec

    @classmethod
    def build(cls, request: Request) -> SlurmLauncher:
        """The registry's builder; LaunchError outside an allocation or without the run's
        spec and configuration."""
        mpi = MpiexecLauncher.detect(request.mpiexec, request.env, request.extra)
        senv = SlurmEnv.from_environ(request.env)
        if senv is None or not senv.nodes:
            raise LaunchError("--launcher srun: not inside a Slurm allocation "
                              "(no SLURM_JOB_ID / SLURM_JOB_NODELIST)")
        spec, cfg = request.spec, request.cfg
        if spec is None or cfg is None:
            raise LaunchError("the Slurm launcher needs the run's spec and configuration")
        return cls(mpi, senv, spec.n, spec.spares, cfg.job_pfs_dir / paths.SLURM_SLOTS,
                   shrink=spec.shrink, in_job=spec.in_job)

    def __init__(self, mpi: MpiexecLauncher, senv: SlurmEnv, n: int, spares: int,
                 state_file: Path, tools: SlurmTools | None = None, shrink: int = 0,
                 in_job: bool = False) -> None:
        self.mpi, self.senv, self.n, self.shrink = mpi, senv, n, shrink
        if in_job:
            mpi.in_job(0)                    # validates: LaunchError unless Open MPI (ULFM)
        self.in_job = in_job
        self.tools = tools or SlurmTools(senv.job_id)
        self.state_file = state_file
        nodes = list(senv.nodes)
        if len(nodes) <= spares:
            raise LaunchError(f"--spares {spares}: the allocation has only {len(nodes)} "
                              f"node(s) ({compress_hostlist(nodes)})")
        self.slots_needed = len(nodes) - spares
        if n % self.slots_needed:
            raise LaunchError(f"-n {n} ranks do not divide evenly over {self.slots_needed} "
                              f"nodes ({len(nodes)} allocated, {spares} kept as spares)")
        self.per_node = n // self.slots_needed
        self.failed: dict[str, str] = {}
        self.launched: list[str] = []
        self.slots = self._initial_slots(nodes)
        self._save()

    # ------------------------------------------------------------- Launcher API
    def command(self, n: int, cmd: Sequence[str]) -> list[str]:
        """``mpiexec --host slot:T,... --map-by slot``; in-job, the healthy spare nodes'
        slots too (their ranks are the spare ranks) and ULFM on."""
        nodes = self.slots + (self.spares() if self.in_job else [])
        self.launched = nodes                   # process p runs on nodes[p // per_node]
        hosts = ",".join(f"{node}:{self.per_node}" for node in nodes)
        return build_command(n + self.spare_ranks(), cmd, self.mpi.flavor, self.mpi.path,
                             ("--host", hosts, "--map-by", "slot",
                              *(ULFM_ARGS if self.in_job else ())), user=self.mpi.extra)

    def spare_ranks(self) -> int:
        """In-job: a spare rank per slot of every healthy spare node; else 0."""
        return len(self.spares()) * self.per_node if self.in_job else 0

    def environ(self, base: Mapping[str, str]) -> dict[str, str]:
        env = launch_env(base, self.mpi.flavor)
        env.setdefault("PMIX_SECURITY_MODE", "native")
        env["FTKIT_RANKS_PER_NODE"] = str(self.per_node)
        if self.in_job:
            env[SPARES_ENV] = str(self.spare_ranks())
        return env

    def describe(self) -> dict[str, object]:
        return {"slots": list(self.slots), "spare_nodes": self.spares(),
                "failed_nodes": dict(self.failed)}

    # ---------------------------------------------------------------- recovery
    def spares(self) -> list[str]:
        return [n for n in self.senv.nodes if n not in self.slots and n not in self.failed]

    def after_failure(self) -> Recovery:
        """Find failed nodes of the current slots, swap in spares, or ask for a requeue.
        In-job, the slots first follow the nodes that moved to spare nodes during the
        attempt (:meth:`follow_in_job`)."""
        self.follow_in_job()
        failed = self.tools.failed_nodes(self.slots)
        self.failed.update(failed)
        spares = self.spares()
        if len(spares) < len(failed):
            short = (f"out of spare nodes: {compress_hostlist(failed)} failed and "
                     f"{len(spares)} healthy spare(s) left in "
                     f"{compress_hostlist(self.senv.nodes)}")
            shrunk = self._shrink(failed, spares, short) if self.shrink else None
            self._save()
            return shrunk or Recovery("requeue", failed, {}, short)
        replaced = {node: spares.pop(0) for node in self.slots if node in failed}
        self.slots = [replaced.get(node, node) for node in self.slots]
        self._save()
        what = (f"excluding {compress_hostlist(failed)}, spares in: "
                + ", ".join(f"{a}->{b}" for a, b in replaced.items())) if failed \
            else "no node failed (software failure): same nodes"
        return Recovery("relaunch", failed, replaced, what)

    def follow_in_job(self) -> dict[int, str]:
        """Slot k -> the node its ranks run on after the in-job recoveries of the last
        attempt (``in-job`` events after its ``launch`` event: a logical rank taken by
        process p runs on ``launched[p // per_node]``); the slots are updated and saved.
        Returns the slots that moved."""
        if not self.in_job or not self.launched:
            return {}
        recoveries: list[dict[str, object]] = []
        for event in read_events(self.state_file.parent / paths.EVENTS):
            if event.get("event") == "launch":
                recoveries = []
            elif event.get("event") == "in-job":
                recoveries.append(event)
        moved: dict[int, str] = {}
        for event in recoveries:
            replaced = event.get("replaced")
            for rank, process in (replaced.items() if isinstance(replaced, dict) else ()):
                slot, at = int(rank) // self.per_node, int(process) // self.per_node
                if 0 <= slot < len(self.slots) and 0 <= at < len(self.launched):
                    moved[slot] = self.launched[at]
        moved = {k: node for k, node in moved.items() if self.slots[k] != node}
        if moved:
            self.slots = [moved.get(k, node) for k, node in enumerate(self.slots)]
            self._save()
        return moved

    def requeue(self) -> tuple[bool, str]:
        return self.tools.requeue()

    # --------------------------------------------------------------- internals
    def _shrink(self, failed: dict[str, str], spares: list[str], short: str
                ) -> Recovery | None:
        """Fewer slots: the healthy ones, then ``spares``, as many as keep the rank count a
        multiple of :attr:`shrink`; None when not even one slot does."""
        pool = [node for node in self.slots if node not in self.failed] + spares
        count = max((k for k in range(1, len(pool) + 1)
                     if (k * self.per_node) % self.shrink == 0), default=0)
        if not count:
            return None
        before, self.slots = self.n, pool[:count]
        self.n = count * self.per_node
        left = pool[count:]
        return Recovery("shrink", failed, {}, (
            f"{short}; --shrink: {before} -> {self.n} ranks on {compress_hostlist(self.slots)}"
            + (f" ({compress_hostlist(left)} kept as spare)" if left else "")
            + ", resuming from the newest PFS step resharded"), n=self.n)

    def _initial_slots(self, nodes: list[str]) -> list[str]:
        """Slots from a previous run of this job (requeue) where those nodes are still in
        the allocation, the other slots from the remaining nodes in allocation order."""
        previous: list[str] = []
        try:
            previous = list(json.loads(self.state_file.read_text())["slots"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if len(previous) != self.slots_needed:
            previous = []
        slots: list[str | None] = [p if p in nodes else None for p in previous] \
            or [None] * self.slots_needed
        free = [n for n in nodes if n not in slots]
        return [s if s is not None else free.pop(0) for s in slots]

    def _save(self) -> None:
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.state_file, json.dumps(
            {"slots": self.slots, "failed": self.failed, "per_node": self.per_node}, indent=1))
