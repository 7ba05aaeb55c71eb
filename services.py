"""Reward services over HTTP: configs, a deadline-bound transport, and the retry loop.

    loop = _service_loop(...)                        # checked settings: the keywords of `_serve`
    scores, failed = _serve("remote", units, prepare, send, redact=mask_secrets([token]), **loop)
    reply = post_json(url, body, timeout=60)         # JSON in, JSON out, under the running attempt's limits

rewards.py builds the `openai_api`, `custom_api` and `remote` scorers on this module; this module
holds no scorer and imports no project module.

Each attempt has one deadline for everything: the name lookup, connect, send and the whole reply.
httpx's timeouts bound each socket operation, not the request, and nothing bounds the lookup (the
standard library's `getaddrinfo` takes no timeout), so `http_client` wraps the network backend of
its connection pool: the lookup runs in a helper thread that the attempt waits for at most until
its deadline, every socket read or write waits at most until it, and reads stop at the byte cap.
A server that answers one byte a second, or a resolver that never answers, fails at the deadline.
A reply larger than the cap (counted on the wire; compressed replies are refused, as their size
is unknown until decoded) fails the attempt without being read further.

Attempts are retried with exponential backoff (`backoff * 2**attempt` seconds, each wait at most MAX_BACKOFF) up to
`retries` attempts; HTTP 4xx other than 408/429 is not retried. Once a unit fails for good, `on_error="raise"`
raises `RewardServiceError` naming the service, the samples and the attempts made, and sends
nothing more; `"skip"` marks its samples in `failed`. Every error and log line goes through the
service's `redact`; `mask_secrets` builds one that hides a secret whole, without its scheme word
(`Bearer `), and any piece of it that a server echoed or a truncation cut.
"""

import base64
import contextlib
import ipaddress
import json
import logging
import math
import os
import re
import reprlib
import socket
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor, as_completed

import httpcore
import httpx
import numpy as np
import torch
import yaml

import flags

log = logging.getLogger(__name__)
MAX_BACKOFF = 300.0  # seconds: the longest wait before a retry (--reward-backoff 1e9 waited 31 years)


class RewardServiceError(RuntimeError):
    """A reward service (API judge, remote server) failed on a sample after all retries."""


# ----------------------------------------------------------------------------- checks of options

# ----------------------------------------------------------------------------- secrets

PIECE = 4  # characters: a run of this many of a secret's value that shows up in a line is masked


def mask_secrets(secrets):
    """A `redact(text) -> text` that replaces, with "***", each secret whole, its value without a scheme word
    ("Bearer abc" -> also "abc", which some servers echo), and every run of PIECE or more characters that
    occurs inside such a value (a reply cut at 300 characters can end in the middle of an echoed token).
    Shorter runs stay: they carry a few bits at most, and masking them would garble ordinary words."""
    whole, pieces = set(), set()
    for secret in secrets:
        if secret:
            scheme, _, credential = secret.strip().partition(" ")
            whole.add(secret)
            pieces.add(credential.strip() or scheme)  # the value without its scheme word
    whole = sorted((whole | pieces) - {""}, key=len, reverse=True)  # "Bearer abc" before "abc"
    pieces.discard("")

    def redact(text):
        for value in whole:
            text = text.replace(value, "***")
        out, i = [], 0
        while i < len(text):  # greedy: the longest run from i that lies inside a value
            j = i
            while j < len(text) and any(text[i:j + 1] in piece for piece in pieces):
                j += 1
            if j - i >= PIECE:
                out.append("***")
                i = j
            else:
                out.append(text[i])
                i += 1
        return "".join(out)

    return redact


# scheme://user:password@ (RFC 3986 3.2.1), up to a token's last @: a password holding an unescaped / or @ ends the
# authority sooner by the RFC, but is still the user's password; a setting that is one URL, up to its last @ (a space)
URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)\S*@")
URL_SETTING = re.compile(r"(?is)^(\s*[a-z][a-z0-9+.-]*://).*@")


def redact_urls(text):
    """`text` with the user:password of every URL in it shown as ***: what a setting may show of a URL."""
    return URL_USERINFO.sub(r"\1***@", text)


def redacted(settings):
    """{name: value} as recorded or printed (args.json, --print-config, a logger's config): the credentials of every
    URL in a string value, or in a list of strings, shown as ***. API keys never reach the settings: the flags name
    the environment variables that hold them."""
    def hide(value):
        if isinstance(value, str):
            return redact_urls(URL_SETTING.sub(r"\1***@", value))
        if isinstance(value, (list, tuple)):
            return type(value)(hide(v) for v in value)
        return value
    return {name: hide(value) for name, value in settings.items()}


