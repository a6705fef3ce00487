"""The applied config of a running mlx_lm.server, the patches that consult it, and its reloads.

mlx_lm.server runs in this process and holds one model at a time. A reload executes the plan
(`reload.plan_reload`) at once on what the provider consults: the name map and the
interception targets change together, the folders of removed and changed entries are marked
stale, and a stale model is loaded again inside `ModelProvider.load`, the point where
mlx_lm.server itself swaps models between requests, on the generation thread. So a request in
flight finishes on the old model and the next one waits for the load, never refused."""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
import weakref
from pathlib import Path

from expert_stream.plugin.config import HostConfig
from expert_stream.plugin.hosts.mlx_lm import compat
from expert_stream.plugin.hosts.mlx_lm.request_counts import RequestCounts
from expert_stream.plugin.hosts.mlx_lm.routes import patch_handler
from expert_stream.plugin.live_figures import COUNTERS, MEMORY, CounterLedger, handle_counters, process_memory
from expert_stream.plugin.redact import redacting_calls
from expert_stream.plugin.reload import FileWatcher, ModelState, ReloadRecord, plan_reload, refuse_reload, \
    unchanged_file
from expert_stream.streaming.errors import BudgetError
from expert_stream.plugin.status_history import StatusHistory, add_figures

log = logging.getLogger("expert_stream")


