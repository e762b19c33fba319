"""The elastic driver: ``hora run -np N --min-np A --max-np B --host-discovery-script S ...``.

A state machine (:mod:`hora.runner.elastic.fsm`: the job's states, the transitions written once and a pure
``step``), one thread (this one) that every 50 ms observes, steps and acts; the discovery script
runs in a thread of its own (:mod:`hora.runner.elastic.discovery`) and only ever hands over a host list, so
a failing or hanging script cannot block a decision. The control plane is the job's store (keys:
:mod:`hora.base.elastic_protocol`), served in this process.

Workers. One process per slot (``host:index``, the worker id, stable across respawns), started with
``HORA_ELASTIC=1``, ``HORA_ELASTIC_ID``, ``HORA_ELASTIC_WORKER`` (the process's number k, its output tag
``[k]``), ``HORA_HOSTNAME``, the store's address, scope and secret, and no rank. Each ``init()`` of a worker
writes ``ready/<id>/<k> = n`` and waits for ``answer/<id>/<k>/<n>``: ``gen g`` (its place is in ``plan/g``;
the mesh of g rendezvouses under ``<scope>/e<g>/1``), ``exit`` (its slot is no longer listed, or the job is
over: it exits 0), ``fail`` (the job failed: it raises ``JobFailed``), or ``solo`` (its first init() while a
job is running: a world of one until it enters ``hora.elastic.run``, Horovod #2189). Host updates go to
``update``; when a member of g dies the driver writes ``<scope>/e<g>/1/abort`` so that ranks still connecting
g's mesh give up at once. (Keys: :mod:`hora.base.elastic_protocol`.)

States of the current generation g:

* forming: some workers wait for an answer. The driver waits for every live member of g (they come once
  they leave training: a lost peer, or a host update at their next commit), and for the first generation
  (or when the members alone are fewer than ``--min-np``) for every newly started worker too; otherwise a
  worker still starting joins the next generation through a host update, so that the survivors of a kill
  go on at once. A member that has not come ``--elastic-timeout`` s after g began to break up, or a new
  worker waited for that long after its start, is killed and counted as a failure of its host. No generation
  is formed while a worker's end is not handled yet (it may be a member's: a failure reset). Then generation
  g+1 is formed from the workers that came, at most ``--max-np``, in rank order: the holders of the
  committed state first (workers that completed a sync: ``S/el/synced/<wid>/<k>``), then g's other members
  by their old rank, then newcomers, hosts kept together, so the new rank 0 holds the committed state; when
  no holder is left the job fails (``HORA_ELASTIC_RESTART_ON_LOSS`` opts in to starting over). If fewer than
  ``--min-np`` came, it waits, and fails the job once that has lasted ``--elastic-timeout`` s. The first
  generation has ``-np`` workers, raised to ``--min-np`` and capped at ``--max-np``.
* running: the driver watches worker ends and the host list. A new worker that arrives, or a host of g
  that is no longer listed, is posted as a host update (``update = "<ts> <added|removed>"``): the members
  raise ``HostsUpdatedInterrupt`` at their next commit and come back for g+1. A member that fails makes
  the others fail with ``PeerLostError``: they roll back, come back, and g+1 is formed without it; its
  slot is started again if its host is still listed and not blacklisted. A member whose training function
  raised an ``InternalError`` says so in its request (``ready = "<n> fail <commits> <error>"``). Failure
  resets (a member died, or one says it failed) count towards ``--reset-limit`` (membership changes do not);
  the reset that passes it fails the job, and so do ``HORA_ELASTIC_FAILURE_RESETS`` failure resets in a row
  with no commit in between (the members report their commit counts), even without ``--reset-limit``.
* finishing: a worker exits 0 without being told to (its training is done): no new generation is formed,
  and whoever asks for a place is told to exit. The job succeeds when every worker has ended and no member
  of the last generation failed before one finished (a member that fails after another finished only gets
  a warning: the training is complete); otherwise it exits with the first such failure's status. Workers
  still running ``--elastic-timeout`` s after the first one finished are killed, with a warning (exit 0).

Discovery results (:class:`hora.runner.elastic.policy.DiscoveryGuard`): one that would remove every running
worker, or every worker holding the committed state, or list fewer slots than ``--min-np``, is acted on only
once a later successful run still lists it ``HORA_ELASTIC_DISCOVERY_GRACE`` s after the first; the log says
what was seen and decided.

Hosts (:class:`hora.runner.elastic.policy.FailurePolicy`, which owns the counts below): a host whose workers
fail 3 times in a row (``HORA_ELASTIC_BLACKLIST_AFTER``; an error exit, a crash, a worker that never came or a
lost host count, a kill by SIGKILL/SIGTERM/SIGINT/SIGHUP does not) is blacklisted (its workers are stopped, so
no survivor waits on them), for good or for a growing cooldown within ``--blacklist-cooldown-range``. The count
starts again whenever a worker of the host comes through the end of a generation alive: a host whose workers
crash at start is blacklisted, one whose workers are killed now and then while the others there train is not. A
slot whose workers fail that way ``HORA_ELASTIC_SLOT_FAILURES`` times in a row (its count starts again only when
one of its own workers comes through a generation) fails the job with the last one's status: the survivors on
its host keep the host's count at 0, so without it a deterministic crash would loop for ever.

Every worker failed in its own code (:mod:`hora.runner.elastic.allfailed`): when each member of the generation
(before the first one: each slot's first worker) has exited with an exception of the training code, a restart
would repeat it; as Horovod's driver, this one stops the job then, with the first worker's exception, status
and last lines (a ``ZeroDivisionError`` on every rank is reported as such, not as "fewer than --min-np").

Exit status: 0 on success; the failed worker's status (128+N for signal N); 1 when the driver gives up (below
``--min-np`` too long, ``--reset-limit``, failure resets with no progress, the committed state lost); 128+N
when it is interrupted. (The knobs: :mod:`hora.base.knobs`, group "elastic".)
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any, Callable

from hora.base import elastic_protocol as protocol
from hora.base.outcome import RankOutcome, tail_of
from hora.runner.elastic.allfailed import Round
from hora.runner.elastic.discovery import Discovery
from hora.runner.elastic.ends import WorkerEnds
from hora.runner.elastic.frozen import FrozenKiller
from hora.runner.elastic.fsm import Act, DriverState, Observation, step
from hora.runner.elastic.policy import (DiscoveryGuard, FailurePolicy, below_min_np, host_counts, host_slots,
                                        rank_order, wanted_slots)
from hora.runner.elastic.workers import Pool, Proc
from hora.runner.output import say as _say
from hora.runner.spawn import Output

TICK = 0.05
EXIT_GRACE = 10.0  # s a worker told to exit gets before it is killed
MESH_TIMEOUT = 10  # s: the workers' --start-timeout unless given (see Driver.__init__)


class Driver(WorkerEnds):
    def __init__(self, command: list[str], settings: dict[str, Any], envs: dict[str, str], store: Any,
                 store_addr: Callable[[str], str], output: Output | None, remote: Any = None, pool: Any = None,
                 discovery: Any = None):
        """``pool`` and ``discovery`` replace the process pool (:class:`Pool`: ``start(wid, host, index, env)``
        -> a :class:`Proc`, ``live()``, ``procs``, ``exits``, ``next_number``, ``signal(procs, sig)``,
        ``check_sessions()``, ``stop_all()``) and the script discovery (``hosts``, ``problem``, ``start()``,
        ``close()``; optional ``slots(hosts)``, see :meth:`_wanted`): another launcher (hora.ray's actors, Ray's
        nodes, hora.spark's tasks) brings its own."""
        self.s = settings
        self.np = settings["np"]
        self.min_np, self.max_np = settings["min_np"], settings["max_np"]
        self.timeout, self.start_timeout = settings["elastic_timeout"], settings["start_timeout"]
        self.restart_on_loss = settings.get("restart_on_loss", False)
        self.finished_at: float | None = None  # when the first worker finished training
        self.base_env, self.store, self.store_addr = dict(envs), store, store_addr
        if "HORA_START_TIMEOUT" not in envs and "HOROVOD_START_TIMEOUT" not in envs:
            # a generation's mesh connects processes that are all waiting already: when one of them dies in
            # the middle, the others find out by this timeout, so it is shorter than a static job's 30 s
            self.base_env["HORA_START_TIMEOUT"] = str(MESH_TIMEOUT)
        self.scope = envs["HORA_STORE_SCOPE"]
        self.pool = pool if pool is not None else Pool(command, output, remote)
        self.discovery = discovery if discovery is not None else Discovery(
            settings["script"], settings["slots"], _say, settings["discovery_interval"],
            settings["discovery_timeout"], fixed=settings.get("fixed"))
        self.policy = FailurePolicy.from_settings(settings)
        self.blacklist = self.policy.blacklist
        self.guard = DiscoveryGuard(settings.get("discovery_grace", 5.0), self.min_np)
        self.slots: dict[str, Proc] = {}  # wid -> its current (or last) process
        self.gen = 0
        self.members: list[str] = []  # wids of generation gen, in rank order
        self.member_numbers: list[int] = []  # and their worker numbers (a respawned slot is a new worker)
        self.breaking: float | None = None  # when gen began to break up
        self.failed_member = False  # a member of gen failed: the next generation is a failure reset
        self.first_failure: float | None = None  # for the "resumed after" figure
        self.update_ts = 0
        self.posted = 0  # the update timestamp already posted for this generation
        self.below: float | None = None
        self.finishing = False
        self.failure: tuple[int, str] | None = None  # (exit status, message): the job failed
        self.member_failure: tuple[int, str] | None = None
        self.root: RankOutcome | None = None  # the failed worker to blame when the job fails
        self.round = Round()  # the workers whose failing all in their own code ends the job (allfailed.py)
        self._signal: int | None = None
        self.frozen = FrozenKiller(store, self.scope, _say)  # a member frozen past the limit is killed
        self.state = DriverState.DISCOVERING

    def stop(self, sig: int) -> None:
        """Ask the loop to stop as on signal ``sig`` (from another thread: a launcher's Ctrl-C, say): it
        stops the workers and ``run`` returns ``128 + sig``."""
        self._signal = self._signal or sig

    # --- the loop
    def run(self) -> int:
        old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                old[sig] = signal.signal(sig, lambda n, _f: setattr(self, "_signal", self._signal or n))
        self.discovery.start()
        try:
            return self._loop()
        finally:
            self.discovery.close()
            self.pool.stop_all()
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def _loop(self) -> int:
        """Observe -> :func:`~hora.runner.elastic.fsm.step` -> act, every ``TICK`` s, until a final state."""
        started = time.monotonic()
        while True:
            now = time.monotonic()
            hosts = None
            if self._signal is None:
                self.pool.check_sessions()
                self._exits(now)
                self.frozen.look(self.gen, [] if self.finishing else self.member_numbers, self.pool)
                if self.failure is None:
                    hosts = self._hosts(now)
            self.state, acts = step(self.state, self._observe(now, started, hosts is not None))
            for act in acts:
                code = self._act(act, hosts, now)
                if code is not None:
                    return code
            time.sleep(TICK)

    def _observe(self, now: float, started: float, hosts_known: bool) -> Observation:
        return Observation(
            now=now, started=started, timeout=self.timeout, signal=self._signal, failure=self.failure,
            hosts_known=hosts_known, discovery=getattr(self.discovery, "what", "the host discovery script"),
            discovery_problem=self.discovery.problem, finishing=self.finishing, finished_at=self.finished_at,
            live=len(self.pool.live()) if self.finishing else 0, member_failure=self.member_failure,
            gen=self.gen, breaking=self.breaking is not None)

    def _act(self, act: Act, hosts: dict[str, int] | None, now: float) -> int | None:
        """Do what ``step`` said; the job's exit status when it ends."""
        if act.kind == "log":
            _say(act.text)
        elif act.kind == "interrupt":
            return act.code
        elif act.kind == "fail":
            self.failure = (act.code, act.text)
            return self._fail()
        elif act.kind == "finish":
            return self._result()
        elif act.kind == "dismiss":
            for p in self._ready():
                self._answer(p, "exit the job is over (a worker finished training)")
            for p in self.pool.live():  # one still starting gets the same answer when it asks, or is stopped
                if not p.stopping and p.number not in self.member_numbers:
                    self._stop([p], now, kill=False)
        elif act.kind == "kill_late":
            self._finish_timeout(now)
        elif act.kind == "follow" and hosts is not None:
            self._follow(hosts, now)
        elif act.kind == "form" and hosts is not None:
            ready = self._ready()
            self._post_arrivals(ready)
            self._form(ready, hosts, now)
        elif act.kind == "escalate":
            self._escalate(now)
        return None

    def _hosts(self, now: float) -> dict[str, int] | None:
        for h in self.blacklist.released(now):
            _say(f"host {h} is back from the blacklist")
        running, holding = host_counts([p for p in self.pool.live() if not p.stopping],
                                       lambda p: p.number in self.member_numbers and self._holder(p))
        listed, lines = self.guard.step(self.discovery.hosts, getattr(self.discovery, "checked", now), running,
                                        holding)
        for line in lines:
            _say(line)
        if listed is None:
            return None
        return {h: n for h, n in listed.items() if h not in self.blacklist}

    def _wanted(self, hosts: dict[str, int]) -> list[tuple[str, str, int]]:
        """The slots to run (:func:`hora.runner.elastic.policy.wanted_slots`); a discovery whose slots are not
        ``0..n-1`` on each host (hora.spark's: one per task, a lost task leaves a hole) names them (``slots``)."""
        return wanted_slots(getattr(self.discovery, "slots", host_slots)(hosts), self.np, self.min_np, self.max_np,
                            self.gen, {p.wid for p in self.pool.live() if not p.stopping})

    def _follow(self, hosts: dict[str, int], now: float) -> None:
        """Start the wanted slots that have no worker; deal with workers whose slot is no longer wanted."""
        wanted = self._wanted(hosts)
        names = {w for w, _h, _i in wanted}
        removed = False
        for p in self.pool.live():
            if p.wid in names or p.stopping:
                continue
            if p.number in self.member_numbers:
                removed = removed or self.breaking is None  # it leaves at the next commit, with the others
                p.stopping = True
                p.stop_at = now + self.timeout
            else:
                self._stop([p], now, kill=True)
        if removed:
            self._post(protocol_result="removed")
        for wid, host, index in wanted:
            p = self.slots.get(wid)
            if p is not None and not p.seen:
                continue  # running, or its end not handled yet
            if not self.policy.may_start(wid, now):
                continue
            env = dict(self.base_env)
            env.update({protocol.ID_VAR: wid, protocol.NUMBER_VAR: str(self.pool.next_number), "HORA_HOSTNAME": host,
                        "HORA_ELASTIC": "1", "HORA_STORE_ADDR": self.store_addr(host)})
            self.slots[wid] = self.pool.start(wid, host, index, env)
            if p is None and self.gen == 0:  # the first worker of its slot: one of the first round
                self.round.started(self.slots[wid].number)

    def _ready(self) -> list[Proc]:
        """Live workers waiting for an answer, with their request numbers in ``p.asked``."""
        out = []
        for p in self.pool.live():
            n, error, commits = protocol.parse_ready(self.store.get(protocol.ready_key(self.scope, p.wid, p.number)))
            if n > p.answered:
                p.asked, p.failed_req, p.commits = n, error, commits
                out.append(p)
        return out

    def _post_arrivals(self, ready: list[Proc]) -> None:
        """A newcomer that arrives while a generation runs: answer its first request ``solo`` (see the module
        docstring) and, once it asks to join, tell the members (a host update ``added``)."""
        if not self.members:
            return
        for p in ready:
            if p.number in self.member_numbers or p.stopping:
                continue
            if p.asked == 1 and p.answered == 0:
                self._answer(p, "solo")
                continue
            if not p.announced and self.breaking is None:
                p.announced = True
                self._post(protocol_result="added")

    def _post(self, protocol_result: str) -> None:
        code = {"removed": 1, "added": 2}[protocol_result]
        self.update_ts += 1
        self.store.set(protocol.update_key(self.scope), f"{self.update_ts} {code}".encode())
        _say(f"hosts updated ({protocol_result}): generation {self.gen} re-forms at its next commit")

    # --- forming
    def _form(self, ready: list[Proc], hosts: dict[str, int], now: float) -> None:
        ready = [p for p in ready if p.answered < p.asked]
        for p in ready:
            if p.stopping:  # removed members (and others told to go) that came back for a place
                self._answer(p, "exit its slot is no longer listed (host removed or fewer slots)")
        waiting = [p for p in ready if not p.stopping]
        if any(p.number in self.member_numbers for p in waiting) and self.breaking is None:
            self.breaking = now
        active = [p for p in self.pool.live() if not p.stopping]
        if len(active) < self.min_np:
            self._check_below(now, hosts)
            if self.failure is not None:
                return
        elif self.members and self.breaking is None:
            self.below = None
        if not waiting:
            return
        if any(p.done and not p.seen for p in self.pool.procs):
            return  # an end not handled yet: it may be a member's (a failure reset), decide next tick
        came = {p.number for p in waiting}
        late = []
        for p in active:
            if p.number in came:
                continue
            member = p.number in self.member_numbers
            if member and self.breaking is None:
                return  # the generation runs: newcomers wait for its next commit
            if not member and self.gen > 0 and len(waiting) >= self.min_np:
                continue  # a worker still starting joins later (a host update), the survivors go on now
            if now - (self.breaking if member else p.started) < self.timeout:
                return
            late.append(p)
        for p in late:
            _say(f"worker {p.number} ({p.wid}) did not come to form generation {self.gen + 1} within "
                 f"--elastic-timeout {self.timeout:g} s; stopping it")
            self._stop([p], now, kill=True)
            self._host_failed(p.host, now)
        order = rank_order(waiting, self.member_numbers, self._holder)
        chosen = order[:self.max_np] if self.max_np else order
        if len(chosen) < self.min_np:
            self._check_below(now, hosts)
            return
        self.below = None
        if not self._count_reset(waiting) or not self._holders_left(chosen):
            return
        for p in order[len(chosen):]:
            self._answer(p, f"exit --max-np {self.max_np} workers are running")
        self._start_generation(chosen, now)

    def _count_reset(self, waiting: list[Proc]) -> bool:
        """Count the reset about to happen if it follows a failure (a member died, or one says it failed
        inside: a deterministic error re-forms the job at every try); False when that fails the job."""
        members = [p for p in waiting if p.number in self.member_numbers]
        failed_inside = [p for p in members if p.failed_req]
        progress = any(p.commits > p.base_commits for p in members)
        if not (self.failed_member or failed_inside):
            self.policy.count_reset(False, progress, "")
            return True
        if self.member_failure is not None:
            why = self.member_failure[1]
        elif failed_inside:
            why = f"worker {failed_inside[0].wid}: {failed_inside[0].failed_req}"
        else:
            why = "a worker failed"
        fail = self.policy.count_reset(True, progress, why)
        if fail is not None:
            self.failure = (1, fail)
            return False
        return True

    def _holder(self, p: Proc) -> bool:
        """Whether ``p`` holds the committed state: it completed a sync (and lives, in the last generation)."""
        return self.store.get(protocol.synced_key(self.scope, p.wid, p.number)) is not None

    def _holders_left(self, chosen: list[Proc]) -> bool:
        """The next generation's rank 0 must hold the committed state; when no worker that does is left (the
        state died with them) the job fails, unless HORA_ELASTIC_RESTART_ON_LOSS opts in to start over."""
        if not self.member_numbers or (chosen and self._holder(chosen[0])):
            return True
        held = [p for p in self.pool.procs if p.number in self.member_numbers and self._holder(p)]
        if not held:
            return True  # nobody ever synced in the last generation: every worker has the initial state
        if not self.restart_on_loss:
            gone = " ".join(f"{p.wid}[{p.number}]" for p in held)
            self.failure = (1, f"every worker holding the committed state is gone ({gone}): the state was lost "
                               "with them (HORA_ELASTIC_RESTART_ON_LOSS=1 starts over from the initial state)")
            return False
        _say(f"warning: no worker holding the committed state of generation {self.gen} is left: generation "
             f"{self.gen + 1} starts over from the state its workers start with (HORA_ELASTIC_RESTART_ON_LOSS)")
        return True

    def _start_generation(self, chosen: list[Proc], now: float) -> None:
        for p in chosen:
            if p.number in self.member_numbers:  # it came through the end of a generation alive
                self.policy.came_through(p.wid, p.host)
        fresh = any(p.number not in self.member_numbers for p in chosen)
        self.gen += 1
        plan = protocol.make_plan(self.gen, self.update_ts, self.policy.resets, [(p.wid, p.host) for p in chosen],
                                  fresh)
        self.store.set(protocol.plan_key(self.scope, self.gen), plan.encode())
        for p in chosen:
            self._answer(p, f"gen {self.gen}")
            p.announced, p.gen, p.base_commits = True, self.gen, p.commits
        self.members = [p.wid for p in chosen]
        self.member_numbers = [p.number for p in chosen]
        self.round.begin(self.member_numbers)
        self.breaking, self.failed_member = None, False
        self.member_failure = None
        took = f"; {now - self.first_failure:.2f} s after the failure" if self.first_failure else ""
        self.first_failure = None
        names = " ".join(f"{r}={p.wid}[{p.number}]" for r, p in enumerate(chosen))
        _say(f"generation {self.gen}: {len(chosen)} workers (rank=slot[worker]): {names}"
             f"{'; resets after failures ' + str(self.policy.resets) if self.policy.resets else ''}{took}")

    def _check_below(self, now: float, hosts: dict[str, int]) -> None:
        self.below = self.below or now
        if now - self.below < self.timeout:
            return
        have = [p.wid for p in self.pool.live() if not p.stopping]
        self.failure = (1, below_min_np(have, [w for w, _h, _i in self._wanted(hosts)], self.members, self.gen,
                                        self.guard.acted or {}, sorted(self.blacklist.until), self.min_np,
                                        self.timeout))

    # --- answers and stopping
    def _answer(self, p: Proc, text: str) -> None:
        n = p.asked if p.asked > p.answered else p.answered + 1
        self.store.set(protocol.answer_key(self.scope, p.wid, p.number, n), text.encode())
        p.answered = n
        if text.startswith(("exit", "fail")):
            p.stopping = True
            p.stop_at = time.monotonic() + EXIT_GRACE

    def _stop(self, procs: list[Proc], now: float, kill: bool) -> None:
        for p in procs:
            p.stopping = True
            p.stop_at = now if kill else now + EXIT_GRACE
        self._escalate(now)

    def _escalate(self, now: float) -> None:
        due = [p for p in self.pool.live() if p.stopping and p.stop_at is not None and p.stop_at <= now]
        for p in due:
            p.stop_at = None
        if due:
            self.pool.signal(due, signal.SIGKILL)

    def _fail(self) -> int:
        code, msg = self.failure
        told = self._ready()
        for p in told:
            self._answer(p, f"fail {msg}")
        deadline = time.monotonic() + EXIT_GRACE / 2  # time to say why on their own, before the teardown
        while time.monotonic() < deadline and any(not p.done for p in told):
            time.sleep(TICK)
        _say(f"elastic job failed: {msg}" + (tail_of(self.root) if self.root is not None else ""))
        return code

    def _result(self) -> int:
        """Success unless a member of the last generation failed before any worker finished training."""
        if self.member_failure is not None:
            code, msg = self.member_failure
            _say(f"elastic job failed: {msg}" + (tail_of(self.root) if self.root is not None else ""))
            return code
        return 0
