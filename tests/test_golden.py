"""Golden runs: short training runs of every loss and sampler on the tiny model, whose trained tensors and logged
rewards and losses must not change under a refactor.

Each run is 2 steps of tests/test_train.py's small setup with a fixed seed. What it produced is reduced to
    - a SHA-256 of every tensor in the last checkpoint (the trained weights, the EMA and old-policy copies, Adam's
      moments), and of the logged rewards, losses and gradient norms of both steps, and
    - float summaries of the same (sums, absolute sums), for machines whose CPU kernels round differently.
tests/golden.json holds a record per machine (torch version, CPU model, its kernels' instruction set, threads). On a
machine that has a record every hash must match it: bit for bit. Elsewhere the summaries must agree with some
machine's record within a few per cent, which catches a changed algorithm but not a changed rounding: two steps of
these runs amplify a CPU's other rounding to about 1 % (an AMD EPYC against the Intel Xeon record: grad_norm 0.003515
against 0.003548). Add or replace this machine's record (only for a deliberate change of the numbers, said in the
commit message; a change of the numbers
also drops the other machines' records of the runs it changed) with

    python tests/test_golden.py --record
"""
import hashlib
import json
import os
import platform
import sys

import pytest
import torch

import forkserver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden.json")
SMALL = ["--model", "tiny", "--prompts-per-step", "2", "--group-size", "4", "--sample-batch-size", "4",
         "--train-batch-size", "4", "--num-steps", "4", "--resolution", "32", "--log-images-every", "0", "--seed", "7"]
RUNS = {
    "grpo-flow": ["--loss", "grpo", "--sde", "flow"],
    "grpo-dance": ["--loss", "grpo", "--sde", "dance"],
    "grpo-cps": ["--loss", "grpo", "--sde", "cps"],
    "guard-flow": ["--loss", "guard", "--sde", "flow"],
    "guard-dance": ["--loss", "guard", "--sde", "dance"],
    "flowdppo-flow": ["--loss", "flowdppo", "--sde", "flow", "--updates-per-batch", "2"],
    "flowdppo-dance": ["--loss", "flowdppo", "--sde", "dance"],
    "flowdppo-cps": ["--loss", "flowdppo", "--sde", "cps"],
    "nft": ["--loss", "nft"],
    "awm": ["--loss", "awm", "--train-timesteps", "2"],
    "grpo-minibatches-updates": ["--loss", "grpo", "--minibatches", "2", "--updates-per-batch", "2",
                                 "--train-batch-size", "2"],
    "grpo-lora-kl-ema": ["--loss", "grpo", "--lora-rank", "4", "--lora-alpha", "8", "--kl-beta", "0.1",
                         "--ema-decay", "0.9", "--global-std"],
    "guard-lora-kl-exact": ["--loss", "guard", "--lora-rank", "4", "--kl-beta", "0.1", "--kl-form", "exact"],
    "nft-lora-kl": ["--loss", "nft", "--lora-rank", "4", "--kl-beta", "0.01", "--nft-beta", "0.5"],
    "awm-updates-ema": ["--loss", "awm", "--train-timesteps", "2", "--updates-per-batch", "2", "--ema-decay", "0.9",
                        "--sampler", "euler"],
    "grpo-fast-cfg": ["--loss", "grpo", "--sde-window", "fast", "--window-size", "1", "--guidance-scale", "3"],
    "grpo-mix-flash-same-noise": ["--loss", "grpo", "--sde-window", "mix", "--window-size", "2",
                                  "--iters-per-window", "1", "--flash", "--same-noise-per-group"],
    "grpo-bf16": ["--loss", "grpo", "--mixed-precision", "bf16"],
    "sft": ["--loss", "sft"],
    "dpo": ["--loss", "dpo"],
    "dgpo": ["--loss", "dgpo", "--train-timesteps", "2"],
    "shapes-geneval": ["--model", "shapes", "--loss", "grpo", "--eval-every", "0", "--resolution", "32"],
    "shapes-default": ["--model", "shapes", "--eval-every", "0", "--resolution", "32"],  # the default run: nft
}
RESUME = "grpo-resume"  # grpo-lora-kl-ema stopped after step 1 and resumed from its checkpoint to step 2
FSDP = "grpo-fsdp"  # two processes under torchrun, a sharded full fine-tune with two minibatches
LOGGED = ("reward_mean", "reward_std", "loss", "grad_norm")  # and every "reward/..." component


