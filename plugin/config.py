"""The host config with the plugin's blocks: parse, validate all of it, admit it to memory.

One YAML file serves both hosts. Top level: the host's own keys, `models:` (a list of entries)
and our `expert_stream:` block; each model entry may carry its own `expert_stream:` block
(`true` or `{}` takes the top-level defaults). Validation is all or nothing: `load_host_config`
returns a complete `HostConfig` or raises ConfigError naming the file, the entry and the key.
Nothing here imports a host: the adapter passes what it knows (`HostSchema`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from expert_stream.plugin import yaml_limits
from expert_stream.plugin.admission import AdmissionError, admit
from expert_stream.plugin.endpoint_guard import allow_list
from expert_stream.plugin.paths import checkpoint_bytes, expand, is_folder, looks_like_hub_id, resolve_model_path
from expert_stream.streaming.auto_budget import HEADROOM_GIB
from expert_stream.streaming.errors import ExpertStreamError, SettingsError
from expert_stream.streaming.settings import StreamSettings, refuse_removed

log = logging.getLogger("expert_stream")

KEY = "expert_stream"
# A streamed model waits on the SSD: prefill of a long prompt can take minutes, and the host's
# queue_timeout is also its per-chunk stream timeout. One hour, unless the entry sets its own.
STREAMED_QUEUE_TIMEOUT_S = 3600
# Host entry keys that name files or folders (expanded like model_path).
PATH_KEYS = frozenset({"adapter_path", "draft_model_path", "chat_template_file", "lora_paths"})


class ConfigError(ExpertStreamError):
    """A host config file the plugin refuses; the message names the file, entry and key."""


@dataclass(frozen=True)
class PluginOptions:
    """The top-level `expert_stream:` block."""

    enabled: bool = True
    watch: bool = False
    poll_seconds: float = 1.0
    debounce_seconds: float = 0.5
    drain_timeout_s: float = 600.0  # in-flight requests get this long before they are cut off
    queue_timeout: int = STREAMED_QUEUE_TIMEOUT_S
    memory_gib: Optional[float] = None  # None: what this process may use (streaming/memory_limit.py)
    headroom_gib: float = HEADROOM_GIB  # kept free beside each model's process
    reload_endpoint: bool = True
    metrics_allow: tuple = ()  # addresses besides this machine that GET /expert-stream/metrics answers
    defaults: dict = field(default_factory=dict)


# Finite bounds of the numeric options (NaN and .inf fall outside): a poll of 0, -1 or NaN
# seconds spins a core, a huge headroom overflows the byte count.
OPTION_RANGES = {"poll_seconds": (0.05, 3600), "debounce_seconds": (0, 3600), "drain_timeout_s": (0, 7 * 86400),
                 "queue_timeout": (1, 30 * 86400), "memory_gib": (0.001, 1 << 20), "headroom_gib": (0, 1 << 20)}


@dataclass(frozen=True)
class HostSchema:
    """What the config parser must know about a host: its name and version (for messages), the
    keys a model entry may have, the key that holds the served id, and what streamed entries
    get (a long queue timeout unless set, one request at a time)."""

    name: str
    version: str
    entry_keys: frozenset
    id_key: str  # the key this host version reads the served id from
    id_aliases: tuple = ("served_model_name", "model_id")
    queue_timeout_key: Optional[str] = None  # the entry key for the host's request timeout
    forced_entry_values: dict = field(default_factory=dict)
    top_level_keys: Optional[frozenset] = None  # None: any (the host ignores unknown top-level keys)
    streamed_entry_check: Optional[Callable[[dict], Optional[str]]] = None  # entry -> why it cannot stream
    entry_check: Optional[Callable[[dict], Optional[str]]] = None  # entry -> what the host's own schema refuses
    top_level_check: Optional[Callable[[dict], Optional[str]]] = None  # top level -> what the host refuses
    context_key: Optional[str] = None  # the entry key of the host's own context length, if it has one
    one_model_at_a_time: bool = False  # the host holds one model at a time (else all of them at once)
    unread_options: frozenset = frozenset()  # top-level options this host never reads: refused when set


@dataclass
class ModelEntry:
    index: int
    model_id: str
    model_path: str
    host_entry: dict  # what the host sees: our block removed, host defaults applied
    settings: Optional[StreamSettings]  # None: not streamed, the host loads it as always
    resident_bytes: int  # memory admission estimate (0 when the size is unknown)
    footprint: Any = None  # streaming.footprint.Footprint for streamed entries
    # An auto entry's budget, resolved with every other entry (admission.py); not part of the
    # fingerprint: a number resolved differently changes no model, its budget just follows.
    budget: Any = None  # streaming.auto_budget.HandedBudget
    draft_bytes: int = 0  # the entry's draft_model_path checkpoint, loaded whole beside it (0: none or unknown)

    @property
    def streamed(self) -> bool:
        return self.settings is not None

    @property
    def fingerprint(self) -> str:
        """Changes when anything the served model depends on changes (the reload diff)."""
        payload = {"host": self.host_entry, "stream": self.settings.to_dict() if self.settings else None}
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()

    def resolved_path(self) -> Path:
        return Path(self.model_path).expanduser().resolve()

    def budget_status(self) -> Optional[dict]:
        """The budget as status shows it: the number set, or auto's pick and why (None: not streamed)."""
        if not self.streamed:
            return None
        if not self.settings.auto:
            return {"budget_gib": self.settings.budget_gib, "budget_bytes": self.settings.budget_bytes, "auto": False}
        if self.budget is None:  # not resolved here (a pipeline rank sizes its own layers)
            return {"budget_gib": "auto", "auto": True}
        return {**(self.budget.explained or {}), "budget_gib": round(self.budget.bytes / (1 << 30), 4),
                "budget_bytes": self.budget.bytes, "auto": True}


