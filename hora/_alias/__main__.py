"""``python -m hora._alias``: print the alias directory (for PYTHONPATH), or install/uninstall the hook.

    python -m hora._alias                       # prints the directory
    python -m hora._alias install-hook [DIR]    # HORA_HOROVOD_ALIAS=1 then works without PYTHONPATH
    python -m hora._alias uninstall-hook [DIR]
"""

import sys

from hora import _alias


def main(argv: list[str]) -> int:
    if not argv:
        print(_alias.path())
        return 0
    if argv[0] in ("install-hook", "uninstall-hook") and len(argv) <= 2:
        directory = argv[1] if len(argv) == 2 else None
        if argv[0] == "install-hook":
            print(f"wrote {_alias.install_hook(directory)}; HORA_HOROVOD_ALIAS=1 now makes `import horovod` "
                  "load hora in this environment")
        else:
            print("removed the hook" if _alias.uninstall_hook(directory) else "no hook was installed")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
