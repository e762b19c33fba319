"""The public core API, on NumPy: the session (:mod:`~hora.core.session`: the current initialisation's state,
and the elastic rendezvous that outlives it), init and the topology (:mod:`~hora.core.basics`), the collectives
(:mod:`~hora.core.ops`, with their input checks, refusals and object records), process sets, build facts, and
worker-side launch (:mod:`~hora.core.launchers` reads the launcher's environment; :mod:`~hora.core.run_task`
is what ``hora.run()``'s workers execute). It stands on the private engine (:mod:`hora.engine`); ``hora``'s
top-level names, :mod:`hora.elastic`, the binding kit and the bindings stand on it.
"""
