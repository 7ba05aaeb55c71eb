"""The two-node launch from train.py's docstring, run as two torchrun agents on 127.0.0.1 (gloo, CPU).

Each agent is one "node" with one process; they meet through a c10d rendezvous on a free local port,
as two machines would through HOST:29500. Rendezvous may hand out the node ranks in either order.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time

from test_train import ROOT, SMALL, metrics

FAST = SMALL + ["--log-images-every", "0"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_one_process_each_keep_identical_weights(tmp_path):
    out = str(tmp_path / "run")
    port, env = free_port(), dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    procs, logs = [], []
    try:
        for node in (0, 1):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                   "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                   "--rdzv-id", "two-node-test", "--rdzv-conf", "join_timeout=120", "--max-restarts", "0",
                   "train.py", *FAST, "--steps", "2", "--save-every", "1", "--out", out]
            log = open(tmp_path / f"node{node}.log", "w+")  # files, not pipes: a full pipe would stall a node
            logs.append(log)
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = time.time() + 240
        while any(p.poll() is None for p in procs) and time.time() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):  # one node failed: do not wait for the other
                break
            time.sleep(0.2)
    finally:
        for p in procs:  # the agent and its worker share a process group
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        text = []
        for log in logs:
            log.seek(0)
            text.append(log.read())
            log.close()
    report = "\n".join(f"--- node {i} (exit {p.returncode}):\n{t[-3000:]}" for i, (p, t) in enumerate(zip(procs, text)))
    assert [p.returncode for p in procs] == [0, 0], report

    assert sum("2 processes |" in t for t in text) == 1, report  # one global rank 0, on one of the nodes
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]  # only global rank 0 writes, once per step
    assert all(not r.get("skipped") and r["grad_norm"] > 0 and abs(r["first_ratio_dev"]) < 1e-4 for r in rows), rows
    assert json.load(open(os.path.join(out, "args.json")))["world_size"] == 2
    sums = [json.load(open(os.path.join(out, "checkpoints", str(s), "state.json")))["rank_checksums"] for s in (1, 2)]
    assert all(len(s) == 2 and s[0] == s[1] for s in sums), sums  # DDP across nodes: replicas identical
    assert sums[0][0] != sums[1][0], sums  # ...and they trained: step 2 moved the weights
