"""Plugin loading and the sampler registry, in the manner of vLLM's ``vllm.plugins``.

Below the drafters, the loop and the plugins (it imports nothing of specjax:
targets are ``module:attr`` strings imported on first use), so each of them may
look names up here. It is the one import path of the registry's names.

Two entry-point groups
----------------------
``specjax.plugins``
    Each entry point names a ``register()`` function taking no arguments.
    :func:`load_plugins` calls every installed one once per process; a plugin
    registers what it provides (samplers with :func:`register_sampler`,
    ``custom_generate`` functions with :func:`register_custom_generate`).
    Importing a plugin's module must have no side effects: all the work happens
    in ``register()``.
``specjax.samplers``
    Each entry point names a sampler: a callable with the
    :func:`specjax.rejection_sample` contract (including the ``validate``
    keyword). Nothing is imported until :func:`load_sampler` asks for it.

This package declares, in its own ``pyproject.toml``: plugins
``builtin_samplers`` (registers ``jax``, ``numpy``, ``torch``) and
``transformers`` (registers the ``custom_generate`` function ``specjax``, see
:mod:`specjax.plugin.hf`); samplers ``jax``, ``numpy``, ``torch``.

Filtering: ``SPECJAX_PLUGINS``
------------------------------
Unset: everything installed loads. Set: a comma-separated allowlist of
entry-point *names*, applied to both groups, as vLLM applies ``VLLM_PLUGINS``
to each of its groups: a ``specjax.plugins`` entry point runs, and a
``specjax.samplers`` entry point is visible, only if its name is listed.
Samplers registered by an allowed plugin are visible whatever their names.
An empty value allows nothing. The ``jax`` sampler (the package's own kernel)
is always available. So ``SPECJAX_PLUGINS=builtin_samplers`` gives ``jax``,
``numpy`` and ``torch`` and no third-party code runs; ``SPECJAX_PLUGINS=""``
gives ``jax`` only. The variable is read once, by the first
:func:`load_plugins` call of the process (plugins are never unloaded), and that
value filters both groups for the rest of the process.

Names
-----
Sampler and ``custom_generate`` names match ``[A-Za-z0-9_.-]+``. One name, two
different targets is an error: :func:`register_sampler` refuses it (unless
``override=True``), and :func:`load_sampler` refuses a name that two installed
distributions declare differently. Registering the same target again is a
no-op, so a plugin may register what its distribution also declares as an
entry point.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BUILTIN_SAMPLERS",
    "ENV_VAR",
    "PLUGINS_GROUP",
    "SAMPLERS_GROUP",
    "PluginInfo",
    "allowed_names",
    "available_custom_generates",
    "available_samplers",
    "load_custom_generate",
    "load_plugins",
    "load_plugins_by_group",
    "load_sampler",
    "named_entry_points",
    "plugin_status",
    "register_custom_generate",
    "register_sampler",
    "resolve_target",
    "sampler_origins",
]

logger = logging.getLogger("specjax.plugin")

PLUGINS_GROUP = "specjax.plugins"
SAMPLERS_GROUP = "specjax.samplers"
ENV_VAR = "SPECJAX_PLUGINS"

#: The samplers this package ships, declared once: name -> "module:attr". ``jax``
#: (the package's own kernel) is always available, whatever SPECJAX_PLUGINS says;
#: the ``builtin_samplers`` plugin (:mod:`specjax.plugin.builtin`) registers the
#: others. pyproject.toml's ``specjax.samplers`` entry points repeat this table as
#: the distribution's metadata (tests/test_plugin_registry.py keeps them equal).
BUILTIN_SAMPLERS: dict[str, str] = {
    "jax": "specjax.boundary.api:rejection_sample",
    "numpy": "specjax.plugin.reference_samplers:numpy_rejection_sample",
    "torch": "specjax.plugin.reference_samplers:torch_rejection_sample",
}
_ALWAYS = "jax"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")

_lock = threading.RLock()
_plugins_loaded = False
_plugin_info: dict[str, PluginInfo] = {}
_env_at_load: str | None = None  # SPECJAX_PLUGINS as the first load_plugins() read it


@dataclass(frozen=True)
class PluginInfo:
    """What :func:`load_plugins` did with one ``specjax.plugins`` entry point.

    Attributes:
      name: the entry point's name.
      value: its ``module:function`` target.
      distribution: ``"name version"`` of the distribution declaring it, or ``""``.
      status: ``"loaded"`` (``register()`` returned), ``"failed"`` (importing or
        calling it raised anything, ``SystemExit`` included; see ``error``) or ``"excluded"`` (by ``SPECJAX_PLUGINS``).
      error: ``"ExceptionType: message"`` for failed plugins, else ``""``.
    """

    name: str
    value: str
    distribution: str
    status: str
    error: str = ""


@dataclass(frozen=True)
class _Target:
    """A registered object: a callable, or a lazy ``module:attr`` spec."""

    spec: str  # "module:qualname", used to compare registrations
    obj: Any  # the callable, or None until loaded
    origin: str  # where it came from, for messages
    override: bool = False  # registered with override=True: wins over entry points


class _Table:
    """One kind of registered object (samplers, custom_generate functions)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.registered: dict[str, _Target] = {}

    def register(self, name: str, target: Any, origin: str, *, override: bool) -> None:
        _check_name(self.kind, name)
        new = _make_target(self.kind, name, target, origin, override)
        if self.kind == "sampler" and name == _ALWAYS and new.spec != BUILTIN_SAMPLERS[_ALWAYS]:
            raise ValueError(f"sampler {name!r}: reserved for {BUILTIN_SAMPLERS[_ALWAYS]}, got {new.spec}")
        with _lock:
            old = self.registered.get(name)
            if old is not None and old.spec != new.spec and not override:
                raise ValueError(
                    f"{self.kind} {name!r}: already registered as {old.spec} ({old.origin}); refusing to "
                    f"replace it with {new.spec} (pass override=True to replace it)"
                )
            if old is not None and old.spec == new.spec and old.obj is not None and new.obj is None:
                return  # the same target, already loaded
            self.registered[name] = new


