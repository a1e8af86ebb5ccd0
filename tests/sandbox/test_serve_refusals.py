"""`posttrain sandbox serve` with a port or host it cannot listen on: exit 2 and one line, no traceback.

Drills (before: a traceback, or a message about tokens): a port another process holds, --port 99999,
--host 999.1.1.1.
"""

import socket

import pytest

from posttrain.cli import main


def _refused(capsys, *flags: str) -> str:
    assert main(["sandbox", "serve", *flags]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    return err


@pytest.mark.timeout(120)
def test_a_port_in_use_is_one_line(capsys):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        err = _refused(capsys, "--port", str(port))
    assert f"cannot listen on --host 127.0.0.1 --port {port}" in err and "in use" in err


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--port", "99999"], "--port 99999: a TCP port is 0 to 65535"),
        (["--port", "-1"], "--port -1: a TCP port is 0 to 65535"),
        (["--host", "999.1.1.1"], "--host '999.1.1.1' is not a valid IPv4 address"),
    ],
)
def test_a_port_or_host_that_cannot_be_is_refused_before_the_sandbox_starts(capsys, flags, fragment):
    assert fragment in _refused(capsys, *flags)
