"""Rank 0's negotiation: which submitted tensors are ready everywhere, in what order, fused how.

Pure logic, no I/O (the engine feeds it messages and sends what it returns), so its rules can be
read in one place: a tensor is ready when every rank of its process set has submitted it (joined
ranks excepted: they contribute the op's neutral element to allreduces, zeros for Sum and Average);
the submissions must agree on everything but the data (else every rank gets the same error naming
the ranks and both values); grouped tensors wait for their whole group (a group whose number of
tensors differs between ranks fails on every rank at once, since its members' names would never
meet); ready allreduces with the same dtype, op, scaling and process set are fused up to the
threshold; and signatures seen before get a bit in the response cache so that in steady state ranks
send small integers instead of descriptions.
"""

from __future__ import annotations

import collections
import dataclasses
import time

from hora.base.errors import HoraError, HoraValueError, InternalError, MismatchError
from hora.collectives.reduce import OP_NAMES
from hora.engine import names as naming
from hora.engine.messages import (ADD_PS, ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST, JOIN,
                                REDUCESCATTER, REMOVE_PS, Refusal, Request, Response, error)
from hora.engine.straggler import StragglerAccount
from hora.engine.subtree import share
from hora.engine.unnamed import at, order, resolve, signature

_COMPARED = {  # fields that must agree across ranks, by op kind
    ALLREDUCE: ("op", "dtype", "shape", "pre", "post", "layout", "device"),
    REDUCESCATTER: ("op", "dtype", "shape", "pre", "post", "device"),
    BROADCAST: ("dtype", "shape", "root", "device"),
    ALLGATHER: ("dtype", "trailing", "device"),
    ALLTOALL: ("dtype", "trailing", "device"),
    BARRIER: (),
    JOIN: (),
    ADD_PS: ("ranks",),
    REMOVE_PS: ("set_id",),
}


def _field(req: Request, field: str):
    if field == "trailing":
        return ("ndim", len(req.shape), "dims after the first", tuple(req.shape[1:]))
    return getattr(req, field)


def _show(field: str, value) -> str:
    if field == "op":
        return OP_NAMES.get(value, str(value))
    if field == "device":
        return "the GPU" if value else "the host"
    if field == "trailing":
        return f"{value[1]}-d with dimensions after the first {value[3]}"
    if field in ("shape", "ranks"):
        return str(tuple(value))
    return repr(value) if isinstance(value, str) else str(value)


@dataclasses.dataclass
class _Failed:
    """A group that ranks submitted with different numbers of members, failed: who sent what (for the
    text), and the members still to come, which fail on arrival (a rank's members arrive one by one, and
    a rank of the set may not have reached the group yet). Forgotten once every rank's part is in."""

    kind: str
    group: str
    counts: dict[int, list[int]]  # rank -> the forms it submitted: member counts, 0 for a single op
    left: dict[tuple[int, int], int]  # (rank, form) -> members of it not yet submitted
    waiting: set[int]  # ranks of the set that have not submitted their part yet
    refused: dict[int, str] = dataclasses.field(default_factory=dict)  # rank -> why it refused its input

    def text(self) -> str:
        said, unit = [], " tensor(s)"  # the unit after the first count only: "1 tensor(s), rank 1 submitted 2"
        for r in sorted(self.counts):
            counts = []
            for n in self.counts[r]:
                counts.append(f"a single {self.kind} (not grouped)" if n == 0 else f"{n}{unit}")
                unit = unit if n == 0 else ""
            forms = " and ".join(counts)
            said.append(f"rank {r} submitted {forms}" + (f" (refused at submission: {self.refused[r]})"
                                                         if r in self.refused else ""))
        unnamed = " (an unnamed group: unnamed ops are matched by their order on each rank)" \
            if naming.is_unnamed_group(self.group) else ""
        return (f"grouped {self.kind} '{self.group}'{unnamed}: " + ", ".join(said)
                + "; every rank must pass the same number of tensors")


