"""What a forked child lets go of: the listening sockets it inherited from the trainer.

A child started with ``fork`` holds a copy of every descriptor of its parent, the sockets that torch's
rendezvous store and gloo listen on included. The child never accepts on them, but while it lives the
ports stay open (after the trainer died, say) and its copy shares the parent's queue of incoming
connections. Forking is what lets a reward function loaded from a user's file reach the workers without
being pickled, so the workers keep it and drop the sockets instead (:func:`drop_listening_sockets`).

Linux has no close-on-fork flag (only close-on-exec, which a fork without exec ignores), so the child does
it itself, first thing. Each such descriptor is pointed at /dev/null rather than closed: objects copied
from the parent (the store, gloo) still name that number, and a closed number could be reused by the next
file the child opens; /dev/null keeps it taken, and anything using it as a socket gets an error.
"""

from __future__ import annotations

import os
import socket
import stat


def drop_listening_sockets() -> list[int]:
    """Replace every listening socket among this process's descriptors with /dev/null (meant for a child
    right after fork). Returns the descriptors replaced; nothing where the descriptors cannot be listed."""
    listing = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    try:
        fds = sorted(int(name) for name in os.listdir(listing))
    except OSError:
        return []
    dropped = [fd for fd in fds if _is_listening_socket(fd)]
    if dropped:
        devnull = os.open(os.devnull, os.O_RDONLY)
        for fd in dropped:
            os.dup2(devnull, fd, inheritable=False)
        os.close(devnull)
    return dropped


def _is_listening_socket(fd: int) -> bool:
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return False
        sock = socket.socket(fileno=fd)  # wraps the descriptor (detached below, never closed here)
    except OSError:  # closed meanwhile (the listing's own), or a family Python cannot wrap
        return False
    try:
        return sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
    except OSError:
        return False
    finally:
        sock.detach()
