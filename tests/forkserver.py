"""`python train.py ...` for the tests, as a fork of one process that has imported the project already.

A tiny two-step run takes about 10 s of CPU, 7 of them importing torch, diffusers, peft and scipy; the suite starts
such a run about a hundred times. One server per pytest worker imports it all once and forks a child for each run:
the child is a fresh process (its own pid, signals, exit status, files) that starts where the imports end. A
`torchrun --standalone --nproc_per_node=N` of a script becomes N forked ranks with torchrun's worker environment,
the others stopped when one fails, as torchrun's agent does.

    proc = forkserver.run([sys.executable, "train.py", ...], cwd=ROOT, env=env, timeout=300)  # a CompletedProcess
    proc = forkserver.start([sys.executable, "train.py", ...], cwd=ROOT, env=env)  # a Popen, to signal or kill

Both fall back to a real subprocess where a fork could differ from one: another interpreter or `-m`, an
environment that differs from the server's beyond the thread count and PYTHONPATH, or FLOW_RL_TEST_FORK=0 (every run
a subprocess, to check that both agree); `start` also leaves a torchrun to the real launcher. What the child redoes
so that it starts as a new process would: the working directory, the environment, the project's own modules
(imported anew: a few read the environment when imported), stdin / stdout / stderr, sys.argv and sys.path, torch's
thread count and default seed, Python's and numpy's global seeds from the OS; at its end the interpreter's own exit
steps (non-daemon threads joined, atexit handlers, flushed streams). `python -c code args` runs the code as
`python -c` does.
"""
import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # applied in the child with torch.set_num_threads
# Variables the worker's environment may hold and the server's not, read when used, never by an import the server made;
# the child's environment is the request's, so it reads them as a new process would:
#   pytest's PYTEST_CURRENT_TEST (anew for every test), inductor's TORCHINDUCTOR_CACHE_DIR (at its first compile);
#   what a test's imports set after the server started: cv2 (imported with rapidocr) its Qt paths and LD_LIBRARY_PATH
#   (the loader reads it at a process's start, for libraries the server has loaded already), transformers
#   TOKENIZERS_PARALLELISM, the shapes scripts OMP_WAIT_POLICY (how idle OpenMP threads wait: speed, never bits);
#   the service tests' NO_PROXY (read per request).
# Left out of this list, the later ones send a dozen of the suite's runs to a new interpreter (~12 CPU-s of imports
# each).
SET_IN_THE_WORKER = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "QT_QPA_PLATFORM_PLUGIN_PATH", "QT_QPA_FONTDIR",
                     "LD_LIBRARY_PATH", "TOKENIZERS_PARALLELISM", "OMP_WAIT_POLICY", "NO_PROXY", "no_proxy")
# PYTHONPATH may differ too: the child puts it on sys.path where the interpreter would (after the script's folder,
# before the standard library); the server starts without one.
BASE_PATH = []  # the server's sys.path as a new interpreter starts it, less the script's folder


# --- the server ------------------------------------------------------------------------------------------------------

def _exit_code(exc):
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)  # sys.exit("message"), as the interpreter prints it
    return 1


