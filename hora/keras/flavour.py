"""Which Keras the user's code is written for: Keras 3 (``keras``) or Keras 2 (``tf_keras``).

On TensorFlow >= 2.16 ``tf.keras`` is Keras 3, unless ``TF_USE_LEGACY_KERAS=1`` (TensorFlow's own switch)
makes it ``tf_keras``, the Keras 2 that Horovod's users wrote for. hora serves both from the same modules and
chooses per object: a ``tf_keras`` optimizer or model takes the Keras 2 path (:mod:`hora.keras.legacy`);
where nothing says (a callback is made before it sees a model), the switch decides, as it decides what
``tf.keras`` is in the user's script.
"""

from __future__ import annotations

import inspect
import os

from hora.base.errors import NotSupportedError

__all__ = ["legacy_requested", "is_tf_keras", "tf_keras", "Flavoured"]


def legacy_requested() -> bool:
    """True when ``TF_USE_LEGACY_KERAS`` is on (TensorFlow's test: ``1``, ``true`` or ``True``)."""
    return os.environ.get("TF_USE_LEGACY_KERAS", "") in ("1", "true", "True")


def is_tf_keras(obj) -> bool:
    """True for an instance (or a class) from ``tf_keras``: Keras 2 on current TensorFlow."""
    cls = obj if isinstance(obj, type) else type(obj)
    return any(c.__module__.split(".")[0] == "tf_keras" for c in cls.__mro__)


def tf_keras():
    """The ``tf_keras`` module, or an error that says how to get it."""
    try:
        import tf_keras as module
    except ImportError:
        raise NotSupportedError("TF_USE_LEGACY_KERAS=1 asks for Keras 2, but tf_keras is not installed: "
                                "pip install tf-keras==<your TensorFlow's major.minor>.*") from None
    return module


class Flavoured:
    """Put first in the bases of hora's Keras 3 callbacks: under ``TF_USE_LEGACY_KERAS=1`` constructing one
    makes its ``tf_keras`` twin instead (:meth:`_legacy_twin`), whose ``fit`` would refuse a
    Keras 3 callback. The arguments go over by name, so each class keeps its own positional order. A user's
    subclass keeps its Keras 3 base."""

    def __new__(cls, *args, **kwargs):
        if legacy_requested() and cls.__module__.startswith("hora."):
            other = cls._legacy_twin()
            if other is not None:
                bound = inspect.signature(cls.__init__).bind(None, *args, **kwargs)
                named = {k: v for k, v in list(bound.arguments.items())[1:] if k != "kwargs"}
                return other(**named, **bound.arguments.get("kwargs", {}))
        new = super().__new__
        return new(cls) if new is object.__new__ else new(cls, *args, **kwargs)  # Keras 3 layers record them

    @classmethod
    def _legacy_twin(cls) -> type | None:
        """The ``tf_keras`` class that stands for ``cls``; None: none (each user of the mixin names its own: the
        callbacks' :class:`hora.keras.callbacks.Keras3`, a layer's own class)."""
        return None
