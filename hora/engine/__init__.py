"""The engine, private: the background loop that negotiates, fuses and runs every collective.

Rank 0's coordinator agrees on what runs next (:mod:`~hora.engine.coordinator`), every rank executes the
agreed responses (:mod:`~hora.engine.execute`), and the baton lets the calling thread drive the loop itself
when it would otherwise only wait. Users and bindings reach it through :mod:`hora.core`, never directly.
"""
