"""``hora run``'s elastic driver (:mod:`hora.runner.elastic.driver`, whose docstring holds the protocol)."""

from hora.runner.elastic.launch import is_elastic, run_elastic

__all__ = ["is_elastic", "run_elastic"]
