"""Environment variables by which ``ftkit run`` tells its ranks about the job (the run <->
rank contract; the ``FTKIT_*`` settings of :class:`ftkit.config.Config` are read there)."""

#: how many of the world's ranks are spares (``ftkit run --in-job --spares K``)
SPARES_ENV = "FTKIT_SPARE_RANKS"
