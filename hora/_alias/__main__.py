"""``hora horovod-alias`` (also ``python -m hora._alias``): the opt-in step that lets Horovod scripts run.

    hora horovod-alias install      # `import horovod...` loads hora and `horovodrun` exists, in this environment
    hora horovod-alias uninstall    # removes both again
    hora horovod-alias status
    hora horovod-alias path         # the alias directory, for PYTHONPATH (no install)
    hora horovod-alias install-hook [DIR]    # only HORA_HOROVOD_ALIAS=1 switches the alias on
    hora horovod-alias uninstall-hook [DIR]
"""

import sys

from hora import _alias


def main(argv: list[str]) -> int:
    from hora._alias import install as inst

    if not argv or argv == ["path"]:
        print(_alias.path())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd in ("install", "uninstall", "status") and not rest:
        try:
            if cmd == "install":
                pth, script = inst.install()
                print(f"wrote {pth} and {script}: in this environment `import horovod.torch as hvd` loads hora "
                      "and `horovodrun -np 2 python train.py` runs hora's launcher; `hora horovod-alias "
                      "uninstall` undoes it")
            elif cmd == "uninstall":
                removed = inst.uninstall()
                print("removed " + ", ".join(map(str, removed)) if removed else "the horovod alias was not installed")
            else:
                print(inst.status())
        except (inst.AliasError, OSError) as e:
            print(f"hora horovod-alias {cmd}: {e}", file=sys.stderr)
            return 1
        return 0
    if cmd in ("install-hook", "uninstall-hook") and len(rest) <= 1:
        directory = rest[0] if rest else None
        if cmd == "install-hook":
            print(f"wrote {_alias.install_hook(directory)}; HORA_HOROVOD_ALIAS=1 now makes `import horovod` "
                  "load hora in this environment")
        else:
            print("removed the hook" if _alias.uninstall_hook(directory) else "no hook was installed")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