@dataclass
class HostConfig:
    path: Path
    text_hash: str
    options: PluginOptions
    top_level: dict  # the host's own top-level keys (our block removed), `models` excluded
    entries: list[ModelEntry]
    schema: HostSchema

    def host_document(self) -> dict:
        return {**self.top_level, "models": [e.host_entry for e in self.entries]}

    def host_yaml(self) -> str:
        return yaml.safe_dump(self.host_document(), sort_keys=False)

    def by_id(self) -> dict[str, ModelEntry]:
        return {e.model_id: e for e in self.entries}

    def streamed_settings(self) -> dict[str, dict]:
        """Served id -> settings dict, for the processes that load the models."""
        return {e.model_id: e.settings.to_dict() for e in self.entries if e.streamed}


def read_yaml(path: Path) -> tuple[dict, str]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        doc = yaml_limits.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    except yaml_limits.YamlLimitError as exc:
        raise ConfigError(f"{path}: refused: {exc}; a host config is a few levels of plain keys") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: the config must be a YAML mapping with a `models:` list")
    return doc, hashlib.sha256(raw).hexdigest()


def parse_options(path: Path, block: Any) -> PluginOptions:
    where = f"{path}: {KEY}"
    if block is None or block is True:
        return PluginOptions()
    if block is False:
        return PluginOptions(enabled=False)
    if not isinstance(block, dict):
        raise ConfigError(f"{where}: must be a mapping (enabled, watch, defaults, ...), got {block!r}")
    fields = {f.name: f for f in dataclasses.fields(PluginOptions)}
    unknown = sorted(map(str, set(block) - set(fields)))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}")
    block = dict(block)
    for name, value in block.items():
        if isinstance(value, str) and "float" in str(fields[name].type):
            block[name] = value = _number(value)  # PyYAML reads `1e3` (no dot) as a string
        _check_type(where, name, value, fields[name].type)
        low, high = OPTION_RANGES.get(name, (None, None))
        if low is not None and value is not None and not low <= value <= high:
            raise ConfigError(f"{where}.{name}: must be between {low} and {high}, got {value!r}")
    if "metrics_allow" in block:
        try:
            block["metrics_allow"] = allow_list(block["metrics_allow"], f"{where}.metrics_allow")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if "defaults" in block:
        try:
            refuse_removed(block["defaults"], f"{where}.defaults")
        except SettingsError as exc:
            raise ConfigError(str(exc)) from None
        unknown = sorted(map(str, set(block["defaults"]) - {f.name for f in dataclasses.fields(StreamSettings)}))
        if unknown:
            raise ConfigError(f"{where}.defaults: unknown setting(s) {', '.join(unknown)}; known: "
                              + ", ".join(f.name for f in dataclasses.fields(StreamSettings)))
    return PluginOptions(**block)


