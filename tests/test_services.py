"""services.py: secrets stay out of every error and log line, whatever piece of them a server echoes, and the
deadline of an attempt bounds the name lookup too. Real local HTTP servers; a resolver that never answers."""

import logging
import socket
import threading
import time

import numpy as np
import pytest

import services
from reward_server import JsonServer
from rewards import RewardServiceError, build_reward

FAST = dict(reward_backoff=0.001)  # retries without waiting


def images(n):
    return np.zeros((n, 8, 8, 3), dtype=np.uint8)


def test_mask_secrets_hides_the_value_with_and_without_its_scheme_and_any_piece_of_it():
    redact = services.mask_secrets(["Bearer tok-9f3c2a7e51"])
    assert redact("got Bearer tok-9f3c2a7e51 here") == "got *** here"
    assert redact("bad credentials tok-9f3c2a7e51") == "bad credentials ***"
    assert redact("HTTP 401: token tok-9f3c") == "HTTP 401: token ***"  # a reply cut inside the token
    assert redact("b'...c2a7e51'") == "b'...***'"  # its tail, as the start of a cut would leave it
    assert redact("Bearer scheme, 401 Unauthorized, tok") == "Bearer scheme, 401 Unauthorized, tok"  # < 4 chars stay
    bare = services.mask_secrets(["sk-live-0d8e6b4f"])  # a value without a scheme, echoed with one
    assert bare("Authorization: Bearer sk-live-0d8e6b4f rejected") == "Authorization: Bearer *** rejected"
    assert services.mask_secrets([None, ""])("nothing to hide") == "nothing to hide"


@pytest.mark.parametrize("token, echo", [
    ("Bearer rm-secret-4d1f9a7c", lambda header: f"bad credentials {header.removeprefix('Bearer ')}"),
    ("rm-secret-4d1f9a7c", lambda header: f"expected Bearer, got {header}"),
    ("Bearer rm-secret-4d1f9a7c", lambda header: "x" * 283 + header),  # the 300-character cut falls in the token
])
def test_a_server_echoing_the_token_in_any_form_never_shows_it(monkeypatch, caplog, token, echo):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("RM_TEST_TOKEN", token)
    status = [500]

    def respond(body, headers):
        return status[0], echo(headers["Authorization"]), 0.0

    with JsonServer(respond) as server:
        reward = build_reward("remote", rm_url=server.url, rm_auth_env="RM_TEST_TOKEN", **FAST)
        with pytest.raises(RewardServiceError) as err:  # 500: retried and logged at each attempt
            reward(images(2), ["a", "b"], None)
        status[0] = 401
        with pytest.raises(RewardServiceError) as err_401:
            reward(images(2), ["a", "b"], None)
    assert all(h["Authorization"] == token for h in server.headers)
    assert "retrying" in caplog.text and "HTTP 401" in str(err_401.value)
    for text in (str(err.value), str(err_401.value), caplog.text):
        assert "***" in text
        for i in range(len("rm-secret-4d1f9a7c") - 3):  # no 4 characters of it in a row
            assert "rm-secret-4d1f9a7c"[i:i + 4] not in text, text


@pytest.fixture
def hung_resolver(monkeypatch):
    """socket.getaddrinfo that never answers for hosts under .hung.test (until the test ends)."""
    release, real = threading.Event(), socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        if str(host).endswith(".hung.test"):
            release.wait()
            raise socket.gaierror(socket.EAI_AGAIN, "released at the end of the test")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield
    release.set()


def test_the_deadline_bounds_the_name_lookup(hung_resolver):
    reward = build_reward("remote", rm_url="http://rm.hung.test:8080/score", reward_timeout=0.5, reward_retries=2,
                          **FAST)
    outcome = {}

    def call():
        start = time.monotonic()
        try:
            reward(images(1), ["a"], None)
        except RewardServiceError as err:
            outcome["error"] = str(err)
        outcome["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the lookup outlived a 0.5 s deadline by 10 s"
    assert "no complete reply within the 0.5 s deadline" in outcome["error"]
    assert "after 2 attempt(s)" in outcome["error"]
    assert outcome["seconds"] < 3


def test_names_still_resolve_and_every_address_is_tried(hung_resolver, monkeypatch):
    """A name whose first address refuses the connection (a closed port on ::1, as 'localhost' often gives first)
    connects on the next one, as socket.create_connection does; a name that does not resolve is a ConnectError."""
    real = socket.getaddrinfo

    def two_addresses(host, port, *args, **kwargs):
        if host == "rm.local.test":  # 127.0.0.2 is loopback too, and nothing listens there: refused
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.2", port)),
                    (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]
        if host == "rm.gone.test":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", two_addresses)
    with JsonServer(lambda body, headers: (200, {"scores": [0.5] * len(body["prompts"])}, 0.0)) as server:
        port = server.url.rsplit(":", 1)[1]
        reward = build_reward("remote", rm_url=f"http://rm.local.test:{port}/score", reward_timeout=5, **FAST)
        assert reward(images(2), ["a", "b"], None)["reward"].tolist() == [0.5, 0.5]
    with pytest.raises(RewardServiceError, match="ConnectError"):
        build_reward("remote", rm_url="http://rm.gone.test/score", reward_retries=1)(images(1), ["a"], None)