def _child(request):
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                                (1, request["stdout"], os.O_WRONLY | os.O_APPEND),  # ranks share them
                                (2, request["stderr"], os.O_WRONLY | os.O_APPEND)):
            opened = os.open(path, flags, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        import random

        import numpy
        import torch
        random.seed()
        numpy.random.seed()
        torch.random.default_generator.manual_seed(torch.random.default_generator.initial_seed())
        threads = request["env"].get("OMP_NUM_THREADS")
        if threads and threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for name, module in list(sys.modules.items()):  # the project's own modules import anew, as in a new process:
            path = getattr(module, "__file__", None) or ""  # some read the environment when imported (the ranks)
            if path.startswith(ROOT + os.sep) and not path.startswith(os.path.join(ROOT, "tests") + os.sep):
                del sys.modules[name]
        extra = [os.path.abspath(p) for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        if "code" in request:  # python -c code args: sys.argv[0] "-c", the working directory first on the path
            sys.argv, sys.path[:] = ["-c", *request["argv"]], [""] + extra + BASE_PATH
            exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = list(request["argv"])
            sys.path[:] = [os.path.dirname(os.path.abspath(sys.argv[0]))] + extra + BASE_PATH  # as `python script.py`
            import runpy
            runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:  # the interpreter's own exit: wait for non-daemon threads, run atexit handlers, flush
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _detach(request):
    """A run that the server does not wait for (`start`): a reaper process, orphaned at once so that the server never
    waits on it, forks the run in a session of its own (as start_new_session=True), writes its pid, waits for it and
    writes its exit code (negative for a signal, as Popen's): the files `start`'s handle reads."""
    first = os.fork()
    if first:
        os.waitpid(first, 0)
        return
    try:
        if os.fork() == 0:  # the reaper
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)  # off the server's request and reply pipes
            os.dup2(null, 1)
            led, leads = os.pipe()
            run = os.fork()
            if run == 0:
                os.close(led)
                os.setsid()
                os.close(leads)  # its group exists: a killpg of the pid now reaches it
                _child(request)
            os.close(leads)
            os.read(led, 1)  # the end of the pipe: the run has its session
            os.close(led)
            _write(request["pid_file"], str(run))
            _, status = os.waitpid(run, 0)
            _write(request["code_file"], str(os.waitstatus_to_exitcode(status)))
    finally:
        os._exit(0)


def _write(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)  # whole or absent for the reader


# What the runs import lazily, from inside functions (the pipelines, text encoders, peft): about 3.5 s of CPU that every
# forked run would pay again, six times a tiny one-step run's own work. Importing a library module earlier runs the
# same code as importing it later; the project's modules are not among them (they import anew in each child).
LAZY = {"diffusers": ("StableDiffusion3Pipeline", "SD3Transformer2DModel", "FlowMatchEulerDiscreteScheduler",
                      "FluxPipeline", "FluxKontextPipeline", "FluxTransformer2DModel", "AutoencoderKL"),
        "transformers": ("CLIPTextModel", "CLIPTextModelWithProjection", "CLIPTokenizer", "T5EncoderModel"),
        "peft": ("LoraConfig", "get_peft_model"), "safetensors.torch": ("load_file", "save_file")}


def _import_lazy_classes():
    import importlib
    for module, names in LAZY.items():
        try:
            for name in names:
                getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):  # an older library: the children import what they need themselves
            pass


def serve():
    """Reads one JSON request a line from stdin: a run, or a "group" of runs (the ranks of a torchrun); answers
    {"pids"} when the children start and {"code"} when they have all ended."""
    BASE_PATH[:] = sys.path[1:]  # less this file's folder
    sys.path.insert(0, ROOT)
    import diffusers  # noqa: F401  the imports every run pays for
    import matplotlib
    import scipy.stats  # noqa: F401
    matplotlib.use("Agg")  # as eval.py's figures select it
    import matplotlib.pyplot  # noqa: F401
    import eval  # noqa: F401
    import train  # noqa: F401
    _import_lazy_classes()
    reply = sys.stdout
    reply.write('{"ready": true}\n')
    reply.flush()
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        if request.get("detached"):
            _detach(request)
            reply.write('{"started": true}\n')
            reply.flush()
            continue
        pids = []
        for one in request.get("group", [request]):
            pid = os.fork()
            if pid == 0:
                _child(one)
            pids.append(pid)
        reply.write(json.dumps({"pids": pids}) + "\n")
        reply.flush()
        codes = {}
        while len(codes) < len(pids):
            pid, status = os.wait()
            codes[pid] = os.waitstatus_to_exitcode(status)
            if codes[pid] != 0:  # as torchrun: one rank failed, the others are stopped
                for other in set(pids) - set(codes):
                    os.kill(other, signal.SIGTERM)
        code = codes[pids[0]] if "group" not in request else int(any(codes.values()))
        reply.write(json.dumps({"code": code}) + "\n")
        reply.flush()


