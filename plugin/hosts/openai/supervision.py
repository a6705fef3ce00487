"""Model processes that die (a crash, the OOM killer, kill -9) are noticed and restarted.

mlx-openai-server does not watch its model processes: a dead one stays routed, its in-flight
requests and every new one wait on a queue nobody reads until the client gives up (the
proxy's RPC timeout is the entry's queue_timeout, an hour for streamed models). The
supervisor polls each routed process; on a death it (1) marks the model `restarting` in the
status, (2) answers its in-flight requests with an error at once and routes new ones to a
handler that does the same, (3) starts the model again, at most MAX_RESTARTS times in
RESTART_WINDOW_S, after which the model stays in `error` until the next reload."""

from __future__ import annotations

import asyncio
import logging
import time

from expert_stream.plugin.hosts.openai.compat import exit_code, fail_pending

log = logging.getLogger("expert_stream")

POLL_S = 0.5
MAX_RESTARTS = 3
RESTART_WINDOW_S = 600.0


class ProcessSupervisor:
    """Watches the model processes a Reloader routed to; owns the restarts and their count.

    It is given what it uses: the status record, and three calls of the reloader that owns the
    processes: `take_dead()` (the routed processes that died, taken out of routing: model_id ->
    proxy), `hold(model_id)` (its requests wait on a WaitingHandler, returned) and
    `restart(model_id)` (start it again: True when it runs, False when it failed to start, None
    when the entry was removed or reloaded meanwhile)."""

    def __init__(self, record, take_dead, hold, restart):
        self.record = record
        self.take_dead = take_dead
        self.hold = hold
        self.restart = restart
        self.deaths: dict[str, list[float]] = {}  # model_id -> times its process died
        self.restarted: dict[str, int] = {}  # model_id -> times its process was started again (ever)
        self._restarting: dict[str, asyncio.Task] = {}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            try:
                self.notice_deaths()
            except Exception:  # the supervisor outlives its own failures
                log.exception("expert-stream: checking the model processes failed")

    def stop(self) -> None:
        """The server is stopping: no restart may start a process after the cleanup."""
        for task in self._restarting.values():
            task.cancel()

    def notice_deaths(self) -> list[str]:
        """The synchronous part (no await: nothing can route to the dead process meanwhile):
        take each dead process out of routing, fail its requests, schedule the restart."""
        dead = self.take_dead()
        for model_id, proxy in dead.items():
            code = exit_code(proxy)
            now = time.monotonic()
            times = [t for t in self.deaths.get(model_id, []) if now - t < RESTART_WINDOW_S] + [now]
            self.deaths[model_id] = times
            state = self.record.models.get(model_id)
            give_up = len(times) > MAX_RESTARTS
            why = f"its model process exited (exit code {code})"
            if give_up:
                message = (f"{why}, {len(times)} times in {RESTART_WINDOW_S:.0f} s; not restarted again "
                           "until the next reload")
            else:
                message = f"{why}; restarting it (restart {len(times)} of at most {MAX_RESTARTS})"
            log.error("expert-stream: %s: %s", model_id, message)
            if state:
                state.state, state.error = ("error" if give_up else "restarting"), message
                state.restarts = len(times) if not give_up else MAX_RESTARTS
            self.hold(model_id).fail(message + "; send the request again shortly")
            failed = fail_pending(proxy, f"model {model_id!r}: {message}; send the request again", "ModelProcessDied")
            if failed:
                log.warning("expert-stream: %s: %d in-flight request(s) answered with an error", model_id, failed)
            if not give_up:
                self._restarting[model_id] = asyncio.get_running_loop().create_task(self._restart(model_id, proxy))
        return list(dead)

    async def _restart(self, model_id: str, dead_proxy) -> None:
        await dead_proxy.cleanup()
        fail_pending(dead_proxy, f"model {model_id!r}: its model process exited; send the request again",
                     "ModelProcessDied")  # any that reached it after the first sweep
        while True:
            # No await between restart() and the bookkeeping below: nothing else runs meanwhile.
            started = await self.restart(model_id)
            if started is None:
                return  # removed or reloaded meanwhile
            if started:
                self.restarted[model_id] = self.restarted.get(model_id, 0) + 1
                log.info("expert-stream: %s: model process restarted", model_id)
                return
            state = self.record.models.get(model_id)
            error = state.error if state else "unknown error"
            self.deaths[model_id].append(time.monotonic())
            attempts = len(self.deaths[model_id])
            if attempts > MAX_RESTARTS:
                self.hold(model_id).fail(f"could not be restarted ({attempts - 1} attempts): {error}")
                return
            if state:
                state.state, state.restarts = "restarting", attempts
            self.hold(model_id).fail(f"restarting it after a failed start (restart {attempts} of at "
                                     f"most {MAX_RESTARTS}): {error}")
            await asyncio.sleep(2.0)