def url_secrets(url):
    """The secrets a URL carries in its user:password, for `mask_secrets`: the userinfo, the password, and the Basic
    Authorization value httpx sends for them (which a server may echo)."""
    found = URL_SETTING.match(url or "")
    if not found:
        return []
    userinfo = url[len(found.group(1)):found.end() - 1]
    user, _, password = userinfo.partition(":")
    basic = base64.b64encode(urllib.parse.unquote(userinfo).encode()).decode("ascii")
    return [userinfo, password, basic]


# ----------------------------------------------------------------------------- reward services: configs

def load_config(value, flag):
    """A reward-service config: a YAML file, inline `base64:<base64 of YAML>`, or a dict; it must hold a mapping.

    `prompt_path` is read relative to the config file and becomes `prompt`; an inline config has
    no directory, so it must carry `prompt` itself.
    """
    if value is None:
        raise ValueError(f"this reward needs {flag}: a YAML file or base64:<base64-encoded YAML>")
    folder, text = None, None
    if isinstance(value, dict):
        config = dict(value)
    elif isinstance(value, str) and value.startswith("base64:"):
        try:
            text = base64.b64decode(value[len("base64:"):], validate=True).decode("utf-8")
        except ValueError as err:  # binascii.Error and UnicodeDecodeError are ValueErrors
            raise ValueError(f"{flag}: the base64:<payload> does not decode ({err})") from None
    elif isinstance(value, str) and os.path.isfile(value):
        folder = os.path.dirname(os.path.abspath(value))
        with open(value, encoding="utf-8") as f:
            text = f.read()
    else:
        raise ValueError(f"{flag} {value!r} is neither a YAML file nor base64:<payload>")
    if text is not None:
        try:
            config = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"{flag}: not valid YAML ({' '.join(str(err).split())})") from None
    if not isinstance(config, dict):  # an empty file, 0, "" or a list is a mistake, not an empty config
        raise ValueError(f"{flag} must hold a YAML mapping such as 'model: ...', got {flags.show(config)}")
    if "prompt_path" in config:
        if "prompt" in config:
            raise ValueError(f"{flag}: give prompt or prompt_path, not both")
        if folder is None:
            raise ValueError(f"{flag}: prompt_path is not allowed in an inline config; "
                             f"put the rubric text under prompt")
        with open(os.path.join(folder, config.pop("prompt_path")), encoding="utf-8") as f:
            config["prompt"] = f.read()
    return config


def _http_url(url, name):
    if not isinstance(url, str) or not url.lower().startswith(("http://", "https://")):
        raise ValueError(f"{name} must be an http:// or https:// URL, got "
                         f"{flags.show(redact_urls(url) if isinstance(url, str) else url)}")
    return url


# ----------------------------------------------------------------------------- reward services: HTTP

class BadReply(ValueError):
    """A service answered, but not with what the protocol expects."""


class _HTTPStatus(OSError):
    def __init__(self, code, message):
        super().__init__(message)
        self.status_code = code


_attempt = threading.local()  # the service attempt this thread runs: deadline (time.monotonic), seconds, bytes left


@contextlib.contextmanager
def _limits(seconds, max_bytes):
    """Bound the socket operations of `http_client` clients in this thread by one deadline and one byte budget."""
    _attempt.deadline, _attempt.seconds = time.monotonic() + seconds, seconds
    _attempt.left = _attempt.max_bytes = max_bytes
    try:
        yield
    finally:
        _attempt.deadline = None


def _time_left(timeout):
    """A socket operation's timeout, cut to what is left of the attempt's deadline (outside an attempt: as is)."""
    if getattr(_attempt, "deadline", None) is None:
        return timeout
    left = _attempt.deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"no complete reply within the {_attempt.seconds:g} s deadline")
    return left if timeout is None else min(timeout, left)


