"""hora's errors as TensorFlow's: a cross-rank mismatch is also a ``tf.errors.FailedPreconditionError`` and a
bad argument also a ``tf.errors.InvalidArgumentError``, as Horovod's ops raise them.

The error a TensorFlow op of hora raises is an instance of a class derived from both hora's class and
TensorFlow's (made once per pair), so ``except tf.errors.FailedPreconditionError`` and ``except
hvd.MismatchError`` (or ``ValueError``) both catch it. In eager mode that is the error itself. Inside a
``tf.function`` or a v1 graph a host call's exception becomes what TensorFlow makes of it: a bad argument
(a ``ValueError``) an ``InvalidArgumentError``, a mismatch an ``UnknownError`` carrying hora's message
(TensorFlow keeps no other class across a host call); docs/migrating_from_horovod.md says so.
"""

from __future__ import annotations

import functools

import tensorflow as tf

from hora.base.errors import HoraValueError, MismatchError

__all__ = ["as_tf_error"]

_PAIRS = ((MismatchError, tf.errors.FailedPreconditionError), (HoraValueError, tf.errors.InvalidArgumentError))


@functools.lru_cache(maxsize=None)
def _twin(cls: type, tf_cls: type) -> type:
    return type(cls.__name__, (cls, tf_cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                              "__reduce__": _reduce, "__str__": _str})


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


def as_tf_error(e: BaseException) -> BaseException:
    """``e`` as an instance of hora's class and TensorFlow's (see the module docstring); ``e`` itself when it
    has no TensorFlow counterpart or is one already."""
    if isinstance(e, tf.errors.OpError):
        return e
    for hora_cls, tf_cls in _PAIRS:
        if isinstance(e, hora_cls):
            twin = _twin(type(e), tf_cls)
            out = BaseException.__new__(twin, *e.args)
            out.args = e.args
            out.__dict__.update(e.__dict__)
            out._message, out._node_def, out._op, out._experimental_payloads = str(e), None, None, {}
            out.__cause__, out.__suppress_context__ = e.__cause__, True
            return out.with_traceback(e.__traceback__)
    return e
