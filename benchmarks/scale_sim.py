"""Scale simulation: hora's start-up, connections and control plane for thousands of logical ranks in one
process (issue 27). Real objects, fake sockets:

- start-up: every rank's store requests, made by the real client code (``hora.transport.links.publish`` and
  ``find`` as the TCP mesh makes them, ``hora.transport.store.agree`` as the shared-memory and hierarchical
  set-ups vote) through :class:`FakeStore`, a ``StoreClient`` whose only fake part is its socket: each
  request goes to a real ``StoreServer``'s handler. A request that would wait server-side (a gather whose
  keys are not all there yet) parks its rank, which is run again once the others have moved; only the
  requests of the run that completes are counted, as a real client's one waiting request would be.
- connections: the connection plan (``hora.transport.plan``) at start-up, and the peers the real ring
  allreduce (``hora.collectives.ring``) touches on a recording communicator: what a ring workload adds.
- control: one negotiation cycle in the steady state (every tensor in the response cache): each rank's
  real ``REQUESTS`` message (``hora.engine.messages``, pickled as the engine sends it) toward rank 0, taken in
  by the real :class:`hora.engine.subtree.Merger` of each router on the way (which sends its subtree's
  merged request up once all of it is in), rank 0's real ``Coordinator`` negotiating what arrives (timed,
  with the reading of the merged requests), and its ``RESPONSES`` sent once down the tree (``send_tree``),
  each frame carried along the control tree by ``plan.next_hop`` (what ``ControlPlane.send`` routes with),
  counting the frames and bytes each rank reads or writes (passing on included). ``--no-merge`` gives the
  plane without merging (every request passed on whole, one answer per rank), as last measured.

Run: ``.venv/bin/python benchmarks/scale_sim.py [--sizes 256,1024,4096,8192] [--tensors 16]``
"""

from __future__ import annotations

import argparse
import struct
import time

import numpy as np

from hora.collectives import ring
from hora.engine import messages as m
from hora.engine.coordinator import Coordinator
from hora.engine.coordinator import ResponseCache
from hora.engine.execute import nbytes_of
from hora.engine.subtree import Merger, merged
from hora.transport import links, plan, store as st

LOCAL = 8  # ranks per simulated host (the shared-memory vote runs per host, the hierarchical one across hosts)


class Parked(Exception):
    """A request that a real server would hold until other ranks move."""


class FakeStore(st.StoreClient):
    """The real client's calls on a real server's handler; no socket. Counts round trips and the server's
    time on them."""

    def __init__(self, server: st.StoreServer):  # noqa: D107 - no connection to make
        self.server, self.round_trips, self.server_s = server, 0, 0.0

    def _call(self, op: int, key: str, value: bytes, timeout: float | None = None) -> tuple[int, bytes]:
        if op == st.GET:
            value = struct.pack("!d", 0.0)  # answer now: a miss parks the rank instead of blocking the process
        elif op == st.GATHER:
            value = st._GATHER.pack(0.0, st._GATHER.unpack(value)[1])
        self.round_trips += 1
        t = time.perf_counter()
        status, payload = self.server._handle(op, key.encode(), value)
        self.server_s += time.perf_counter() - t
        if status == st.TIMEOUT:
            raise Parked(key)
        return status, payload

    def close(self) -> None:
        pass


def run_phase(server: st.StoreServer, steps: list, trips: list[int]) -> float:
    """Run ``steps`` (``(rank, fn(store))``), retrying parked ones after the rest; adds each rank's
    counted round trips to ``trips``; returns the server's time on the counted requests."""
    server_s, pending = 0.0, steps
    while pending:
        parked = []
        for rank, fn in pending:
            client = FakeStore(server)
            try:
                fn(client)
            except Parked:
                parked.append((rank, fn))
                continue
            trips[rank] += client.round_trips
            server_s += client.server_s
        if len(parked) == len(pending):
            raise RuntimeError(f"start-up deadlocked: {len(parked)} ranks wait for each other")
        pending = parked
    return server_s


