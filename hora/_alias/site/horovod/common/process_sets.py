from hora.core.sets import add_process_set, remove_process_set  # noqa: F401
from hora.core.process_sets import ProcessSet, global_process_set  # noqa: F401
