"""Rank 0's negotiation rules, as pure logic (no processes): readiness, order, mismatch errors, groups,
fusion, the response cache, join, process sets and the stall list."""

import pytest

from hora.base.errors import HoraValueError, MismatchError
from hora.engine import messages as m
from hora.engine.coordinator import Coordinator
from hora.engine.execute import nbytes_of
from hora.engine.unnamed import resolve, signature, wire

Average, Sum, Max = 0, 1, 4
pytestmark = pytest.mark.timeout(30)


def req(name, kind=m.ALLREDUCE, op=Sum, dtype="float32", shape=(4,), **kw):
    return m.Request(name, kind, op=op, dtype=dtype, shape=shape, **kw)


def coord(size=2, fusion=1 << 20, cache=16):
    return Coordinator(size, fusion, cache)


def take(c):
    """(responses, cache additions); evictions are checked in the cache tests through c.take directly."""
    return c.take(nbytes_of)[:2]


def submit_all(c, request, ranks=None):
    for r in ranks if ranks is not None else range(c.size):
        c.submit(r, request)


# --- readiness and order ---------------------------------------------------------------------------

def test_a_tensor_is_ready_only_when_every_rank_submitted_it():
    c = coord(3)
    c.submit(0, req("a"))
    c.submit(2, req("a"))
    assert take(c)[0] == []
    c.submit(1, req("a"))
    out, _ = take(c)
    assert [(r.kind, r.names, r.shapes) for r in out] == [(m.ALLREDUCE, ("a",), ((4,),))]
    assert take(c)[0] == []  # taken once


def test_order_is_readiness_order_whatever_each_rank_submitted_first():
    c = coord(2, fusion=0)
    for n in "abc":
        c.submit(0, req(n))
    for n in "cab":
        c.submit(1, req(n))
    assert [r.names[0] for r in take(c)[0]] == ["c", "a", "b"]


def test_names_are_keyed_by_process_set():
    c = coord(2, fusion=0)
    c.process_sets[1] = (0, 1)
    c.submit(0, req("x", ps=0))
    c.submit(1, req("x", ps=1))
    assert take(c)[0] == []
    c.submit(1, req("x", ps=0))
    assert [(r.ps, r.names) for r in take(c)[0]] == [(0, ("x",))]


# --- mismatches ------------------------------------------------------------------------------------

@pytest.mark.parametrize("other,expect", [
    (req("w", shape=(4, 3)), "allreduce 'w': rank 1 sent shape (4, 3), rank 0 sent (4,)"),
    (req("w", dtype="float64"), "allreduce 'w': rank 1 sent dtype 'float64', rank 0 sent 'float32'"),
    (req("w", pre=2.0), "allreduce 'w': rank 1 sent prescale factor 2.0, rank 0 sent 1.0"),
    (req("w", post=0.5), "allreduce 'w': rank 1 sent postscale factor 0.5, rank 0 sent 1.0"),
    (req("w", kind=m.ALLGATHER), "'w': rank 1 did allgather, rank 0 did allreduce"),
])
def test_mismatch_is_one_error_naming_tensor_ranks_and_values(other, expect):
    c = coord(2)
    c.submit(0, req("w"))
    c.submit(1, other)
    (resp,), adds = take(c)
    assert resp.kind == "error" and resp.names == ("w",)
    assert resp.error.cls is MismatchError and resp.error.text.startswith(expect), resp.error
    assert adds == []  # a mismatch is not cached
    # the name is free again
    submit_all(c, req("w"))
    assert [r.kind for r in take(c)[0]] == [m.ALLREDUCE]


def test_reduce_op_and_root_mismatch():
    c = coord(3)
    c.submit(0, req("o", op=Sum))
    c.submit(1, req("o", op=Sum))
    c.submit(2, req("o", op=Max))
    c.submit(0, req("b", kind=m.BROADCAST, root=0))
    c.submit(1, req("b", kind=m.BROADCAST, root=2))
    c.submit(2, req("b", kind=m.BROADCAST, root=0))
    errors = {r.names[0]: r.error.text for r in take(c)[0]}
    assert "rank 2" in errors["o"] and "rank 0" in errors["o"] and "'o'" in errors["o"]
    assert errors["b"].startswith("broadcast 'b': rank 1 sent root 2, rank 0 sent 0")


