"""hora's errors as TensorFlow's: a cross-rank mismatch is also a ``tf.errors.FailedPreconditionError`` and a
bad argument also a ``tf.errors.InvalidArgumentError``, as Horovod's ops raise them, eagerly, inside a
``tf.function`` and in a v1 ``Session``.

The error a TensorFlow op of hora raises is an instance of a class derived from both hora's class and
TensorFlow's (made once per pair), so ``except tf.errors.FailedPreconditionError`` and ``except
hvd.MismatchError`` (or ``ValueError``) both catch it. In eager mode that is the error itself.

Inside a graph, hora's ops are host calls (``tf.numpy_function``), and TensorFlow keeps only a few classes
across one (checked on 2.21: ``ValueError``/``TypeError`` become ``InvalidArgumentError``; everything else,
a ``FailedPreconditionError`` included, becomes ``UnknownError`` with the text), then raises the class it
chose from C++. So :func:`host_call_guard` parks the original error under a number, as its twin, and raises
a stand-in whose text names the number (a ``ValueError`` for a bad argument, a ``RuntimeError`` for a
mismatch); and :func:`install` gives ``UnknownError`` and ``InvalidArgumentError`` a ``__new__`` that, for a
text naming a parked error, returns that twin instead of a new error. A mismatch's twin is then an
``UnknownError`` as well (C++ raises that class, and Python keeps only an instance of it), so code written
for hora's earlier ``UnknownError`` still catches it. Only a text with hora's tag is touched; where a future
TensorFlow builds its errors differently, the stand-in's text still carries hora's message.
"""

from __future__ import annotations

import collections
import functools
import itertools
import re
import threading

import tensorflow as tf

from hora.base.errors import HoraValueError, MismatchError

__all__ = ["as_tf_error", "host_call_guard", "install"]

_PAIRS = ((MismatchError, tf.errors.FailedPreconditionError), (HoraValueError, tf.errors.InvalidArgumentError))


@functools.lru_cache(maxsize=None)
def _twin(cls: type, tf_cls: type, also: type | None = None) -> type:
    bases = (cls, tf_cls) if also is None or issubclass(tf_cls, also) else (cls, tf_cls, also)
    return type(cls.__name__, bases, {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                      "__reduce__": _reduce, "__str__": _str, "__init__": _init})


def _init(self, *args, **kwargs) -> None:
    """Built whole by :func:`as_tf_error`, and then left as it is when TensorFlow calls the class again on it
    (see :func:`install`); built from TensorFlow's ``(node_def, op, message)`` when ``Session.run`` raises
    a new one of the same class."""
    if "_message" not in self.__dict__:
        node_def, op, message = (tuple(args) + (None, None, ""))[:3]
        self.args = (message,)
        self._message, self._node_def, self._op, self._experimental_payloads = message, node_def, op, {}


def _str(self) -> str:
    return self._message


def _reduce(self):
    return _rebuild, (type(self).__mro__[1], self.args, dict(self.__dict__))


def _rebuild(cls: type, args: tuple, state: dict):
    """Unpickle a twin (a rank's error sent to another process): the same pair again."""
    e = cls.__new__(cls, *args)
    e.args = args
    e.__dict__.update(state)
    return as_tf_error(e)


def as_tf_error(e: BaseException, also: type | None = None) -> BaseException:
    """``e`` as an instance of hora's class and TensorFlow's (see the module docstring), and of ``also``;
    ``e`` itself when it has no TensorFlow counterpart or is one already."""
    if isinstance(e, tf.errors.OpError):
        return e
    for hora_cls, tf_cls in _PAIRS:
        if isinstance(e, hora_cls):
            twin = _twin(type(e), tf_cls, also)
            out = BaseException.__new__(twin, *e.args)
            out.args = e.args
            out.__dict__.update(e.__dict__)
            out._message, out._node_def, out._op, out._experimental_payloads = str(e), None, None, {}
            out.__cause__, out.__suppress_context__ = e.__cause__, True
            return out.with_traceback(e.__traceback__)
    return e


# -- across a host call -----------------------------------------------------------------------------------
_PARKED: collections.OrderedDict[int, BaseException] = collections.OrderedDict()
_PARKED_MAX = 64  # the newest parked twins (TensorFlow may build an error twice: Session.run re-raises)
_NUMBERS = itertools.count(1)
_LOCK = threading.Lock()
_TAG = re.compile(r"\[hora error #(\d+)\]")


def host_call_guard(fn, args):
    """``fn(*args)`` inside a graph's host call; an error with a TensorFlow counterpart is parked and a
    stand-in naming it raised instead (see the module docstring)."""
    try:
        return fn(*args)
    except (MismatchError, HoraValueError) as e:
        value = isinstance(e, HoraValueError)
        with _LOCK:
            number = next(_NUMBERS)
            _PARKED[number] = as_tf_error(e, None if value else tf.errors.UnknownError)
            while len(_PARKED) > _PARKED_MAX:
                _PARKED.popitem(last=False)
        raise (ValueError if value else RuntimeError)(f"{type(e).__name__}: {e} [hora error #{number}]") from None


def _parked(args: tuple) -> BaseException | None:
    for a in args:
        if isinstance(a, str) and (found := _TAG.search(a)) is not None:
            with _LOCK:
                return _PARKED.get(int(found.group(1)))
    return None


def install() -> None:
    """Give ``UnknownError`` and ``InvalidArgumentError`` the ``__new__`` that hands back a parked twin (once)."""
    for tf_cls in (tf.errors.UnknownError, tf.errors.InvalidArgumentError):
        if "_hora_new" in tf_cls.__dict__:
            continue
        original = tf_cls.__new__

        def __new__(cls, *args, _original=original, **kwargs):
            ours = _parked(args)
            if ours is not None and isinstance(ours, cls):
                return ours
            return _original(cls, *args, **kwargs)
        tf_cls.__new__ = __new__
        tf_cls._hora_new = True
