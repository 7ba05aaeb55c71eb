"""Subprocess runs of the real command lines on the tiny model: every loss and sampler, resume, DDP, eval."""
import json
import os
import sys

import pytest
import torch

import forkserver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Small but complete: 2 prompts x 4 samples, 4 denoising steps (3 trained), 32 px.
SMALL = ["--model", "tiny", "--prompts-per-step", "2", "--group-size", "4", "--sample-batch-size", "4",
         "--train-batch-size", "4", "--num-steps", "4", "--resolution", "32", "--log-images-every", "1"]


def run(cmd, tmp_path, *, check=True, env=None, timeout=300):
    full_env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    full_env.update(env or {})
    proc = forkserver.run(cmd, cwd=ROOT, env=full_env, timeout=timeout)  # a fork of a process that imported train
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def train(tmp_path, *flags, out="run", check=True, env=None):
    out_dir = str(tmp_path / out)
    proc = run([sys.executable, "train.py", *SMALL, "--out", out_dir, *flags], tmp_path, check=check, env=env)
    return proc, out_dir


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.parametrize("flags", [
    ["--loss", "grpo", "--sde", "flow"],
    ["--loss", "guard", "--sde", "dance"],
    ["--loss", "flowdppo", "--sde", "cps", "--updates-per-batch", "2"],
    ["--loss", "grpo", "--sde", "flow", "--lora-rank", "4", "--lora-alpha", "8", "--kl-beta", "0.1", "--minibatches", "2",
     "--train-batch-size", "2", "--ema-decay", "0.9"],
    ["--loss", "grpo", "--sde-window", "mix", "--window-size", "2", "--iters-per-window", "1", "--flash"],
    ["--loss", "grpo", "--sde-window", "fast", "--window-size", "1", "--guidance-scale", "3", "--mixed-precision", "bf16"],
], ids=["grpo-flow", "guard-dance", "flowdppo-cps", "lora-kl-ema", "mix-flash", "fast-cfg-bf16"])
def test_two_steps(tmp_path, flags):
    proc, out = train(tmp_path, "--steps", "2", *flags)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert not r.get("skipped"), r
        for key in ("reward_mean", "reward_std", "reward/jpeg_compressibility_mean", "loss", "ratio_mean", "approx_kl", "seconds"):
            assert key in r and r[key] == r[key], (key, r)  # present and not NaN
        assert r["reward_mean"] < 0  # JPEG compressibility is minus a size
        assert r["trained_steps"] >= 1
    # Old log-probs are the rollout's: the first update of an on-policy batch has ratio 1 (fp32 exactly, bf16 closely).
    tol = 1e-4 if "bf16" not in flags else 0.1
    assert all(abs(r["first_ratio_dev"]) < tol for r in rows)
    if "flowdppo" in flags:
        assert all("masked_fraction" in r and "kl_mask_fraction" in r for r in rows)
    args = json.load(open(os.path.join(out, "args.json")))
    assert args["args"]["loss"] == flags[1] and args["commit"] and args["torch"] == torch.__version__
    ckpt = os.path.join(out, "checkpoints", "2")
    assert os.path.isfile(os.path.join(ckpt, "state.json")) and os.path.isfile(os.path.join(ckpt, "trainable.safetensors"))
    assert os.path.isfile(os.path.join(out, "samples", "000002.png"))


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_lr_schedule_is_torchs_scheduler_of_the_same_name(schedule):
    """Policy.lr against torch.optim.lr_scheduler (ConstantLR at factor 1, LinearLR, CosineAnnealingLR) over a
    run of 9 optimizer steps (3 steps x 3 updates), and held at the final rate past the run's end."""
    import types

    import policy
    args = types.SimpleNamespace(lr=1e-3, lr_final=0.1, lr_schedule=schedule, steps=3, updates_per_batch=3,
                                 minibatches=1)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=args.lr)
    reference = {"constant": lambda: torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0),
                 "linear": lambda: torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, args.lr_final, total_iters=8),
                 "cosine": lambda: torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, 8, eta_min=1e-4)}[schedule]()
    for n in range(9):
        got = policy.Policy.lr(types.SimpleNamespace(args=args, optimizer_steps=n))
        assert got == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-12), n
        optimizer.step()
        reference.step()
    assert policy.Policy.lr(types.SimpleNamespace(args=args, optimizer_steps=20)) == pytest.approx(
        args.lr * (1 if schedule == "constant" else args.lr_final))


