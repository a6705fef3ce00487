"""The counters of each model process, readable while it generates.

A model process answers the parent's RPC between requests only (the host's request loop runs
one request at a time), so a stats call during a long generation waits for its end. The
counters the operator watches travel another way: the parent gives each streamed model process
a small row of shared memory (in the queue_config the host already passes to it at spawn), and
a thread in the process writes its handle's counters and its memory there every WRITE_S. The
parent reads the row whenever it likes, also after the process ended (its last figures stay):
that is how the served name's counters stay monotonic across reloads and restarts (the ledger
retires a row once its process is gone). Per-layer figures, slots and settings still come
through the RPC, between requests.

A row is float64: counters are whole numbers below 2**53. A read while the process writes may
mix two writes; each counter read is one of them, so each stays monotonic."""

from __future__ import annotations

import itertools
import logging
import threading
import time

from expert_stream.plugin.hosts.openai import compat
from expert_stream.plugin.live_figures import COUNTERS, MEMORY, CounterLedger

log = logging.getLogger("expert_stream")

WRITE_S = 0.5
ROW = len(COUNTERS) + len(MEMORY)


class ProcessRows:
    """The parent's side: one row per streamed model process it started, per served name."""

    def __init__(self):
        self.ledger = CounterLedger()
        self._serial = itertools.count()
        self._rows: dict[str, list] = {}  # served name -> [(serial, row, proxy)]

    def new_row(self, model_id: str, proxy):
        """A row for the process `proxy` is about to start (spawn context: it is inherited)."""
        import multiprocessing

        row = multiprocessing.get_context("spawn").RawArray("d", ROW)
        self._rows.setdefault(model_id, []).append((next(self._serial), row, proxy))
        return row

    def read(self) -> tuple[dict, dict]:
        """({served name: monotonic counters}, {served name: memory of its running process}).
        Rows of processes that ended are read a last time and retired."""
        counters, memory = {}, {}
        for model_id, rows in self._rows.items():
            for entry in list(rows):
                serial, row, proxy = entry
                values = list(row)
                self.ledger.observe(model_id, serial, values[:len(COUNTERS)])
                if compat.process_ended(proxy):
                    self.ledger.retire(model_id, serial)
                    rows.remove(entry)
                elif compat.process_alive(proxy):
                    memory[model_id] = dict(zip(MEMORY, (int(v) for v in values[len(COUNTERS):])))
            counters[model_id] = self.ledger.totals(model_id)
        return counters, memory


def start_writer(row, model_id: str) -> threading.Thread:
    """In the model process: write its handle's counters and its memory into `row` every
    WRITE_S, until the process ends."""

    def write_loop():
        while True:
            time.sleep(WRITE_S)
            write(row, model_id)

    thread = threading.Thread(target=write_loop, name="expert-stream-counters", daemon=True)
    thread.start()
    return thread


def write(row, model_id: str) -> None:
    """One write of the row (also the last one, as the process stops)."""
    from expert_stream.plugin.hosts import interception
    from expert_stream.plugin.live_figures import handle_counters, process_memory

    handle = interception.handles().get(model_id)
    if handle is None:
        return  # not loaded yet
    try:
        row[:] = handle_counters(handle) + process_memory()
    except Exception as exc:  # the figures must never stop the model
        log.warning("expert-stream: %s: writing the live counters failed: %s", model_id, exc)