@dataclasses.dataclass
class Entry:
    requests: dict[int, Request]
    since: float
    warned: bool = False
    at: dict[int, float] = dataclasses.field(default_factory=dict)  # rank -> when its request came (straggler)


class ResponseCache:
    """Signature <-> bit, kept identical on the coordinator and on every rank of the signature's
    process set: the coordinator assigns bits (never reusing one) and evicts the least recently used
    entry when full, and sends both with its responses. A rank may still send a bit it has not yet
    heard was evicted, so the coordinator remembers evicted bits for a while (``tombstones``)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.bit_of: collections.OrderedDict[Request, int] = collections.OrderedDict()
        self.req_of: dict[int, Request] = {}
        self.tombstones: collections.OrderedDict[int, Request] = collections.OrderedDict()

    def add(self, bit: int, req: Request) -> None:
        self.bit_of[req], self.req_of[bit] = bit, req

    def evict(self, bit: int) -> None:
        req = self.req_of.pop(bit, None)
        if req is not None and self.bit_of.get(req) == bit:  # it may have been re-added under a new bit
            del self.bit_of[req]

    def touch(self, req: Request) -> None:
        if req in self.bit_of:
            self.bit_of.move_to_end(req)

    def lookup(self, bit: int) -> Request:
        req = self.req_of.get(bit)
        if req is None:
            req = self.tombstones.get(bit)
        if req is None:
            raise InternalError(f"a rank sent response-cache bit {bit}, which rank 0 evicted too long ago to "
                                "remember; the ranks' caches fell out of step. Raise HORA_CACHE_CAPACITY, or set "
                                "it to 0 to turn the response cache off")
        return req


class Coordinator:
    """Rank 0's negotiation state. On rank 0 ``process_sets`` is the one table of registered sets (the
    engine reads it too): a set exists from the moment its ``add_process_set`` is agreed and is gone
    once its removal is. A set removed in the batch that ``take()`` returns is remembered until the
    next ``take()``, so the responses on it that precede its removal in that batch are
    still routed and run (:meth:`ranks_of`)."""

    def __init__(self, size: int, fusion_threshold: int, cache_capacity: int):
        self.size = size
        self.fusion_threshold = fusion_threshold
        self.cache = ResponseCache(cache_capacity)
        self.cache_on = True  # autotune may switch the cache off and on (set_cache)
        self._next_bit = 0
        self.process_sets: dict[int, tuple[int, ...]] = {0: tuple(range(size))}
        self._removing: dict[int, tuple[int, ...]] = {}  # removals agreed since the last take()
        self._removed: dict[int, tuple[int, ...]] = {}  # removals in the batch the last take() returned
        self._next_ps = 1
        self._free_ps: list[int] = []  # ids of removed sets, reused first and oldest first, as Horovod does
        self.table: dict[tuple[int, str], Entry] = {}
        self.ready: list[Response] = []
        self.additions: list[tuple[int, Request]] = []  # cache bits assigned since last take()
        self.evictions: list[tuple[int, int]] = []  # (bit, process set) evicted since last take()
        self._groups: dict[tuple, list[Response]] = {}
        # groups in flight by (process set, group name): member count -> {rank: members submitted}
        self._forms: dict[tuple[int, str], dict[int, dict[int, int]]] = {}
        self._failed: dict[tuple[int, str], _Failed] = {}  # groups of differing sizes, failed (_fail_group)
        self.joined: list[int] = []
        self.arrivals: dict[tuple[int, str], dict[int, float]] = {}  # agreed since the last take(): for account
        self.account = StragglerAccount(size)  # who every fused collective waited for (hora.engine.straggler)

    # -- input ---------------------------------------------------------------------------------
    def submit(self, rank: int, req: Request, when: float | None = None) -> None:  # when: its arrival at a router
        if req.kind == JOIN:
            if rank not in self.joined:
                self.joined.append(rank)
            self._recheck()
            return
        key = (req.ps, req.name)
        if (req.group is not None or self._forms or self._failed) and self._sized(rank, req):
            return
        entry = self.table.get(key)
        now = time.monotonic() if when is None else when
        if entry is None:
            entry = self.table[key] = Entry({}, now)
        entry.requests[rank] = req
        entry.at[rank] = now
        self._check(key, entry)

    def submit_bit(self, rank: int, sent, when: float | None = None) -> None:
        """``rank``'s request sent as a cache bit (an unnamed op's with its slot: :func:`hora.engine.unnamed.wire`)."""
        self.submit(rank, resolve(self.cache, sent), when)

    def idle(self) -> bool:
        """Nothing waits here: no request, response, join, group or process-set removal in flight (the
        small-allreduce fast path, :mod:`hora.engine.fastpath`, may then pair two ranks' calls itself)."""
        return not (self.table or self.ready or self.joined or self._groups or self._removing or self._forms
                    or self._failed)

    def ranks_of(self, ps: int) -> tuple[int, ...]:
        """The ranks of set ``ps`` for the batch last taken (a set it removes included)."""
        ranks = self.process_sets.get(ps)
        if ranks is None:
            ranks = self._removed.get(ps) or self._removing.get(ps, ())
        return ranks

    def _required(self, ps: int) -> set[int]:
        ranks = set(self.process_sets.get(ps, ()))
        return ranks - set(self.joined) if ps == 0 else ranks

    def _recheck(self) -> None:
        for key, entry in list(self.table.items()):
            self._check(key, entry)
        if len(self.joined) == self.size:
            self.ready.append(Response(JOIN, 0, ("join",), value=self.joined[-1]))
            self.joined = []

    def _check(self, key: tuple[int, str], entry: Entry) -> None:
        ps = key[0]
        if len(entry.requests) < len(self.process_sets.get(ps, ())) - (len(self.joined) if ps == 0 else 0):
            return  # not every rank yet: a count, not a set of the set's ranks per submit (O(N) per tensor, not N^2)
        required = self._required(ps)
        if not required or not required <= set(entry.requests):
            return
        del self.table[key]
        self.arrivals[key] = entry.at
        resp = self._respond(key, entry)
        group = next(iter(entry.requests.values())).group
        if group is None and self._forms:  # a named single op matches a group of one (_plain_form)
            group = next((q.group for q in entry.requests.values() if q.group is not None), None)
        if group is None:
            self.ready.append(resp)
            return
        # a group is released whole, errors included, once every member has been negotiated
        members = self._groups.setdefault((key[0],) + tuple(group), [])
        members.append(resp)
        if len(members) == group[1]:
            del self._groups[(key[0],) + tuple(group)]
            self.ready.extend(members)
            forms = self._forms.get((key[0], group[0]))
            if forms is not None:
                forms.pop(group[1], None)
                if not forms:
                    del self._forms[(key[0], group[0])]

    # -- groups of differing sizes ---------------------------------------------------------------
    def _sized(self, rank: int, req: Request) -> bool:
        """Check ``req`` (a group's member, or a single op while groups are in flight) against the group
        sizes the other ranks submitted under its group's name; True if it was failed here, as one member
        of a group whose size differs between ranks (or of such a group failed before). Without this, the
        members' names differ between the ranks (``g`` against ``g.0``, ``g.1``) and nothing would ever
        match them: a hang until the stall shutdown. The check is eager: a rank that has two groups of one
        name and different sizes in flight at once, in another order than its peers, is taken for a
        mismatch too (one name, one group at a time)."""
        ps, group = req.ps, req.group
        g, n = group if group is not None else naming.plain_form(req.name)
        gk = (ps, g)
        if self._failed:
            failed = self._failed.get(gk)
            if failed is not None and self._late(failed, gk, rank, n, req):
                return True
        forms = self._forms.get(gk)
        if group is not None:
            if forms is None:
                forms = self._forms[gk] = {}
            seen = forms.get(n)
            if seen is None:
                seen = forms[n] = {}
            k = seen.get(rank)
            if k is not None:  # a rank's part is checked at its first member only
                seen[rank] = k + 1
                return False
            seen[rank] = 1
            if len(forms) == 1 and (ps, naming.plain_name(g)) not in self.table:  # all alike, no single op
                return False
        elif forms is None:
            return False
        have = self._have(ps, g, forms)
        if all(n in f for r, f in have.items() if r != rank):
            return False
        if req.group is None:
            have.setdefault(rank, []).append(n)
        self._fail_group(gk, rank, req, have)
        return True

    def _have(self, ps: int, g: str, forms: dict[int, dict[int, int]]) -> dict[int, list[int]]:
        """rank -> the forms (:func:`_plain_form`) in flight under group name ``g``: the groups' sizes,
        and a single op of the name that stands for the group, waiting in the table."""
        have: dict[int, list[int]] = {}
        for n, seen in forms.items():
            for r in seen:
                have.setdefault(r, []).append(n)
        entry = self.table.get((ps, naming.plain_name(g)))
        if entry is not None:
            form = naming.plain_form(naming.plain_name(g))[1]
            for r, q in entry.requests.items():
                if q.group is None:
                    have.setdefault(r, []).append(form)
        return have

    def _fail_group(self, gk: tuple[int, str], rank: int, req: Request, have: dict[int, list[int]]) -> None:
        """Fail group ``gk`` on every rank at once, ``req`` (from ``rank``) having shown that the ranks'
        sizes differ: one error for each name that any rank's part has (the names follow from the group's
        name and size, and a rank's members all reach its engine together, so its handles are all there to
        fail), and the members still to come remembered, to be dropped as they arrive (:meth:`_late`)."""
        ps, g = gk
        forms = self._forms.pop(gk, {})
        left = {(r, n): n - k for n, seen in forms.items() for r, k in seen.items() if k < n}
        failed = _Failed(req.kind, g, have, left, self._required(ps) - set(have))
        names = [nm for n in dict.fromkeys(n for f in have.values() for n in f) for nm in naming.members(g, n)]
        plain = naming.plain_name(g)
        for (kps, name), entry in self.table.items():  # the members waiting (and why a rank refused its own)
            if kps == ps and any(q.group[0] == g if q.group is not None else name == plain
                                 for q in entry.requests.values()):
                names.append(name)
                failed.refused.update((r, q.reason) for r, q in entry.requests.items() if type(q) is Refusal)
        if type(req) is Refusal:
            failed.refused[rank] = req.reason
        for n in forms:  # the members negotiated already, held for the rest of their group
            names += [nm for resp in self._groups.pop((ps, g, n), []) for nm in resp.names]
        text = failed.text()
        for name in dict.fromkeys(names):
            self._fail_name(ps, name, text)
        if failed.left or failed.waiting:
            self._failed[gk] = failed

    def _late(self, failed: _Failed, gk: tuple[int, str], rank: int, n: int, req: Request) -> bool:
        """True if ``req`` belongs to failed group ``gk``, and then it is dropped: a member of a rank's part
        whose error has gone out, or the first of a part not seen before (a rank that reached the group
        late), whose members all fail now. A rank whose part is all in starts afresh (its next step)."""
        left = failed.left.get((rank, n), 0)
        if left > 1:
            failed.left[(rank, n)] = left - 1
        elif left == 1:
            del failed.left[(rank, n)]
        elif rank in failed.waiting:
            failed.waiting.discard(rank)
            failed.counts[rank] = [n]
            if n > 1:
                failed.left[(rank, n)] = n - 1
            if type(req) is Refusal:
                failed.refused[rank] = req.reason
            text = failed.text()
            for name in naming.members(gk[1], n):
                self._fail_name(gk[0], name, text)
        else:
            return False
        if not failed.left and not failed.waiting:
            del self._failed[gk]
        return True

    def _fail_name(self, ps: int, name: str, text: str) -> None:
        """An error for ``name`` on every rank of set ``ps`` (each fails its handle of that name, if it
        has one), and the name's requests forgotten, so that no rank is left waiting under it."""
        self.table.pop((ps, name), None)
        self.ready.append(error(ps, name, MismatchError, text))

    # -- validation ----------------------------------------------------------------------------
    def _respond(self, key: tuple[int, str], entry: Entry) -> Response:
        ps, name = key
        reqs = entry.requests if len(entry.requests) == 1 else dict(sorted(entry.requests.items()))
        ranks = list(reqs)
        first_rank, first = ranks[0], reqs[ranks[0]]
        same = all(req == first for req in reqs.values())  # the usual case, checked in C
        if not same or type(first) is Refusal:
            for r, req in reqs.items():
                if type(req) is Refusal:
                    return error(ps, name, MismatchError, f"{req.kind} '{name}': rank {r} refused its input at "
                                                          f"submission: {req.reason}")
        for r in ([] if same else ranks[1:]):
            req = reqs[r]
            if req.kind != first.kind:
                return self._error(ps, name, f"'{name}': rank {r} did {req.kind}{at(req)}, rank {first_rank} did "
                                             f"{first.kind}{at(first)}; every rank must run the same op on a name"
                                             f"{order(first)}", first)
            for f in _COMPARED[first.kind]:
                a, b = _field(req, f), _field(first, f)
                if a != b:
                    label = "dimensions" if f == "trailing" else {
                        "pre": "prescale factor", "post": "postscale factor",
                        "layout": "a packed buffer whose tensors' shapes or dtypes differ: layout"}.get(f, f)
                    if f == "device":
                        return self._error(ps, name, f"{first.kind} '{name}': rank {r} sent a tensor on {_show(f, a)}, "
                                                     f"rank {first_rank} one on {_show(f, b)}; every rank must give "
                                                     "a GPU tensor, or every rank a host one", first)
                    return self._error(ps, name, f"{first.kind} '{name}': rank {r} sent {label} {_show(f, a)}"
                                                 f"{at(req)}, rank {first_rank} sent {_show(f, b)}{at(first)}"
                                                 f"{order(first)}", first)
        if self.joined and ps == 0 and first.kind not in (ALLREDUCE, BARRIER):
            return self._error(ps, name, f"{first.kind} '{name}' is not supported while ranks "
                                         f"{sorted(self.joined)} have joined (hora.join()); only allreduce is", first)
        self._cache(first)
        kind = first.kind
        if kind == ALLGATHER:
            rows = tuple(reqs[r].shape[0] if r in reqs else 0 for r in self.process_sets[ps])
            return Response(kind, ps, (name,), dtype=first.dtype, shapes=(first.shape,), rows=(rows,),
                            device=first.device)
        if kind == ALLTOALL:
            matrix = tuple(reqs[r].splits for r in self.process_sets[ps])
            return Response(kind, ps, (name,), dtype=first.dtype, shapes=(first.shape,), rows=matrix,
                            device=first.device)
        if kind == ADD_PS:
            for pid, existing in self.process_sets.items():
                if existing == first.ranks:
                    return self._error(ps, name, f"process set {list(first.ranks)} already exists (id {pid})", first)
            reusable = [p for p in self._free_ps if p not in self._removing]  # not in this very batch
            if reusable:
                pid = reusable[0]
                self._free_ps.remove(pid)
            else:
                pid = self._next_ps
                self._next_ps += 1
            self.process_sets[pid] = first.ranks
            return Response(kind, ps, (name,), value=pid)
        if kind == REMOVE_PS:
            pid = first.set_id
            if pid not in self.process_sets or pid == 0:
                return self._error(ps, name, f"process set id {pid} is not registered (or is the global set)", first)
            self._removing[pid] = self.process_sets.pop(pid)
            self._free_ps.append(pid)
            return Response(kind, ps, (name,), value=pid)
        # the ranks that contribute the op's neutral element: those joined that never submitted this
        # tensor. A rank that submitted it before joining contributes its data, like any other (its
        # handle is still waited on; counting it as joined gave a wrong sum on the inline path)
        joined = tuple(r for r in sorted(self.joined) if r not in reqs) if ps == 0 and kind == ALLREDUCE else ()
        return Response(kind, ps, (name,), op=first.op, dtype=first.dtype, shapes=(first.shape,),
                        root=first.root, pre=first.pre, post=first.post, joined=joined, device=first.device)

    def _cache(self, req: Request) -> None:
        """Give ``req``'s signature a bit (evicting the least recently used entry when full). An unnamed op's
        signature leaves its slot out (:func:`hora.engine.unnamed.signature`): it repeats every step."""
        cache = self.cache
        if not req.cacheable or cache.capacity == 0 or not self.cache_on:
            return
        req = signature(req)
        if req in cache.bit_of:
            cache.touch(req)
            return
        if len(cache.bit_of) >= cache.capacity:
            self._evict(*next(iter(cache.bit_of.items())))
        cache.add(self._next_bit, req)
        self.additions.append((self._next_bit, req))
        self._next_bit += 1

    def _evict(self, req: Request, bit: int) -> None:
        cache = self.cache
        cache.evict(bit)
        cache.tombstones[bit] = req
        while len(cache.tombstones) > 4 * cache.capacity:
            cache.tombstones.popitem(last=False)
        self.evictions.append((bit, req.ps))

    def set_cache(self, on: bool) -> None:
        """Autotune's switch of the response cache. Off evicts every entry (the ranks hear it with the
        next responses and send full requests from then on; bits already in flight resolve through the
        tombstones); on lets new signatures get bits again."""
        if on == self.cache_on:
            return
        self.cache_on = on
        if not on:
            for req, bit in list(self.cache.bit_of.items()):
                self._evict(req, bit)

    @staticmethod
    def _error(ps: int, name: str, msg: str, first: Request) -> Response:
        """A negotiation error: a misused process-set call is the caller's bad input, anything else
        a mismatch between ranks."""
        cls: type[HoraError] = HoraValueError if first.kind in (ADD_PS, REMOVE_PS) else MismatchError
        return error(ps, name, cls, msg)

    # -- output --------------------------------------------------------------------------------
    def take(self, nbytes_of) -> tuple[list[Response], list[tuple[int, Request]], list[tuple[int, int]]]:
        """The ready responses, fused, and the cache bits assigned and evicted with them."""
        out: list[list[Response]] = []  # each item: the responses fused into one
        sizes: list[int] = []
        open_: dict[tuple, int] = {}
        for resp in self.ready:
            if resp.kind == ALLREDUCE and self.fusion_threshold > 0:
                key = (resp.ps, resp.op, resp.dtype, resp.pre, resp.post, resp.joined, resp.device)
                n = nbytes_of(resp.dtype, resp.shapes[0])
                i = open_.get(key)
                if i is not None and sizes[i] + n <= self.fusion_threshold:
                    out[i].append(resp)
                    sizes[i] += n
                    continue
                if n < self.fusion_threshold:  # a tensor that fills the buffer alone keeps the bucket open
                    open_[key] = len(out)
                out.append([resp])
                sizes.append(n)
                continue
            out.append([resp])
            sizes.append(0)
        self.ready = []
        self._removed, self._removing = self._removing, {}  # every removal agreed is in this batch
        adds, self.additions = self.additions, []
        evicts, self.evictions = self.evictions, []
        fused = [group[0] if len(group) == 1 else group[0]._replace(
            names=tuple(n for r in group for n in r.names),
            shapes=tuple(sh for r in group for sh in r.shapes)) for group in out]
        if self.arrivals:
            self.account.observe(fused, self.arrivals)
            self.arrivals = {}
        return fused, adds, evicts

    def share(self, peer: int, responses: list[Response], additions: list[tuple[int, Request]],
              evictions: list[tuple[int, int]]) -> tuple[list, list, list]:
        """What rank ``peer`` hears of one :meth:`take` (:func:`hora.engine.subtree.share`)."""
        return share(peer, responses, additions, evictions, self.ranks_of)

    def stalled(self, older_than: float) -> list[tuple[int, str, list[int]]]:
        """(process set, name, missing ranks) for tensors waiting longer than ``older_than`` s."""
        now = time.monotonic()
        return [(ps, name, sorted(self._required(ps) - set(e.requests)))
                for (ps, name), e in self.table.items() if now - e.since > older_than]

