"""A progress watchdog in every worker: a hung rank costs seconds, not ``--pg-timeout``.

A rank that stops making progress (a deadlock, a stuck filesystem, a GPU hang, a SIGSTOP) keeps
every other rank waiting in its next collective, and a stopped process does not even exit when its
agent asks. torch's own answer (``torch.distributed.elastic.timer``) needs a variable set in the
agent, which plain torchrun users do not set; this one needs nothing from the launcher.

Every rank runs a thread that, once a second, publishes a heartbeat (last step, a beat counter,
whether the loop is busy with work that is not a step) in the job's store. When no step is
completing within the deadline (``--hang-timeout``, or 10x the slowest recent step if that is
longer) and this rank is not busy, it reads every heartbeat twice, two beats apart, ending at the
deadline:

- a rank whose beat did not move is hung (stopped, or wedged holding the interpreter);
- a rank that is busy and alive (saving, evaluating, logging) is waited for: not a hang;
- otherwise a live rank whose training thread is not in a collective (the heartbeat says where it
  stands) is hung: a deadlock, a read that never returns, a GPU that never finishes. Its own
  watchdog sees the same and leaves too.

Two ranks read the heartbeats: the *probers*, the first rank and the last (every rank knows them
from the world's size alone), on two nodes wherever the job has two, so that one node's fault never
silences both. Every other rank, once its own deadline has passed, looks for their verdict every
beat: two reads of every heartbeat by every rank were the job's quadratic traffic (at 8,000 ranks,
more than the store answers in the watchdog's 2 s). A rank that finds the probers' own heartbeats
standing still (both of them: one may be the hung rank, and the other then declares), or the store
silent, reads the heartbeats itself, as a prober does.

Then the first rank to see it declares the hang in the store, writes ``hang`` into events.jsonl and
kills hung workers of its own node (their agent would wait 30 s for them to obey SIGTERM); each
rank that finds the verdict kills those of its own node. Where the survivors can go on in process
(membership.py), it hands them the hung ranks' names and they go on without them; otherwise it
exits with EXIT_HUNG, the others follow as their collectives fail, and the agents restart the group
from the last checkpoint. A verdict is first put to the writers' fence: a process the job no longer
holds (a frozen rank woken after the survivors went on without it, whose peers' heartbeats stopped
or whose store went) declares nothing, and leaves with the fence's line and status (EXIT_DROPPED).
The first step and data preparation come before the watchdog is armed; a rank's evaluation,
save and logging are "busy" (its peers wait on), a collective never.

A peer whose process or links went silent is named sooner, by its pulse (silence.py), and a node
cut off from its peers by what the nodes found as they tried each other (reach.py).

Where a rank waits for its peers is marked by the loop itself, whatever the backend (waiting()).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import json
import logging
import os
import platform
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from datetime import timedelta
from typing import Any

from torch.distributed import Store

from elastic_mnist.backoff import cap_connections
from elastic_mnist.distributed import end_process
from elastic_mnist.env import DistEnv
from elastic_mnist.errors import EXIT_HUNG, CannotTell
from elastic_mnist.resilience.agreement import read_present
from elastic_mnist.resilience.fence import NO_FENCE, FenceClosed, NullFence
from elastic_mnist.resilience.findings import Cuts
from elastic_mnist.resilience.heartbeat import (
    Heartbeat,
    StoreSilent,
    Verdict,
    WatchdogClosed,
    probers,
    training_thread_position,
)
from elastic_mnist.resilience.reach import NO_REACH, cut_off_ranks, reach_for
from elastic_mnist.resilience.silence import SilenceWatch, stall_after
from elastic_mnist.resilience.store_wait import STORE_WAIT_S

log = logging.getLogger(__name__)

BEAT_S = 1.0
STEPS_PER_DEADLINE = 10
"""The deadline is at least this many of the slowest recent steps."""
RECENT_STEPS = 100
PROBE_BEATS = 2
"""Beats between the probe's two reads of the heartbeats: a live rank's beat moves in them."""
STORE_TIMEOUT, PREFIX = timedelta(seconds=2), "elastic_mnist/watchdog/"
DECLARED = PREFIX + "hang"


class NullWatchdog:
    """No watchdog: one process, or ``--hang-timeout 0``."""

    def start(self) -> None:
        pass

    def step_done(self, step: int, seconds: float) -> None:
        pass

    @contextlib.contextmanager
    def busy(self, what: str) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        yield

    def absorb(self) -> None:
        """Called on a failure of the training loop; returns unless a hang explains it."""

    def close(self, wait: bool = True) -> None:
        pass


class Watchdog(NullWatchdog):
    def __init__(self, env: DistEnv, store: Store, floor_s: float,
                 report: Callable[[dict[str, Any]], None], beat_s: float = BEAT_S,
                 go_on_without: Callable[[list[int], str], None] | None = None,
                 store_host: int | None = 0, fence: NullFence = NO_FENCE,
                 silent: Callable[[], set[int] | None] | None = None, backend: str = ""):
        """``report(record)`` writes the ``hang`` event where this rank can;
        ``go_on_without(ranks, reason)``, where the survivors can go on in process, hands them
        the hung ranks instead of leaving; ``store_host``: the rank whose process serves
        ``store`` (None when no rank does); ``fence``: the writers', asked before a verdict;
        ``silent()``: the members whose pulse stopped, which a prober watches between verdicts
        (silence.py; None: no pulses, where the survivors cannot go on in process);
        ``backend``: the group's, whose data network the node's first rank tries (reach.py;
        none where empty, or where the survivors cannot go on in process)."""
        self.env, self.store, self.floor_s, self.report = env, store, floor_s, report
        self.fence = fence
        self.beat_s = beat_s
        self.go_on_without = go_on_without
        self.store_host = store_host
        self.store.set_timeout(STORE_TIMEOUT)
        # A stopped store host accepts connections but never answers, and a socket read waits
        # for it however the store's timeout is set: every store call runs here, bounded.
        self._calls = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="watchdog-store")
        self._pending: concurrent.futures.Future | None = None
        self._calling = threading.Lock()  # the training thread calls too (first step, absorb)
        self.peers: dict[int, Heartbeat] = {}
        """Every rank's heartbeat as first read: who and where each is, to find it if it hangs."""
        self.recent: collections.deque[float] = collections.deque(maxlen=RECENT_STEPS)
        self.step = 0
        self.armed = False
        self.busy_with = ""
        self.waits, self.waiting_since = 0, 0.0
        """How many :meth:`waiting` blocks the training thread is in (they nest), since when."""
        self.last_progress = time.monotonic()
        self.beats = 0
        self.prober = env.rank in probers(env.world_size)
        self.silent_looks, self.away_since = 0, None
        """This rank's looks in a row that the store did not answer; since when its probe has
        found the store away (None: it answered)."""
        self.prober_beats: dict[int, int] | None = None
        """The probers' beats at this rank's last look for their verdict."""
        self.identity = {"host": platform.node(), "pid": os.getpid(), "ppid": os.getppid()}
        self.training_thread = threading.get_ident()  # the one that builds the watchdog
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._declaring = threading.Lock()  # two threads reach verdicts: the hang's, the silence's
        on = go_on_without is not None  # the survivors go on in process
        nodes = lambda: {r: beat.node for r, beat in self.peers.items()}
        self.silence = (SilenceWatch(env.rank, silent, self.stalled_s, self._declare_silent,
                                     self._stop, lambda: max(self.recent, default=0.0), cut=Cuts(
                                         store, self._call, nodes, lambda: self.step)
                                     if backend else None)
                        if silent is not None and on and self.prober else None)
        self.reach = (reach_for(env.rank, env.local_rank, backend, store, self._call)
                      if backend and on else NO_REACH)

    # --- the training thread --------------------------------------------------------------------

    def start(self) -> None:
        self._publish()  # before the first step: once it is done, every rank's entry is there
        with contextlib.suppress(StoreSilent):  # a store gone is seen by the probe
            self.reach.announce()
        self.reach.watch(self.stalled_s, lambda: stall_after(max(self.recent, default=0.0)),
                         lambda: self.step, self._stop)
        self._thread.start()
        if self.silence is not None:
            self.silence.start()

    def step_done(self, step: int, seconds: float) -> None:
        self.step, self.away_since = step, None  # a step: any wait for the store is over
        self.last_progress = time.monotonic()
        if self.armed:
            self.recent.append(seconds)
        else:  # the first step (compiling, warming up) is no measure of the others
            # Who and where each is, to kill it if it stops: a prober reads every rank's; any
            # other rank its own node's (ranks are numbered node by node), the ones it can kill.
            first = self.env.rank - self.env.local_rank
            self.peers = self._table(None if self.prober else
                                     range(first, first + self.env.local_world_size)) or {}
            self.armed = True

    @contextlib.contextmanager
    def busy(self, what: str) -> Iterator[None]:
        """Work between steps that may take long (saving, evaluating): not a hang."""
        self.busy_with = what
        try:
            yield
        finally:
            self.busy_with = ""
            self.last_progress = time.monotonic()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """The training thread waits for its peers inside the block (a collective, or the host
        sync that reads its result): if the group hangs, it is not this rank that hangs it.
        Blocks nest: the step's wait holds a collective's own, and the rank waits until the
        outermost ends (NCCL's collective returns at once; the read after it blocks)."""
        if not self.waits:
            self.waiting_since = time.monotonic()
        self.waits += 1
        try:
            yield
        finally:
            self.waits -= 1

    waiting_for_peers = property(lambda self: self.waits > 0)

    def stalled_s(self) -> float | None:
        """How long this rank has waited for its peers in its current wait; None while it does
        not (and before its first step, and while busy with work of its own)."""
        if not self.armed or self.busy_with or not self.waits:
            return None
        return time.monotonic() - self.waiting_since

    def deadline_s(self) -> float:
        return max(self.floor_s, STEPS_PER_DEADLINE * max(self.recent, default=0.0))

    def absorb(self) -> None:
        """A collective failed: if a peer declared a hang, this rank leaves quietly as well."""
        if self._fenced():
            return
        try:
            found = self._call(self.store.check, [DECLARED])
            record = json.loads(self._call(self.store.get, DECLARED)) if found else None
        except StoreSilent:  # the store went with its host
            record = None
        if record is not None:
            log.error("leaving the group: rank %s declared it hung after step %s",
                      record["reported_by"], record["last_step"])
            self._exit()

    def close(self, wait: bool = True) -> None:
        """Stops the watchdog; ``wait=False`` does not wait for a store call in flight."""
        self._stop.set()
        if wait and self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        self._calls.shutdown(wait=False)
        self.reach.close()

    def _call(self, method: Callable[..., Any], *args: Any) -> Any:
        """``method(*args)`` on the store, or StoreSilent if it does not answer in time (at once
        while an earlier call still waits for it)."""
        with self._calling:
            if self._pending is not None and not self._pending.done():
                raise StoreSilent
            try:
                self._pending = self._calls.submit(method, *args)
            except RuntimeError as e:  # submitted after close: the generation is over
                raise WatchdogClosed from e
            try:
                return self._pending.result(STORE_TIMEOUT.total_seconds())
            except (concurrent.futures.TimeoutError, RuntimeError) as e:
                raise StoreSilent from e

    # --- the watchdog thread --------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.beat_s):
            cap_connections()  # the connections opened since: heard within 1 s of a heal
            self._publish()
            if not self._probe_due():
                continue
            if not self.prober:
                found = self._probers_verdict()
                if found == "wait":
                    continue
                if found != "probe":  # the probers' verdict: this rank follows it
                    self._follow(found)
                    return
            verdict = self._probe()
            if verdict is None:  # a peer is busy, or steps moved meanwhile: a fresh deadline
                self.last_progress = time.monotonic()
                continue
            step = self.step
            time.sleep(max(0.0, self.deadline_s() - (time.monotonic() - self.last_progress)))
            if self.step == step and not self.busy_with and not self._stop.is_set():
                self._declare(verdict)  # at the deadline, not before

    def _probers_verdict(self) -> dict[str, Any] | str:
        """A rank that does not probe, past its deadline: the probers' verdict, once declared
        (looked for every beat); ``wait`` while the probers beat on and nothing is declared yet;
        ``probe`` when this rank must read the heartbeats itself: both probers' heartbeats
        stood still between two reads of them (every PROBE_BEATS beats), or the store does not
        answer."""
        if time.monotonic() - self.last_progress < self.deadline_s():
            return "wait"
        try:
            if self._call(self.store.check, [DECLARED]):
                return json.loads(self._call(self.store.get, DECLARED))
            if self.beats % PROBE_BEATS:
                return "wait"
            keys = [f"{PREFIX}{rank}" for rank in probers(self.env.world_size)]
            beats = {beat.rank: beat.beat for beat in (
                Heartbeat(**json.loads(v))
                for v in read_present(self.store, keys, self._call).values())}
        except StoreSilent:  # twice in a row: a store loaded by the hang answers late once
            self.silent_looks += 1
            return "probe" if self.silent_looks >= 2 else "wait"
        self.silent_looks = 0
        last, self.prober_beats = self.prober_beats, beats
        if last is None:
            return "wait"
        # One prober standing still may be the hung rank itself: the other declares. Both
        # standing still, nobody will.
        moved = [rank for rank in probers(self.env.world_size)
                 if rank in beats and beats[rank] != last.get(rank)]
        return "wait" if moved else "probe"

    def _follow(self, record: dict[str, Any]) -> None:
        """The probers' verdict, found by a rank that does not probe: it kills the stopped
        workers of its own node that the verdict names; then, where the survivors go on in
        process, the membership (woken by the declaration) takes it from there; else it leaves
        as the probers do. A process the job no longer holds leaves at the fence instead."""
        if self._fenced():
            return
        suspects = record.get("ranks") or []
        log.error("hang: rank %s found rank(s) %s hung after step %s (%s)",
                  record.get("reported_by"), ", ".join(map(str, suspects)) or "unknown",
                  record.get("last_step"), record.get("reason"))
        silent = {int(rank): Heartbeat(**beat) for rank, beat in record.get("silent", {}).items()}
        self._kill_stopped_siblings(Verdict(suspects, list(silent), record.get("reason", ""),
                                            silent))
        if self.go_on_without is not None and suspects and self.env.rank not in suspects:
            self.close(wait=False)
            # Declared to the membership as the prober does: the prober may be lost, or held
            # (writing its event), between its claim and its declaration. The first declarer
            # wakes every rank; this one then returns at once.
            self.go_on_without(suspects, record.get("reason", ""))
            return
        self._exit()

    def _publish(self) -> None:
        self.beats += 1
        beat = Heartbeat(rank=self.env.rank, step=self.step, beat=self.beats,
                         busy=self.busy_with, where=training_thread_position(self.training_thread),
                         waiting=self.waiting_for_peers, node=self.env.rank - self.env.local_rank,
                         unreachable=list(self.reach.found), **self.identity)
        with contextlib.suppress(StoreSilent):  # a store gone is seen by the probe
            # Its fields are plain values: ``vars``, not ``asdict``'s deep copy of each.
            self._call(self.store.set, f"{PREFIX}{self.env.rank}", json.dumps(vars(beat)))

    def _probe_due(self) -> bool:
        """The probe's two reads take PROBE_BEATS beats: they start that long before the
        deadline, so that a hang is declared at it."""
        lead = PROBE_BEATS * self.beat_s
        return (self.armed and not self.busy_with and not self._stop.is_set()
                and time.monotonic() - self.last_progress > self.deadline_s() - lead)

    def _table(self, ranks: range | None = None) -> dict[int, Heartbeat] | None:
        """Every rank's heartbeat (those of ``ranks``), None if the store does not answer."""
        keys = [f"{PREFIX}{rank}" for rank in (ranks or range(self.env.world_size))]
        try:
            values = read_present(self.store, keys, self._call).values()
        except StoreSilent:
            return None
        return {beat.rank: beat for beat in (Heartbeat(**json.loads(v)) for v in values)}

    def _probe(self) -> Verdict | None:
        step = self.step
        first = self._table()
        for _ in range(PROBE_BEATS):  # beating on, as every live rank does
            time.sleep(self.beat_s)
            self._publish()
        second = self._table()
        if self.step != step or self.busy_with or self._stop.is_set():
            return None
        if first is None or second is None:
            silent = ("the coordination store does not answer" if self.store_host is None else
                      f"the store that rank {self.store_host} serves does not answer")
            if not self.waiting_for_peers:  # no peer holds this rank up: it is the one stuck
                me = self.env.rank
                return Verdict([me], [], f"alive, not in a collective: rank {me} at "
                               f"{training_thread_position(self.training_thread)}; {silent}", {})
            if self.store_host is None:  # its return wakes this rank (store_wait.py)
                self.away_since = self.away_since or time.monotonic()
                away = time.monotonic() - self.away_since < STORE_WAIT_S  # unless it went on
                return None if away and not self._fenced() else Verdict([], [], silent, {})
            return Verdict([self.store_host], [self.store_host], silent, {})
        self.away_since = None
        ranks = range(self.env.world_size)
        silent = [r for r in ranks if r not in first or r not in second
                  or second[r].beat == first[r].beat]
        if any(second[r].busy for r in ranks if r not in silent):
            return None
        if any(second[r].step != first[r].step for r in ranks if r not in silent):
            return None
        if silent:
            return Verdict(silent, silent, "no heartbeat (stopped or wedged)", second)
        stuck = [r for r in ranks if not second[r].waiting]
        if not stuck:  # all waiting: for a node that its peers cannot reach? (reach.py)
            cut, why = cut_off_ranks(second)
            if cut:
                return Verdict(cut, [], why, second)
        where = "; ".join(f"rank {r} at {second[r].where}" for r in stuck)
        return Verdict(stuck, [], f"alive, not in a collective: {where}" if stuck else
                       "every rank alive and waiting in a collective", second)

    def _fenced(self) -> bool:
        """Asks the fence (bounded by itself, then generation.json decides; never behind a call
        a silent store holds): a process the job no longer holds leaves there, with the fence's
        line and status, instead of declaring a hang. False while it holds, or cannot tell."""
        try:
            self.fence.check(False, True)
        except CannotTell:
            return False
        except FenceClosed:  # the fence's ``on_over`` returned (tests): nothing more is said
            return True
        return False

    def _declare_silent(self, ranks: list[int], reason: str) -> None:
        """The silence watch names ``ranks`` (silence.py): a hang; their node kills them."""
        self._declare(Verdict(ranks, [], reason, {}))

    def _declare(self, verdict: Verdict) -> None:
        if self._declaring.acquire(blocking=False):  # the first closes the watchdog: a second
            # reached meanwhile is dropped, not held behind the first's store calls
            try:
                self._declare_once(verdict)
            finally:
                self._declaring.release()

    def _declare_once(self, verdict: Verdict) -> None:
        # Closed meanwhile (the training thread, woken by a peer's declaration, recovers while
        # the fence is asked): the generation is over, and so is this verdict.
        if self._fenced() or self._stop.is_set():
            return
        self._publish()  # a prober's beat moves as it declares: the others wait for it
        waited = time.monotonic() - self.last_progress
        record = {"rank": verdict.suspects[0] if verdict.suspects else None,
                  "ranks": verdict.suspects, "last_step": self.step,
                  "reported_by": self.env.rank, "reason": verdict.reason,
                  "waited_s": round(waited, 2), "deadline_s": round(self.deadline_s(), 2),
                  # Who and where the silent are: each rank that finds the verdict kills those
                  # of its own node.
                  "silent": {str(r): asdict(beat) for r in verdict.silent
                             if (beat := verdict.heartbeats.get(r) or self.peers.get(r))}}
        try:
            first = self._claim(record)
        except WatchdogClosed:
            return
        go_on = (self.go_on_without is not None and bool(verdict.suspects)
                 and self.env.rank not in verdict.suspects)
        suspects = ", ".join(map(str, verdict.suspects)) or "unknown"
        log.error("hang: no step completed for %.1f s after step %d (deadline %.1f s); hung "
                  "rank(s): %s (%s); %s", waited, self.step, self.deadline_s(), suspects,
                  verdict.reason, "going on without them" if go_on else
                  "leaving so that torchrun restarts the group")
        if first:
            self.report(record)
        self._kill_stopped_siblings(verdict)
        if go_on:
            self.close(wait=False)  # the generation it watched is over
            self.go_on_without(verdict.suspects, verdict.reason)
            return
        self._exit()

    def _claim(self, record: dict[str, Any]) -> bool:
        """True if this rank is the first to declare (or the store is gone and it is the lowest
        rank not suspected): the one that writes the event."""
        try:
            value = json.dumps(record)
            return self._call(self.store.compare_set, DECLARED, "", value).decode() == value
        except WatchdogClosed:
            raise
        except StoreSilent:
            live = [r for r in range(self.env.world_size) if r not in record["ranks"]]
            return bool(live) and self.env.rank == min(live)

    def _kill_stopped_siblings(self, verdict: Verdict) -> None:
        """A stopped process obeys SIGTERM only when continued, and its agent waits 30 s for it
        before SIGKILL: workers of this node (same agent) whose heartbeat stopped go now."""
        for rank in verdict.silent:
            beat = verdict.heartbeats.get(rank) or self.peers.get(rank)
            if (beat is not None and beat.host == self.identity["host"]
                    and beat.ppid == self.identity["ppid"] and beat.pid != os.getpid()):
                log.error("killing rank %d (pid %d): it stopped responding", rank, beat.pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(beat.pid, signal.SIGKILL)

    def _exit(self) -> None:
        end_process(EXIT_HUNG)
