"""``hora run``'s elastic driver (:mod:`hora.runner.elastic.driver`, whose docstring holds the protocol)."""

from hora.runner.elastic.launch import elastic_results, is_elastic, run_elastic

__all__ = ["elastic_results", "is_elastic", "run_elastic"]