# --- the client, in the pytest worker --------------------------------------------------------------------------------

_server = None  # (Popen, its environment)


def _start(env):
    global _server
    env = {k: v for k, v in env.items() if k != "PYTHONPATH"}  # each child puts its own on sys.path
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], cwd=ROOT, env=env, bufsize=0,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    proc.pending = b""
    if (_read(proc, 120) or {}).get("ready"):
        _server = (proc, dict(env))
    else:
        proc.kill()
        _server = (None, dict(env))  # failed to start: every run a subprocess


def _torchrun(cmd):
    """(ranks, the script's argv) of `python -m torch.distributed.run --standalone --nproc_per_node=N script.py ...`;
    None for any other command, or other launcher options."""
    if cmd[:3] != [sys.executable, "-m", "torch.distributed.run"]:
        return None
    rest, ranks, standalone = list(cmd[3:]), "", False
    while rest and rest[0].startswith("--"):
        option = rest.pop(0)
        if option == "--standalone":
            standalone = True
        elif option.startswith(("--nproc_per_node=", "--nproc-per-node=")):
            ranks = option.split("=", 1)[1]
        elif option in ("--nproc_per_node", "--nproc-per-node") and rest:
            ranks = rest.pop(0)
        else:
            return None
    if not standalone or not ranks.isdigit() or int(ranks) < 1 or not rest or not rest[0].endswith(".py"):
        return None
    return int(ranks), rest


