"""The record an object travels as in ``broadcast_object`` and ``allgather_object`` (:mod:`hora.core.ops`).

A record is a status byte, its length (8 bytes) and the pickled bytes, or, when pickling failed, the error's
text. Every rank takes part in every collective of an object op whatever happened on it, so a rank that cannot
pickle or unpickle raises its own exception, its peers raise an InternalError naming it and its cause, and the
next collective finds every rank in step.
"""

from __future__ import annotations

import numpy as np

OK, FAILED = 0, 1
HEADER = 9
ERROR_TEXT = 500  # characters of a failing rank's error sent to its peers


def record(status: int, body: bytes) -> np.ndarray:
    return np.frombuffer(bytes([status]) + len(body).to_bytes(8, "little") + body, np.uint8)


def records(data: np.ndarray) -> list[tuple[int, memoryview]]:
    """The records of an allgather of records, in rank order (views into ``data``, not copies)."""
    raw, out, i = memoryview(data), [], 0
    while i < len(raw):
        n = int.from_bytes(raw[i + 1:i + HEADER], "little")
        out.append((raw[i], raw[i + HEADER:i + HEADER + n]))
        i += HEADER + n
    return out


def describe(doing: str, e: BaseException) -> bytes:
    return f"{doing}: {type(e).__name__}: {e}"[:ERROR_TEXT].encode("utf-8", "replace")


def pickled(obj) -> tuple[bytes, Exception | None]:
    """(the pickled bytes, None), or (the error's text, the error) when ``obj`` cannot be pickled."""
    import cloudpickle

    try:
        return cloudpickle.dumps(obj), None
    except Exception as e:  # whatever __reduce__ or a member's pickling raised; BaseException goes by
        return describe("pickle its object", e), e


def part(name: str | None, part: str) -> str | None:
    return None if name is None else f"{name}.{part}"


def failure(what: str, failed: dict):
    """The error for a rank whose peers ``failed`` (global rank -> what went wrong there)."""
    from hora.base.errors import InternalError

    named = "; ".join(f"rank {r} could not {bytes(t).decode('utf-8', 'replace')}" for r, t in failed.items())
    return InternalError(f"{what}: {named} (that rank raised the error itself; hora is still usable)")