def test_allgather_compares_only_the_dimensions_after_the_first():
    c = coord(2)
    c.submit(0, req("g", kind=m.ALLGATHER, shape=(2, 3)))
    c.submit(1, req("g", kind=m.ALLGATHER, shape=(5, 3)))
    (resp,), _ = take(c)
    assert resp.kind == m.ALLGATHER and resp.rows == ((2, 5),)
    c.submit(0, req("h", kind=m.ALLGATHER, shape=(2, 3)))
    c.submit(1, req("h", kind=m.ALLGATHER, shape=(2, 4)))
    (resp,), _ = take(c)
    assert resp.kind == "error" and "(3,)" in resp.error.text and "(4,)" in resp.error.text


def test_alltoall_gets_the_splits_matrix():
    c = coord(2)
    c.submit(0, req("t", kind=m.ALLTOALL, shape=(3,), splits=(1, 2)))
    c.submit(1, req("t", kind=m.ALLTOALL, shape=(4,), splits=(4, 0)))
    (resp,), adds = take(c)
    assert resp.rows == ((1, 2), (4, 0))
    assert adds == []  # alltoall requests vary from call to call: never cached


# --- groups ------------------------------------------------------------------------------------------

def test_a_group_is_released_whole_and_fused_together():
    c = coord(2)
    gid = ("grp.0", 3)
    for r in range(2):
        c.submit(r, req("g.0", group=gid))
        c.submit(r, req("g.1", group=gid))
    c.submit(0, req("g.2", group=gid))
    assert take(c)[0] == []  # two of three are ready: wait for the whole group
    c.submit(1, req("g.2", group=gid))
    out, _ = take(c)
    assert [r.names for r in out] == [("g.0", "g.1", "g.2")]


def test_a_mismatch_in_a_group_releases_the_other_members():
    c = coord(2)
    gid = ("grp.0", 3)
    for r in range(2):
        c.submit(r, req("g.0", group=gid))
        c.submit(r, req("g.1", group=gid, shape=(4,) if r == 0 else (5,)))
        c.submit(r, req("g.2", group=gid))
    out, _ = take(c)
    assert sorted(n for r in out for n in r.names) == ["g.0", "g.1", "g.2"], out


def _part(c, rank, group, n, ps=0, make=None):
    """Rank ``rank``'s part of group ``group`` of ``n`` tensors, named as hora.core.ops names them."""
    names = [group] if n == 1 else [f"{group}.{i}" for i in range(n)]
    for nm in names:
        c.submit(rank, (make or req)(nm, group=(group, n), ps=ps))


def _clean(c):
    return not (c.table or c._forms or c._failed or c._groups)


@pytest.mark.parametrize("first", [0, 1])
def test_a_group_whose_size_differs_between_ranks_fails_whole_on_every_rank_at_once(first):
    c = coord(2)
    counts = {0: 1, 1: 2}
    for r in (first, 1 - first):
        _part(c, r, "compress.p", counts[r])
    out, _ = take(c)
    assert sorted(n for r in out for n in r.names) == ["compress.p", "compress.p.0", "compress.p.1"], out
    assert {r.kind for r in out} == {"error"} and {r.error.cls for r in out} == {MismatchError}
    assert {r.error.text for r in out} == {"grouped allreduce 'compress.p': rank 0 submitted 1 tensor(s), rank 1 "
                                           "submitted 2; every rank must pass the same number of tensors"}
    assert _clean(c)
    submit_all(c, req("next"))  # the next collective, and the next step's group of one size, run
    _part(c, 0, "compress.p", 2)
    _part(c, 1, "compress.p", 2)
    out, _ = take(c)
    assert [(r.kind, r.names) for r in out] == [(m.ALLREDUCE, ("next", "compress.p.0", "compress.p.1"))]
    assert _clean(c)


