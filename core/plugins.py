"""The plugin manager: transports and resolvers found through pluggy.

Plugins are modules with ``@clusterwire.hookimpl`` functions. They are found
(lazily, at the first lookup) through the ``clusterwire`` entry-point group,
which is how the built-in transports register too, plus the modules that
``plugins.toml`` lists under ``load``. Plugins named under ``block`` are never
loaded. Each hook returns typed records that are validated at load time.
"""

from __future__ import annotations

import difflib
import importlib
import os
import re
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pluggy

from clusterwire.errors import AlreadyExistsError, InvalidArgumentError, NotFoundError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PROJECT = "clusterwire"
ENTRY_POINT_GROUP = "clusterwire"
CONFIG_ENV = "CLUSTERWIRE_PLUGINS"
CONFIG_FILE = "plugins.toml"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

_PROTOCOL = re.compile(r"^[a-z][a-z0-9_-]*(\+[a-z][a-z0-9_-]*)*$")
_RESOLVER = re.compile(r"^[a-z][a-z0-9_]*$")

# Where a protocol or resolver that is not installed comes from, for the error message.
PROVIDERS = {
    "grpc+local": "the built-in 'grpc+local' transport (reinstall clusterwire)",
    "grpc+verbs": "pip install 'clusterwire[verbs]'",
    "zmq": "from a clusterwire checkout: pip install ./plugins/clusterwire-zmq (it is not on "
           "a package index)",
}


@dataclass(frozen=True)
class TransportSpec:
    """A transport a plugin provides: ``factory(options)`` returns a ``Transport``."""

    protocol: str
    factory: Callable[[Mapping[str, Any]], Any]
    description: str = ""


@dataclass(frozen=True)
class ResolverSpec:
    """A cluster resolver a plugin provides: ``factory(**kwargs)`` returns a ClusterResolver."""

    name: str
    factory: Callable[..., Any]
    description: str = ""


class HookSpecs:
    """The hooks a clusterwire plugin may implement."""

    @hookspec
    def clusterwire_add_transports(self) -> list[TransportSpec]:
        """Return the transports this plugin provides."""

    @hookspec
    def clusterwire_add_resolvers(self) -> list[ResolverSpec]:
        """Return the cluster resolvers this plugin provides."""


@dataclass
class PluginConfig:
    """The content of a plugins.toml file."""

    path: str | None = None
    load: list[str] = field(default_factory=list)
    block: list[str] = field(default_factory=list)
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    security: dict[str, Any] = field(default_factory=dict)
    data_limits: dict[str, Any] = field(default_factory=dict)


def find_config_path(path: str | os.PathLike | None = None) -> str | None:
    """The plugins.toml to use: ``path``, else $CLUSTERWIRE_PLUGINS, else ./plugins.toml."""
    if path is not None:
        return os.fspath(path)
    if os.environ.get(CONFIG_ENV):
        return os.environ[CONFIG_ENV]
    return CONFIG_FILE if os.path.isfile(CONFIG_FILE) else None


def load_config(path: str | os.PathLike | None = None) -> PluginConfig:
    """Read plugins.toml; a malformed file raises InvalidArgumentError naming file and line."""
    found = find_config_path(path)
    if found is None:
        return PluginConfig()
    try:
        with open(found, "rb") as handle:
            data = tomllib.load(handle)
    except FileNotFoundError:
        raise NotFoundError(
            f"Plugin configuration {found!r} does not exist (named by "
            f"{'the argument' if path is not None else '$' + CONFIG_ENV}).") from None
    except tomllib.TOMLDecodeError as err:
        raise InvalidArgumentError(f"Malformed plugin configuration {found}: {err}") from None
    unknown = set(data) - {"load", "block", "options", "security", "data_limits"}
    if unknown:
        raise InvalidArgumentError(
            f"{found}: unknown key(s) {sorted(unknown)}; allowed: load, block, [options.NAME], "
            "[security], [data_limits].")
    config = PluginConfig(path=found)
    for key in ("load", "block"):
        value = data.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise InvalidArgumentError(f"{found}: '{key}' must be a list of strings, got {value!r}")
        setattr(config, key, value)
    options = data.get("options", {})
    if not all(isinstance(v, dict) for v in options.values()):
        raise InvalidArgumentError(f"{found}: [options] must hold one table per plugin name.")
    config.options = options
    security = data.get("security", {})
    if not isinstance(security, dict):
        raise InvalidArgumentError(f"{found}: [security] must be a table.")
    config.security = security
    data_limits = data.get("data_limits", {})
    if not isinstance(data_limits, dict):
        raise InvalidArgumentError(f"{found}: [data_limits] must be a table.")
    config.data_limits = data_limits
    return config