def test_lr_schedule_is_logged_and_continues_across_a_resume(tmp_path):
    flags = ["--lr", "1e-3", "--lr-schedule", "linear", "--lr-final", "0.25", "--log-images-every", "0"]
    _, whole = train(tmp_path, "--steps", "3", *flags, out="whole")
    _, part = train(tmp_path, "--steps", "1", *flags, out="part")
    train(tmp_path, "--steps", "3", "--resume", "auto", *flags, out="part")  # the count, not the process, sets it
    assert [r["lr"] for r in metrics(whole)] == pytest.approx([1e-3, 0.625e-3, 0.25e-3])
    assert [r["lr"] for r in metrics(part)] == pytest.approx([1e-3, 0.625e-3, 0.25e-3])


@pytest.mark.slow  # tests/test_golden.py::test_resumed_run_equals_the_uninterrupted_one checks it bit for bit
def test_resume_matches_uninterrupted_run(tmp_path):
    _, full = train(tmp_path, "--steps", "4", "--save-every", "2", out="full")
    _, part = train(tmp_path, "--steps", "2", out="part")
    train(tmp_path, "--steps", "4", "--resume", os.path.join(part, "checkpoints", "2"), out="part")
    a, b = metrics(full), metrics(part)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        for key in ("reward_mean", "loss", "ratio_mean", "approx_kl"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-7), (key, ra["step"])


def test_lora_checkpoint_loads_with_diffusers(tmp_path):
    import models
    _, out = train(tmp_path, "--steps", "1", "--lora-rank", "4", "--lora-alpha", "4", "--lr", "0.05")
    lora_dir = os.path.join(out, "checkpoints", "1", "lora")
    assert os.path.isfile(os.path.join(lora_dir, "pytorch_lora_weights.safetensors"))
    pipe = models.load_pipeline("tiny")
    x = models.initial_noise(pipe, 2, 32, generator=torch.Generator().manual_seed(0))
    embeds = models.encode_prompts(pipe, ["a red cube", "a blue ball"])
    before = models.velocity(pipe, x, 0.5, embeds)
    pipe.load_lora_weights(lora_dir)  # diffusers' own loader
    after = models.velocity(pipe, x, 0.5, embeds)
    assert not torch.allclose(before, after, atol=1e-6)  # the trained adapter changes the output
    # ...and it is the adapter the run trained: the same weights applied through our own loader agree.
    import eval as evaluation
    pipe2 = models.load_pipeline("tiny")
    models.add_lora(pipe2, 4, 4)
    evaluation.load_weights(pipe2, os.path.join(out, "checkpoints", "1"))
    assert torch.allclose(models.velocity(pipe2, x, 0.5, embeds), after, atol=1e-5)


def test_eval_on_checkpoint_and_plot(tmp_path):
    _, out = train(tmp_path, "--steps", "2", "--lr", "0.01")
    eval_out = str(tmp_path / "eval")
    proc = run([sys.executable, "eval.py", "--checkpoints", os.path.join(out, "checkpoints", "2"), "--resolution", "32",
                "--max-prompts", "3", "--eval-steps", "4", "--out", eval_out], tmp_path)
    summary = json.load(open(os.path.join(eval_out, "summary.json")))
    results = summary["results"]
    assert len(results) == 2 and "base" in results
    values = [r["jpeg_compressibility"] for r in results.values()]
    assert all(v < 0 for v in values) and values[0] != values[1]  # trained weights change the deterministic samples
    from PIL import Image
    grid = Image.open(os.path.join(eval_out, "grid.png"))
    assert grid.size[1] >= 3 * 32 and grid.size[0] >= 2 * 32
    run([sys.executable, "eval.py", "--plot", out], tmp_path)
    assert Image.open(os.path.join(out, "curves.png")).size[0] > 100


@pytest.mark.parametrize("content,needle", [
    ("", "no prompts"),
    ("{not json}\n[1, 2]\n", "no valid row"),
])
def test_bad_prompt_files_are_refused(tmp_path, content, needle):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text(content)
    proc, _ = train(tmp_path, "--steps", "1", "--prompts", str(bad), check=False)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and needle in last and str(bad) in last and "Traceback" not in proc.stderr