def _rank_env(env, rank, ranks, port):
    """The environment torchrun's local agent gives a worker (torch/distributed/elastic/agent/server/
    local_elastic_agent.py), with rank 0 hosting the rendezvous store (no agent store)."""
    return dict(env, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_NAME="default",
                LOCAL_WORLD_SIZE=str(ranks), WORLD_SIZE=str(ranks), GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=str(ranks),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0",
                TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none", TORCHELASTIC_USE_AGENT_STORE="False",
                OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _forkable(cmd, env):
    if os.environ.get("FLOW_RL_TEST_FORK", "1") == "0" or not hasattr(os, "fork"):
        return False
    script = len(cmd) >= 2 and (cmd[1].endswith(".py") or cmd[1] == "-c" and len(cmd) > 2)
    single = cmd[0] == sys.executable and script
    if not single and _torchrun(cmd) is None:
        return False
    if _server is not None:
        differs = {k for k in set(env) | set(_server[1]) if env.get(k) != _server[1].get(k)}
        if differs - set(THREAD_VARS) - set(SET_IN_THE_WORKER) - {"PYTHONPATH"}:
            return False
    return True


def _read(proc, timeout):
    """The server's next reply, or None after `timeout` seconds (None: no limit) or when it has exited. Reads the pipe
    unbuffered: a buffered readline could hold the next reply where select() cannot see it."""
    fd = proc.stdout.fileno()
    while b"\n" not in proc.pending:
        if not select.select([fd], [], [], timeout)[0]:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            return None
        proc.pending += chunk
    line, proc.pending = proc.pending.split(b"\n", 1)
    return json.loads(line)


def _server_for(cmd, env):
    """The fork server that can run `cmd` in `env` (started at the first call), or None: run it as a subprocess."""
    if not _forkable(cmd, env):
        return None
    if _server is None:
        _start(env)
    proc = _server[0]
    return None if proc is None or proc.poll() is not None else proc


def _request(cmd, cwd, env, stdout, stderr):
    """The server's request for a single run of `python script.py args` or `python -c code args`."""
    request = dict(cwd=os.path.abspath(cwd), env=env, stdout=stdout, stderr=stderr)
    return dict(request, code=cmd[2], argv=cmd[3:]) if cmd[1] == "-c" else dict(request, argv=cmd[1:])


def run(cmd, *, cwd=ROOT, env=None, timeout=None):
    """subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout), forked where it can;
    `python -m torch.distributed.run --standalone --nproc_per_node=N script.py ...` as N forked ranks."""
    env = dict(os.environ if env is None else env)
    proc = _server_for(cmd, env)
    if proc is None:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        open(out, "w").close()
        open(err, "w").close()
        launch = _torchrun(cmd)
        if launch is None:
            request = _request(cmd, cwd, env, out, err)
        else:
            ranks, argv, port = *launch, _free_port()
            request = dict(group=[dict(cwd=os.path.abspath(cwd), stdout=out, stderr=err, argv=argv,
                                       env=_rank_env(env, r, ranks, port)) for r in range(ranks)])
        proc.stdin.write(json.dumps(request).encode() + b"\n")
        pids = _read(proc, 60)["pids"]
        done = _read(proc, timeout)
        if done is None:  # past the timeout: kill the children, as subprocess.run does
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _read(proc, 60)
            raise subprocess.TimeoutExpired(cmd, timeout, output=_text(out), stderr=_text(err))
        return subprocess.CompletedProcess(cmd, done["code"], _text(out), _text(err))


def two_ranks(script, *args, timeout=300):
    """`torchrun --standalone --nproc_per_node=2 tests/<script> args...` from the repository root (HF_HUB_OFFLINE, one
    thread a rank, the repository on PYTHONPATH: the script runs from tests/), forked where it can; asserts it exited
    0, its output's tails in the message. -> the finished process."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join("tests", script), *map(str, args)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = run(cmd, cwd=ROOT, env=env, timeout=timeout)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def start(cmd, *, cwd=ROOT, env=None):
    """subprocess.Popen(cmd, cwd=cwd, env=env, stdout=PIPE, stderr=PIPE, text=True, start_new_session=True), forked
    where it can (a single run, not a torchrun): the handle has Popen's pid, returncode, poll, wait, communicate,
    send_signal, terminate and kill, and the run leads its own process group as with start_new_session."""
    env = dict(os.environ if env is None else env)
    proc = None if _torchrun(cmd) is not None else _server_for(cmd, env)
    if proc is None:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    return Started(proc, cmd, cwd, env)


class Started:
    """A forked run started by `start`, read through the files its reaper writes (see _detach)."""

    def __init__(self, server, cmd, cwd, env):
        self.args, self.returncode, self._output = cmd, None, None
        self._dir = tempfile.mkdtemp(prefix="forked-")
        self._paths = {k: os.path.join(self._dir, k) for k in ("stdout", "stderr", "pid", "code")}
        open(self._paths["stdout"], "w").close()
        open(self._paths["stderr"], "w").close()
        request = dict(_request(cmd, cwd, env, self._paths["stdout"], self._paths["stderr"]), detached=True,
                       pid_file=self._paths["pid"], code_file=self._paths["code"])
        server.stdin.write(json.dumps(request).encode() + b"\n")
        if not (_read(server, 60) or {}).get("started"):
            raise RuntimeError(f"the fork server did not start {cmd}")
        deadline = time.monotonic() + 60
        while not os.path.exists(self._paths["pid"]):  # the reaper writes it once the run has its session
            if time.monotonic() > deadline:
                raise RuntimeError(f"the fork server's reaper gave no pid for {cmd} in 60 s")
            time.sleep(0.005)
        with open(self._paths["pid"]) as f:
            self.pid = int(f.read())

    def poll(self):
        if self.returncode is None and os.path.exists(self._paths["code"]):
            with open(self._paths["code"]) as f:
                code = int(f.read())
            self._output = (_text(self._paths["stdout"]), _text(self._paths["stderr"]))
            shutil.rmtree(self._dir, ignore_errors=True)
            self.returncode = code
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def communicate(self, timeout=None):
        self.wait(timeout)
        return self._output

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def _text(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


if __name__ == "__main__":
    serve()
