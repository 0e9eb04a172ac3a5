"""The run <-> rank contract: what ``ftkit run`` and its ranks tell each other through files
and the environment — the names of a job's files (:mod:`.paths`), its event log
(:mod:`.events`), its locks (:mod:`.lock`), the records of errors that would recur and of
ranks that gave up (:mod:`.fatal`), the identity of a run (:mod:`.identity`), the
environment (:mod:`.env`) and parent-death signals (:mod:`.deathsig`). Imports nothing above
``errors`` and ``fs``, so every layer may use it."""