@pytest.mark.parametrize("flags,needle", [
    (["--prompts-per-step", "3", "--group-size", "3"], "not divisible"),
    (["--train-cfg", "--guidance-scale", "1"], "--train-cfg needs CFG"),
    (["--loss", "guard", "--sde", "cps"], "--sde cps"),
    (["--reward", "nosuchreward"], "nosuchreward"),
    (["--sde-window", "fast", "--window-size", "9"], "--window-size"),
    (["--no-such-flag"], "unrecognized arguments"),
])
def test_bad_flags_are_refused_in_one_line(tmp_path, flags, needle):
    proc, _ = train(tmp_path, "--steps", "1", *flags, check=False)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert needle in proc.stderr.strip().splitlines()[-1]


@pytest.mark.slow  # tests/test_multinode.py checks the same replicas (and more) over a c10d rendezvous
def test_torchrun_two_processes_keep_identical_weights(tmp_path):
    out = str(tmp_path / "ddp")
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *SMALL,
         "--steps", "2", "--out", out], tmp_path)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    state = json.load(open(os.path.join(out, "checkpoints", "2", "state.json")))
    sums = state["rank_checksums"]
    assert len(sums) == 2 and sums[0] == sums[1]  # DDP kept both replicas identical
    assert all(abs(r["first_ratio_dev"]) < 1e-4 for r in rows)


def test_ema_is_saved_and_used_by_evaluation(tmp_path, monkeypatch):
    """--ema-decay keeps an average of the trained weights; eval.py --ema evaluates it instead of the raw weights."""
    from safetensors.torch import load_file
    import eval as evaluation
    import models
    import train as train_module
    monkeypatch.chdir(ROOT)
    out = str(tmp_path / "ema")
    train_module.main([*SMALL, "--steps", "2", "--ema-decay", "0.5", "--lr", "0.01", "--out", out, "--log-images-every", "0"])
    ckpt = os.path.join(out, "checkpoints", "2")
    raw, ema = load_file(os.path.join(ckpt, "trainable.safetensors")), load_file(os.path.join(ckpt, "ema.safetensors"))
    base = dict(models.load_pipeline("tiny").transformer.named_parameters())
    name = next(k for k in raw if (raw[k] != base[k]).any())  # a weight the run changed
    # Two optimizer steps, decay min((1 + n) / (10 + n), 0.5) after step n: ema = (2/11 b + 9/11 w1) / 4 + 3/4 w2.
    assert not torch.equal(ema[name], raw[name]) and not torch.equal(ema[name], base[name].detach())
    for use_ema, expected in ((False, raw), (True, ema)):
        pipe = models.load_pipeline("tiny")
        evaluation.load_weights(pipe, ckpt, use_ema=use_ema)
        assert torch.equal(dict(pipe.transformer.named_parameters())[name].detach(), expected[name])


def test_sample_grid_captions_show_prompt_reward_and_verdict(tmp_path):
    import eval as evaluation
    import run
    from PIL import Image
    scores = {"reward": torch.tensor([0.75, 1.0]), "geneval_correct": torch.tensor([0.0, 1.0])}
    captions = run.sample_captions(["a red circle", "two squares"], scores, "reward", 2)
    assert captions == ["a red circle\nreward 0.750 | wrong", "two squares\nreward 1.000 | correct"]
    images = torch.zeros(2, 32, 32, 3, dtype=torch.uint8)
    path = evaluation.save_sample_grid(str(tmp_path / "g.png"), images, captions)[0]
    grid = Image.open(path)
    assert grid.size[0] == 2 * 128 and grid.size[1] >= 128 + 2 * 12  # enlarged to be read, captions below


