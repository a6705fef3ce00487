"""Hot reload, the host-independent part: noticing that the config file changed, planning what
a new config changes (`plan_reload`), and keeping the record the status endpoint reports.
Executing the plan (stopping and starting models) is the host adapter's job."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from expert_stream.plugin.admission import room_for_both
from expert_stream.plugin.config import ConfigError, HostConfig, ModelEntry


class FileWatcher:
    """Polls a file's (mtime, size, inode); reports a change once the file has stayed the same
    for `debounce` seconds, so an editor's write-rename-chmod sequence is one change. The caller
    then compares the content hash, so a touch without an edit changes nothing."""

    def __init__(self, path: Path, debounce: float = 0.5):
        self.path = Path(path)
        self.debounce = debounce
        self._seen = self._stat()
        self._changed_at: Optional[float] = None

    def _stat(self):
        try:
            st = os.stat(self.path)
        except OSError:
            return None  # mid-rename or deleted: wait for it to come back
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def poll(self, now: Optional[float] = None) -> bool:
        now = time.monotonic() if now is None else now
        current = self._stat()
        if current != self._seen:
            self._seen = current
            self._changed_at = now
            return False
        if current is not None and self._changed_at is not None and now - self._changed_at >= self.debounce:
            self._changed_at = None
            return True
        return False


@dataclass(frozen=True)
class ReloadPlan:
    """What applying `new` over `old` (both validated) does, by served id, each list in file
    order: `removed` entries go, `changed` ones reload, `added` ones load, `unchanged` ones keep
    serving untouched. `beside` holds the changed ids whose new model fits in memory beside the
    old one (`room_for_both`): a host that runs a process per model loads those before it
    unloads the old one; otherwise the old one goes first."""

    old: Optional[HostConfig]
    new: HostConfig
    removed: tuple = ()
    changed: tuple = ()
    added: tuple = ()
    unchanged: tuple = ()
    beside: frozenset = frozenset()

    @property
    def unload(self) -> list[ModelEntry]:
        """The entries of the old config whose models stop serving: removed, then changed."""
        before = self.old.by_id() if self.old else {}
        return [before[i] for i in self.removed + self.changed]

    @property
    def load(self) -> list[ModelEntry]:
        """The entries of the new config whose models start: changed, then added."""
        after = self.new.by_id()
        return [after[i] for i in self.changed + self.added]

    def applied(self) -> list[tuple[str, str]]:
        """(action, model_id) for the `config_reloaded` hook, in the order they are applied."""
        return [("removed", i) for i in self.removed] + [("changed", i) for i in self.changed] + \
               [("added", i) for i in self.added]

    def summary(self) -> dict:
        return {"removed": list(self.removed), "changed": list(self.changed), "added": list(self.added)}


def plan_reload(old: Optional[HostConfig], new: HostConfig, memory_bytes: Optional[int] = None) -> ReloadPlan:
    """The one reload planner both hosts execute; `old` is None at start (everything is added).
    An entry changes when anything its model depends on does (`ModelEntry.fingerprint`)."""
    before = old.by_id() if old else {}
    after = new.by_id()
    changed = tuple(i for i in after if i in before and before[i].fingerprint != after[i].fingerprint)
    return ReloadPlan(
        old=old, new=new,
        removed=tuple(i for i in before if i not in after),
        changed=changed,
        added=tuple(i for i in after if i not in before),
        unchanged=tuple(i for i in after if i in before and i not in changed),
        beside=frozenset(i for i in changed if room_for_both(new, before[i], memory_bytes)),
    )


@dataclass
class ModelState:
    model_id: str
    model_path: str
    streamed: bool
    state: str = "loading"  # loading | ready | draining | error
    error: Optional[str] = None
    settings: Optional[dict] = None
    budget: Optional[dict] = None  # the budget now: {budget_gib, auto, ...the terms auto subtracted}
    loaded_at: Optional[float] = None
    load_seconds: Optional[float] = None
    stats: Optional[dict] = None  # last cache stats the serving process reported
    restarts: int = 0  # times its process died and was started again (openai host)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


@dataclass
class ReloadRecord:
    """What the status endpoint reports about the config and its reloads."""

    config_path: str
    host: str
    host_version: str
    applied_hash: Optional[str] = None
    applied_at: Optional[float] = None
    last_error: Optional[str] = None
    last_error_at: Optional[float] = None
    failed_hash: Optional[str] = None  # an invalid file is not retried until it changes again
    reloads: int = 0
    reloads_refused: int = 0  # reloads that changed nothing: invalid file, failed validation or apply
    last_reload: Optional[dict] = None  # {reason, removed, changed, added, seconds, cut_off}
    reloading: bool = False
    warnings: list = field(default_factory=list)
    models: dict = field(default_factory=dict)  # model_id -> ModelState

    def fail(self, message: str, text_hash: Optional[str]) -> None:
        self.last_error = message
        self.last_error_at = time.time()
        self.failed_hash = text_hash

    def applied(self, plan: ReloadPlan, reason: str, seconds: float, **extra) -> None:
        """Record `plan` as applied (a reload, unless it is the first config at start)."""
        self.applied_hash, self.applied_at = plan.new.text_hash, time.time()
        if reason != "start":
            self.reloads += 1
        self.last_reload = {"reason": reason, **plan.summary(), "seconds": seconds, **extra}

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "models"}
        out["models"] = {mid: m.as_dict() for mid, m in self.models.items()}
        return out


def file_hash(path: Path) -> Optional[str]:
    import hashlib

    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def unchanged_file(record: "ReloadRecord", applied: HostConfig, new: HostConfig) -> Optional[dict]:
    """The answer to a reload whose file is the applied one again (a touch, or an edit undone
    after a refused one), or None when there is something to apply."""
    if new.text_hash != applied.text_hash:
        return None
    record.last_error = record.failed_hash = None  # back to the applied file
    return {"ok": True, "unchanged": True, "applied": []}


def refuse_reload(record: "ReloadRecord", path: Path, reason: str, exc: Exception) -> dict:
    """A reload whose file did not validate (ConfigError) or whose validation failed (a plugin's
    hook raising): record and log it, tell the plugins, and keep serving the applied config.
    The same unchanged file is refused once, not on every poll."""
    import logging

    from expert_stream.plugin import plugins

    text_hash = file_hash(path)
    if text_hash == record.failed_hash and reason == "file changed":
        return {"ok": False, "error": record.last_error, "repeated": True}
    message = str(exc) if isinstance(exc, ConfigError) else \
        f"{path}: validating the config failed: {type(exc).__name__}: {exc}"
    record.fail(message, text_hash)
    record.reloads_refused += 1
    logging.getLogger("expert_stream").error(
        "expert-stream: reload (%s) refused, still serving the previous config: %s", reason, message,
        exc_info=not isinstance(exc, ConfigError))
    plugins.get_plugin_manager().hook.config_reloaded(path=str(path), applied=[], error=message)
    return {"ok": False, "error": message}