def test_sizes_that_share_member_names_fail_each_name_once():
    c = coord(2)
    _part(c, 0, "g", 2)
    _part(c, 1, "g", 3)  # g.0 and g.1 are names of both parts
    out, _ = take(c)
    assert sorted(n for r in out for n in r.names) == ["g.0", "g.1", "g.2"], out
    assert "rank 0 submitted 2 tensor(s), rank 1 submitted 3" in out[0].error.text
    assert _clean(c)


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1), (0, 2, 1)])
def test_at_np3_a_rank_that_reaches_the_failed_group_late_fails_too(order):
    c = coord(3)
    counts = {0: 2, 1: 1, 2: 2}
    texts = {}
    for r in order:
        _part(c, r, "g", counts[r])
        for resp in take(c)[0]:
            assert resp.kind == "error", resp
            texts.setdefault(r, set()).add(resp.error.text)
    late = order[-1]  # its part comes after the mismatch: it fails as it arrives
    assert texts[late] == {"grouped allreduce 'g': rank 0 submitted 2 tensor(s), rank 1 submitted 1, rank 2 "
                           "submitted 2; every rank must pass the same number of tensors"}, texts
    assert _clean(c)
    submit_all(c, req("after"))
    assert [r.names for r in take(c)[0]] == [("after",)]


def test_unnamed_groups_of_different_sizes():
    c = coord(2)
    _part(c, 0, "group.noname.3", 1)
    _part(c, 1, "group.noname.3", 3)
    out, _ = take(c)
    assert sorted(n for r in out for n in r.names) == ["group.noname.3"] + [f"group.noname.3.{i}" for i in range(3)]
    assert out[0].error.text.startswith("grouped allreduce 'group.noname.3' (an unnamed group"), out[0].error
    assert _clean(c)


@pytest.mark.parametrize("name,group", [("p", "p"), ("noname.4", "group.noname.4")])
@pytest.mark.parametrize("single_first", [True, False])
def test_a_single_op_where_a_peer_runs_a_group_of_two(name, group, single_first):
    c = coord(2)
    steps = [lambda: c.submit(0, req(name)), lambda: _part(c, 1, group, 2)]
    for step in steps if single_first else steps[::-1]:
        step()
    out, _ = take(c)
    assert sorted(n for r in out for n in r.names) == sorted([name, f"{group}.0", f"{group}.1"]), out
    expect = "1 tensor(s)" if name == "p" else "a single allreduce (not grouped)"
    assert f"rank 0 submitted {expect}, rank 1 submitted 2" in out[0].error.text, out[0].error
    assert _clean(c)


def test_a_named_single_op_matches_a_group_of_one():
    c = coord(2)
    c.submit(0, req("p"))
    _part(c, 1, "p", 1)
    assert [(r.kind, r.names) for r in take(c)[0]] == [(m.ALLREDUCE, ("p",))]
    assert _clean(c)


def test_groups_of_one_name_on_different_process_sets_do_not_clash():
    c = coord(2)
    c.process_sets[1] = (0, 1)
    _part(c, 0, "g", 2, ps=0)
    _part(c, 1, "g", 1, ps=1)
    assert take(c)[0] == []
    _part(c, 1, "g", 2, ps=0)
    _part(c, 0, "g", 3, ps=1)
    out, _ = take(c)
    assert [(r.ps, r.kind, r.names) for r in out if r.kind != "error"] == [(0, m.ALLREDUCE, ("g.0", "g.1"))]
    assert sorted(n for r in out if r.kind == "error" for n in r.names) == ["g", "g.0", "g.1", "g.2"]
    assert {r.ps for r in out if r.kind == "error"} == {1} and _clean(c)


def test_a_rank_that_refused_its_group_is_named_with_its_reason():
    c = coord(2)
    c.submit(0, m.Refusal("p", m.ALLREDUCE, "HoraValueError: expected a list", group=("p", 1)))
    _part(c, 1, "p", 2)
    out, _ = take(c)
    assert "rank 0 submitted 1 tensor(s) (refused at submission: HoraValueError: expected a list), rank 1 " \
           "submitted 2" in out[0].error.text, out[0].error
    assert _clean(c)


