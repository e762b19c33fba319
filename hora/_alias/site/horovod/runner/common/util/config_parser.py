"""``horovod.runner.common.util.config_parser``: the names of Horovod's settings variables; hora reads a
``--config-file`` with hora.runner.config_file."""

from horovod import _shim

LOG_LEVELS = ["TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"]
NCCL_IB_DISABLE = "NCCL_IB_DISABLE"
for _name in ("FUSION_THRESHOLD CYCLE_TIME CACHE_CAPACITY HIERARCHICAL_ALLREDUCE HIERARCHICAL_ALLGATHER "
              "TORUS_ALLREDUCE AUTOTUNE AUTOTUNE_LOG AUTOTUNE_WARMUP_SAMPLES AUTOTUNE_STEPS_PER_SAMPLE "
              "AUTOTUNE_BAYES_OPT_MAX_SAMPLES AUTOTUNE_GAUSSIAN_PROCESS_NOISE TIMELINE TIMELINE_MARK_CYCLES "
              "STALL_CHECK_DISABLE STALL_CHECK_TIME_SECONDS STALL_SHUTDOWN_TIME_SECONDS MPI_THREADS_DISABLE "
              "NUM_NCCL_STREAMS THREAD_AFFINITY GLOO_TIMEOUT_SECONDS LOG_LEVEL LOG_HIDE_TIME").split():
    globals()["HOROVOD_" + _name] = "HOROVOD_" + _name  # hora reads each of these as its HORA_ knob's alias

_shim.fill(globals(), {
    "set_args_from_config set_env_from_args validate_config_args":
        "hora reads --config-file with hora.runner.config_file.load and exports settings with "
        "hora.runner.flags.env_for; Horovod's argparse-based helpers are not exported",
})