_samplers = _Table("sampler")
_custom_generates = _Table("custom_generate")


# --------------------------------------------------------------------------- #
# Entry points and the allowlist
# --------------------------------------------------------------------------- #


def _entry_points(group: str) -> list[importlib.metadata.EntryPoint]:
    """Installed entry points of ``group`` (one per distribution and name)."""
    return list(importlib.metadata.entry_points(group=group))


def _dist_label(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return ""
    try:
        return f"{dist.name} {dist.version}"
    except Exception:  # broken metadata must not break loading
        return ""


def _parse(raw: str | None) -> frozenset[str] | None:
    if raw is None:
        return None
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


def allowed_names() -> frozenset[str] | None:
    """The allowlist from ``SPECJAX_PLUGINS`` as of now: None when unset (allow all)."""
    return _parse(os.environ.get(ENV_VAR))


def _allowed_for_process() -> frozenset[str] | None:
    """The allowlist the process uses: ``SPECJAX_PLUGINS`` as the first :func:`load_plugins` read it."""
    load_plugins()
    return _parse(_env_at_load)


def _filter_note() -> str:
    raw = _env_at_load
    return "" if raw is None else f" ({ENV_VAR}={raw!r} restricts which entry points load)"


def named_entry_points(
    group: str, reserved: Mapping[str, str | None], allowed: frozenset[str] | None
) -> tuple[dict[str, _Target], dict[str, list[str]]]:
    """The allowed entry points of ``group`` as lazy targets by name, and the names declared twice.

    The one reading of a group of named objects (samplers, drafters): an entry
    point whose name is in ``reserved`` (the package's own names) is skipped,
    with a warning unless it declares the reserved target itself (``None``:
    any ``specjax.`` target); one not in ``allowed`` (``SPECJAX_PLUGINS``;
    None allows all) is skipped; a name two distributions declare with
    different targets is returned in ``clashes`` (``{name: [spec (origin)]}``)
    rather than chosen.
    """
    table: dict[str, _Target] = {}
    clashes: dict[str, list[str]] = {}
    for ep in _entry_points(group):
        spec = ep.value.replace(" ", "")
        if ep.name in reserved:
            own = reserved[ep.name]
            if (spec != own) if own is not None else not spec.startswith("specjax."):
                logger.warning(
                    "%s: ignoring %s = %s from %s: the name %r is reserved for the built-in %s",
                    group,
                    ep.name,
                    ep.value,
                    _dist_label(ep) or "unknown distribution",
                    ep.name,
                    own or "one",
                )
            continue
        if allowed is not None and ep.name not in allowed:
            continue
        label = _dist_label(ep) or "unknown distribution"
        target = _Target(spec, None, f"entry point {group}:{ep.name} of {label}")
        old = table.get(ep.name)
        if old is not None and old.spec != target.spec:
            clashes.setdefault(ep.name, [f"{old.spec} ({old.origin})"]).append(f"{target.spec} ({target.origin})")
            continue
        table[ep.name] = target
    return table, clashes


def resolve_target(kind: str, name: str, target: _Target) -> Callable[..., Any]:
    """Import a lazy target (``module:attr``) once; ``ImportError``/``TypeError`` naming ``kind`` and ``name``."""
    return _resolve(kind, name, target)


def load_plugins_by_group(group: str) -> dict[str, Callable[..., Any]]:
    """Load (import) the allowed entry points of ``group``; do not call them.

    Returns ``{entry point name: loaded object}``. Entry points excluded by
    ``SPECJAX_PLUGINS`` are skipped; one that fails to import is logged on the
    ``"specjax.plugin"`` logger and skipped (vLLM's behaviour).
    """
    allowed = allowed_names()
    loaded: dict[str, Callable[..., Any]] = {}
    for ep in _entry_points(group):
        if allowed is not None and ep.name not in allowed:
            logger.debug("%s: skipping %s (not in %s)", group, ep.name, ENV_VAR)
            continue
        try:
            loaded[ep.name] = ep.load()
        except BaseException as err:  # also SystemExit; an interrupt is re-raised
            if isinstance(err, KeyboardInterrupt):
                raise
            logger.error("%s: failed to load %s = %s: %s", group, ep.name, ep.value, _describe(err), exc_info=err)
    return loaded


def load_plugins() -> dict[str, PluginInfo]:
    """Run every installed, allowed ``specjax.plugins`` ``register()``, once per process.

    Idempotent and thread-safe: the first call does the work, later calls (also
    from inside a plugin's ``register()``) return at once and register nothing
    twice. A plugin that fails to import or whose ``register()`` raises (any
    ``BaseException``: a plugin calling ``sys.exit()`` too) is logged on the
    ``"specjax.plugin"`` logger and recorded as ``"failed"``; the others still
    load. A ``KeyboardInterrupt`` is recorded the same way and re-raised after
    the last plugin.

    Returns:
      ``{plugin name: PluginInfo}`` (the same as :func:`plugin_status`).
    """
    global _plugins_loaded, _env_at_load
    with _lock:
        if _plugins_loaded:
            return dict(_plugin_info)
        _plugins_loaded = True  # before calling plugins: a plugin may call load_sampler
        _env_at_load = os.environ.get(ENV_VAR)
        allowed = _parse(_env_at_load)
        interrupted: KeyboardInterrupt | None = None
        for ep in _entry_points(PLUGINS_GROUP):
            label = _dist_label(ep)
            if allowed is not None and ep.name not in allowed:
                _plugin_info[ep.name] = PluginInfo(ep.name, ep.value, label, "excluded")
                continue
            if _plugin_info.get(ep.name, None) is not None and _plugin_info[ep.name].status == "loaded":
                # The same name from a second distribution (or a duplicate path entry).
                prev = _plugin_info[ep.name]
                if prev.value == ep.value:
                    continue
                logger.warning(
                    "%s: two plugins named %r (%s and %s); both run", PLUGINS_GROUP, ep.name, prev.value, ep.value
                )
            try:
                register = ep.load()
                if not callable(register):
                    raise TypeError(f"{ep.value} is a {type(register).__name__}, not a callable register()")
                register()
            except BaseException as err:
                # Any BaseException: a plugin calling sys.exit() on import must not leave the
                # registry half-loaded. An interrupt is recorded too, and re-raised once every
                # plugin has a status, so Ctrl-C still stops the process.
                if isinstance(err, KeyboardInterrupt) and interrupted is None:
                    interrupted = err
                logger.error(
                    "%s: plugin %s = %s failed: %s", PLUGINS_GROUP, ep.name, ep.value, _describe(err), exc_info=err
                )
                _plugin_info[ep.name] = PluginInfo(ep.name, ep.value, label, "failed", _describe(err))
            else:
                _plugin_info[ep.name] = PluginInfo(ep.name, ep.value, label, "loaded")
        if interrupted is not None:
            raise interrupted
        return dict(_plugin_info)


def _describe(err: BaseException) -> str:
    """``"ExceptionType: message"`` (``SystemExit(3)`` gives ``"SystemExit: 3"``)."""
    return f"{type(err).__name__}: {err}"


def plugin_status() -> dict[str, PluginInfo]:
    """``{plugin name: PluginInfo}`` for the plugins seen so far (empty before loading)."""
    with _lock:
        return dict(_plugin_info)


def _reset_for_tests() -> None:
    """Forget loaded plugins and registrations (tests only: plugins are never unloaded)."""
    global _plugins_loaded, _env_at_load
    with _lock:
        _plugins_loaded = False
        _env_at_load = None
        _plugin_info.clear()
        _samplers.registered.clear()
        _custom_generates.registered.clear()


# --------------------------------------------------------------------------- #
# Registration
# --------------------------------------------------------------------------- #


def _check_name(kind: str, name: Any) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"{kind} name: expected letters, digits, '_', '.' or '-', got {name!r}")


