"""``horovod.runner.launch``: horovodrun's entry point and command-line parser, answered by hora's launcher."""

from __future__ import annotations

import argparse
import sys

from hora.runner.launch import run_commandline  # noqa: F401
from horovod import _shim
from horovod.common.util import ccl_built, ddl_built, extension_available, gloo_built, mpi_built, nccl_built  # noqa: F401
from horovod.runner.common.util import config_parser, hosts, safe_shell_exec, secret, timeout  # noqa: F401
from horovod.runner.common.util import LAUNCHER
from horovod.runner.common.util import settings as hvd_settings  # noqa: F401


def check_build(verbose: bool = False) -> str:
    """The ``-cb`` table: frameworks, controllers and transports this installation has."""
    from hora.runner.launch import check_build as table

    return table()


def parse_args(args: list[str] | None = None) -> argparse.Namespace:
    """horovodrun's command line (default ``sys.argv[1:]``) as a namespace: each flag's value under its
    hora name, ``command`` the rest. Bad input raises :class:`hora.runner.cli_args.UsageError`."""
    from hora.runner.cli_args import parse

    parsed = parse(sys.argv[1:] if args is None else list(args))
    return argparse.Namespace(**parsed.values, command=parsed.command, help=parsed.help)


def is_gloo_used(use_gloo: bool | None = None, use_mpi: bool | None = None, use_jsrun: bool | None = None) -> bool:
    """hora's own TCP transport plays Gloo's part whenever the job is not started by mpirun (or jsrun)."""
    return bool(use_gloo) or not (use_mpi or use_jsrun)


_shim.fill(globals(), {
    "CACHE_FOLDER CACHE_STALENESS_THRESHOLD_MINUTES cache": "hora caches no host checks",
    "SSH_ATTEMPTS SSH_CONNECT_TIMEOUT_S get_remote_command": "hora checks hosts over ssh in hora.runner.ssh",
    "KVStoreServer put_data_into_kvstore read_data_from_kvstore":
        "hora's rendezvous store (hora.transport.store) is authenticated and speaks its own protocol",
    "gloo_run gloo_run_elastic mpi_run js_run is_jsrun_installed lsf run_controller driver_service discovery "
    "elastic_settings network threads": LAUNCHER,
    "make_check_build_action make_deprecated_bool_action make_nic_action make_override_action "
    "make_override_bool_action make_override_false_action make_override_true_action":
        "hora's command line is parsed from its flag table (hora.runner.cli_args), not by argparse actions",
})
