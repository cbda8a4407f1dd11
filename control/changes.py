"""Fleet-wide control rows: an issued key or a scheduler settings edit saved on one node
reaches every node.

The rows are in the shared database already (``IssuedKey``, ``SchedulerSettingsRecord``);
what a node lacks is the news that another node changed them. :func:`changed` is called
after a change commits here (``control.keys``, ``control.settings_admin``) and hands it to
the announcer fleet mode installed (:func:`set_announcer`: ``fleet.node.Fleet.announce``,
a message on Redis); every other node then calls ``control.remote.apply_remote`` off its
event loop, which reads the rows again as a local save would (the key ring, the running
scheduler's settings). Outside fleet mode there is no announcer and nothing happens.
"""

from __future__ import annotations

from collections.abc import Callable

KINDS = frozenset({"keys", "settings"})
"""What can change: the issued keys (and whether keys are required), the scheduler settings."""

_announcer: Callable[[str], None] | None = None


def set_announcer(announce: Callable[[str], None] | None) -> None:
    """Fleet mode's announcer (thread-safe: called from Django's sync threads); None: off."""
    global _announcer
    _announcer = announce


def changed(kind: str) -> None:
    """A change of ``kind`` committed on this node: tell the others (fleet mode only)."""
    announce = _announcer
    if announce is not None and kind in KINDS:
        announce(kind)
