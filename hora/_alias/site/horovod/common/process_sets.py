from hora.core.process_sets import (ProcessSet, add_process_set, global_process_set,  # noqa: F401
                                      remove_process_set)
