"""A request's model name to what runs it, in the running server: the active profile, the
dispatcher's model states and loads for selectors, the body rewrites (``useModelName``,
``stripParams``, ``setParams``, ``setParamsByID``) and the ``/v1/models`` records of peers,
selectors and profile pins. The rules themselves are pure, in scheduler/names.py.

A selector resolves *before* the request is queued: the dispatcher only ever sees the model
that runs it, and the record keeps the name the client asked for too.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

from proxy import peers
from scheduler.config import Config
from scheduler.dispatcher import Dispatcher
from scheduler.names import STRATEGY_PIN, STRATEGY_SPILLOVER, Route, route
from scheduler.process import ModelState
from scheduler.runtime import Runtime


def model_states(dispatcher: Dispatcher) -> Mapping[str, ModelState]:
    """Model id -> state, for every model not stopped."""
    return dispatcher.model_states()


_reserved: Counter[str] = Counter()
"""Local model id -> requests a selector sent to it whose turn has not come yet (see
:func:`reserved`)."""


def model_load(dispatcher: Dispatcher, model_id: str) -> int:
    """Requests of a local model waiting or running: the dispatcher's count, or the
    selector's own reservations when higher (a burst of requests is resolved before the
    dispatcher task has seen the first of them)."""
    return max(dispatcher.load(model_id), _reserved.get(model_id, 0))


@contextlib.contextmanager
def reserved(target: Route) -> Iterator[None]:
    """Count a selector's pick against its model until the request's turn has come (or it
    ended): from then on the dispatcher counts it."""
    model = target.model.id if target.selector and target.model is not None else None
    if model is None:
        yield
        return
    _reserved[model] += 1
    try:
        yield
    finally:
        _reserved[model] -= 1
        if _reserved[model] <= 0:
            del _reserved[model]


def resolve(rt: Runtime, requested: str) -> Route:
    """Where ``requested`` goes now. Raises :class:`scheduler.names.Unroutable`."""
    config = rt.config
    if not (config.selectors or config.profiles or config.peer_routes):
        model = config.resolve(requested)  # the common case: one dict lookup or two
        if model is not None:
            return Route(requested, requested, model=model)
    dispatcher = rt.dispatcher
    states = model_states(dispatcher) if config.selectors else None

    def load(key: str) -> int:
        if key in config.peer_routes and key not in config.models:
            return peers.load(key)
        return model_load(dispatcher, key)

    return route(config, requested, profile=rt.profile, states=states, load=load)


def record_extra(target: Route) -> dict[str, str]:
    """What the record keeps of the name: the requested one when it is not the model's id."""
    ran = target.model.id if target.model is not None else target.peer.fqn if target.peer else ""
    return {"requested_model": target.requested} if target.requested != ran else {}


def rewrite_local(data: dict[str, Any], body: bytes, target: Route) -> bytes:
    """The body for a local model: ``model`` is the resolved name (or ``useModelName``),
    then ``stripParams``, ``setParams`` and the resolved name's ``setParamsByID``. The raw
    body is kept when nothing changes."""
    model = target.model
    assert model is not None
    by_id = model.set_params_by_id.get(target.name)
    renamed = target.name != target.requested
    if not (model.use_model_name or model.strip_params or model.set_params or by_id or renamed):
        return body
    data["model"] = model.use_model_name or target.name
    return _filtered(data, model.strip_params, model.set_params, by_id)


def rewrite_peer(data: dict[str, Any], target: Route) -> bytes:
    """The body for a peer: ``model`` is the peer's own name for it, then the peer's
    filters (``setParamsByID`` by the name the request resolved to)."""
    assert target.peer is not None
    peer = target.peer.peer
    data["model"] = target.peer.model
    return _filtered(
        data, peer.strip_params, peer.set_params, peer.set_params_by_id.get(target.name)
    )


def multipart_model(target: Route) -> str | None:
    """The ``model`` field a multipart body should carry upstream, or None to keep it:
    ``useModelName``, else the resolved name for a local model; the peer's own name."""
    if target.peer is not None:
        wanted = target.peer.model
    else:
        assert target.model is not None
        wanted = target.model.use_model_name or target.name
    return None if wanted == target.requested else wanted


_DISPOSITION = re.compile(rb"^content-disposition:(.*)$", re.IGNORECASE | re.MULTILINE)
_MODEL_FIELD = re.compile(rb';\s*name="?model"?\s*(;|$)')
_FILENAME = re.compile(rb";\s*filename\*?=", re.IGNORECASE)


def rewrite_multipart_model(body: bytes, boundary: str, value: str) -> bytes:
    """The multipart body with its ``model`` field's value replaced (files untouched,
    byte for byte); unchanged when it has no such field."""
    delimiter = b"--" + boundary.encode("latin-1")
    parts = body.split(delimiter)
    changed = False
    for i in range(1, len(parts) - 1):  # between the preamble and the closing "--"
        part = parts[i]
        head, sep, content = part.partition(b"\r\n\r\n")
        if not sep:
            continue
        match = _DISPOSITION.search(head)
        disposition = match.group(1).strip() if match is not None else b""
        if not _MODEL_FIELD.search(disposition) or _FILENAME.search(disposition):
            continue
        ending = b"\r\n" if content.endswith(b"\r\n") else b""
        parts[i] = head + sep + value.encode() + ending
        changed = True
    return delimiter.join(parts) if changed else body


def _filtered(
    data: dict[str, Any],
    strip: tuple[str, ...],
    set_params: Mapping[str, Any],
    by_id: Mapping[str, Any] | None,
) -> bytes:
    for param in strip:
        if param != "model":
            data.pop(param, None)
    for key, value in set_params.items():
        data[key] = value
    for key, value in (by_id or {}).items():
        data[key] = value
    return json.dumps(data).encode()


def listing_extras(
    config: Config, profile: str, states: Mapping[str, ModelState], listed: set[str]
) -> list[tuple[str, dict[str, Any]]]:
    """``/v1/models`` records beyond the local models, as llama-swap lists them: every peer
    model as ``peer/model``, every listed selector, and the active profile's pins that
    name something (and are no name listed already). Returns (id, record fields)."""
    records: list[tuple[str, dict[str, Any]]] = []
    for peer in config.peers.values():
        for name in peer.models:
            fqn = f"{peer.id}/{name}"
            records.append(
                (
                    fqn,
                    {
                        "name": f"{peer.id}: {name}",
                        "status": "unloaded",
                        "internal": {"type": "peer", "peerID": peer.id},
                    },
                )
            )
    for selector in config.selectors.values():
        if selector.unlisted:
            continue
        status = "unloaded"
        for target in selector.targets:
            local = config.resolve(target)
            if local is not None and states.get(local.id) in (
                ModelState.READY,
                ModelState.STARTING,
            ):
                status = "loaded"
            if selector.strategy == STRATEGY_PIN or status == "loaded":
                break
        internal: dict[str, Any] = {
            "type": "selector",
            "strategy": selector.strategy,
            "targets": list(selector.targets),
        }
        if selector.strategy == STRATEGY_SPILLOVER:
            internal["spillover"] = selector.spillover
        records.append(
            (
                selector.id,
                {
                    "name": selector.name,
                    "description": selector.description,
                    "metadata": dict(selector.metadata),
                    "status": status,
                    "internal": internal,
                },
            )
        )
    active = config.profiles.get(profile) if profile else None
    if active is not None:
        shadowed = listed | set(config.aliases) | set(config.peer_routes) | set(config.selectors)
        for pin, target in active.pins.items():
            if target and pin not in shadowed:
                records.append((pin, {"status": "unloaded", "internal": {"type": "profile"}}))
    return records
