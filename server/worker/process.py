"""The worker process (owns the engine and the accelerator) and its client in the API process.

They talk over an anonymous pipe pair created by ``multiprocessing`` (no socket, nothing reachable off the machine),
carrying only the msgpack structs of ``server.worker.messages``. Neither side ever blocks on the pipe where it must
stay responsive:

- API process: the asyncio loop only puts encoded messages on a queue; a writer thread sends them (a burst of long
  prompts can be more bytes than the pipe buffers, and a worker busy in a prefill, or frozen, does not read). A reader
  thread receives and hands each message to the loop; requests get an ``asyncio.Queue`` of worker messages each.
- Worker process: a reader thread receives every message at once, answers health probes itself (with how long the
  scheduler has been in its current step, so a stuck engine still shows) and queues the rest for the scheduler,
  which handles them between two steps.
"""
from __future__ import annotations

import asyncio
import dataclasses
import gc
import functools
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
import uuid
from multiprocessing.connection import Connection
from typing import Callable

from server.config import EngineConfig
from server.worker import messages as m

log = logging.getLogger("specserve.worker")


def freeze_startup_heap() -> None:
    """Move every object alive after start-up (torch, transformers, the model's Python objects: millions) out of the
    garbage collector's reach. Otherwise a full collection walks them all, and one came about 200 ms into serving,
    stalling every stream at once: the API process's event loop, and the worker's step on the shared cores."""
    gc.collect()
    gc.freeze()


def worker_main(cfg: EngineConfig, conn: Connection) -> None:
    """Entry point of the worker process: build the engine, announce it, then serve until told to stop."""
    import torch

    from server.engine import faults, load_engine
    from server.engine.stepcost import BUDGET_ROWS, STEP_GAP_FACTOR, step_costs, step_token_budget
    from server.worker.budget import DraftBudget
    from server.worker.scheduler import Scheduler

    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    if os.environ.get("SPECSERVE_WORKER_THREADS"):
        torch.set_num_threads(int(os.environ["SPECSERVE_WORKER_THREADS"]))
    engine = load_engine(cfg)
    engine.faults = faults.from_env()
    send_lock = threading.Lock()  # the scheduler and the reader thread (pongs) both send

    def send(msg: m.FromWorker) -> None:
        data = m.encode(msg)
        with send_lock:
            conn.send_bytes(data)

    a = engine.target.args
    send(m.Ready(engine.target.model_id, engine.drafter.name, cfg.cache.max_seq_len, engine.pool.num_slots,
                 a.vocab_size, str(engine.device), str(engine.dtype).removeprefix("torch.")))
    budget, max_step = DraftBudget.fixed(), cfg.server.max_step_tokens
    goodput = cfg.server.draft_budget == "goodput" and engine.drafter.name != "none"
    if goodput or max_step is None:
        curve = step_costs(engine, max_step or BUDGET_ROWS[-1], engine.target.hf_dir)
        if max_step is None:
            log.info("server.max_step_tokens: a step within %.1f times its decoding rows' cost on the measured curve "
                     "(%d rows when one sequence decodes)", STEP_GAP_FACTOR, step_token_budget(curve))
            max_step = functools.partial(step_token_budget, curve)
        if goodput:
            budget = DraftBudget.from_curve(curve)
    sched = Scheduler(engine, send, cfg.server.max_waiting, max_step, budget)
    freeze_startup_heap()
    inbox: queue.SimpleQueue = queue.SimpleQueue()  # messages for the scheduler, or the exception that ended reading
    threading.Thread(target=_worker_reader, args=(conn, inbox, lambda: m.Pong("", sched.busy_s(), sched.failed_steps),
                                                  send), name="specserve-worker-reader", daemon=True).start()

    def poll(timeout: float = 0.0) -> None:
        """Handle every queued message (wait up to `timeout` seconds for the first), then update the gauges."""
        try:
            item = inbox.get(timeout=timeout) if timeout > 0 else inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(item, BaseException):
                raise item
            sched.handle(item)
            try:
                item = inbox.get_nowait()
            except queue.Empty:
                break
        sched.status()  # queued / aborted requests show at once, not after a whole admission round

    try:
        while not (sched.stopping and sched.idle):
            poll(0.0 if not sched.idle else 0.05)
            if sched.stopping and sched.idle:
                break
            sched.tick()
            sched.status()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        log.info("API process went away; worker exits")


