"""The run <-> rank contract: what ``ftkit run`` and its ranks tell each other through files
and the environment — the records of errors that would recur and of ranks that gave up
(:mod:`.fatal`), the identity of a run (:mod:`.identity`). Imports nothing above
``errors`` and ``fs``, so every layer may use it."""
