"""``GET /api/hardware``: what this machine is, in llama-swap's shape (its ``hw`` package's
snapshot): CPU, memory, operating system, container, GPUs. Read once, from local files
only (``/proc``, ``/etc/os-release``, the NVIDIA driver's ``/proc/driver/nvidia``), never
the network nor a subprocess; then kept (the machine does not change under a running
server)."""

from __future__ import annotations

import datetime
import os
import platform
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
"""llama-swap's ``schema_version`` for this shape."""
_GO_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "i686": "386"}
"""``raw_name``: the architecture as llama-swap (Go's GOARCH) names it."""


@cache
def snapshot() -> dict[str, Any]:
    """The machine, read the first time it is asked for."""
    try:
        version = metadata.version("llamaswap")
    except metadata.PackageNotFoundError:
        version = "unknown"
    machine = platform.machine()
    return {
        "schema_version": SCHEMA_VERSION,
        "captured_at": datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z"),
        "capture": {
            "scope": "inference_host",
            "method": "detected",
            "detector": {"name": "llamaswap", "version": version},
        },
        "architecture": {"name": machine, "raw_name": _GO_ARCH.get(machine, machine)},
        "operating_system": _os(),
        "environment": _environment(),
        "cpu": _cpu(Path("/proc/cpuinfo")),
        "memory": {"capacity_bytes": _memory()},
        "accelerators": _gpus(Path("/proc/driver/nvidia/gpus")),
    }


def _os() -> dict[str, Any]:
    name = version = None
    try:
        release = platform.freedesktop_os_release()
        name, version = release.get("ID"), release.get("VERSION_ID")
    except OSError:
        pass
    return {
        "family": platform.system().lower(),
        "name": name,
        "version": version,
        "kernel": platform.release(),
    }


def _environment() -> dict[str, Any]:
    """A container (Docker, Podman) or the host itself."""
    if Path("/.dockerenv").exists():
        return {"kind": "container", "name": "Docker", "version": None}
    if Path("/run/.containerenv").exists():
        return {"kind": "container", "name": "Podman", "version": None}
    return {"kind": "host", "name": None, "version": None}


def cpu_facts(text: str) -> dict[str, Any]:
    """llama-swap's ``cpu`` record from ``/proc/cpuinfo``'s text."""
    vendor = model = None
    sockets: set[str] = set()
    cores: set[tuple[str, str]] = set()
    threads = 0
    physical = ""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        name, value = name.strip(), value.strip()
        if name == "processor":
            threads += 1
        elif name == "vendor_id" and vendor is None:
            vendor = value
        elif name == "model name" and model is None:
            model = value
        elif name == "physical id":
            physical = value
            sockets.add(value)
        elif name == "core id":
            cores.add((physical, value))
    threads = threads or os.cpu_count() or 0
    return {
        "vendor": vendor,
        "model": model,
        "socket_count": len(sockets) or 1,
        "physical_core_count": len(cores) or threads,
        "logical_thread_count": threads,
    }


def _cpu(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        text = ""
    return cpu_facts(text)


def _memory() -> int | None:
    """The installed memory: every zone's ``present`` pages (``/proc/zoneinfo``), as
    llama-swap counts it (the kernel's MemTotal leaves out what it reserved), else the
    pages the system reports."""
    try:
        text = Path("/proc/zoneinfo").read_text(errors="replace")
    except OSError:
        text = ""
    pages = sum(
        int(line.split()[1]) for line in text.splitlines() if line.split()[:1] == ["present"]
    )
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return page * (pages or os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        return None


def _gpus(root: Path) -> list[dict[str, Any]]:
    """NVIDIA GPUs the driver lists (one ``information`` file per GPU); none elsewhere."""
    found = []
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return []
    for entry in entries:
        try:
            text = (entry / "information").read_text(errors="replace")
        except OSError:
            continue
        facts = {}
        for line in text.splitlines():
            name, _, value = line.partition(":")
            facts[name.strip()] = value.strip()
        found.append(
            {
                "vendor": "NVIDIA",
                "model": facts.get("Model"),
                "bus_id": facts.get("Bus Location") or entry.name,
            }
        )
    return found
