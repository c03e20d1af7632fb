"""TCP's retransmission backoff, capped at a second on the job's connections, so that a link or a
store that comes back is heard within a second, however long it was away.

A connection that sends into a silent link retransmits with a timeout that doubles each time (up
to 120 s): after a 30 s outage of the store's host its next try came 23.5 s after the heal
(``tests/test_backoff.py``'s two hosts of their own, with a 30 s cut; the test cuts 7 s, and
the connection is heard 5.6 s late), and every call on it waits that long. A fault that needed the store just then cost a restart (``make partitions``' store-kill:
the recovery's declaration and check-in, on connections that had sent through the outage, were
heard only after the change's 20 s bound). Linux 6.15 caps that timeout per socket
(``TCP_RTO_MAX_MS``): capped at ``RTO_MAX_MS``, a connection tries again every second and is
heard within a second of the heal. TCP's own give-up counts tries (``tcp_retries2``, about 15
minutes with the doubling), which a cap would shorten to seconds: ``TCP_USER_TIMEOUT`` keeps it
at 15 minutes instead.

The connections are torch's (TCPStore's clients, gloo's pairs): this module finds them among
the process's open files, as sockets, and caps each once (:func:`cap_connections`; the watchdog
does it every beat, the agent every keep-alive). A listening socket passes its options to the
connections it accepts (Linux copies the listener's socket): the stores this package serves
are capped where they listen (stores.py). Where the kernel is older the option is refused and
nothing changes (said once, at debug level).
"""

from __future__ import annotations

import logging
import os
import socket
import threading

log = logging.getLogger(__name__)

TCP_RTO_MAX_MS = 44
"""Linux's socket option (``include/uapi/linux/tcp.h``, since 6.15): the retransmission
timeout's cap, in milliseconds."""
RTO_MAX_MS = 1000
"""The cap: a link back is heard within about this long."""
USER_TIMEOUT_MS = 15 * 60 * 1000
"""How long unanswered data may wait before TCP gives the connection up: what its default
(``tcp_retries2`` = 15, the timeout doubling to 120 s) comes to."""

_capped: set[int] = set()
"""The sockets (by inode) capped already, or found not TCP."""
_lock = threading.Lock()
_refused = False


def cap(sock: socket.socket) -> bool:
    """Caps ``sock``'s retransmission timeout (and keeps its give-up at 15 minutes); False
    where the kernel refuses the option."""
    global _refused
    try:
        sock.setsockopt(socket.IPPROTO_TCP, TCP_RTO_MAX_MS, RTO_MAX_MS)
    except OSError as e:
        if not _refused:
            _refused = True
            log.debug("TCP's retransmission backoff stays uncapped here: %s", e)
        return False
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS)
    return True


def cap_connections() -> int:
    """Caps every TCP socket of this process not capped yet (torch's among them); how many."""
    if socket.getdefaulttimeout() is not None:
        return 0  # a socket made from a descriptor would turn torch's non-blocking
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # not Linux: nothing to cap
        return 0
    count = 0
    with _lock:
        seen = set()
        for fd in fds:
            try:  # the link's name only: never a call into a file system (a cut mount's waits)
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:  # closed meanwhile
                continue
            if not target.startswith("socket:["):
                continue
            inode = int(target[len("socket:["):-1])
            seen.add(inode)
            if inode in _capped:
                continue
            _capped.add(inode)
            count += _cap_fd(fd)
        _capped.intersection_update(seen)  # closed sockets' inodes may come again
    return count


def _cap_fd(fd: int) -> int:
    """Caps the TCP socket open as ``fd`` (through a duplicate: the options are the socket's,
    not the descriptor's); 1 where it was one and was capped."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return 0
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return 0
        return int(cap(sock))
    except OSError:
        return 0
    finally:
        sock.close()