class LmServerState:
    """The applied config of a running mlx_lm.server, and the patches that consult it."""

    def __init__(self, host, internals, config: HostConfig):
        self.host = host
        self.internals = internals
        self.config = config
        self.lock = threading.RLock()
        self.reload_lock = threading.Lock()
        self.stale: set[str] = set()  # folders whose loaded model no longer matches its entry
        self.removed: set[str] = set()  # names removed from the config
        self.provider = None
        self.bind_host = "127.0.0.1"  # mlx_lm.server's default; serve() reads --host
        self.pipeline = None  # pipeline_mode.PipelineMode when this process is one rank of --pipeline
        self.record = ReloadRecord(str(config.path), host.name, internals.version,
                                   applied_hash=config.text_hash, applied_at=time.time())
        self._sync_models()
        self.requests = RequestCounts(self._served_name)
        self.ledger = CounterLedger()  # monotonic counters per served name, over its handles
        self._sources = weakref.WeakKeyDictionary()  # handle -> its number in the ledger
        self._numbers = itertools.count()
        self.history = StatusHistory()

    # -- the config as the provider sees it ---------------------------------------------------
    def aliases(self) -> dict[str, str]:
        return {e.model_id: str(e.resolved_path()) for e in self.config.entries}

    def targets(self) -> dict:
        from expert_stream.plugin.hosts.interception import Target
        from expert_stream.streaming.auto_budget import ProcessMemory

        options = self.config.options
        memory = ProcessMemory(options.memory_gib, options.headroom_gib)  # pipeline ranks size auto themselves
        return {e.resolved_path(): Target(e.model_id, e.settings.to_dict(), e.budget, memory,
                                          e.host_entry.get("trust_remote_code") is True)
                for e in self.config.entries if e.streamed}

    def _sync_models(self) -> None:
        models = {}
        for e in self.config.entries:
            old = self.record.models.get(e.model_id)
            models[e.model_id] = ModelState(e.model_id, e.model_path, e.streamed,
                                            state=old.state if old else "configured",
                                            settings=e.settings.to_dict() if e.streamed else None,
                                            budget=e.budget_status())
        self.record.models = models

    def install(self) -> None:
        from expert_stream.plugin.hosts import interception

        interception.install()
        interception.set_targets(self.targets())
        compat.patch_provider(self.internals.Provider, self._provider_made, self._before_load, self._dropping,
                              self._loaded)
        compat.wrap_generate(self.internals.ResponseGenerator,  # errors reach clients as text; requests counted
                             lambda generate: redacting_calls(self._naming_model(
                                 self.requests.counting(generate, compat.requested_model))))
        patch_handler(self)

    def _naming_model(self, generate):
        """Errors of `generate` (a load that failed: a shard truncated, a folder gone) reach the
        client naming the model they asked for; the soak found them naming a shard only."""
        @functools.wraps(generate)
        def named(*args, **kwargs):
            try:
                return generate(*args, **kwargs)
            except Exception as exc:
                name = self._served_name(compat.requested_model(args, kwargs)) or compat.requested_model(args, kwargs)
                if name is None or repr(name) in str(exc):
                    raise
                raise RuntimeError(f"model {name!r}: {exc}") from exc

        return named

    def _provider_made(self, provider, cli_args) -> None:
        self.provider = provider
        with self.lock:
            compat.set_names(provider, self.removed, self.config.entries)
            if cli_args.model in self.aliases():
                compat.set_default(provider, self.aliases()[cli_args.model])

    def _before_load(self, provider, model_path, draft) -> None:
        refuse_streamed_draft(draft, "the request's draft model")
        hold_draft(draft)
        with self.lock:
            aliases = self.aliases()
            if model_path in self.removed and model_path not in aliases:
                raise ValueError(f"model {model_path!r} was removed from {self.config.path}")
            if model_path not in (None, "", "default_model", *aliases, *aliases.values()):
                # mlx_lm.server would take any other name for a Hugging Face repo and download
                # it; this server serves its config (the host answers this with a 404).
                raise ValueError(f"model {model_path!r} is not served here; served: {', '.join(aliases)}")
            loaded = compat.loaded_folder(provider)
            if loaded is not None and str(Path(loaded).resolve()) in self.stale:
                self.stale.discard(str(Path(loaded).resolve()))
                self._observe()  # the last counters of the handle the load replaces
                compat.forget_loaded(provider)  # forces a load with the new settings

    def _dropping(self, provider) -> None:
        """mlx_lm.server holds one model at a time: the streamed model it drops to load another
        releases its reader and memory now, before the next one is sized and loaded."""
        from expert_stream.plugin.hosts import interception

        for model_id in interception.handles():
            interception.forget(model_id)

    def _loaded(self, provider, folder: str, seconds: float) -> None:
        with self.lock:
            for entry in self.config.entries:
                model_state = self.record.models.get(entry.model_id)
                if model_state is None:
                    continue
                if str(entry.resolved_path()) == folder:
                    model_state.state, model_state.loaded_at = "loaded", time.time()
                    model_state.load_seconds = seconds
                elif model_state.state == "loaded":
                    model_state.state = "configured"
            streamed = any(str(e.resolved_path()) == folder for e in self.config.entries if e.streamed)
        if streamed:
            compat.serve_one_at_a_time(provider)  # batching collapses the hit rate

    # -- reload ---------------------------------------------------------------------------------
    def watch(self) -> None:
        watcher = FileWatcher(self.config.path, self.config.options.debounce_seconds)
        while True:
            time.sleep(self.config.options.poll_seconds)
            try:
                if watcher.poll():
                    self.reload("file changed")
            except Exception as exc:  # the watcher outlives any failure: the next edit is applied
                log.exception("expert-stream: watching %s: %s", self.config.path, exc)
                self.record.fail(f"watching the config file failed: {type(exc).__name__}: {exc}", None)

    def reload(self, reason: str, new=None) -> dict:
        """`new`: the config every pipeline rank validated (pipeline_reload asks them all first)."""
        from expert_stream.plugin import plugins
        from expert_stream.plugin.hosts import interception

        if self.pipeline is not None and new is None:
            return self.pipeline.reloads.request(reason)
        with self.reload_lock:
            path = self.config.path
            try:
                new = new or self.host.load_config(path, self.internals)
            except Exception as exc:  # ConfigError, or a plugin's hook failing: refused either way
                return refuse_reload(self.record, path, reason, exc)
            same = unchanged_file(self.record, self.config, new)
            if same is not None:
                return same
            t0 = time.perf_counter()
            plan = plan_reload(self.config, new)
            with self.lock:
                for entry in plan.unload:
                    self.stale.add(str(entry.resolved_path()))
                self.removed = (self.removed | set(plan.removed)) - set(new.by_id())
                self.config = new
                interception.set_targets(self.targets())
                if self.provider is not None:
                    compat.set_names(self.provider, self.removed, self.config.entries)
                self._sync_models()
                for model_id in plan.changed:
                    self.record.models[model_id].state = "pending reload"
            for model_id in plan.unchanged:  # a budget resolved anew is followed, not reloaded
                entry = new.by_id()[model_id]
                if entry.budget is None:
                    continue
                try:
                    interception.set_budget(model_id, entry.budget)
                except BudgetError as exc:  # layers left as stock blocks cannot give experts back
                    log.warning("expert-stream: %s reloads at its next request for its new budget: %s", model_id, exc)
                    with self.lock:
                        self.stale.add(str(entry.resolved_path()))
            self.record.last_error = self.record.failed_hash = None
            self.record.applied(plan, reason, round(time.perf_counter() - t0, 3),
                                note="a changed model reloads at its next request")
            applied = plan.applied()
            plugins.get_plugin_manager().hook.config_reloaded(path=str(path), applied=applied, error=None)
            return {"ok": True, "applied": applied, "last_reload": self.record.last_reload}

    def models_list(self, only=None) -> dict:
        """/v1/models as mlx_lm.server shapes it, with the configured served names."""
        with self.lock:
            ids = [e.model_id for e in self.config.entries]
        return {"object": "list", "data": [{"id": i, "object": "model", "created": int(self.record.applied_at or 0)}
                                           for i in ids if only is None or i == only]}

    def status(self) -> dict:
        from expert_stream.plugin.hosts import interception

        stats = interception.stats()
        counters = self._observe()
        with self.lock:
            for model_id, model_state in self.record.models.items():
                if model_id in stats:
                    model_state.stats = stats[model_id]
                    model_state.budget = stats[model_id]["budget"]
            out = self.record.as_dict()
            loaded = compat.loaded_folder(self.provider)
            serving = [e.model_id for e in self.config.entries
                       if loaded and str(e.resolved_path()) == str(Path(loaded).resolve())]
        out["loaded_model"] = loaded
        memory = {}  # in pipeline mode: per rank, in the pipeline's rows
        if self.pipeline is not None:
            out["pipeline"] = self.pipeline.status()
        elif serving:
            memory = dict.fromkeys(serving, dict(zip(MEMORY, map(int, process_memory()))))
        return add_figures(out, self.history, counters, self.requests.snapshot(), memory)

    # -- the operator's figures -------------------------------------------------------------
    def _served_name(self, requested):
        """The served name a request counts under (None: a model outside the config)."""
        with self.lock:
            ids = self.config.by_id()
            default = self.config.top_level.get("default_model") or self.config.entries[0].model_id
        if requested in ids:
            return requested
        return default if requested in (None, "", "default_model") else None

    def _observe(self) -> dict:
        """{served name: monotonic counters} of the streamed entries: this process's handles
        (one ledger source per handle; a handle that went is retired), or in pipeline mode
        every rank's (each rank keeps its own monotonic counters; a rank is a source)."""
        from expert_stream.plugin.hosts import interception

        with self.lock:
            if self.pipeline is not None:
                pipeline = self.pipeline.status()
                for row in pipeline["per_rank"]:
                    if row["loaded"] and pipeline["model"]:
                        self.ledger.observe(pipeline["model"], ("rank", row["rank"]),
                                            [row["counters"][c] for c in COUNTERS])
            else:
                for model_id, handle in interception.handles().items():
                    number = self._sources.get(handle)
                    if number is None:
                        number = self._sources[handle] = next(self._numbers)
                    self.ledger.observe(model_id, number, handle_counters(handle))
                    for gone in set(self.ledger.sources(model_id)) - {number}:
                        self.ledger.retire(model_id, gone)
            return {e.model_id: self.ledger.totals(e.model_id) for e in self.config.entries if e.streamed}

    def sample(self) -> None:
        """Every history interval, the counters of each served model (a daemon thread)."""
        while True:
            try:
                self.history.add(self._observe())
            except Exception:  # the sampler outlives its own failures
                log.exception("expert-stream: sampling the counters failed")
            time.sleep(self.history.interval_s)


def hold_draft(draft) -> None:
    """The draft loads whole beside the model about to load: an auto budget counts it."""
    from expert_stream.plugin.paths import checkpoint_bytes
    from expert_stream.streaming.auto_budget import LEDGER

    LEDGER.hold_stock("draft model", checkpoint_bytes(None if draft is None else str(draft)))


def refuse_streamed_draft(draft, where: str) -> None:
    """A draft model loads whole, stock, beside the main model: the folder of a streamed entry
    would be streamed a second time under that entry's name (and close the first one's reader)."""
    from expert_stream.plugin.hosts import interception

    target = interception.target_for(draft) if draft else None
    if target is not None:
        raise ValueError(f"{where} {draft} is the folder of the streamed entry {target.model_id!r}: a draft model "
                         "loads whole, without streaming; use a small dense model with the same tokenizer")
