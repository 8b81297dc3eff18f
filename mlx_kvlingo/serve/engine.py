"""One worker thread runs all MLX work, fed by a bounded queue.

MLX models and caches are not safe to use from several threads at once, and one
CPU/GPU gains nothing from interleaving requests. Request threads submit a *job*
(a function returning an iterator of events) and read its events as they come;
a full queue is refused at once (:class:`QueueFull`) so the server can answer
503 instead of piling up work; a job whose client went away is cancelled and
stops at its next event.
"""

import queue
import threading
import time
from typing import Callable, Iterator, Optional

from ..errors import KvlingoError

_END = object()


class QueueFull(KvlingoError):
    """The engine's queue holds as many waiting jobs as it may."""


class Job:
    """A submitted job: iterate it for its events (an exception raised by the job
    is re-raised here); :meth:`cancel` stops it at its next event."""

    def __init__(self, fn: Callable[[Callable[[], bool]], Iterator]):
        self.fn = fn
        self.events: "queue.Queue" = queue.Queue()
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.started: Optional[float] = None
        self.finished = threading.Event()

    def cancel(self):
        self.cancelled.set()

    def next_event(self, timeout: Optional[float] = None):
        """The next event, or raises ``queue.Empty`` after ``timeout``, or
        ``StopIteration`` at the end."""
        ev = self.events.get(timeout=timeout)
        if ev is _END:
            self.events.put(_END)  # stay at the end for later calls
            raise StopIteration
        if isinstance(ev, _Failure):
            raise ev.error
        return ev

    def __iter__(self):
        while True:
            try:
                yield self.next_event()
            except StopIteration:
                return


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class Engine:
    """The worker thread and its queue (``max_queue`` waiting jobs, besides the
    one running)."""

    def __init__(self, max_queue: int = 8, on_exit: Optional[Callable[[], None]] = None):
        if max_queue < 1:
            raise KvlingoError("max_queue must be at least 1.")
        self._queue: "queue.Queue" = queue.Queue(maxsize=max_queue)
        self._on_exit = on_exit
        self._closed = False
        self.running: Optional[Job] = None
        self.completed = 0
        self.cancelled = 0
        self._thread = threading.Thread(target=self._loop, name="kvlingo-engine", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    def submit(self, fn: Callable[[Callable[[], bool]], Iterator]) -> Job:
        """Queue ``fn(cancelled)`` (it returns an iterator of events); raises
        :class:`QueueFull` when the queue is full."""
        if self._closed:
            raise KvlingoError("The engine is shut down.")
        job = Job(fn)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull(
                f"The server is busy ({self._queue.maxsize} requests waiting); retry shortly."
            ) from None
        return job

    def _loop(self):
        try:
            while True:
                job = self._queue.get()
                if job is None:
                    return
                self._run(job)
        finally:
            if self._on_exit is not None:
                self._on_exit()

    def _run(self, job: Job):
        self.running = job
        job.started = time.perf_counter()
        events = None
        try:
            if job.cancelled.is_set():
                self.cancelled += 1
                return
            events = job.fn(job.cancelled.is_set)
            for ev in events:
                job.events.put(ev)
                if job.cancelled.is_set():
                    self.cancelled += 1
                    break
            else:
                self.completed += 1
        except Exception as e:  # reported to the job's reader
            job.events.put(_Failure(e))
        finally:
            if events is not None and hasattr(events, "close"):
                events.close()
            job.events.put(_END)
            job.finished.set()
            self.running = None

    def close(self, timeout: float = 30.0):
        """Stop taking jobs, let the queued ones run, and end the thread."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)