def test_default_is_the_shapes_world_and_tiny_keeps_its_preset():
    """No flags: the shapes model, its prompt files, the GenEval judge with the shapes detector, DiffusionNFT with
    the settings measured for it there; another loss on the shapes model gets its own defaults (GRPO on CPS steps),
    and `--model tiny` and hub models keep theirs (the shapes settings do not leak into them)."""
    import train as train_module
    _, args = train_module.parse_args([])
    assert (args.model, args.loss, args.reward, args.geneval_detector) == ("shapes", "nft", "geneval", "shapes")
    assert (args.num_steps, args.timestep_fraction, args.sampler, args.prompts_per_step * args.group_size) == \
        (6, 0.5, "dpm2", 128)
    _, args = train_module.parse_args(["--loss", "grpo"])
    assert (args.loss, args.sde, args.num_steps, args.timestep_fraction, args.lr) == ("grpo", "cps", 10, 1.0, 1e-4)
    _, args = train_module.parse_args(["--loss", "nft", "--num-steps", "10"])  # the command line wins
    assert (args.num_steps, args.timestep_fraction) == (10, 0.5)
    assert (args.prompts, args.eval_prompts, args.input_key) == \
        ("prompts/shapes_train.jsonl", "prompts/shapes_test.jsonl", "prompt")
    assert args.eval_every > 0 and args.resolution == 32 and args.ema_decay == 0.95
    for model in ("tiny", "sd3"):
        _, args = train_module.parse_args(["--model", model])
        assert (args.loss, args.sde, args.ema_decay, args.eval_every, args.input_key, args.eval_prompts) == \
            ("grpo", "flow", 0.0, 0, "input", None), model
        _, args = train_module.parse_args(["--model", model, "--loss", "nft"])
        assert (args.num_steps, args.timestep_fraction) == (10, 0.99), model
        assert args.geneval_detector is None  # geneval.reward reads None as mask2former
    _, args = train_module.parse_args(["--loss", "grpo", "--sde", "dance", "--ema-decay", "0"])  # the command line wins
    assert args.sde == "dance" and args.ema_decay == 0.0


def test_eval_summary_line_reads_as_accuracy():
    import eval as evaluation
    scores = {"reward": 0.5, "geneval_correct": 0.25, "geneval_overall": 0.3, "geneval_single_object": 0.9,
              "geneval_two_object": 0.2, "geneval_counting": float("nan"), "geneval_colors": 0.7,
              "geneval_position": 0.0, "geneval_color_attr": 0.0}
    line = evaluation.summary_line(scores)
    assert line == ("accuracy 0.300 (single_object 0.90, two_object 0.20, colors 0.70, position 0.00, "
                    "color_attr 0.00) | reward +0.5000")
    assert evaluation.summary_line({"reward": -0.25, "reward/jpeg": -0.25}) == "reward -0.2500 | reward/jpeg -0.2500"


def test_tensorboard_gets_the_metrics_the_evaluation_and_the_samples(tmp_path):
    """--log-to tensorboard writes event files under <out>/tensorboard that TensorBoard's own reader reads back."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    _, out = train(tmp_path, "--steps", "2", "--log-to", "tensorboard", "--eval-every", "2", "--eval-prompts",
                   "prompts/tiny.txt", "--eval-steps", "2")
    events = EventAccumulator(os.path.join(out, "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    scalars, rows = events.Tags()["scalars"], metrics(out)
    assert {"reward_mean", "grad_norm", "eval/reward"} <= set(scalars)
    assert [e.step for e in events.Scalars("reward_mean")] == [1, 2]
    assert [e.value for e in events.Scalars("grad_norm")] == pytest.approx([r["grad_norm"] for r in rows])
    assert [e.step for e in events.Scalars("eval/reward")] == [0, 2]
    assert [e.step for e in events.Images("samples")] == [1, 2]  # the sample grid of every logged step


def test_more_samples_per_held_out_prompt_repeat_the_prompts_with_fresh_noise(tmp_path, monkeypatch):
    """--eval-samples-per-prompt k scores the held-out prompts k times over; copy c of prompt j is drawn from noise
    index c N + j, so the first copy is exactly the one-image evaluation and the others are new draws."""
    import eval as evaluation
    import train as train_module
    monkeypatch.chdir(ROOT)
    scored, sample_images = {}, evaluation.sample_images

    def record(pipe, texts, **kw):  # what each held-out evaluation samples: images, prompts, source images
        images = sample_images(pipe, texts, **kw)
        scored[len(scored)] = (images.clone(), list(texts), list(kw["source_images"]))
        return images
    monkeypatch.setattr(evaluation, "sample_images", record)
    base = [*SMALL, "--steps", "1", "--eval-every", "1", "--eval-prompts", "prompts/tiny.txt", "--eval-steps", "2",
            "--log-images-every", "0"]
    for k in (1, 2):
        train_module.main([*base, "--eval-samples-per-prompt", str(k), "--out", str(tmp_path / f"k{k}")])
    (one, texts, sources), (two, texts2, sources2) = scored[0], scored[2]  # step 0 of each run
    n = len(texts)
    assert n > 1 and texts2 == texts * 2 and sources2 == sources * 2 and len(two) == 2 * n
    assert torch.equal(two[:n], one)  # the first copy: the one-image evaluation, bit for bit
    assert all(not torch.equal(two[n + j], one[j]) for j in range(n))  # the second: other noise
