"""The names collectives are matched by, written and read in this one module.

Every submission carries a name, the same on every rank, under which the coordinator matches the ranks' requests
(:mod:`hora.engine.coordinator`). The core (:mod:`hora.core.ops`) names what the caller did not, and the
coordinator reads a name's structure back when a group's size differs between ranks; both go through the
functions below, so the format is defined once:

* an unnamed op is ``noname.<n>``, numbered per process set in submission order, and ``noname.<e>.<n>``
  after the ``e``-th completed ``join()`` (the numbering restarts there; see :func:`take`);
  barriers and process-set calls have their own sequences (``barrier.<n>``, ``process_set.<n>``);
* a grouped op's id is ``(its name, its number of members)``; an unnamed group is named ``group.`` + the
  automatic name it takes, so a group takes one number of the sequence whatever its size;
* member ``i`` of group ``g`` of ``n`` is ``g.<i>``, and a group of one is named ``g`` itself;
* a single (ungrouped) op in a group's place has a *form*: a named op is a group of one (form 1, so it matches
  a group of one of its name), an unnamed one is form 0 under ``group.<its name>``, a form no group has: an
  unnamed op and an unnamed group in the same place never match, and the coordinator says so.

Automatic names never repeat; what an unnamed op puts in the response cache is its request without its name, with
its call site (:mod:`hora.engine.unnamed`), which the request itself says it has (``Request.site``), not its name.
"""

from __future__ import annotations

import itertools
import threading

UNNAMED = "noname"  # the automatic sequence of ordinary ops
GROUP = "group."  # what an unnamed group's name starts with
_lock = threading.Lock()


def take(counters: dict, name: str | None, ps: int = 0, prefix: str = UNNAMED) -> str:
    """``name``, or the next automatic name of sequence ``prefix`` in process set ``ps``, from ``counters``
    (the session's: every rank starts from 0 at ``init()``).

    Unnamed ops are numbered in submission order within their process set, so the ranks of a
    set match them by that order (an unnamed op on a subset does not shift the global numbering).

    The numbers restart at every completed ``join()``, under a new epoch (``noname.<epoch>.<n>``):
    while a rank has joined, the others run unnamed allreduces and barriers that it never submits
    (and allgathers that fail) and so take numbers it does not, and without the restart the ranks'
    numbering would disagree for good after the join, a hang on the next unnamed op. A join's
    completion is the one point that every rank passes with all of its own earlier submissions
    numbered, so that is where the numbering is made equal again (:func:`new_epoch`)."""
    if name is not None:
        return str(name)
    with _lock:
        counter = counters.setdefault((prefix, ps), itertools.count())
        epoch = counters.get("epoch", 0)
        n = next(counter)
    return auto(prefix, epoch, n)


def new_epoch(counters: dict) -> None:
    """Every rank has passed a join: the automatic names restart (see :func:`take`)."""
    with _lock:
        epoch = counters.get("epoch", 0) + 1
        counters.clear()
        counters["epoch"] = epoch


def group_id(counters: dict, name: str | None, ps: int, n: int) -> tuple[str, int]:
    """A grouped op's id: its name, or the next automatic one as an unnamed group's, and its number of
    members."""
    return (str(name) if name is not None else unnamed_group(take(counters, None, ps)), n)


def auto(prefix: str, epoch: int, n: int) -> str:
    """The ``n``-th automatic name of sequence ``prefix`` in join epoch ``epoch``."""
    return f"{prefix}.{n}" if epoch == 0 else f"{prefix}.{epoch}.{n}"


def unnamed_group(auto_name: str) -> str:
    """The name of an unnamed group that took the automatic name ``auto_name``."""
    return GROUP + auto_name


def member(group: str, i: int, n: int) -> str:
    """Member ``i``'s name in group ``group`` of ``n``: the group's name for a group of one. An unnamed
    group's members are named from its one automatic name too, so that ranks whose groups differ in size
    (an error every rank hears) still agree on the names of the ops that follow."""
    return f"{group}.{i}" if n > 1 else group


def is_unnamed_group(group: str) -> bool:
    return group.startswith(GROUP + UNNAMED + ".")


def plain_form(name: str) -> tuple[str, int]:
    """(group name, form) of a single, ungrouped op named ``name``: the group it stands for (see above)."""
    return (GROUP + name, 0) if name.startswith(UNNAMED + ".") else (name, 1)


def plain_name(group: str) -> str:
    """The name a single op in group ``group``'s place takes (the inverse of :func:`plain_form`)."""
    return group[len(GROUP):] if is_unnamed_group(group) else group


def members(group: str, form: int) -> list[str]:
    """The names of a rank's part in group ``group`` of form ``form``."""
    return [plain_name(group)] if form == 0 else [member(group, i, form) for i in range(form)]
