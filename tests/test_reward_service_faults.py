"""The real training command line against a flaky `remote` reward server: HTTP 500s, replies slower than
--reward-timeout, replies trickled a byte at a time, retries that recover and ones that do not. Skip mode
drops exactly the failed groups and trains on the rest with the served scores; raise mode stops with
one line naming the service, the step and the prompt.

With SMALL (2 prompts x 4, --sample-batch-size 4) each rollout batch is one group and one POST, and
the trainer scores its batches one at a time, in order: the c-th distinct request is step c // 2,
group c % 2. The server decides by that index and the attempt number, so every run fails the same way.
"""
import base64
import hashlib
import io
import os
import statistics
import sys
import threading

import numpy as np
import pytest
from PIL import Image

from reward_server import JsonServer, Raw
from test_train import SMALL, metrics, run

FAST = SMALL + ["--log-images-every", "0"]
TIMEOUT = 1.0  # --reward-timeout; a "slow" reply comes after 3x that, a "trickle" takes 20x that a byte at a time
CRASH = "upstream model crashed\nworker 3 restarting"  # a multi-line error page must still give a one-line error


class FlakyService:
    """The remote protocol, scoring each image by its mean pixel / 255. `plan[c]` lists what attempt
    0, 1, ... of the c-th distinct request gets: "ok", "500", "slow" (answers after the timeout) or "trickle"
    (a byte every 50 ms for 20 s: no socket read ever waits a full timeout, only the attempt's deadline ends it)."""

    def __init__(self, plan):
        self.plan, self.lock = plan, threading.Lock()
        self.calls, self.attempts = {}, []  # request key -> call index; (call, attempt, action, scores, prompts) in order

    def __call__(self, body, headers):
        scores = [float(np.asarray(Image.open(io.BytesIO(base64.b64decode(png)))).mean() / 255) for png in body["images"]]
        key = hashlib.sha256("".join(body["images"]).encode()).hexdigest()  # a retry resends the same body
        with self.lock:
            call = self.calls.setdefault(key, len(self.calls))
            attempt = sum(1 for a in self.attempts if a[0] == call)
            action = self.plan[call][min(attempt, len(self.plan[call]) - 1)]
            self.attempts.append((call, attempt, action, scores, body["prompts"]))
        if action == "500":
            return 500, CRASH, 0.0
        if action == "trickle":
            return 200, Raw(b" ", interval_s=0.05, count=int(20 * TIMEOUT / 0.05)), 0.0
        return 200, {"scores": scores}, 3 * TIMEOUT if action == "slow" else 0.0

    def served(self, call):
        """The scores the c-th request got back, or None when every attempt failed."""
        return next((s for c, _, a, s, _ in self.attempts if c == call and a == "ok"), None)


def train_remote(tmp_path, server, steps, on_error):
    out = str(tmp_path / on_error)
    proc = run([sys.executable, "train.py", *FAST, "--steps", str(steps), "--out", out, "--reward", "remote",
                "--rm-url", server.url, "--reward-retries", "2", "--reward-timeout", str(TIMEOUT),
                "--reward-on-error", on_error], tmp_path, check=False,
               env={"NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}, timeout=240)
    return proc, out


def test_skip_drops_failed_groups_and_trains_on_served_scores(tmp_path):
    service = FlakyService([
        ["500", "ok"],    # step 1, group 0: recovers on the retry
        ["slow", "trickle"],  # step 1, group 1: times out, then hits the deadline while trickling -> dropped
        ["500", "500"],   # step 2, group 0: dropped
        ["ok"],           # step 2, group 1
        ["500", "500"],   # step 3: every group fails -> nothing to learn, the step is skipped
        ["500", "500"],
    ])
    with JsonServer(service) as server:
        proc, out = train_remote(tmp_path, server, 3, "skip")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # --reward-retries 2: two attempts per failing request, no more; a success ends the retries.
    assert [(c, a) for c, a, *_ in service.attempts] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
                                                         (4, 0), (4, 1), (5, 0), (5, 1)]
    assert proc.stderr.count("skipped (reward 0, failed=True)") == 4  # one warning per request given up on

    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # Group 1 of step 1 waits 1 s (slow), 1 s (--reward-backoff), 1 s (deadline of the trickle): not the 20 s trickle.
    assert rows[0]["seconds_reward_wait"] < 10 * TIMEOUT, rows[0]
    for row, kept in zip(rows[:2], (service.served(0), service.served(3))):
        assert not row.get("skipped") and row["dropped_groups"] == 1, row
        # The dropped group's zeros are out of the statistics: only the served scores remain.
        assert row["reward_mean"] == pytest.approx(statistics.fmean(kept), rel=1e-6)
        assert row["reward/remote_mean"] == pytest.approx(statistics.fmean(kept), rel=1e-6)
        assert row["reward_std"] == pytest.approx(statistics.stdev(kept), rel=1e-4, abs=1e-7)
        assert row["loss"] == row["loss"] and row["grad_norm"] > 0 and abs(row["first_ratio_dev"]) < 1e-4
    assert rows[2].get("skipped") == 1 and rows[2]["dropped_groups"] == 2, rows[2]
    assert "remote" in rows[2]["skip_reason"] and "loss" not in rows[2]  # no update without a single reward


def test_raise_stops_with_one_line_naming_service_step_and_prompt(tmp_path):
    service = FlakyService([["500", "ok"], ["500", "500"]])  # step 1: group 0 recovers, group 1 never does
    with JsonServer(service) as server:
        proc, out = train_remote(tmp_path, server, 2, "raise")
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert [(c, a) for c, a, *_ in service.attempts] == [(0, 0), (0, 1), (1, 0), (1, 1)]  # stopped at once
    last = proc.stderr.strip().splitlines()[-1]
    group_1_prompt = service.attempts[-1][4][0]
    for needle in ("remote", "step 1", "2 attempt(s)", "HTTP 500", "upstream model crashed", repr(group_1_prompt),
                   "--reward-on-error skip"):
        assert needle in last, (needle, last)
    assert not os.path.isfile(os.path.join(out, "metrics.jsonl")) or metrics(out) == []  # no step was logged