def _spec_of(obj: Any) -> str:
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if module and qualname and "<" not in qualname:
        return f"{module}:{qualname}"
    return f"<object at {id(obj):#x}>"


def _make_target(kind: str, name: str, target: Any, origin: str, override: bool = False) -> _Target:
    if isinstance(target, str):
        module, sep, attr = target.partition(":")
        if not sep or not module.strip() or not attr.strip():
            raise ValueError(f"{kind} {name!r}: expected a callable or a 'module:attribute' string, got {target!r}")
        return _Target(f"{module.strip()}:{attr.strip()}", None, origin, override)
    if not callable(target):
        raise TypeError(
            f"{kind} {name!r}: expected a callable or a 'module:attribute' string, got {type(target).__name__}"
        )
    return _Target(_spec_of(target), target, origin, override)


def register_sampler(name: str, sampler: Callable[..., Any] | str, *, override: bool = False) -> None:
    """Make ``sampler`` available to :func:`load_sampler` under ``name``.

    Args:
      name: letters, digits, ``_``, ``.``, ``-``.
      sampler: a callable with the :func:`specjax.rejection_sample` contract, or
        a ``"module:attribute"`` string imported on first use (so registering
        imports nothing).
      override: replace a different sampler already registered under ``name``.

    Raises:
      ValueError: a bad name, or ``name`` already registered with a different
        target and ``override`` is False. Registering the same target again is
        a no-op.
      TypeError: ``sampler`` is neither callable nor a string.
    """
    _samplers.register(name, sampler, "registered by register_sampler", override=override)


