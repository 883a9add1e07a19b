"""`kvdepot serve` settings: how many sessions, and each one's quotas."""

from __future__ import annotations

from dataclasses import dataclass

from kvdepot.server import setting_parsers as parsers
from kvdepot.server.config.table import setting
from kvdepot.server.sizes import pool_share_bytes


def _pool_share(text: str) -> str:
    """Checks a SIZE or PERCENT% setting; the text is kept (the pool size is known later)."""
    pool_share_bytes(text, 1 << 30)
    return text.strip()


def _auto_or_whole(text: str) -> int:
    """ "auto" (0: derived from other settings) or a whole number of at least 1."""
    if text.strip().lower() == "auto":
        return 0
    return parsers.whole_number(1)(text)


@dataclass
class SessionSettings:
    """Sessions and their quotas."""

    max_sessions: int = setting(
        "--max-sessions",
        256,
        parse=parsers.whole_number(1),
        metavar="N",
        help="open sessions (engine processes) at most; more are refused with RESOURCE_EXHAUSTED",
    )
    max_registrations_per_session: int = setting(
        "--max-registrations-per-session",
        64,
        parse=parsers.whole_number(1),
        metavar="N",
        help="registrations one session may hold (each holds an fd and mappings); more "
        "are refused with RESOURCE_EXHAUSTED",
    )
    max_pinned_per_session: str = setting(
        "--max-pinned-per-session",
        "50%",
        parse=_pool_share,
        shown="50%%",  # argparse %-formats the help
        metavar="SIZE|PERCENT%",
        help="bytes of blocks one session, and every session of its process together, "
        "may hold pinned, as a size or a share of --pool-size; a Pin beyond it is "
        "refused with RESOURCE_EXHAUSTED",
    )
    max_writing_per_session: str = setting(
        "--max-writing-per-session",
        "50%",
        parse=_pool_share,
        shown="50%%",  # argparse %-formats the help
        metavar="SIZE|PERCENT%",
        help="bytes of block rows one session, and every session of its process together, "
        "may hold reserved while they are written, as a size or a share of --pool-size; "
        "stores beyond it are dropped, with that reason",
    )
    max_pool_held: str = setting(
        "--max-pool-held",
        "75%",
        parse=_pool_share,
        shown="75%%",  # argparse %-formats the help
        metavar="SIZE|PERCENT%",
        help="bytes every client together may hold pinned, and apart hold in rows being "
        "written, as a size or a share of --pool-size (the per-session setting instead "
        "where larger); the rest stays for others' stores and loads",
    )
    max_watches_per_session: int = setting(
        "--max-watches-per-session",
        16,
        parse=parsers.whole_number(1),
        metavar="N",
        help="Watch streams one session may hold open; more are refused with RESOURCE_EXHAUSTED",
    )
    max_sessions_per_pid: int = setting(
        "--max-sessions-per-pid",
        16,
        parse=parsers.whole_number(1),
        metavar="N",
        help="sessions one process may hold (the kernel names it on the fd socket); more "
        "are refused with RESOURCE_EXHAUSTED",
    )
    max_sessions_per_uid: int = setting(
        "--max-sessions-per-uid",
        128,
        parse=parsers.whole_number(1),
        metavar="N",
        help="sessions the processes of one user may hold together, shared fairly: past "
        "it a process below its share takes the place of the largest holder's oldest",
    )
    max_calls_per_pid: int = setting(
        "--max-calls-per-pid",
        256,
        parse=parsers.whole_number(1),
        metavar="N",
        help="Depot calls one client process (its sessions together) may have in flight, "
        "streams included, from their headers on; more are refused with RESOURCE_EXHAUSTED "
        "before they are read",
    )
    max_calls_per_uid: int = setting(
        "--max-calls-per-uid",
        0,
        parse=_auto_or_whole,
        shown="auto",
        metavar="auto|N",
        help="Depot calls the processes of one user may have in flight together; auto: a "
        "quarter of the server's concurrent-call limit (16 x --max-sessions: 1024 at the "
        "defaults)",
    )
    max_unattested_sessions: int = setting(
        "--max-unattested-sessions",
        32,
        parse=parsers.whole_number(1),
        metavar="N",
        help="sessions not yet bound to a process, per opener (one TCP peer, or every "
        "unnamed local caller; kvdepot's client binds its own from the open); beyond "
        "them the opener's own oldest is ended, never another's",
    )