def test_cached_group_members_of_a_changed_size_fail_too():
    c = coord(2)
    for _ in range(2):
        _part(c, 0, "g", 2)
        _part(c, 1, "g", 2)
        assert [r.names for r in take(c)[0]] == [("g.0", "g.1")]
    bits = {q.name: b for q, b in c.cache.bit_of.items()}
    c.submit_bit(0, bits["g.0"])  # rank 0 sends its cached part, rank 1 a new size
    c.submit_bit(0, bits["g.1"])
    _part(c, 1, "g", 3)
    out, _ = take(c)
    assert sorted(n for r in out for n in r.names) == ["g.0", "g.1", "g.2"] and {r.kind for r in out} == {"error"}
    assert _clean(c)


# --- fusion ------------------------------------------------------------------------------------------

def test_fusion_by_dtype_op_scaling_and_process_set():
    c = coord(2)
    c.process_sets[1] = (0, 1)
    reqs = [req("a"), req("b", dtype="float64"), req("c"), req("d", op=Max), req("e", pre=2.0), req("f"),
            req("g", ps=1), req("h", kind=m.BROADCAST, root=0), req("i", ps=1), req("j", post=3.0)]
    for q in reqs:
        submit_all(c, q)
    out, _ = take(c)
    assert [r.names for r in out] == [("a", "c", "f"), ("b",), ("d",), ("e",), ("g", "i"), ("h",), ("j",)]
    assert out[0].shapes == ((4,), (4,), (4,))


@pytest.mark.parametrize("threshold,groups", [
    (0, [("a",), ("b",), ("c",), ("d",)]),  # 0 turns fusion off
    (32, [("a", "b"), ("c", "d")]),  # 16 bytes each: exactly two fit
    (31, [("a",), ("b",), ("c",), ("d",)]),
    (1 << 20, [("a", "b", "c", "d")]),
])
def test_fusion_threshold(threshold, groups):
    c = coord(2, fusion=threshold)
    for n in "abcd":
        submit_all(c, req(n))
    assert [r.names for r in take(c)[0]] == groups


def test_a_tensor_larger_than_the_threshold_runs_alone():
    c = coord(2, fusion=64)
    submit_all(c, req("small1"))
    submit_all(c, req("big", shape=(100,)))
    submit_all(c, req("small2"))
    submit_all(c, req("small3"))
    out = [r.names for r in take(c)[0]]
    assert ("big",) in out and sorted(n for names in out for n in names) == ["big", "small1", "small2", "small3"]
    assert len(out) <= 3, out  # (Horovod would fuse all three small ones; here the big one may split them)


# --- the response cache ------------------------------------------------------------------------------

def test_cache_assigns_bits_once_and_bits_stand_for_requests():
    c = coord(2)
    submit_all(c, req("a"))
    submit_all(c, req("b"))
    _, adds = take(c)
    assert adds == [(0, req("a")), (1, req("b"))]
    submit_all(c, req("a"))
    assert take(c)[1] == []  # known: no new bit
    c.submit(0, req("b"))
    c.submit_bit(1, 1)
    out, adds = take(c)
    assert [r.names for r in out] == [("b",)] and adds == []


@pytest.mark.parametrize("capacity,bits", [(0, 0), (2, 4), (16, 4)])
def test_cache_capacity(capacity, bits):
    """Every new name gets a bit (the oldest is evicted when full); at most ``capacity`` stay live."""
    c = coord(2, cache=capacity)
    for n in "abcd":
        submit_all(c, req(n))
    _, adds = take(c)
    assert [b for b, _ in adds] == list(range(bits))
    assert len(c.cache.bit_of) == min(capacity, 4)


def test_uncached_kinds():
    c = coord(2)
    submit_all(c, req("barrier.1", kind=m.BARRIER, op=0, dtype="", shape=()))
    assert take(c)[1] == []


# --- join ----------------------------------------------------------------------------------------------

