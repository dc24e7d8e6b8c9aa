"""While a rank waits for its peers to connect (control plane, TCP links), it logs every few
seconds which ranks are still missing: the start-up progress of jobs launched without lccrun
(issue 38, item 1)."""
from __future__ import annotations

import logging
import socket
import threading

from lightcc.common.control import transport


def test_waiting_for_peers_names_the_missing_ranks(monkeypatch, caplog):
    monkeypatch.setattr(transport, "PROGRESS_S", 0.2)
    monkeypatch.setattr(transport, "ACCEPT_TIMEOUT_S", 1.0)
    token = b"12345678"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]

    def rank_two() -> None:
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(transport.HELLO.pack(token, 2))
        threading.Event().wait(1.5)
        s.close()

    t = threading.Thread(target=rank_two)
    t.start()
    with caplog.at_level(logging.WARNING, logger="lightcc"):
        got = transport.accept_hellos(listener, token, {1, 2, 3})
    t.join()
    listener.close()
    assert set(got) == {2}
    for s in got.values():
        s.close()
    lines = [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()]
    assert lines, caplog.text
    assert lines[-1].startswith("1/3 connected; waiting for ranks 1, 3 to connect"), lines