def register_custom_generate(name: str, fn: Callable[..., Any] | str, *, override: bool = False) -> None:
    """Register a transformers ``custom_generate`` callable under ``name``.

    Same rules as :func:`register_sampler`. The ``transformers`` plugin
    registers ``"specjax"`` → :func:`specjax.plugin.hf.speculative_decoding`.
    """
    _custom_generates.register(name, fn, "registered by register_custom_generate", override=override)


# --------------------------------------------------------------------------- #
# Lookup
# --------------------------------------------------------------------------- #


def _sampler_table() -> tuple[dict[str, _Target], dict[str, list[str]]]:
    """Visible samplers ``{name: target}`` and ambiguous names ``{name: [origins]}``."""
    table, clashes = named_entry_points(SAMPLERS_GROUP, {_ALWAYS: BUILTIN_SAMPLERS[_ALWAYS]}, _allowed_for_process())
    table[_ALWAYS] = _Target(BUILTIN_SAMPLERS[_ALWAYS], None, "built in (always available)")
    with _lock:
        registered = dict(_samplers.registered)
    for name, target in registered.items():
        old = table.get(name)
        if old is None or (old.spec != target.spec and target.override):
            table[name] = target
        elif old.spec == target.spec:
            if target.obj is not None:
                table[name] = target
        else:
            clashes.setdefault(name, [f"{old.spec} ({old.origin})"]).append(f"{target.spec} ({target.origin})")
    return table, clashes


