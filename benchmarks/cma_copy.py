"""Linux CMA (``process_vm_readv``) against NumPy's copy: the single-copy design's building block (issue 15).

    python benchmarks/cma_copy.py --wait-quiet 240

A child process holds a 64 MiB array; this process reads it with ``process_vm_readv`` in 1 MiB, 4 MiB
and 64 MiB pieces, into one cached temporary of the piece's size ("temp", what a fold would read from)
or into a 64 MiB destination ("big", what a copy of the peer's result would write), and copies its own
64 MiB with NumPy the same two ways. GB/s = bytes / median time of 7. Writes
``benchmarks/results/cma_copy.{md,json}``; compare within one run.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_args, finish, start  # noqa: E402

N = 64 << 20


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _child(q, ev) -> None:
    a = np.ones(N, np.uint8)
    q.put(a.ctypes.data)
    ev.wait()


def _gbs(fn) -> float:
    times = []
    for _ in range(7):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return N / statistics.median(times) / 1e9


def measure() -> dict:
    libc = ctypes.CDLL(None, use_errno=True)
    readv = libc.process_vm_readv
    readv.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.POINTER(_Iovec),
                      ctypes.c_ulong, ctypes.c_ulong]
    readv.restype = ctypes.c_ssize_t
    q, ev = mp.Queue(), mp.Event()
    p = mp.Process(target=_child, args=(q, ev))
    p.start()
    addr, out = q.get(), {}
    try:
        for piece in (1 << 20, 4 << 20, N):
            for dest in ("temp", "big"):
                big, tmp = np.zeros(N, np.uint8), np.zeros(piece, np.uint8)

                def cma(piece=piece, dest=dest, big=big, tmp=tmp):
                    for off in range(0, N, piece):
                        d = tmp if dest == "temp" else big[off:off + piece]
                        local, remote = _Iovec(d.ctypes.data, piece), _Iovec(addr + off, piece)
                        if readv(p.pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) != piece:
                            raise OSError(ctypes.get_errno(), "process_vm_readv failed")

                out[f"cma {piece >> 10} KiB pieces into {dest}"] = _gbs(cma)
        a, b, tmp = np.ones(N, np.uint8), np.zeros(N, np.uint8), np.zeros(1 << 20, np.uint8)

        def whole():
            b[:] = a

        def pieces():
            for off in range(0, N, 1 << 20):
                tmp[:] = a[off:off + (1 << 20)]

        out["numpy 64 MiB into big"] = _gbs(whole)
        out["numpy 1024 KiB pieces into temp"] = _gbs(pieces)
    finally:
        ev.set()
        p.join()
    return out


def markdown(res: dict) -> str:
    lines = ["Copying 64 MiB, GB/s (median of 7):", "", "| how | GB/s |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in res["gbs"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    add_args(ap)
    args = ap.parse_args()
    res = start(args.wait_quiet)
    res["gbs"] = measure()
    finish(res, markdown, args.out, "cma_copy")


if __name__ == "__main__":
    main()
