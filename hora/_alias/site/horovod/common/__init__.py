"""``horovod.common``: hora's errors, process sets and helpers under Horovod's module names."""