def available_samplers() -> list[str]:
    """Sorted names :func:`load_sampler` accepts now (loads plugins first)."""
    table, _ = _sampler_table()
    return sorted(table)


def sampler_origins() -> dict[str, str]:
    """``{sampler name: "module:attr (where it came from)"}``, for listings."""
    table, clashes = _sampler_table()
    out = {name: f"{t.spec} ({t.origin})" for name, t in sorted(table.items())}
    for name, origins in clashes.items():
        out[name] = "ambiguous: " + "; ".join(origins)
    return out


def _resolve(kind: str, name: str, target: _Target) -> Callable[..., Any]:
    if target.obj is not None:
        return target.obj
    module_name, _, attr = target.spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except BaseException as err:  # also SystemExit from the module's import; an interrupt goes on
        if isinstance(err, KeyboardInterrupt):
            raise
        raise ImportError(
            f"{kind} {name!r}: cannot import {target.spec} ({target.origin}): {type(err).__name__}: {err}"
        ) from err
    if not callable(obj):
        raise TypeError(f"{kind} {name!r}: {target.spec} is a {type(obj).__name__}, not a callable")
    return obj


def _failed_note() -> str:
    failed = [f"{i.name} ({i.error})" for i in plugin_status().values() if i.status == "failed"]
    return f"; plugins that failed to load: {', '.join(failed)}" if failed else ""


def load_sampler(name: str) -> Callable[..., Any]:
    """The installed sampler called ``name``.

    Loads plugins first (:func:`load_plugins`), then looks ``name`` up among the
    built-in ``jax`` kernel, the allowed ``specjax.samplers`` entry points and
    the samplers plugins registered; imports it on first use.

    Returns:
      a callable with the :func:`specjax.rejection_sample` contract.

    Raises:
      ValueError: an unknown name (the message lists the installed samplers) or
        a name two distributions declare differently.
      ImportError: the sampler's module failed to import.
      TypeError: ``name`` is not a string, or the target is not callable.
    """
    if not isinstance(name, str):
        raise TypeError(f"sampler: expected a sampler name (str), got {type(name).__name__}")
    table, clashes = _sampler_table()
    if name in clashes:
        raise ValueError(
            f"sampler: {name!r} is ambiguous: declared as "
            + " and as ".join(clashes[name])
            + f"; uninstall one, or choose one with {ENV_VAR}"
        )
    target = table.get(name)
    if target is None:
        raise ValueError(
            f"sampler: unknown sampler {name!r}; installed samplers: {', '.join(sorted(table))}"
            + _filter_note()
            + _failed_note()
        )
    return _resolve("sampler", name, target)


def available_custom_generates() -> list[str]:
    """Sorted names of the registered ``custom_generate`` functions (loads plugins first)."""
    load_plugins()
    with _lock:
        return sorted(_custom_generates.registered)


def load_custom_generate(name: str) -> Callable[..., Any]:
    """The ``custom_generate`` function registered as ``name`` (e.g. ``"specjax"``).

    Raises:
      ValueError: an unknown name, listing the registered ones.
    """
    load_plugins()
    with _lock:
        target = _custom_generates.registered.get(name)
        names = sorted(_custom_generates.registered)
    if target is None:
        raise ValueError(
            f"custom_generate: unknown name {name!r}; registered: {', '.join(names) or 'none'}"
            + _filter_note()
            + _failed_note()
        )
    return _resolve("custom_generate", name, target)
