"""``horovod.common``: hora's errors and process sets under Horovod's module names."""
