"""The request watchdog (request_watchdog.py) itself: a request that gets no answer within its
deadline is named against the test that sent it, whether the client gave up (read timeout)
or is still waiting; an answered one is not."""

from __future__ import annotations

import http.server
import threading
import time

import httpx
import pytest
import requests
from conftest import WATCHDOG
from request_watchdog import RequestWatchdog

pytestmark = pytest.mark.fast

EVENTUALLY_S = 30.0  # a poll's deadline: what it catches is "never"
# The silent server's connect succeeds at once (it accepts): a connect bound far above the 0.3 s
# read timeout keeps the watchdog's deadline (connect + read + 1 s) well after the ReadTimeout,
# however late this run gets to it, and costs nothing.
SILENT_TIMEOUT = (10.0, 0.3)


@pytest.fixture
def answering_server():
    class Answer(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.unanswered_ok("the watchdog must see this request go unanswered")
def test_a_read_timeout_is_named_against_its_test(request, silent_port, answering_server) -> None:
    silent_server = f"http://127.0.0.1:{silent_port}"
    assert requests.get(answering_server, timeout=5).text == "ok"
    with httpx.Client() as client:
        assert client.get(answering_server, timeout=5).text == "ok"
    assert WATCHDOG.recorded(request.node.nodeid) == []
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(f"{silent_server}/generate", json={}, timeout=SILENT_TIMEOUT)
    with httpx.Client() as client, pytest.raises(httpx.ReadTimeout):
        client.get(f"{silent_server}/v1/models", timeout=httpx.Timeout(SILENT_TIMEOUT[1], connect=SILENT_TIMEOUT[0]))
    found = WATCHDOG.recorded(request.node.nodeid)
    assert len(found) == 2, found
    assert f"POST {silent_server}/generate" in found[0] and "ReadTimeout" in found[0]
    assert f"GET {silent_server}/v1/models" in found[1] and "ReadTimeout" in found[1]
    assert request.node.nodeid in found[0]


def test_a_request_still_waiting_past_its_deadline_is_named_with_every_thread_stack(capfd) -> None:
    watchdog = RequestWatchdog(dump_workers=lambda: "<worker logs>", check_every_s=0.05)
    watchdog.start()
    try:
        watchdog.begin_test("t::hung", allowed=False)
        err = ""
        with watchdog.track("POST http://127.0.0.1:1/generate", deadline_s=0.2):
            # the client is still waiting when the deadline passes, until the watchdog's report is out
            deadline = time.monotonic() + EVENTUALLY_S
            while "<worker logs>" not in err and time.monotonic() < deadline:
                time.sleep(0.02)
                err += capfd.readouterr().err
        with watchdog.track("GET http://127.0.0.1:1/health", deadline_s=5):
            pass  # answered in time
        found = watchdog.end_test("t::hung")
    finally:
        watchdog.stop()
    assert len(found) == 1 and "POST http://127.0.0.1:1/generate" in found[0] and "still no answer" in found[0]
    assert "UNANSWERED" in err and "--- thread MainThread ---" in err and "<worker logs>" in err


def test_a_test_marked_unanswered_ok_is_not_failed_and_the_next_test_starts_clean() -> None:
    watchdog = RequestWatchdog()
    watchdog.begin_test("t::allowed", allowed=True)
    with pytest.raises(requests.exceptions.ReadTimeout), watchdog.track("GET http://x/", 0.1):
        raise requests.exceptions.ReadTimeout()
    assert watchdog.recorded("t::allowed") and watchdog.end_test("t::allowed") == []
    watchdog.begin_test("t::next", allowed=False)
    assert watchdog.end_test("t::next") == []


@pytest.mark.unanswered_ok("only to look at what was recorded")
def test_a_request_our_own_code_sends_in_process_is_not_a_client_request(request, silent_port) -> None:
    """The language manager's health probe of an encoder, in-process in the fast tier: its
    timeout is a heartbeat miss the product handles, not a client left without an answer."""
    from connector.encoder_peers import EncoderPeers

    peers, answers = EncoderPeers(interval=0.3), []
    done = threading.Event()
    try:
        peers.probe({f"127.0.0.1:{silent_port}"}, lambda addr, probe: (answers.append(probe), done.set()))
        assert done.wait(10)
    finally:
        peers.close()
    assert not answers[0].ok and answers[0].why == "ReadTimeout"
    assert WATCHDOG.recorded(request.node.nodeid) == []
