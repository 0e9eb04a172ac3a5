"""Launching jobs: ``mpiexec`` command building (:mod:`.mpiexec`, pure), the ``ftkit run``
relaunch loop (:mod:`.relaunch`), which job a run runs (:mod:`.jobs`), what an attempt came to
(:mod:`.failures`, :mod:`.outcome`), the completion marker (:mod:`.marker`) and the guards
that keep a job from outliving its ``ftkit run`` (:mod:`.orphans`, :mod:`.childguard`).
Nothing is imported here: ``import ftkit`` never loads the launcher."""
