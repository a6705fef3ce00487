"""The parent's reloader for mlx-openai-server: executes each reload plan (`reload.plan_reload`)
on the running host, one model process per entry, and drains the requests of a model that goes.

A removed entry stops routing and its process stops after its in-flight requests finish (up to
the drain timeout). A changed entry whose new model fits beside the old one loads first and
takes over routing in one swap (make before break); otherwise its requests wait on a
`WaitingHandler` while the old process stops and the new one loads. Added entries load last."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from expert_stream.plugin.config import HostConfig, load_host_config
from expert_stream.plugin.hosts.openai import compat
from expert_stream.plugin.hosts.openai.live_counters import ProcessRows
from expert_stream.plugin.hosts.openai.request_queue import WaitingHandler
from expert_stream.plugin.hosts.openai.schema import apply_server_flags
from expert_stream.plugin.hosts.openai.supervision import ProcessSupervisor
from expert_stream.plugin.reload import FileWatcher, ModelState, ReloadRecord, plan_reload, refuse_reload, \
    unchanged_file
from expert_stream.plugin.status_history import StatusHistory, add_figures

log = logging.getLogger("expert_stream")

STATS_TIMEOUT_S = 2.0  # a child busy generating answers the stats call after its request


class ServingState:
    """Everything the parent process knows while it serves: made before the host starts (server.py);
    the Reloader replaces `config` with each config it applies."""

    def __init__(self, host, internals, schema, config, server_flags):
        self.host = host
        self.internals = internals
        self.schema = schema
        self.config = config  # the applied config
        self.server_flags = server_flags
        self.record = ReloadRecord(str(config.path), host.name, internals.version)


class Reloader:
    """Applies configs to the running host: the first one at start, then every valid edit."""

    def __init__(self, state: ServingState, registry):
        self.state = state
        self.registry = registry
        self.record = state.record
        self.lock = asyncio.Lock()
        self.proxies: dict = {}  # model_id -> HandlerProcessProxy of a routed, running model
        self.entries: dict = {}  # model_id -> the ModelEntry its process was started with
        self._holds: dict = {}  # model_id -> WaitingHandler routed while it is not there
        self.supervisor = ProcessSupervisor(self.record, self.take_dead, self.hold, self.restart)
        self.rows = ProcessRows()  # each streamed model process's live counters
        self.history = StatusHistory()
        self._status_lock = asyncio.Lock()

    # -- triggers ---------------------------------------------------------------------------
    def trigger(self, reason: str = "signal") -> None:
        asyncio.get_running_loop().create_task(self.reload(reason))

    async def watch(self) -> None:
        options = self.state.config.options
        watcher = FileWatcher(self.state.config.path, options.debounce_seconds)
        while True:
            await asyncio.sleep(options.poll_seconds)
            try:
                if watcher.poll():
                    await self.reload("file changed")
            except Exception as exc:  # the watcher outlives any failure: the next edit is applied
                log.exception("expert-stream: watching %s: %s", self.state.config.path, exc)
                self.record.fail(f"watching the config file failed: {type(exc).__name__}: {exc}", None)

    # -- reload -----------------------------------------------------------------------------
    async def reload(self, reason: str) -> dict:
        from expert_stream.plugin import plugins

        async with self.lock:
            path = self.state.config.path
            try:
                new = await asyncio.to_thread(load_host_config, path, self.state.schema)
                apply_server_flags(new, self.state.server_flags)
            except Exception as exc:  # ConfigError, or a plugin's hook failing: refused either way
                return refuse_reload(self.record, path, reason, exc)
            same = unchanged_file(self.record, self.state.config, new)
            if same is not None:
                return same
            if new.top_level.get("server") != self.state.config.top_level.get("server"):
                self.record.warnings.append("server: section changed; host and port apply at the next start")
            try:
                applied = await self._apply(new, reason)
            except Exception as exc:  # reported, and the next edit is applied as usual
                message = f"{path}: applying the config failed: {type(exc).__name__}: {exc}"
                log.exception("expert-stream: reload (%s): %s", reason, message)
                self.record.fail(message, new.text_hash)
                self.record.reloads_refused += 1
                plugins.get_plugin_manager().hook.config_reloaded(path=str(path), applied=[], error=message)
                return {"ok": False, "error": message}
            return {"ok": True, "applied": applied, "last_reload": self.record.last_reload}

    async def apply(self, config: HostConfig, reason: str) -> list:
        async with self.lock:
            return await self._apply(config, reason)

    async def _apply(self, new: HostConfig, reason: str) -> list:
        from expert_stream.plugin import plugins

        old = self.state.config if self.proxies or reason != "start" else None
        plan = plan_reload(old, new)
        after = new.by_id()
        t0 = time.perf_counter()
        self.record.reloading = True
        self.record.last_error = self.record.failed_hash = None  # a model failing to load sets it again
        cut_off = 0
        try:
            await self._follow_budgets(new, plan.unchanged, shrink=True)  # make room first
            for model_id in plan.removed:
                cut_off += await self._unload(model_id, placeholder=False)
                self.record.models.pop(model_id, None)
            for model_id in plan.changed:
                if model_id in plan.beside and model_id in self.proxies:
                    cut_off += await self._replace(after[model_id])
                else:  # its requests wait for the new model meanwhile
                    cut_off += await self._unload(model_id, placeholder=True)
                    await self._load(after[model_id])
            for model_id in plan.added:
                await self._load(after[model_id], fail_hard=(reason == "start"))
            await self._follow_budgets(new, plan.unchanged, shrink=False)  # grow into what was freed
        finally:
            self.record.reloading = False
        self.state.config = new
        self.record.applied(plan, reason, round(time.perf_counter() - t0, 2), cut_off=cut_off)
        applied = plan.applied()
        log.info("expert-stream: config applied (%s): %s", reason, self.record.last_reload)
        plugins.get_plugin_manager().hook.config_reloaded(path=str(new.path), applied=applied, error=None)
        return applied

    async def _follow_budgets(self, new: HostConfig, unchanged, shrink: bool) -> None:
        """The running models whose auto budget the new config resolved smaller (`shrink`) or
        larger get it through the host's RPC; their slots move between two of their requests,
        without a reload. A shrink is awaited before anything loads beside them."""
        after = new.by_id()
        for model_id in unchanged:
            entry, running = after[model_id], self.entries.get(model_id)
            if entry.budget is None or running is None or running.budget is None:
                continue
            if (entry.budget.bytes < running.budget.bytes) != shrink or entry.budget.bytes == running.budget.bytes:
                continue
            self.entries[model_id] = entry  # a restart starts it with the new budget
            state = self.record.models.get(model_id)
            if state is not None:
                state.budget = entry.budget_status()
            proxy = self.proxies.get(model_id)
            if proxy is None:
                continue
            try:
                await compat.call(proxy, "expert_stream_set_budget", model_id, dataclasses.asdict(entry.budget))
            except Exception as exc:  # a dead process restarts with the new budget
                log.warning("expert-stream: %s: its new budget did not reach its process: %s", model_id, exc)

    async def _load(self, entry, fail_hard: bool = False) -> None:
        proxy = await self._start(entry, fail_hard)
        if proxy is not None:
            await self._route(entry.model_id, proxy, entry.host_entry.get("model_type", "lm"),
                              entry.host_entry.get("context_length"))
            self.proxies[entry.model_id] = proxy

    async def _replace(self, entry) -> int:
        """Make before break: the new process loads beside the old one, which serves until
        the switch; if the new one fails to load, the old one keeps serving."""
        model_id = entry.model_id
        old_state = self.record.models.get(model_id)
        proxy = await self._start(entry)
        if proxy is None:
            if old_state is not None:
                failed, self.record.models[model_id] = self.record.models[model_id], old_state
                old_state.error = f"the changed entry failed to load, still serving the previous one: {failed.error}"
            return 0
        old = self.proxies.pop(model_id)
        await self._route(model_id, proxy, entry.host_entry.get("model_type", "lm"),
                          entry.host_entry.get("context_length"))
        self.proxies[model_id] = proxy
        cut_off = await _drain(old, model_id, self.state.config.options.drain_timeout_s)
        await old.cleanup()
        return cut_off

    def take_dead(self) -> dict:
        """Take the routed model processes that died out of routing (the supervisor's call)."""
        dead = {model_id: proxy for model_id, proxy in self.proxies.items() if not compat.process_alive(proxy)}
        for model_id in dead:
            del self.proxies[model_id]
        return dead

    async def restart(self, model_id: str):
        """Start a model whose process died again (the supervisor's call): True when it runs,
        False when it failed to start, None when its entry was removed or reloaded meanwhile."""
        async with self.lock:
            entry = self.entries.get(model_id)
            if entry is None or model_id in self.proxies:
                return None
            await self._load(entry)
            return model_id in self.proxies

    def hold(self, model_id: str):
        """Route the model's requests to a WaitingHandler until something else is routed."""
        entry = self.entries.get(model_id)
        host_entry = entry.host_entry if entry else {}
        model_type = host_entry.get("model_type", "lm")
        handler_type = compat.handler_type(self.state.internals.Proxy, model_type)
        waiting = WaitingHandler(model_id, entry.model_path if entry else "", handler_type, self.state.internals.Proxy,
                                 timeout=host_entry.get("queue_timeout", 300),
                                 max_waiting=host_entry.get("queue_size", 100))
        if compat.is_routed(self.registry, model_id):
            compat.swap_handler(self.registry, model_id, waiting)
        previous = self._holds.get(model_id)
        self._holds[model_id] = waiting
        if previous is not None:
            previous.resolve(waiting)  # who waited there waits on, here
        return waiting

    async def _start(self, entry, fail_hard: bool = False):
        """Spawn the entry's model process and wait until it is ready; None if it failed."""
        internals = self.state.internals
        cfg = internals.ModelEntryConfig(**entry.host_entry)
        previous = self.record.models.get(entry.model_id)
        restarting = previous is not None and previous.state == "restarting"  # the supervisor's restart
        model_state = ModelState(entry.model_id, entry.model_path, entry.streamed,
                                 state="restarting" if restarting else "loading",
                                 restarts=previous.restarts if restarting else 0,
                                 settings=entry.settings.to_dict() if entry.streamed else None,
                                 budget=entry.budget_status())
        self.record.models[entry.model_id] = model_state
        kwargs = {"model_cfg_dict": dataclasses.asdict(cfg), "model_type": cfg.model_type,
                  "model_path": cfg.model_path, internals.proxy_id_param: entry.model_id}
        proxy = internals.Proxy(**kwargs)
        queue_config = {"timeout": cfg.queue_timeout, "queue_size": cfg.queue_size}
        if hasattr(cfg, "max_concurrency"):  # 1.6 (1.8 batches instead)
            queue_config["max_concurrency"] = cfg.max_concurrency
        if entry.streamed:
            queue_config["expert_stream"] = {
                "model_id": entry.model_id, "model_path": entry.model_path, "settings": entry.settings.to_dict(),
                "budget": dataclasses.asdict(entry.budget) if entry.budget is not None else None,
                "trust_remote_code": entry.host_entry.get("trust_remote_code") is True,
                "counters": self.rows.new_row(entry.model_id, proxy)}
        t0 = time.perf_counter()
        try:
            await proxy.start(queue_config)
        except Exception as exc:
            model_state.state, model_state.error = "error", str(exc)
            self.record.fail(f"{entry.model_id}: {exc}", None)
            held = self._holds.get(entry.model_id)
            if held is not None:
                held.fail(f"failed to load after a config change: {exc}")
            await proxy.cleanup()
            if fail_hard:
                raise
            return None
        self.entries[entry.model_id] = entry
        model_state.state = "ready"
        model_state.loaded_at = time.time()
        model_state.load_seconds = round(time.perf_counter() - t0, 2)
        return proxy

    async def _route(self, model_id, handler, model_type, context_length) -> None:
        """Route the model's requests to `handler`: an atomic swap for a routed id."""
        held = self._holds.pop(model_id, None)
        if compat.is_routed(self.registry, model_id):
            compat.swap_handler(self.registry, model_id, handler)
        else:
            await self.registry.register_model(model_id=model_id, handler=handler, model_type=model_type,
                                               context_length=context_length)
        if held is not None:
            held.resolve(handler)

    async def _unload(self, model_id: str, placeholder: bool) -> int:
        """Stop routing to the model, let its in-flight requests finish (up to the drain
        timeout, then cut them off with an error), then stop its process."""
        proxy = self.proxies.pop(model_id, None)
        if placeholder:
            self.hold(model_id)
        else:
            compat.unroute(self.registry, model_id)
            self.entries.pop(model_id, None)
            held = self._holds.pop(model_id, None)
            if held is not None:
                held.fail("was removed from the config")
        if proxy is None:
            return 0
        model_state = self.record.models.get(model_id)
        if model_state:
            model_state.state = "draining"
        cut_off = await _drain(proxy, model_id, self.state.config.options.drain_timeout_s)
        await proxy.cleanup()
        return cut_off

    # -- status -----------------------------------------------------------------------------
    async def status(self) -> dict:
        self.supervisor.notice_deaths()  # never report a dead process as ready
        async with self._status_lock:  # one stats call per process at a time
            requests = {model_id: self._requests(model_id) for model_id in self.record.models}
            for model_id, proxy in list(self.proxies.items()):
                model_state = self.record.models.get(model_id)
                if not model_state or not model_state.streamed or model_state.state != "ready":
                    continue
                if compat.pending_requests(proxy):
                    continue  # it answers after its request: report the last stats (the live counters move)
                try:
                    stats = await asyncio.wait_for(compat.call(proxy, "expert_stream_stats"), STATS_TIMEOUT_S)
                    model_state.stats = stats.get(model_id)
                except Exception:
                    pass  # busy generating: report the last stats it gave
        counters, memory = self.rows.read()
        out = self.record.as_dict()
        for model_id, model in out["models"].items():
            model["restarts_total"] = self.supervisor.restarted.get(model_id, 0)
        return add_figures(out, self.history, counters, requests, memory)

    def _requests(self, model_id: str) -> dict:
        """A streamed model process answers one request at a time: the others it was sent wait
        there, behind it; requests held while the model (re)loads wait too."""
        proxy, held, entry = self.proxies.get(model_id), self._holds.get(model_id), self.entries.get(model_id)
        pending = len(compat.pending_requests(proxy)) if proxy is not None else 0
        running = min(pending, 1) if entry is not None and entry.streamed else pending
        return {"in_flight": running, "queued": pending - running + (held.waiting if held else 0)}

    async def sample(self) -> None:
        """Every history interval, the counters of each served model (status_history)."""
        while True:
            try:
                counters, _ = self.rows.read()
                self.history.add({m: c for m, c in counters.items() if m in self.record.models})
            except Exception:  # the sampler outlives its own failures
                log.exception("expert-stream: sampling the counters failed")
            await asyncio.sleep(self.history.interval_s)


async def _drain(proxy, model_id: str, timeout: float) -> int:
    """Wait for the proxy's in-flight requests; past the timeout, answer each with an error."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while compat.pending_requests(proxy) and loop.time() < deadline:
        await asyncio.sleep(0.1)
    cut_off = compat.fail_pending(proxy, f"model {model_id!r} was unloaded by a config reload after waiting {timeout:.0f} s "
                                  "for this request; send it again", "ModelUnloaded")
    if cut_off:
        log.warning("expert-stream: %s: cut off %d request(s) after the %.0f s drain timeout", model_id, cut_off, timeout)
    return cut_off
