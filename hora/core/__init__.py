"""The public core API, on NumPy: session state and init (:mod:`~hora.core.basics`), the collectives
(:mod:`~hora.core.ops`), process sets, build facts, and worker-side launch (:mod:`~hora.core.launchers` reads
the launcher's environment; :mod:`~hora.core.run_task` is what ``hora run``'s workers execute). It stands on
the private engine (:mod:`hora.engine`); ``hora``'s top-level names and the bindings stand on it.
"""
