"""Where the user's code called a collective, and what a rank's main thread is doing: the call sites
that hang explanations (:mod:`hora.engine.explain`) name.

**A call site** is the first frame outside hora, NumPy and the frameworks hora binds (torch, TensorFlow,
Keras, JAX, MXNet, optax, Lightning): the line of the training script that called ``allreduce``, ``step()`` or
``backward()``. :func:`here` finds it for every unnamed op (whose call site is part of what it is matched
and cached by, :mod:`hora.engine.unnamed`), so it must be cheap: a walk of ``sys._getframe`` whose per-code
verdict (inside or not) is cached, and a :class:`Site` cached per (code object, bytecode offset), so a
loop's call costs a few dictionary look-ups and one increment (its ``count``: how many times this rank
called from there, which tells a per-step collective from a one-off). A submission made from a framework's
own thread (a ``tf.function``'s callback) has no such frame: its site is None.

A named collective's site is not looked for when it is submitted (the walk cost about 2 us per call):
its name already tells a loop's calls apart, and :data:`named` counts them. Only when a hang is
explained does the rank take it, lazily, from its main thread's innermost user frame while that thread
waits inside hora (:func:`hora.engine.explain.local_state`).

**What the main thread is doing** (:func:`main_thread`): its innermost user frames (the standard library,
hora and the frameworks skipped), and the hora function it is inside, if any (``synchronize``,
``allreduce``): a rank in no hora call is computing. It is read from another thread through
:mod:`hora.engine.stacks` (never through that thread's frame objects, which crash CPython 3.11 now and
then), which gives file, line and function name only: a frame's package is told by its file's path, and
its :class:`Frame` has the plain function name and no first line.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from typing import NamedTuple

from hora.engine import stacks

# top-level packages whose frames are never a call site: hora, its Horovod alias, NumPy, the frameworks it binds
INTERNAL = frozenset({"hora", "horovod", "numpy", "torch", "tensorflow", "keras", "tf_keras", "jax", "jaxlib", "mxnet",
                      "optax", "flax", "lightning", "pytorch_lightning", "lightning_fabric"})
FRAMES = 6  # user frames of the main thread a rank reports, innermost first
LIMIT = 1 << 16  # cached code objects and sites before the caches start afresh (code made at run time, exec)


class Frame(NamedTuple):
    """One frame of user code: file (relative to the working directory when under it), line, function."""

    file: str
    line: int
    func: str
    first: int = 0  # the function's first line (tells two functions of one name apart)

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.func}()"


class Site:
    """One call site, shared by every call made from it; ``count`` calls so far on this rank; ``text`` its
    frame as an unnamed op's request carries it (:mod:`hora.engine.unnamed`)."""

    __slots__ = ("frame", "count", "text")

    def __init__(self, frame: Frame):
        self.frame, self.count, self.text = frame, 0, str(frame)


# Both caches are keyed by id(code), never by the code object: hashing a code object hashes its constants
# and names every time (4 us for a 300-line function: a training script's main() is the call site). Each
# entry keeps its code object alive (in ``_codes``), so an id cannot be reused while it is cached.
named: dict = {}  # a named collective's name -> how often this rank submitted it (counted by hora.core.ops)
_internal: dict = {}  # id(code) -> bool: its frames are hora's or a framework's
_sites: dict = {}  # (id(code), bytecode offset) -> Site
_codes: dict = {}  # id(code) -> code: what keeps the keys above valid


def _top(frame) -> str:
    return (frame.f_globals.get("__name__") or "").partition(".")[0]


def _is_internal(frame) -> bool:
    code = frame.f_code
    inside = _internal.get(id(code))
    if inside is None:
        if len(_codes) > LIMIT:
            _internal.clear()
            _sites.clear()
            _codes.clear()
        _codes[id(code)] = code
        inside = _internal[id(code)] = _top(frame) in INTERNAL
    return inside


def short(path: str) -> str:
    """``path`` relative to the working directory when it lies under it (as the user typed the script)."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive
        return path
    return path if rel.startswith("..") else rel


def _frame(f) -> Frame:
    code = f.f_code
    return Frame(short(code.co_filename), f.f_lineno, getattr(code, "co_qualname", code.co_name),
                 code.co_firstlineno)


def here(depth: int = 2) -> Site | None:
    """The call site of the collective being submitted (``depth`` frames above this call), counted; None
    when no frame outside hora and the frameworks called it."""
    f = sys._getframe(depth)
    internal = _internal
    while f is not None:
        inside = internal.get(id(f.f_code))
        if inside is None:
            inside = _is_internal(f)  # (which keeps the code object, so the site's key stays valid)
        if not inside:
            key = (id(f.f_code), f.f_lasti)
            site = _sites.get(key)
            if site is None:
                if len(_sites) > LIMIT:
                    _sites.clear()
                site = _sites[key] = Site(_frame(f))
            site.count += 1
            return site
        f = f.f_back
    return None


def counts(limit: int = 64) -> tuple[tuple[Frame | str, int], ...]:
    """How often this rank called each of its unnamed ops' call sites (a :class:`Frame`) and submitted each
    named collective (its name), the most called first (``limit`` of each)."""
    sites = sorted(list(_sites.values()), key=lambda s: -s.count)[:limit]
    names = sorted(list(named.items()), key=lambda kv: -kv[1])[:limit]
    return tuple((s.frame, s.count) for s in sites) + tuple(names)


class MainThread(NamedTuple):
    """What a rank's main thread is doing: its innermost user frames (innermost first) and the hora
    function it is inside ('' when it is in none: it computes)."""

    frames: tuple[Frame, ...]
    inside: str


def main_thread() -> MainThread:
    """The main thread's state, read from another thread (the engine's, the pulse's)."""
    frames: list[Frame] = []
    inside = ""
    user_seen = False
    for file, line, func in stacks.main_frames() or ():
        kind = _kind_of(file)
        if kind == "hora" and not user_seen:
            inside = func  # the outermost hora frame inside the innermost user frame
        elif kind == "user":
            user_seen = True
            frames.append(Frame(short(file), line, func))
            if len(frames) == FRAMES:
                break
    return MainThread(tuple(frames), inside)


_kinds: dict[str, str] = {}  # file -> "hora", "internal" (a framework's), "stdlib" or "user"


def _kind_of(file: str) -> str:
    kind = _kinds.get(file)
    if kind is None:
        if len(_kinds) > LIMIT:
            _kinds.clear()
        kind = _kinds[file] = _classify(file)
    return kind


def _classify(file: str) -> str:
    if file.startswith("<"):  # <frozen importlib._bootstrap>, <string>, <stdin>
        return "stdlib" if file.startswith("<frozen ") else "user"
    path = os.path.abspath(file)
    best, kind = "", ""  # the innermost package holding the file (hora's Horovod alias lies inside hora)
    for name in INTERNAL:
        mod = sys.modules.get(name)
        if mod is None:
            continue
        for root in list(getattr(mod, "__path__", None) or ()) or [getattr(mod, "__file__", None) or ""]:
            if root and len(root) > len(best) and (path == root or path.startswith(os.path.join(root, ""))):
                best, kind = root, "hora" if name == "hora" else "internal"
    if kind:
        return kind
    paths = sysconfig.get_paths()
    if any(part in path.split(os.sep) for part in ("site-packages", "dist-packages")):
        return "user"  # a package hora does not bind: the user's, as far as a call site goes
    if any(path.startswith(os.path.join(paths[k], "")) for k in ("stdlib", "platstdlib")):
        return "stdlib"  # skipped in a main thread's frames: time.sleep's callers matter
    return "user"