def test_join_lets_the_others_run_with_zeros_and_returns_the_last_rank():
    c = coord(3)
    c.submit(1, req("join", kind=m.JOIN))
    c.submit(0, req("x"))
    c.submit(2, req("x"))
    (resp,), _ = take(c)
    assert resp.kind == m.ALLREDUCE and resp.joined == (1,)
    # a tensor that was waiting for a rank becomes ready when that rank joins
    c.submit(0, req("y"))
    c.submit(2, req("join", kind=m.JOIN))
    (resp,), _ = take(c)
    assert resp.names == ("y",) and resp.joined == (1, 2)
    c.submit(0, req("join", kind=m.JOIN))
    (resp,), _ = take(c)
    assert resp.kind == m.JOIN and resp.value == 0
    # and the next round starts with nobody joined
    c.submit(0, req("z"))
    assert take(c)[0] == []


def test_only_allreduce_and_barrier_run_while_a_rank_is_joined():
    c = coord(2)
    c.submit(1, req("join", kind=m.JOIN))
    c.submit(0, req("g", kind=m.ALLGATHER))
    c.submit(0, req("barrier.1", kind=m.BARRIER, op=0, dtype="", shape=()))
    out, _ = take(c)
    assert out[0].kind == "error" and "ranks [1] have joined" in out[0].error.text
    assert out[1].kind == m.BARRIER


def test_join_does_not_excuse_a_rank_from_other_process_sets():
    c = coord(3)
    c.process_sets[1] = (1, 2)
    c.submit(1, req("join", kind=m.JOIN))
    c.submit(2, req("s", ps=1))
    assert take(c)[0] == []


# --- process sets -------------------------------------------------------------------------------------

def test_add_and_remove_process_sets():
    c = coord(3)
    submit_all(c, m.SetRequest("process_set.1", m.ADD_PS, ranks=(0, 2)))
    submit_all(c, m.SetRequest("process_set.2", m.ADD_PS, ranks=(0, 2)))
    submit_all(c, m.SetRequest("process_set.3", m.ADD_PS, ranks=(1,)))
    out, _ = take(c)
    assert [(r.kind, r.value) for r in out] == [(m.ADD_PS, 1), ("error", None), (m.ADD_PS, 2)]
    assert "already exists" in out[1].error.text and out[1].error.cls is HoraValueError
    assert c.process_sets == {0: (0, 1, 2), 1: (0, 2), 2: (1,)}
    # a tensor in set 1 needs only ranks 0 and 2
    c.submit(0, req("t", ps=1))
    c.submit(2, req("t", ps=1))
    assert [r.names for r in take(c)[0]] == [("t",)]
    submit_all(c, m.SetRequest("process_set.4", m.REMOVE_PS, set_id=1))
    submit_all(c, m.SetRequest("process_set.5", m.REMOVE_PS, set_id=1))
    submit_all(c, m.SetRequest("process_set.6", m.REMOVE_PS, set_id=0))
    out, _ = take(c)
    assert [r.kind for r in out] == [m.REMOVE_PS, "error", "error"]
    assert c.process_sets == {0: (0, 1, 2), 2: (1,)}


def test_a_set_removed_in_a_batch_still_routes_the_work_before_its_removal():
    """Rank 0 has one table of sets, changed when a change is agreed; the responses agreed on a set
    before its removal, in the same batch, still reach (and run on) its ranks."""
    c = coord(3)
    submit_all(c, m.SetRequest("process_set.1", m.ADD_PS, ranks=(1, 2)))
    take(c)
    c.submit(1, req("t", ps=1))
    c.submit(2, req("t", ps=1))
    submit_all(c, m.SetRequest("process_set.2", m.REMOVE_PS, set_id=1))
    out, adds, evicts = c.take(nbytes_of)
    assert [r.kind for r in out] == [m.ALLREDUCE, m.REMOVE_PS] and 1 not in c.process_sets
    assert c.ranks_of(1) == (1, 2)
    assert [r.kind for r in c.share(2, out, adds, evicts)[0]] == [m.ALLREDUCE, m.REMOVE_PS]
    assert [r.kind for r in c.share(0, out, adds, evicts)[0]] == [m.REMOVE_PS]
    take(c)  # the next batch: the set is gone for good
    assert c.ranks_of(1) == ()


# --- stalls --------------------------------------------------------------------------------------------

