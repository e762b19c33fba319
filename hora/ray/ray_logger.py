"""``ray_logger.log(info)``: send a value from a worker to the driver's ``callbacks`` (Horovod's module).

Horovod carried these values through a Ray queue actor; hora puts them in the job's store, which the driver
already serves: ``log`` numbers each value with the store's atomic ADD and sets it under the call's key, and
the driver reads them in order on a thread of its own (:class:`Relay`) and calls every callback on each. With
no callbacks on the current call, ``log`` does nothing.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Callable

__all__ = ["log"]

_lock = threading.Lock()
_key: str | None = None  # "<scope>/ray_log" of the running call, None when no callbacks listen
_rank = 0
_client = None
_client_for: tuple[str, str] | None = None  # (store address, secret) the client was made for
_warned = False


def _configure(key: str | None, rank: int | None) -> None:
    """Set by the worker around each call (:meth:`hora.ray.worker.BaseHorovodWorker.call`). Private: Horovod's
    ``configure(queue)`` took a Ray queue, which hora does not use. ``rank`` None: hora's current rank (an
    elastic worker's rank changes from one generation to the next)."""
    global _key, _rank
    with _lock:
        _key, _rank = key, rank


def log(info_dict: Any, chief_only: bool = True) -> None:
    """Send ``info_dict`` (anything picklable) to the driver's callbacks; only from rank 0 unless
    ``chief_only=False``. Outside a call with callbacks it warns once and drops the value."""
    global _client, _client_for, _warned
    import cloudpickle

    from hora.base import env
    from hora.transport.store import StoreClient

    rank = _rank
    if rank is None:
        from hora.elastic import place

        rank = place()[1]
    if chief_only and rank != 0:
        return
    with _lock:
        key = _key
        if key is None:
            if not _warned:
                _warned = True
                warnings.warn("hora.ray.ray_logger.log called outside a RayExecutor call with callbacks; "
                              "the value is dropped", stacklevel=2)
            return
        where = (env.get("STORE_ADDR") or "", env.get("SECRET") or "")
        if _client is None or _client_for != where:  # a new start() serves a new store
            if _client is not None:
                _client.close()
            _client, _client_for = StoreClient(*where), where
        n = _client.add(f"{key}/count")
        _client.set(f"{key}/{n}", cloudpickle.dumps(info_dict))


class Relay:
    """Driver side: read the values logged under ``key`` in order and call each callback on them, on a thread,
    until :meth:`close` (which delivers what is already there first)."""

    def __init__(self, store_addr: str, secret: str, key: str, callbacks: list[Callable[[Any], Any]]):
        from hora.transport.store import StoreClient

        self._client = StoreClient(store_addr, secret)
        self._key, self._callbacks = key, list(callbacks)
        self._next = 1
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="hora-ray-callbacks", daemon=True)
        self._thread.start()

    def _deliver(self, raw: bytes) -> None:
        import pickle

        value = pickle.loads(raw)
        self._client.delete(f"{self._key}/{self._next}")
        self._next += 1
        for c in self._callbacks:
            c(value)

    def _loop(self) -> None:
        from hora.transport.store import StoreTimeout

        try:
            while not self._stop.is_set():
                try:
                    self._deliver(self._client.get(f"{self._key}/{self._next}", timeout=0.2))
                except StoreTimeout:
                    continue
            while (raw := self._client.try_get(f"{self._key}/{self._next}")) is not None:
                self._deliver(raw)
        except BaseException as e:  # noqa: BLE001 - a failing callback is reported by close()
            self.error = e

    def close(self) -> None:
        """Stop after the values already logged, and delete the call's counter (each value's key goes as it is
        delivered); re-raise a callback's exception."""
        self._stop.set()
        self._thread.join()
        try:
            self._client.delete(f"{self._key}/count")
        except Exception:  # noqa: BLE001 - the store closed (shutdown() from another thread): nothing to keep
            pass
        self._client.close()
        if self.error is not None:
            raise self.error