def _number(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def _check_type(where: str, name: str, value: Any, annotation: str) -> None:
    kind = str(annotation).replace("Optional[", "").rstrip("]")
    if value is None and "Optional" in str(annotation):
        return
    allowed = {"bool": (bool,), "float": (int, float), "int": (int,), "dict": (dict,)}.get(kind)
    if allowed and (isinstance(value, bool) and kind != "bool" or not isinstance(value, allowed)):
        raise ConfigError(f"{where}.{name}: must be {kind}, got {type(value).__name__} {value!r}")


def load_host_config(path: str | Path, schema: HostSchema, *, check_models: bool = True,
                     memory_bytes: Optional[int] = None) -> HostConfig:
    """Parse and validate the whole file. check_models=False skips what reads the checkpoints
    (the footprint and MoE checks, memory admission): for tests of the schema alone."""
    path = Path(expand(str(path))).absolute()
    doc, text_hash = read_yaml(path)
    options = parse_options(path, doc.get(KEY))
    unread = sorted(schema.unread_options & set(doc.get(KEY) or {} if isinstance(doc.get(KEY), dict) else ()))
    if unread:
        raise ConfigError(f"{path}: {KEY}: {', '.join(unread)} does nothing under {schema.name} (it has no "
                          "request queue and no model drain of its own); remove it")
    top_level = {k: v for k, v in doc.items() if k not in (KEY, "models")}
    if schema.top_level_keys is not None:
        unknown = sorted(map(str, set(top_level) - schema.top_level_keys))
        if unknown:
            raise ConfigError(f"{path}: unknown top-level key(s) {', '.join(unknown)} for {schema.name}; "
                              f"known: {', '.join(sorted(schema.top_level_keys | {KEY, 'models'}))}")
    problem = schema.top_level_check(top_level) if schema.top_level_check else None
    if problem:
        raise ConfigError(f"{path}: {problem}")
    models = doc.get("models")
    if not isinstance(models, list) or not models:
        raise ConfigError(f"{path}: `models:` must be a non-empty list of model entries")
    entries: list[ModelEntry] = []
    seen: dict[str, int] = {}
    for i, raw in enumerate(models):
        entry = _parse_entry(path, i, raw, schema, options, check_models)
        if entry.model_id in seen:
            raise ConfigError(f"{path}: models[{i}] and models[{seen[entry.model_id]}] are both served as "
                              f"{entry.model_id!r}; give each a unique served_model_name")
        seen[entry.model_id] = i
        entries.append(entry)
    _refuse_streamed_drafts(path, entries)
    config = HostConfig(path, text_hash, options, top_level, entries, schema)
    if check_models:
        try:
            admit(config, memory_bytes)
        except AdmissionError as exc:
            raise ConfigError(str(exc)) from None
    return config


def _refuse_streamed_drafts(path: Path, entries: list) -> None:
    """A draft model loads whole and stock, in the same process as its main model: a streamed
    entry's folder as a draft would be streamed a second time under the main model's name."""
    streamed = {e.resolved_path(): e for e in entries if e.streamed}
    for entry in entries:
        draft = entry.host_entry.get("draft_model_path")
        other = streamed.get(Path(draft).expanduser().resolve()) if isinstance(draft, str) and draft else None
        if other is not None:
            raise ConfigError(f"{path}: models[{entry.index}] ({entry.model_id}).draft_model_path is the folder of "
                              f"models[{other.index}] ({other.model_id}), which streams: a draft model loads whole, "
                              "without streaming; use a small dense model with the same tokenizer")


def _parse_entry(path: Path, i: int, raw: Any, schema: HostSchema, options: PluginOptions,
                 check_models: bool) -> ModelEntry:
    where = f"{path}: models[{i}]"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: a model entry must be a mapping with model_path, got {raw!r}")
    if "model_path" not in raw or not isinstance(raw["model_path"], str):
        raise ConfigError(f"{where}: model_path (a string) is required")
    host_entry = {k: v for k, v in raw.items() if k != KEY}
    # The hosts take paths literally (`~` reached mlx-openai-server as a repo id): hand them
    # expanded folders, and a cached hub id as its snapshot folder.
    model_path = resolve_model_path(raw["model_path"])
    host_entry["model_path"] = model_path
    for key in PATH_KEYS & set(host_entry):
        value = host_entry[key]
        if isinstance(value, str):
            host_entry[key] = expand(value)
        elif isinstance(value, list):
            host_entry[key] = [expand(v) if isinstance(v, str) else v for v in value]
    ids = [k for k in schema.id_aliases if k in host_entry]
    if len(ids) > 1:
        raise ConfigError(f"{where}: both {ids[0]} and {ids[1]} set; keep one")
    model_id = host_entry.pop(ids[0]) if ids else raw["model_path"]
    if not isinstance(model_id, str) or not model_id:
        raise ConfigError(f"{where}: {ids[0]} must be a non-empty string")
    where = f"{where} ({model_id})"
    allowed = schema.entry_keys - set(schema.id_aliases)
    unknown = sorted(map(str, set(host_entry) - allowed))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} for {schema.name} {schema.version}; "
                          f"known: {', '.join(sorted(allowed | {schema.id_key, KEY}))}")
    host_entry[schema.id_key] = model_id
    block = raw.get(KEY)
    streamed = block not in (None, False) and options.enabled
    if block is not None and not isinstance(block, (dict, bool)):
        raise ConfigError(f"{where}.{KEY}: must be a mapping of settings (or true for the defaults), got {block!r}")
    settings = None
    if streamed:
        problem = schema.streamed_entry_check(host_entry) if schema.streamed_entry_check else None
        if problem:
            raise ConfigError(f"{where}.{KEY}: {problem}")
        values = {**options.defaults, **(block if isinstance(block, dict) else {})}
        if isinstance(values.get("warm_start"), str):
            values["warm_start"] = expand(values["warm_start"])
        if schema.context_key and "context_length" in values:
            raise ConfigError(f"{where}.{KEY}.context_length: {schema.name} has its own `{schema.context_key}` on "
                              "the entry (it also bounds the host's KV cache): set that instead")
        if schema.context_key and isinstance(host_entry.get(schema.context_key), int):
            values["context_length"] = host_entry[schema.context_key]  # the KV an auto budget leaves room for
        settings = _settings(where, values)
        if schema.queue_timeout_key:
            host_entry.setdefault(schema.queue_timeout_key, options.queue_timeout)
        for key, value in schema.forced_entry_values.items():
            if key in raw and raw[key] != value:
                log.warning("%s: %s=%r ignored: streamed models serve one request at a time", where, key, raw[key])
            host_entry[key] = value
    elif block is not None and not options.enabled:
        log.warning("%s: %s.enabled is false: this model loads stock, all of it in memory", where, KEY)
    problem = schema.entry_check(host_entry) if schema.entry_check else None
    if problem:
        raise ConfigError(f"{where}: {problem}")
    entry = ModelEntry(i, model_id, model_path, host_entry, settings, 0)
    if check_models:
        _check_model(where, entry)
    return entry