def test_stalled_lists_missing_ranks(monkeypatch):
    import hora.engine.coordinator as coordinator

    now = [100.0]
    monkeypatch.setattr(coordinator.time, "monotonic", lambda: now[0])
    c = coord(3)
    c.submit(0, req("a"))
    now[0] = 101.0
    c.submit(1, req("b"))
    now[0] = 102.5
    assert c.stalled(2.0) == [(0, "a", [1, 2])]
    assert sorted(c.stalled(1.0)) == [(0, "a", [1, 2]), (0, "b", [0, 2])]
    submit_all(c, req("a"), [1, 2])
    assert c.stalled(1.0) == [(0, "b", [0, 2])]


def test_a_full_cache_evicts_the_least_recently_used_entry():
    c = coord(cache=2)
    for name in ("a", "b"):
        submit_all(c, req(name))
    take(c)
    submit_all(c, req("a"))  # touch a: b is now the least recently used
    take(c)
    submit_all(c, req("c"))
    out, adds, evicts = c.take(nbytes_of)
    assert [q.name for _, q in adds] == ["c"] and [bit for bit, _ in evicts] == [1]
    c.submit_bit(0, 1)  # a rank that had not yet heard of the eviction still gets through
    c.submit_bit(1, 1)
    assert [r.names for r in take(c)[0]] == [("b",)]


def test_unnamed_ops_of_one_call_site_share_one_bit_and_travel_with_their_slot():
    c = coord()
    submit_all(c, req("noname.0", site="t.py:3 in f()"))
    adds = take(c)[1]
    assert [(b, q.name) for b, q in adds] == [(0, "noname")]  # the signature: no slot in it
    first = req("noname.1", site="t.py:3 in f()")
    c.submit(0, first)
    c.submit_bit(1, wire(0, first))  # (bit, the slot's name, no group)
    out, adds = take(c)
    assert adds == [] and [r.names for r in out] == [("noname.1",)]
    assert resolve(c.cache, wire(0, first)) == first


def test_an_unnamed_group_is_cached_without_its_slot():
    c = coord()
    for n in (3, 7):
        gid = (f"group.noname.{n}", 2)
        for r in range(2):
            for i in range(2):
                q = req(f"group.noname.{n}.{i}", shape=(i + 1,), group=gid, site="t.py:5 in g()")
                if n == 7 and r == 1:
                    c.submit_bit(r, wire(c.cache.bit_of[signature(q)], q))
                else:
                    c.submit(r, q)
        out, adds = take(c)
        assert sorted(nm for resp in out for nm in resp.names) == [f"group.noname.{n}.0", f"group.noname.{n}.1"]
        assert [q.name for _, q in adds] == ([] if n == 7 else ["group.noname.0", "group.noname.1"])
        assert not any(resp.error for resp in out)


def test_a_mismatch_in_an_unnamed_slot_names_both_call_sites_and_the_order_rule():
    c = coord()
    c.submit(0, req("noname.4", site="t.py:3 in f()"))
    c.submit(1, req("noname.4", shape=(5,), site="t.py:9 in f()"))
    (resp,), _ = take(c)
    text = resp.error.text
    assert "rank 1 sent shape (5,) (called at t.py:9 in f())" in text, text
    assert "rank 0 sent (4,) (called at t.py:3 in f())" in text and "matched by their order" in text, text
    c.submit(0, req("noname.5", site="t.py:3 in f()"))
    c.submit(1, req("noname.5", kind=m.ALLGATHER, site=""))
    (resp,), _ = take(c)
    assert "rank 1 did allgather (called from no Python frame), rank 0 did allreduce (called at t.py:3" \
        in resp.error.text, resp.error.text


def test_unnamed_ops_from_different_call_sites_still_meet_in_their_slot():
    c = coord()  # (if rank == 0: allreduce(a) else: allreduce(b), as MPI allows)
    c.submit(0, req("noname.0", site="t.py:3 in f()"))
    c.submit(1, req("noname.0", site="t.py:5 in f()"))
    (resp,), _ = take(c)
    assert resp.error is None and resp.names == ("noname.0",)


def test_a_request_named_like_an_automatic_name_is_a_named_one():
    c = coord()  # the fields say what a request is (Request.site), not its name's prefix
    submit_all(c, req("noname.0"))
    assert [q for _, q in take(c)[1]] == [req("noname.0")]