def _resolve(host, port, timeout):
    """The addresses of `host` (an IP address is its own), looked up in a daemon thread that is waited for at most
    `timeout` seconds (None: without limit): getaddrinfo takes no timeout, and a resolver that never answers would
    otherwise outlive any deadline. The thread of such a lookup is left to finish on its own."""
    with contextlib.suppress(ValueError):
        return [str(ipaddress.ip_address(host))]
    found, done = {}, threading.Event()

    def lookup():
        try:
            found["infos"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as err:  # gaierror: no such name
            found["error"] = err
        done.set()

    threading.Thread(target=lookup, name=f"resolve {host}", daemon=True).start()
    if not done.wait(timeout):
        raise TimeoutError(f"no address for {host} within {timeout:.3g} s")
    if "error" in found:
        raise httpcore.ConnectError(str(found["error"]))  # what httpcore's own lookup failure becomes
    return list(dict.fromkeys(info[4][0] for info in found["infos"]))


def hub_reachable(timeout=3.0):
    """Whether the model hub (huggingface_hub's endpoint, HF_ENDPOINT) accepts a connection within `timeout` seconds:
    offline, a hub download retries five times, about 48 s, before it fails."""
    from huggingface_hub import constants

    url = httpx.URL(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        for address in _resolve(url.host, port, timeout):
            with contextlib.suppress(OSError):
                socket.create_connection((address, port), timeout=timeout).close()
                return True
    except (OSError, TimeoutError, httpcore.ConnectError):  # no such name, or no answer
        pass
    return False


class _Deadline:
    """httpcore's network backend, and each stream it opens, with the name lookup and every socket wait cut at the
    running attempt's deadline and reads stopped at its byte budget. A pooled connection keeps its stream; each
    attempt brings its own limits. Everything else (close, get_extra_info, sleep) passes through."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        # The lookup is bounded here: each resolved address is then tried in turn, as socket.create_connection does.
        error = None
        for address in _resolve(host, port, _time_left(timeout)):
            try:
                stream = self.inner.connect_tcp(address, port, _time_left(timeout), local_address, socket_options)
                return _Deadline(stream)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as err:
                error = err
        raise error

    def start_tls(self, ssl_context, server_hostname=None, timeout=None):
        return _Deadline(self.inner.start_tls(ssl_context, server_hostname, _time_left(timeout)))

    def write(self, buffer, timeout=None):
        self.inner.write(buffer, _time_left(timeout))

    def read(self, max_bytes, timeout=None):
        data = self.inner.read(max_bytes, _time_left(timeout))
        if getattr(_attempt, "deadline", None) is not None:
            _attempt.left -= len(data)
            if _attempt.left < 0:
                raise BadReply(f"reply over {_attempt.max_bytes} bytes (--reward-max-bytes); stopped reading it")
        return data


def http_client(headers=None):
    """An httpx.Client for reward services: pooled connections, environment proxies, uncompressed replies, and,
    inside a service attempt, the attempt's deadline and byte cap on every socket operation. Build one per
    service; it is safe to share between threads. `headers` (e.g. an auth header) go with every request."""
    def refuse_compressed(response):  # the cap counts wire bytes, and a small gzip body can decode to gigabytes
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding != "identity":
            raise BadReply(f"the reply is compressed ({encoding}) though the request asked for an uncompressed one")

    client = httpx.Client(headers={"Accept-Encoding": "identity", **(headers or {})}, trust_env=True,
                          limits=httpx.Limits(max_connections=None), event_hooks={"response": [refuse_compressed]})
    # httpx has no public hook below its timeouts: wrap the network backend of each transport's pool (httpx is pinned)
    for transport in [client._transport, *client._mounts.values()]:
        if transport is not None:
            transport._pool._network_backend = _Deadline(transport._pool._network_backend)
    return client


_default_client = []  # the client of `post_json` calls that bring none, made on first use


def post_json(url, body, *, timeout, headers=None, client=None):
    """POST `body` as JSON and return the decoded JSON reply; a non-2xx status raises with its code (4xx other
    than 408/429 are not retried). Inside a service attempt, e.g. in a custom_api `send_request` hook, the
    attempt's deadline and --reward-max-bytes bound it; `timeout` bounds each socket operation."""
    if client is None:
        if not _default_client:
            _default_client.append(http_client())  # a rare race makes two clients; either works
        client = _default_client[0]
    reply = client.post(url, content=json.dumps(body, default=str).encode("utf-8"), timeout=timeout,
                        headers={"Content-Type": "application/json", **(headers or {})})
    if not reply.is_success:
        raise _HTTPStatus(reply.status_code, f"HTTP {reply.status_code} {reply.reason_phrase}: {reply.text[:300]}")
    try:
        return json.loads(reply.content)
    except ValueError:
        raise BadReply(f"reply is not JSON: {reply.content[:200]!r}") from None


def _number(value, what):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise BadReply(f"{what} is not a number: {flags.show(value)}")
    return float(value)


# ----------------------------------------------------------------------------- reward services: the request loop

def _status_code(err):
    """The HTTP status an exception carries (ours and openai's `status_code`, httpx's `response`, urllib's `code`)."""
    for code in (getattr(err, "status_code", None), getattr(getattr(err, "response", None), "status_code", None),
                 getattr(err, "code", None)):
        if isinstance(code, int) and not isinstance(code, bool):
            return code
    return None


def _retryable(err):
    code = _status_code(err)
    return code is None or not (400 <= code < 500 and code not in (408, 429))


def _error_text(err, seconds):
    if isinstance(err, (TimeoutError, httpx.TimeoutException)):  # whichever operation hit the deadline
        return f"TimeoutError: no complete reply within the {seconds:g} s deadline of an attempt"
    return f"{type(err).__name__}: {err}"


def _service_loop(timeout, timeout_name, max_concurrency, concurrency_name, retries, backoff, on_error, max_bytes):
    """A service's request-loop settings, checked when the reward is built: the keywords of `_serve`."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"--reward-on-error must be 'raise' or 'skip', got {on_error!r}")
    return dict(timeout=flags.real(timeout, timeout_name, positive=True),
                max_concurrency=flags.integer(max_concurrency, 1, concurrency_name),
                retries=flags.integer(retries, 1, "--reward-retries"),
                backoff=_at_most(flags.real(backoff, "--reward-backoff", minimum=0), MAX_BACKOFF, "--reward-backoff"),
                on_error=on_error, max_bytes=flags.integer(max_bytes, 1, "--reward-max-bytes"))


def _at_most(value, limit, name):
    if value > limit:
        raise ValueError(f"{name} {value:g}: at most {limit:g} seconds (a wait before a retry); lower it")
    return value


def _serve(service, units, prepare, send, *, timeout, max_bytes, retries, backoff, max_concurrency, on_error,
           redact=lambda s: s, label=None):
    """Score `units` (lists of sample indices) with at most `max_concurrency` requests in flight.

    prepare(u) builds unit u's request once; send(u, request) returns one float per sample of the
    unit. Each attempt runs under one deadline of `timeout` seconds and a reply cap of `max_bytes`,
    and is retried `backoff * 2**attempt` seconds later, up to `retries` attempts. With on_error
    "raise" the first unit that fails for good raises at once, and no unit starts another attempt.
    label(unit) names a unit in errors and logs (default "sample 3", "sample 0-7"); a service whose units are
    not samples (Soft-TIFA: one question of a sample) says what they are.
    Returns (scores [B] float32, failed [B] bool).
    """
    label = label or (lambda unit: f"sample {_samples(unit)}")
    total = sum(len(u) for u in units)
    scores, failed = torch.zeros(total), torch.zeros(total, dtype=torch.bool)
    stop = threading.Event()

    def run(u):
        request, error, attempt = prepare(u), None, 0
        while attempt < retries and not stop.is_set():
            attempt += 1
            try:
                with _limits(timeout, max_bytes):
                    values = send(u, request)
                if len(values) != len(units[u]):
                    raise BadReply(f"{len(values)} scores for {len(units[u])} samples")
                return values, None, attempt
            except Exception as err:
                error = redact(_error_text(err, timeout))
                if not _retryable(err) or attempt >= retries:
                    break
                delay = min(backoff * 2 ** (attempt - 1), MAX_BACKOFF)  # doubling past it would hang the run
                log.warning("%s: %s attempt %d/%d failed (%s); retrying in %.2fs",
                            service, label(units[u]), attempt, retries, error, delay)
                stop.wait(delay)
        return None, error, attempt

    pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix=service)
    futures = {pool.submit(run, u): u for u in range(len(units))}
    try:
        for future in as_completed(futures):
            values, error, attempts = future.result()
            unit = units[futures[future]]
            if error is None:
                scores[unit] = torch.tensor(values, dtype=torch.float32)
                continue
            message = f"{service}: {label(unit)} failed after {attempts} attempt(s): {error}"
            if on_error == "raise":
                stop.set()  # attempts in flight end at their deadline; no new ones start
                raise RewardServiceError(message)
            log.warning("%s; skipped (reward 0, failed=True)", message)
            failed[unit] = True
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return scores, failed


def _samples(unit):
    return str(unit[0]) if len(unit) == 1 else f"{unit[0]}-{unit[-1]}"
