"""Local HTTP servers for the reward-service tests: 127.0.0.1, a free port, one thread per request.

    with JsonServer(lambda body, headers: (200, {"scores": [...]}, 0.0)) as server:
        reward = build_reward("remote", rm_url=server.url)

`respond(body, headers)` returns (status, reply, delay_s): reply is a dict (sent as JSON), str or
bytes; the handler sleeps `delay_s` before answering. A `Raw` reply is written as it is, piece by
piece (status line and headers included), for servers that trickle or never stop. The server counts
requests, the most requests in flight at once, and the bytes of Raw replies it managed to send.
"""

import itertools
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import rewards


class JsonServer:
    def __init__(self, respond):
        self.respond = respond
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        self.bodies, self.headers = [], []
        self.raw_bytes_sent = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                    server.bodies.append(body)
                    server.headers.append(dict(self.headers))
                done = False
                try:
                    status, reply, delay = server.respond(body, dict(self.headers))
                    time.sleep(delay)
                    if isinstance(reply, Raw):
                        for piece in reply.pieces():
                            self.wfile.write(piece)
                            self.wfile.flush()
                            with server.lock:
                                server.raw_bytes_sent += len(piece)
                        return
                    data = reply if isinstance(reply, bytes) else (reply if isinstance(reply, str) else json.dumps(reply)).encode()
                    # Out of flight before the reply leaves: once the client has it, it may send its next request
                    # before this thread runs again, and that one must not be counted beside this one.
                    with server.lock:
                        server.in_flight -= 1
                        done = True
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
                    pass
                finally:
                    if not done:
                        with server.lock:
                            server.in_flight -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


class Raw:
    """A reply written verbatim: `head` (status line and headers) at once, then `chunk` every `interval_s`
    seconds, `count` times (None: until the client leaves). With `trickle_head` the head itself goes out one
    byte per interval."""

    def __init__(self, chunk=b" ", *, interval_s=0.0, count=None, head=None, trickle_head=False):
        self.head = head or b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n"
        self.chunk, self.interval, self.count, self.trickle_head = chunk, interval_s, count, trickle_head

    def pieces(self):
        head = [self.head[i:i + 1] for i in range(len(self.head))] if self.trickle_head else [self.head]
        body = itertools.repeat(self.chunk) if self.count is None else itertools.repeat(self.chunk, self.count)
        for i, piece in enumerate(itertools.chain(head, body)):
            if i and self.interval:
                time.sleep(self.interval)
            yield piece


def chat_reply(content):
    """The Chat Completions reply shape with `content` as the assistant message."""
    return {"id": "cmpl-test", "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]}


class PlainScoreApi:
    """custom_api hooks for a made-up service: POST {"text": prompt, "mean": pixel mean} to
    `url`, read {"value": x}; scores are value * scale."""

    def __init__(self, *, url, scale=1.0):
        self.url, self.scale = url, float(scale)

    def build_request(self, image, prompt, metadata):
        return {"text": prompt, "mean": float(image.mean()), "tag": metadata.get("tag")}

    def send_request(self, request, timeout):
        return rewards.post_json(self.url, request, timeout=timeout)  # under the attempt's deadline and byte cap

    def parse_response(self, response):
        return response["value"] * self.scale


class BoolScoreApi(PlainScoreApi):
    """custom_api hooks whose parse_response returns what the reply's "value" holds, e.g. True or "2"."""

    def parse_response(self, response):
        return response["value"]


class ShoutingJudge(rewards.OpenAIJudge):
    """custom_api: the built-in judge with the prompt upper-cased (only build_request changes)."""

    def build_request(self, image, prompt, metadata):
        return super().build_request(image, prompt.upper(), metadata)


def logprobs_reply(top, token=None):
    """The Chat Completions reply of a server asked for one token with logprobs and top_logprobs (vLLM's shape):
    `top` ({token text: logprob}) is the first token's top_logprobs list, `token` (default: the likeliest) the token
    generated."""
    entries = [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top.items()]
    token = token if token is not None else max(top, key=top.get) if top else ""
    return {"id": "cmpl-test", "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": token}, "finish_reason": "length",
                         "logprobs": {"content": [{"token": token, "logprob": top.get(token, 0.0),
                                                   "bytes": list(token.encode()), "top_logprobs": entries}]}}]}
