"""The ground every layer may import: errors, the knob table, environment parsing.

Imports only the standard library and NumPy, so transport, collectives, the engine, the bindings and the
launcher all stand on it without importing upward.
"""