def _settings(where: str, values: dict) -> StreamSettings:
    from expert_stream.streaming.errors import SettingsError

    # PyYAML reads `5e-05` (no dot) as a string; for a float setting that is surely a number.
    floats = {f.name for f in dataclasses.fields(StreamSettings) if "float" in str(f.type)} | {"budget_gib"}
    for key in floats & set(values):
        if isinstance(values[key], str) and values[key] != "auto":
            try:
                values[key] = float(values[key])
            except ValueError:
                pass
    try:
        return StreamSettings.from_mapping(values, where=f"{where}.{KEY}")
    except SettingsError as exc:
        raise ConfigError(str(exc)) from None


def _check_model(where: str, entry: ModelEntry) -> None:
    """Read the checkpoint's headers: the load checks (streaming/load_checks.py), then its sizes;
    memory admission follows, over every entry."""
    from expert_stream.plugin import plugins
    from expert_stream.streaming.checkpoint import CheckpointIndex
    from expert_stream.streaming.load_checks import check_budget, check_checkpoint

    model_dir = Path(entry.model_path).expanduser()
    entry.draft_bytes = checkpoint_bytes(entry.host_entry.get("draft_model_path"))
    if not entry.streamed:
        if is_folder(model_dir):
            try:
                entry.resident_bytes = CheckpointIndex(model_dir).total_bytes()
            except ExpertStreamError:
                entry.resident_bytes = 0  # the host will say what is wrong with it
        return
    if not is_folder(model_dir):
        hint = (" and not a hub id in the local Hugging Face cache ($HF_HUB_CACHE)"
                if looks_like_hub_id(entry.model_path) else "")
        raise ConfigError(f"{where}: model_path {entry.model_path} is not a folder{hint}; a streamed model "
                          "must be a local MLX checkpoint (download it first, e.g. `hf download ID`)")
    pm = plugins.get_plugin_manager()
    trust = entry.host_entry.get("trust_remote_code") is True
    try:
        check_checkpoint(model_dir, entry.settings, f"{where}.{KEY}", plugins.load_hooks(pm), trust)
        entry.footprint = fp = footprint(model_dir, plugins.architectures(pm), trust)
        if not entry.settings.auto:
            check_budget(entry.settings.budget_bytes, fp.min_budget_bytes, fp.top_k, len(fp.layer_expert_bytes),
                         f"{where}.{KEY}")
    except ConfigError:
        raise
    except ExpertStreamError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith(where) else f"{where}: {message}") from None


_FOOTPRINTS: dict = {}


def footprint(model_dir: Path, architectures, trust_remote_code: bool = False):
    """The engine's footprint (headers and a lazily built model), cached by the files' identity
    so a reload does not rebuild it for unchanged checkpoints."""
    from expert_stream.streaming.errors import NotMoEError
    from expert_stream.streaming.footprint import checkpoint_footprint

    key = (str(model_dir.resolve()), _dir_identity(model_dir))
    if key not in _FOOTPRINTS:
        try:
            _FOOTPRINTS[key] = checkpoint_footprint(model_dir, architectures, trust_remote_code)
        except NotMoEError as exc:
            raise ConfigError(f"{exc}; remove its {KEY} block to serve it as the host would") from None
        except ExpertStreamError as exc:
            raise ConfigError(str(exc)) from None
    return _FOOTPRINTS[key]


def _dir_identity(model_dir: Path) -> tuple:
    return tuple(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                        for p in model_dir.iterdir() if p.suffix in (".json", ".safetensors")))
