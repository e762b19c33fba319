"""The engine, private: the background loop that negotiates, fuses and runs every collective.

Rank 0 coordinates (:mod:`~hora.engine.coordinator`) and every rank executes the agreed responses
(:mod:`~hora.engine.execute`); where the two roles differ is written once (:mod:`~hora.engine.roles`), and so
are the names requests are matched by (:mod:`~hora.engine.names`). The baton lets the calling thread drive the
loop itself when it would otherwise only wait. Users and bindings reach it through :mod:`hora.core`, never
directly.
"""