@dataclass(frozen=True)
class PluginInfo:
    """Where a transport or resolver comes from, for listings and errors."""

    kind: str  # "transport" or "resolver"
    name: str
    plugin: str
    module: str
    distribution: str
    version: str
    description: str


class PluginManager:
    """Loads plugins on first use and looks up transports and resolvers by name."""

    def __init__(self, config_path: str | os.PathLike | None = None):
        self._config_path = config_path
        self._lock = threading.RLock()
        self._loaded = False
        self._pm = pluggy.PluginManager(PROJECT)
        self._pm.add_hookspecs(HookSpecs)
        self.config = PluginConfig()
        # name -> (record, plugin); a PluginInfo reads the distribution's metadata, so it is
        # made only for listings and errors.
        self._transports: dict[str, tuple[TransportSpec, object]] = {}
        self._resolvers: dict[str, tuple[ResolverSpec, object]] = {}
        self._instances: dict[str, Any] = {}
        self._distributions: dict[str, Any] = {}  # plugin name -> importlib.metadata.Distribution
        self._broken: dict[str, tuple[Any, str]] = {}  # plugin name -> (distribution, error)

    @property
    def pluggy(self) -> pluggy.PluginManager:
        """The underlying pluggy manager (for registering plugins in tests)."""
        return self._pm

    def register(self, plugin: object, name: str | None = None) -> None:
        """Register a plugin object or module directly, then re-validate."""
        with self._lock:
            self._ensure_loaded()
            self._pm.register(plugin, name=name)
            self._collect()

    def unregister(self, name: str) -> None:
        """Remove a plugin registered under ``name`` and drop its transports."""
        with self._lock:
            self._pm.unregister(name=name)
            self._instances.clear()
            self._collect()

    def _ensure_loaded(self) -> None:
        if self._loaded:
            return
        self.config = load_config(self._config_path)
        for name in self.config.block:
            self._pm.set_blocked(name)
        self._load_entry_points()
        for module_name in self.config.load:
            if self._pm.is_blocked(module_name):
                continue
            try:
                module = importlib.import_module(module_name)
            except ImportError as err:
                raise NotFoundError(
                    f"{self.config.path}: cannot load plugin module {module_name!r}: {err}"
                ) from None
            if not self._pm.is_registered(module):
                self._pm.register(module, name=module_name)
        self._collect()
        self._loaded = True

    def _load_entry_points(self) -> None:
        """Register each entry point's plugin; one that fails to import is kept aside.

        A broken third-party plugin must not take the other transports down:
        its error is reported when its own protocol is asked for.
        """
        import importlib.metadata  # only here: ``import clusterwire`` stays light

        for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if self._pm.is_blocked(entry.name) or self._pm.has_plugin(entry.name):
                continue
            try:
                plugin = entry.load()
            except Exception as err:
                self._broken[entry.name] = (entry.dist, f"{type(err).__name__}: {err}")
                continue
            self._pm.register(plugin, name=entry.name)
            self._distributions[entry.name] = entry.dist

    def _plugin_name(self, plugin: object) -> str:
        return self._pm.get_name(plugin) or repr(plugin)

    def _info(self, kind: str, name: str, plugin: object, description: str) -> PluginInfo:
        plugin_name = self._plugin_name(plugin)
        dist = self._distributions.get(plugin_name)
        dist_name, version = (dist.name, dist.version) if dist is not None else ("-", "-")
        module = getattr(plugin, "__name__", type(plugin).__module__)
        return PluginInfo(kind, name, plugin_name, module, dist_name, version, description)

    def _collect(self) -> None:
        transports: dict[str, tuple[TransportSpec, object]] = {}
        resolvers: dict[str, tuple[ResolverSpec, object]] = {}
        for plugin in self._pm.get_plugins():
            for hook, record_type, table, key, pattern in (
                ("clusterwire_add_transports", TransportSpec, transports, "protocol", _PROTOCOL),
                ("clusterwire_add_resolvers", ResolverSpec, resolvers, "name", _RESOLVER),
            ):
                impl = getattr(plugin, hook, None)
                if impl is None:
                    continue
                for record in impl() or []:
                    self._add(plugin, record, record_type, table, key, pattern)
        self._transports, self._resolvers = transports, resolvers

    def _add(self, plugin, record, record_type, table, key, pattern) -> None:
        kind = "transport" if record_type is TransportSpec else "resolver"
        plugin_name = self._pm.get_name(plugin)
        if not isinstance(record, record_type):
            raise InvalidArgumentError(
                f"Plugin {plugin_name!r} returned {record!r} from its {kind} hook; "
                f"expected clusterwire.plugins.{record_type.__name__} records.")
        name = getattr(record, key)
        if not isinstance(name, str) or not pattern.match(name):
            raise InvalidArgumentError(
                f"Plugin {plugin_name!r} registers invalid {kind} name {name!r}: use lowercase "
                "letters, digits, '_' or '-', with '+' between parts (e.g. 'grpc+verbs').")
        if name in table:
            other_record, other_plugin = table[name]
            other = self._info(kind, name, other_plugin, other_record.description)
            info = self._info(kind, name, plugin, record.description)
            raise AlreadyExistsError(
                f"The {kind} {name!r} is registered twice: by plugin {other.plugin!r} "
                f"(distribution {other.distribution} {other.version}) and by plugin "
                f"{info.plugin!r} (distribution {info.distribution} {info.version}). "
                f"Uninstall one, or block one in plugins.toml (block = [\"{info.plugin}\"]).")
        table[name] = (record, plugin)

    def protocols(self) -> list[str]:
        """Installed transport protocol strings, sorted."""
        with self._lock:
            self._ensure_loaded()
            return sorted(self._transports)

    def resolver_names(self) -> list[str]:
        """Installed resolver names, sorted."""
        with self._lock:
            self._ensure_loaded()
            return sorted(self._resolvers)

    def listing(self) -> list[PluginInfo]:
        """Every transport and resolver with its plugin, module, distribution, version.

        Plugins that failed to load are listed with kind "broken" and the error.
        """
        with self._lock:
            self._ensure_loaded()
            broken = [PluginInfo("broken", plugin, plugin, "-",
                                 dist.name if dist is not None else "-",
                                 dist.version if dist is not None else "-", error)
                      for plugin, (dist, error) in sorted(self._broken.items())]
            return [self._info(kind, name, plugin, record.description)
                    for kind, table in (("transport", self._transports),
                                        ("resolver", self._resolvers))
                    for name, (record, plugin) in table.items()] + broken

    def options_for(self, plugin_name: str) -> dict[str, Any]:
        """The per-plugin options of plugins.toml for ``plugin_name``."""
        with self._lock:
            self._ensure_loaded()
            return dict(self.config.options.get(plugin_name, {}))

    def security_options(self) -> dict[str, Any]:
        """The [security] table of plugins.toml (TLS files, token file)."""
        with self._lock:
            self._ensure_loaded()
            return dict(self.config.security)

    def data_limits(self) -> tuple[dict[str, Any], str | None]:
        """The [data_limits] table of plugins.toml (the data service's ServiceLimits) and
        the file's path."""
        with self._lock:
            self._ensure_loaded()
            return dict(self.config.data_limits), self.config.path

    def _missing(self, kind: str, name: str, installed: list[str]) -> NotFoundError:
        hint = PROVIDERS.get(name)
        text = f"No {kind} registered for {name!r}."
        close = difflib.get_close_matches(name, [*installed, *PROVIDERS], n=1, cutoff=0.6)
        if close and close[0] != name:
            text += f" Did you mean {close[0]!r}?"
        text += f" Installed: {', '.join(installed) or 'none'}."
        for plugin, (dist, error) in sorted(self._broken.items()):
            origin = f"distribution {dist.name} {dist.version}" if dist is not None else "-"
            text += f" Plugin {plugin!r} ({origin}) failed to load: {error}."
        if hint:
            text += f" {name!r} is provided by {hint}."
        return NotFoundError(text)

    def transport(self, protocol: str) -> Any:
        """The process-wide Transport for ``protocol``; NotFoundError if not installed."""
        if not isinstance(protocol, str):
            raise InvalidArgumentError(f"Protocol {protocol!r} must be a string such as 'grpc'.")
        with self._lock:
            self._ensure_loaded()
            if protocol in self._instances:
                return self._instances[protocol]
            if protocol not in self._transports:
                raise self._missing("transport", protocol, sorted(self._transports))
            spec, plugin = self._transports[protocol]
            instance = spec.factory(self.options_for(self._plugin_name(plugin)))
            self._instances[protocol] = instance
            return instance

    def resolver_spec(self, name: str) -> ResolverSpec:
        """The ResolverSpec registered as ``name``; NotFoundError if not installed."""
        with self._lock:
            self._ensure_loaded()
            if name not in self._resolvers:
                raise self._missing("cluster resolver", name, sorted(self._resolvers))
            return self._resolvers[name][0]


_default: PluginManager | None = None
_default_lock = threading.Lock()


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager (created, not loaded, on first call)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = PluginManager()
        return _default


def set_plugin_manager(manager: PluginManager | None) -> PluginManager | None:
    """Replace the process-wide plugin manager (None: a fresh one on next use); returns the old."""
    global _default
    with _default_lock:
        old, _default = _default, manager
        return old