def machine():
    """What decides the bits: torch's version, the CPU and the instruction set torch's kernels use on it (two "AMD
    EPYC" machines, one with AVX-512 and one with AVX2 only, round differently), and the threads."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    kernels = torch.backends.cpu.get_cpu_capability()
    return f"torch {torch.__version__} | {cpu} | {kernels} | {torch.get_num_threads()} threads"


def digest(out):
    """Hashes and summaries of a finished run folder: every tensor of its last checkpoint and the logged values."""
    from safetensors.torch import load_file

    ckpts = sorted((int(d) for d in os.listdir(os.path.join(out, "checkpoints")) if d.isdigit()))
    ckpt = os.path.join(out, "checkpoints", str(ckpts[-1]))
    tensors = {}
    for name in sorted(os.listdir(ckpt)):
        if name.endswith(".safetensors"):
            tensors.update({f"{name}:{k}": v for k, v in load_file(os.path.join(ckpt, name)).items()})
    optim = torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=True)
    for i, state in optim.get("state", {}).items():
        tensors.update({f"optimizer:{i}:{k}": v for k, v in state.items() if torch.is_tensor(v) and v.ndim > 0})
    h = hashlib.sha256()
    for key in sorted(tensors):
        h.update(key.encode())
        h.update(tensors[key].detach().float().contiguous().numpy().tobytes())
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    logged = [{k: r[k] for k in sorted(r) if k in LOGGED or k.startswith("reward/")} for r in rows]
    weights = [v for k, v in tensors.items() if not k.startswith("optimizer:")]
    return dict(tensors=h.hexdigest(), logged=hashlib.sha256(json.dumps(logged).encode()).hexdigest(),
                steps=[r["step"] for r in rows],
                weight_sum=sum(float(v.double().sum()) for v in weights),
                weight_abs=sum(float(v.double().abs().sum()) for v in weights),
                logged_values=logged)


def _train(argv):
    """train.main in this process, its SystemExit (a refusal) turned into a failure with the message."""
    import train
    try:
        train.main(argv)
    except SystemExit as e:
        if e.code not in (None, 0):
            raise AssertionError(f"train.py {' '.join(argv)} exited: {e.code}") from None


def run_all(root):
    """Every golden run into folders under root -> {name: digest}."""
    results = {}
    for name, flags in RUNS.items():
        out = os.path.join(root, name)
        _train(SMALL + flags + ["--steps", "2", "--out", out])
        results[name] = digest(out)
    out = os.path.join(root, RESUME)
    _train(SMALL + RUNS["grpo-lora-kl-ema"] + ["--steps", "1", "--out", out])
    _train(SMALL + RUNS["grpo-lora-kl-ema"] + ["--steps", "2", "--out", out, "--resume", "auto"])
    results[RESUME] = digest(out)
    out = os.path.join(root, FSDP)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *SMALL,
           "--lora-rank", "0", "--fsdp", "--minibatches", "2", "--train-batch-size", "2", "--steps", "2", "--out", out]
    proc = forkserver.run(cmd, cwd=ROOT, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results[FSDP] = digest(out)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory, one_thread):
    return run_all(str(tmp_path_factory.mktemp("golden")))


@pytest.fixture(scope="module")
def golden():
    with open(GOLDEN) as f:
        return json.load(f)["records"]


def test_every_golden_run_is_recorded_on_the_newest_machine(golden):
    assert set(golden[0]["runs"]) == set(RUNS) | {RESUME, FSDP}


@pytest.mark.parametrize("name", list(RUNS) + [RESUME, FSDP])
def test_golden_run_reproduces(results, golden, name):
    got = results[name]
    assert got["steps"] == [1, 2]
    mine = [r["runs"] for r in golden if r["machine"] == machine() and name in r["runs"]]
    if mine:  # a recording machine: bit for bit
        assert got["tensors"] == mine[0][name]["tensors"], f"{name}: trained tensors changed"
        assert got["logged"] == mine[0][name]["logged"], f"{name}: logged rewards / losses changed"
        return
    # Another CPU or torch: the rounding differs, and two steps amplify it (module docstring); the numbers may not
    # change by more than that, against some machine's record (an AVX2 and an AVX-512 machine differ by up to 4e-4
    # of a weight sum after guard's two steps, more than either differs from a third machine).
    problems = [_differences(got, r["runs"][name], name) for r in golden if name in r["runs"]]
    assert problems and min(problems, key=len) == [], min(problems, key=len)


def _differences(got, want, name):
    """What differs beyond another machine's rounding; bf16 kernels differ between CPUs by up to bf16's own precision
    per operation."""
    rel = 5e-2 if "bf16" in name else 2e-2
    found = []
    if got["weight_sum"] != pytest.approx(want["weight_sum"], rel=rel / 10, abs=1e-4):
        found.append(("weight_sum", got["weight_sum"], want["weight_sum"]))
    if got["weight_abs"] != pytest.approx(want["weight_abs"], rel=rel / 10):
        found.append(("weight_abs", got["weight_abs"], want["weight_abs"]))
    for a, b in zip(got["logged_values"], want["logged_values"]):
        if set(a) != set(b):
            found.append(("logged keys", sorted(a), sorted(b)))
            continue
        for key in a:  # None: a component no sample of the step had (a GenEval tag absent from the step's prompts)
            if (a[key] is None) != (b[key] is None) or (
                    a[key] is not None and a[key] != pytest.approx(b[key], rel=rel, abs=1e-6)):
                found.append((key, a[key], b[key]))
    return found


def test_resumed_run_equals_the_uninterrupted_one(results):
    assert results[RESUME]["tensors"] == results["grpo-lora-kl-ema"]["tensors"]
    assert results[RESUME]["logged"] == results["grpo-lora-kl-ema"]["logged"]


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        raise SystemExit("usage: python tests/test_golden.py --record")
    import tempfile
    sys.path.insert(0, ROOT)
    os.chdir(ROOT)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        runs = run_all(tmp)
    with open(GOLDEN) as f:
        records = json.load(f)["records"]
    # Runs whose numbers changed here are dropped from the other machines' records: they can no longer be checked.
    old = next((r["runs"] for r in records if r["machine"] == machine()), {})
    changed = {n for n, d in runs.items() if n in old and d["tensors"] != old[n]["tensors"]}
    others = [dict(r, runs={n: d for n, d in r["runs"].items() if n not in changed})
              for r in records if r["machine"] != machine()]
    with open(GOLDEN, "w") as f:
        json.dump(dict(records=[dict(machine=machine(), runs=runs)] + others), f, indent=1)
        f.write("\n")
    print(f"changed: {sorted(changed) or 'none'}")
    print(f"recorded {len(runs)} runs in {GOLDEN} on {machine()}")