def startup(n: int) -> dict:
    """Every rank's start-up requests; the busiest rank's round trips and the server's time per request."""
    server = st.StoreServer("sim-secret")
    try:
        trips = [0] * n
        prefix = "job/0"
        hosts = [list(range(h, min(h + LOCAL, n))) for h in range(0, n, LOCAL)]
        server_s = run_phase(server, [(r, lambda c, r=r: links.publish(c, prefix, r, f"10.0.{r // 256}.{r % 256}:5"))
                                      for r in range(n)], trips)
        server_s += run_phase(server, [(r, lambda c, r=r: links.find(c, prefix, r, n, 30.0)) for r in range(n)], trips)

        def shm_vote(c, members, r):  # the shared-memory set-up's store protocol (hora.transport.shm)
            key = f"{prefix}/shm/host{members[0]}"
            voters = {str(p): f"rank {p}" for p in members[1:]}
            if r == members[0]:
                c.set(f"{key}/seg", b"pid:fd:nonce:chunk")
                st.agree(c, f"{key}/ok", voters, None, "", 30.0)
            else:
                c.get(f"{key}/seg")
                st.agree(c, f"{key}/ok", voters, str(r), "", 30.0)

        def hier_vote(c, r):  # the hierarchical set-up's verdict across hosts (hora.transport.hierarchical)
            voters = {str(i): f"ranks {g}" for i, g in enumerate(hosts)}
            me = str(r // LOCAL) if r % LOCAL == 0 else None
            st.agree(c, f"{prefix}/hier/verdict", voters, me, "", 30.0)

        server_s += run_phase(server, [(r, lambda c, r=r: shm_vote(c, hosts[r // LOCAL], r)) for r in range(n)], trips)
        server_s += run_phase(server, [(r, lambda c, r=r: hier_vote(c, r)) for r in range(n)], trips)
        total = sum(trips)
        return {"trips_max": max(trips), "trips_mean": total / n, "store_us_per_request": 1e6 * server_s / total}
    finally:
        server.close()


class _Done:
    done, error = True, None

    def wait(self, timeout=None) -> None:
        pass


class RecordingComm:
    """A communicator whose requests complete at once and which remembers the peers it was asked for."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size, self.peers = rank, size, set()

    def isend(self, peer: int, buf) -> _Done:
        self.peers.add(peer)
        return _Done()

    irecv_into = isend


def connections(n: int) -> dict:
    """Start-up connections per rank (data, control) and the peers a ring allreduce adds, over sample ranks."""
    worst = {"data": 0, "control": 0, "ring_extra": 0}
    for r in sorted({0, 1, n // 2, n - 1, plan.children(0, n).stop - 1}):
        data = set(plan.ring_neighbours(r, n))
        comm = RecordingComm(r, n)
        ring.allreduce(comm, np.zeros(n, np.float32), lambda a, b: None)
        worst["data"] = max(worst["data"], len(data))
        worst["control"] = max(worst["control"], len(plan.control_links(r, n)))
        worst["ring_extra"] = max(worst["ring_extra"], len(comm.peers - data))
    worst["depth"] = plan.depth(n - 1)
    return worst


class SimControl:
    """What a router's Merger sees of its control plane: the tree, and a send that the simulation carries."""

    closed = False

    def __init__(self, rank: int, n: int, carry):
        self.rank, self.tree, self._carry = rank, (n, plan.FANOUT), carry

    def send_best(self, peer: int, msg: tuple) -> bool:
        self._carry(self.rank, peer, m.dumps(msg))
        return True


def control_cycle(n: int, tensors: int, merge: bool = True) -> dict:
    """One steady-state negotiation cycle (every tensor cached): frames and bytes per rank, rank 0's time."""
    coord = Coordinator(n, 64 << 20, 1024)
    reqs = [m.Request(f"grad.{i}", m.ALLREDUCE, 0, "float32", (1024,)) for i in range(tensors)]
    for rank in range(n):  # the first cycle: full requests, which the coordinator caches
        for q in reqs:
            coord.submit(rank, q)
    coord.take(nbytes_of)
    bits = [coord.cache.bit_of[q] for q in reqs]
    frames, nbytes = [0] * n, [0] * n

    at_root: list[bytes] = []
    mergers: dict[int, Merger] = {}

    def link(a: int, b: int, size: int) -> None:
        for x in (a, b):
            frames[x] += 1
            nbytes[x] += size

    def carry(src: int, dst: int, payload: bytes) -> None:
        here, size = src, len(payload) + 12  # the frame's header: length, source, destination
        while here != dst:
            hop = plan.next_hop(here, dst)
            link(here, hop, size)
            here = hop
            if here != dst and dst == 0 and here in mergers and mergers[here].offer(src, payload):
                return  # taken in by the router (its merged request goes up later)
        if dst == 0:
            at_root.append(payload)

    if merge:
        cache = ResponseCache(1024)
        for q in reqs:
            cache.add(coord.cache.bit_of[q], q)
        for r in range(n):
            if plan.children(r, n) and r:
                mergers[r] = Merger(r, plan.subtree(r, n), SimControl(r, n, carry), cache, hold=None)
    for rank in range(n - 1, 0, -1):  # deepest first: a router's own request comes after its subtree's
        msg = (m.REQUESTS, rank, [], bits, {})
        if rank not in mergers or not mergers[rank].up(rank, msg):
            carry(rank, 0, m.dumps(msg))
    t0 = time.perf_counter()
    now = time.monotonic()
    for data in at_root:
        msg = m.loads(data)
        if len(msg) > 5:
            for rank, bit, when in merged(msg, n, plan.FANOUT, now):
                coord.submit_bit(rank, bit, when)
        else:
            for bit in msg[3]:
                coord.submit_bit(msg[1], bit)
    for bit in bits:
        coord.submit_bit(0, bit)
    responses, adds, evicts = coord.take(nbytes_of)
    if merge:  # once down the tree: each rank reads it once and writes it to each child
        size = len(m.dumps((m.RESPONSES, responses, adds, evicts, {}))) + 12
        for r in range(1, n):
            link(plan.parent(r), r, size)
    else:
        for peer in range(1, n):
            mine, a, e = coord.share(peer, responses, adds, evicts)
            carry(0, peer, m.dumps((m.RESPONSES, mine, a, e)))
    rank0_s = time.perf_counter() - t0
    others = frames[1:] or [0]
    return {"rank0_frames": frames[0], "rank0_bytes": nbytes[0], "router_frames_max": max(others),
            "busiest_frames": max(frames), "busiest_bytes": max(nbytes), "rank0_ms": 1e3 * rank0_s,
            "responses": len(responses), "agreed": sum(len(r.names) for r in responses)}


def simulate(n: int, tensors: int = 16, merge: bool = True) -> dict:
    return {"n": n, **startup(n), **connections(n), **control_cycle(n, tensors, merge)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="256,1024,2048,4096,8192")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--no-merge", action="store_true", help="routers pass every request on; one answer per rank")
    args = ap.parse_args()
    print("| N | store round trips per rank (max / mean) | store µs per request | data conns at start-up "
          "| extra conns for ring allreduce | control conns | tree depth | rank 0 frames per cycle "
          "| busiest rank's frames | busiest rank's KiB per cycle | rank 0 negotiation ms |")
    print("|" + "---|" * 11)
    for n in (int(s) for s in args.sizes.split(",")):
        r = simulate(n, args.tensors, not args.no_merge)
        print(f"| {n} | {r['trips_max']} / {r['trips_mean']:.2f} | {r['store_us_per_request']:.0f} | {r['data']} "
              f"| {r['ring_extra']} | {r['control']} | {r['depth']} | {r['rank0_frames']} | {r['busiest_frames']} "
              f"| {r['busiest_bytes'] / 1024:.0f} | {r['rank0_ms']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
