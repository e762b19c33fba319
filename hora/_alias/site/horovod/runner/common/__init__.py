"""``horovod.runner.common``: Horovod's launcher helpers, as far as hora has them (``util``)."""