def _worker_reader(conn: Connection, inbox: queue.SimpleQueue, state: Callable[[], m.Pong],
                   send: Callable[[m.FromWorker], None]) -> None:
    """Worker side: drain the pipe continuously; answer probes here, queue everything else for the scheduler."""
    try:
        while True:
            msg = m.decode_to_worker(conn.recv_bytes())
            if isinstance(msg, m.Ping):
                now = state()
                send(m.Pong(msg.request_id, now.busy_s, now.failed_steps))
            else:
                inbox.put(msg)
    except (EOFError, OSError):
        inbox.put(EOFError("the API process closed the pipe"))
    except Exception as e:  # a malformed message: the scheduler's thread re-raises it and the worker exits
        inbox.put(e)


class WorkerDied(RuntimeError):
    """The worker process exited or stopped answering."""


RESTART_WINDOW_S = 600.0  # server.worker_restarts counts the restarts within this many seconds


class _Link:
    """One worker process and the pipe to it, with the queue its writer thread sends from."""

    def __init__(self, cfg: EngineConfig):
        ctx = mp.get_context("spawn")  # a fresh interpreter: no inherited threads, CUDA-safe
        self.conn, self._child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=worker_main, args=(cfg, self._child), name="specserve-worker", daemon=True)
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()  # encoded messages for the writer thread; None ends it

    def start(self, timeout: float) -> m.Ready:
        """Start the process and block until it has loaded the model; then start the writer thread."""
        self.process.start()
        self._child.close()
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.2):
            if not self.process.is_alive():
                raise WorkerDied(f"worker exited during start-up (exit code {self.process.exitcode})")
            if time.monotonic() > deadline:
                self.process.kill()
                raise WorkerDied("worker did not become ready in time")
        try:
            msg = m.decode_from_worker(self.conn.recv_bytes())
        except Exception as e:  # it exited between the poll and the read, or sent something malformed
            self.process.kill()
            raise WorkerDied(f"no Ready message from the worker: {type(e).__name__}: {e}") from None
        if not isinstance(msg, m.Ready):
            self.process.kill()
            raise WorkerDied(f"unexpected first message from the worker: {msg!r}")
        threading.Thread(target=self._writer, name="specserve-worker-writer", daemon=True).start()
        return msg

    def _writer(self) -> None:
        """Send queued messages in order; blocking here (a full pipe) never blocks the event loop."""
        while (data := self.outbox.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except (OSError, ValueError):  # the worker is gone: the reader sees the pipe close and reports it
                return


class WorkerClient:
    """API-process side: start the worker, submit requests, route replies, notice the worker's death or an engine
    that fails every step, and restart it.

    A restart (at most ``server.worker_restarts`` within RESTART_WINDOW_S) fails the requests that were running
    (they had received output) with a clear error; the ones that had not started are sent again to the new worker,
    once: a request that was pending through two deaths fails (it may be what kills the worker). While the worker
    restarts, ``alive`` is False (new requests are refused with a 503) and ``restarting`` is True. Past the budget, or
    when a restart fails, ``on_death`` runs (``serve`` exits with status 1 for its supervisor to restart it)."""

    def __init__(self, cfg: EngineConfig, on_death: Callable[[], None] | None = None,
                 on_restart: Callable[[], None] | None = None):
        self.cfg = cfg
        self.on_death, self.on_restart = on_death, on_restart
        self.ready: m.Ready | None = None
        self.dead = False
        self.crashed = False  # died without being told to shut down, and was not restarted
        self.restarting = False
        self.restarts: list[float] = []  # monotonic times of the restarts so far
        self.failed_steps = 0  # the worker's count of consecutive steps failed as a whole (Status, Pong)
        self._closing = False
        self._queues: dict[str, asyncio.Queue] = {}
        self._unstarted: dict[str, m.Generate] = {}  # submitted, no answer from the worker yet
        self._resent: set[str] = set()  # sent again to a restarted worker
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listeners: list[Callable[[m.FromWorker], None]] = []
        self._link = _Link(cfg)

    @property
    def process(self):
        return self._link.process

    def start(self, timeout: float = 600.0) -> m.Ready:
        """Start the worker and block until it has loaded the model (first GGUF conversion included)."""
        self.ready = self._link.start(timeout)
        return self.ready

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Begin routing worker messages into ``loop`` (call from the serving event loop)."""
        self._loop = loop
        self._read(self._link)

    def _read(self, link: _Link) -> None:
        threading.Thread(target=self._reader, args=(link,), name="specserve-worker-reader", daemon=True).start()

    def add_listener(self, fn: Callable[[m.FromWorker], None]) -> None:
        """``fn`` sees every message on the event loop (metrics)."""
        self._listeners.append(fn)

    def _reader(self, link: _Link) -> None:
        try:
            while True:
                # what has arrived goes to the loop in one wake-up (a step sends several messages)
                batch = [m.decode_from_worker(link.conn.recv_bytes())]
                while len(batch) < 64 and link.conn.poll(0):
                    batch.append(m.decode_from_worker(link.conn.recv_bytes()))
                try:
                    self._loop.call_soon_threadsafe(self._dispatch_all, link, batch)
                except RuntimeError:  # loop closed
                    return
        except (EOFError, OSError):
            pass
        except Exception:  # a malformed message means the worker is broken: treat as death
            log.exception("bad message from the worker")
            link.process.kill()
        try:
            self._loop.call_soon_threadsafe(self._died, link)
        except RuntimeError:  # the serving loop is already closed: we are shutting down
            self.dead = True

    def _dispatch_all(self, link: _Link, msgs: list[m.FromWorker]) -> None:
        if link is not self._link:
            return  # a worker already replaced
        for msg in msgs:
            self._dispatch(msg)

    def _dispatch(self, msg: m.FromWorker) -> None:
        for fn in self._listeners:
            fn(msg)
        if isinstance(msg, (m.Status, m.Pong)):
            self._engine_health(msg.failed_steps)
        if isinstance(msg, (m.Status, m.Step)):  # for the listeners (metrics) only
            return
        self._unstarted.pop(msg.request_id, None)
        q = self._queues.get(msg.request_id)
        if q is not None:
            q.put_nowait(msg)
            if isinstance(msg, (m.Failed, m.Aborted, m.Pong)) or (isinstance(msg, m.Tokens) and msg.finish_reason):
                self._queues.pop(msg.request_id, None)
                self._resent.discard(msg.request_id)

    @property
    def failing(self) -> bool:
        """The engine has failed ``server.unhealthy_after_failed_steps`` steps in a row."""
        return self.failed_steps >= self.cfg.server.unhealthy_after_failed_steps

    def _engine_health(self, failed_steps: int) -> None:
        self.failed_steps = failed_steps
        if self.failing and not self.dead and not self._closing:
            log.error("the engine failed %d steps in a row: restarting the worker", failed_steps)
            self._link.process.kill()  # the reader sees the pipe close: _died restarts it

    def _died(self, link: _Link) -> None:
        if self.dead or link is not self._link:
            return
        self.dead = True
        link.outbox.put(None)
        if self._closing:
            return
        now = time.monotonic()
        recent = [t for t in self.restarts if now - t < RESTART_WINDOW_S]
        can_restart = len(recent) < self.cfg.server.worker_restarts
        log.error("the worker process died (exit code %s)%s", link.process.exitcode,
                  "; restarting it" if can_restart else
                  f"; {len(recent)} restarts in the last {RESTART_WINDOW_S:.0f} s: not restarting it")
        for rid in [rid for rid in self._unstarted if rid not in self._queues]:  # nobody waits for it any more
            del self._unstarted[rid]
        keep = {rid for rid in self._unstarted if rid not in self._resent} if can_restart else set()
        for rid, q in list(self._queues.items()):
            if rid not in keep:
                q.put_nowait(m.Failed(rid, "the model worker process died while this request was in it"
                                      + ("; it is being restarted" if can_restart else ""), kind="server_error"))
                self._queues.pop(rid, None)
                self._unstarted.pop(rid, None)
                self._resent.discard(rid)
        if not can_restart:
            self.crashed = True
            if self.on_death:
                self.on_death()
            return
        self.restarting = True
        self.restarts = recent + [now]
        threading.Thread(target=self._restart, args=(link,), name="specserve-worker-restart", daemon=True).start()

    def _restart(self, old: _Link) -> None:
        """A new worker (its own thread: loading the model takes seconds to minutes); the loop takes it over. The
        old process is gone first (its memory freed), and the new one gets as many KV slots as the first had."""
        old.process.kill()
        old.process.join(30)
        cache = dataclasses.replace(self.cfg.cache, num_slots=self.ready.num_slots)
        link = _Link(dataclasses.replace(self.cfg, cache=cache))
        try:
            ready = link.start(timeout=600.0)
        except Exception as e:
            log.exception("the worker could not be restarted")
            self._call(self._restart_failed, e)
            return
        if self._closing or not self._call(self._restarted, link, ready):
            link.process.kill()  # the server is shutting down: nobody will take this worker over

    def _call(self, fn, *args) -> bool:
        """Run ``fn(*args)`` on the serving loop (from another thread); False once the loop is closed."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
            return True
        except RuntimeError:
            return False

    def _restarted(self, link: _Link, ready: m.Ready) -> None:
        self._link, self.ready = link, ready
        self.dead, self.restarting, self.failed_steps = False, False, 0
        if self._closing:
            link.process.kill()
            return
        self._read(link)
        log.info("worker restarted (pid %d); sending it the %d requests that had not started", link.process.pid,
                 len(self._unstarted))
        for rid, req in list(self._unstarted.items()):
            self._resent.add(rid)
            self._send(req)
        if self.on_restart:
            self.on_restart()

    def _restart_failed(self, e: Exception) -> None:
        self.restarting = False
        self.crashed = True
        for rid, q in list(self._queues.items()):
            q.put_nowait(m.Failed(rid, f"the model worker process died and could not be restarted: {e}",
                                  kind="server_error"))
        self._queues.clear()
        self._unstarted.clear()
        self._resent.clear()
        if self.on_death:
            self.on_death()

    def _send(self, msg: m.ToWorker) -> None:
        """Queue `msg` for the writer thread (never blocks)."""
        if self.dead:
            raise WorkerDied("the worker process is restarting" if self.restarting else
                             "the worker process is not running")
        self._link.outbox.put(m.encode(msg))

    def submit(self, req: m.Generate | m.Ping) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._queues[req.request_id] = q
        try:
            self._send(req)
        except WorkerDied:
            self._queues.pop(req.request_id, None)
            raise
        if isinstance(req, m.Generate):
            self._unstarted[req.request_id] = req
        return q

    def abort(self, request_id: str, final: bool = False) -> None:
        """Tell the worker to drop the request. Nothing more is routed to its queue, unless `final`: then the queue
        gets the worker's last word on it, `Aborted` with the stats so far or the finishing `Tokens`."""
        held = request_id in self._queues if final else self._queues.pop(request_id, None) is not None
        self._unstarted.pop(request_id, None)  # never sent again to a restarted worker
        self._resent.discard(request_id)
        if self.dead:  # restarting: the new worker never hears of it
            q = self._queues.pop(request_id, None)
            if q is not None and final:
                q.put_nowait(m.Aborted(request_id, None))
            return
        if held:
            try:
                self._send(m.Abort(request_id))
            except WorkerDied:
                pass

    async def ping(self, timeout: float) -> m.Pong | None:
        """The worker's answer to a probe, or None when none came within ``timeout`` seconds."""
        rid = new_request_id("ping")
        try:
            q = self.submit(m.Ping(rid))
            pong = await asyncio.wait_for(q.get(), timeout)
        except (WorkerDied, asyncio.TimeoutError):
            self._queues.pop(rid, None)
            return None
        return pong if isinstance(pong, m.Pong) and not self.dead else None

    @property
    def in_flight(self) -> int:
        """Generation requests submitted and not finished (health probes excluded)."""
        return sum(1 for rid in self._queues if not rid.startswith("ping-"))

    @property
    def alive(self) -> bool:
        return not self.dead and self.process.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._closing = True
        link = self._link
        if self.alive:
            try:
                self._send(m.Shutdown())
            except WorkerDied:
                pass
        link.outbox.put(None)  # the writer ends after sending what is queued
        if link.process.pid is None:
            return  # never started
        link.process.join(timeout)
        if link.process.is_alive():
            link.process.terminate()
            link.process.join(5)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
