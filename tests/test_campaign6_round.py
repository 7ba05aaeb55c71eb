"""Issue 78's own round: what the sixth campaign's fixes left open, then hostile input on what they added. The video
token bound counts the batch a forward holds (sample batch, micro-batch, CFG's halves) and eval.py checks the frame
rule before any model loads; LTX-2's held-out evaluations at --eval-guidance-scale 1 and FLUX.1 Kontext's preset
guidance against their pipelines. Each finding ends in one line naming the fix (or a warning, or works); each test
fails without the handling it names."""
import inspect
import os
import re
import sys

import pytest

import config
import families
import models
from families import common
from test_campaign6_cli import one_error_line  # the command ended non-zero in one `error:` line, no traceback
from test_train import ROOT, run

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread


def settings(*argv):
    p, args = config.parse_args(list(argv))
    config.check_args(p, args, 1)
    return p, args


# ----------------------------------------------------------------------------- the video token bound's batch (item 1)

def test_a_forward_holds_its_batch_twice_under_cfg():
    """families.forward_samples: CFG's two halves in one batch where the scale is above 1 (LTX-2: either scale),
    none where the guidance is embedded; config.forward_samples takes the run's largest forward."""
    assert families.forward_samples("tiny-hunyuan-video-1.5", [(16, 1.0), (4, 1.0)]) == 16
    assert families.forward_samples("tiny-hunyuan-video-1.5", [(16, 1.0), (12, 4.5)]) == 24
    assert families.forward_samples("tiny-ltx2", [(3, 1.0)], audio_guidance_scale=7.0) == 6  # the sound alone
    assert families.forward_samples("tiny-wan", [(3, 1.0)], audio_guidance_scale=7.0) == 3  # no sound to guide
    assert families.forward_samples("tiny-flux", [(5, 3.5)]) == 5  # FLUX.1-dev: a guidance embedding, no CFG
    base = ["--model", "tiny-hunyuan-video-1.5", "--group-size", "4", "--prompts-per-step", "2"]
    _, args = settings(*base, "--sample-batch-size", "8", "--train-batch-size", "2", "--guidance-scale", "4.5",
                       "--no-train-cfg")
    assert config.forward_samples(args, 1.0) == 16  # the rollouts' 8 under CFG
    _, args = settings(*base, "--sample-batch-size", "2", "--train-batch-size", "8", "--guidance-scale", "4.5",
                       "--train-cfg")
    assert config.forward_samples(args, 4.5) == 16  # the micro-batch's 8 under CFG
    _, args = settings(*base, "--sample-batch-size", "4", "--train-batch-size", "2", "--eval-every", "1",
                       "--eval-prompts", "prompts/tiny.txt", "--eval-guidance-scale", "3")
    assert config.forward_samples(args, 1.0) == 8  # the held-out batch of 4 under the evaluation's CFG


@pytest.fixture(scope="module")
def hunyuan():
    return models.load_pipeline("tiny-hunyuan-video-1.5")


def frames_one_fits_not_16(pipe):
    """A frame count whose tokens fit one sample's forward and not one of 16 on this host, and the most 16 allow."""
    frame_tokens = 4 * 4  # 64 px, VAE 16, patch 1
    alone, batch = (common.sample_tokens(pipe.transformer, "cpu", n) for n in (1, 16))
    latent = batch // frame_tokens + 1
    assert latent * frame_tokens <= alone
    return (latent - 1) * 4 + 1, (batch // frame_tokens - 1) * 4 + 1


def test_the_token_bound_shares_the_memory_among_a_forwards_samples(hunyuan):
    """Before: a count that fits one sample passed whatever the batch (16 rollouts of 4097 frames on tiny-hunyuan
    asked for 34 GB: `DefaultCPUAllocator: can't allocate`, or the kernel's OOM killer)."""
    frames, most = frames_one_fits_not_16(hunyuan)
    hunyuan.forward_samples = 1
    assert models.latent_shape(hunyuan, 64, num_frames=frames)[1] == (frames - 1) // 4 + 1
    hunyuan.forward_samples = 16
    with pytest.raises(ValueError, match=f"a forward of 16 samples .* the most this size allows is {most} "
                                         r"\(or fewer samples a forward: --sample-batch-size"):
        models.latent_shape(hunyuan, 64, num_frames=frames)
    assert models.latent_shape(hunyuan, 64, num_frames=most)[1] == (most - 1) // 4 + 1
    hunyuan.forward_samples = None


@pytest.mark.parametrize("script", ["train.py", "eval.py"])
def test_a_frame_count_one_sample_holds_and_a_batch_does_not_is_refused_in_one_line(script, hunyuan, tmp_path):
    """The real command lines at 16 samples a forward: one `error:` line naming the most frames that fit, before any
    rollout."""
    frames, most = frames_one_fits_not_16(hunyuan)
    flags = ["--model", "tiny-hunyuan-video-1.5", "--num-frames", str(frames), "--out", str(tmp_path / "out")]
    flags += (["--steps", "1", "--sample-batch-size", "16", "--group-size", "8", "--prompts-per-step", "4"]
              if script == "train.py" else ["--batch-size", "16", "--max-prompts", "16", "--prompts",
                                            "prompts/pickscore_test.txt"])
    line = one_error_line(run([sys.executable, script, *flags], tmp_path, check=False))
    assert line.startswith(f"error: --num-frames {frames}: ") and "a forward of 16 samples" in line, line
    assert f"the most this size allows is {most} " in line, line
    assert not (tmp_path / "out" / "samples").exists() and not (tmp_path / "out" / "summary.json").exists()


def test_eval_refuses_the_frame_rule_before_any_model_loads(tmp_path):
    """Before: eval.py loaded the model first (the hub's ltx2, absent here: `cannot load`)."""
    line = one_error_line(run([sys.executable, "eval.py", "--model", "ltx2", "--num-frames", "100", "--out",
                               str(tmp_path / "out")], tmp_path, check=False,
                              env=dict(HF_HUB_OFFLINE="1")))
    assert re.search("--num-frames 100 must be 8 k \\+ 1 for ltx2 .*nearest are 97 and 105", line), line
    line = one_error_line(run([sys.executable, "eval.py", "--model", "sd3", "--num-frames", "5"], tmp_path,
                              check=False))
    assert "--num-frames 5: sd3 makes images; drop the flag" in line, line


# ----------------------------------------------------------------------------- guidance against the pipelines

def test_ltx2_held_out_soundtrack_at_eval_guidance_1_is_said_and_the_store_refused(capsys):
    """LTX2Pipeline(guidance_scale=1, audio_guidance_scale=7) guides the sound alone, as the run's evaluations do:
    warned once; with a prompt store (no negative prompt at a scale of 1) refused in one line, where it was a
    ValueError in the first held-out evaluation."""
    held_out = ["--eval-every", "1", "--eval-prompts", "prompts/tiny.txt", "--eval-guidance-scale", "1"]
    settings("--model", "ltx2", *held_out)
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("warning:")] == [
        "warning: --eval-guidance-scale 1 samples the held-out videos' picture without CFG and their soundtrack at "
        "--audio-guidance-scale 7, as LTX2Pipeline guides it (CFG where either scale is above 1); eval.py "
        "--guidance-scale 1 --audio-guidance-scale 1 scores a checkpoint without any"]
    settings("--model", "ltx2", *held_out[:-1], "2")  # guided: nothing to say
    settings("--model", "ltx2", "--no-train-cfg", *held_out)  # the sound follows the video's scale: no CFG at all
    assert "warning" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        settings("--model", "ltx2", *held_out, "--prompt-store", "store")
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--eval-guidance-scale 1 with --audio-guidance-scale 7 runs CFG on the held-out soundtracks alone" in last
    assert "drop --prompt-store, or give --eval-guidance-scale above 1" in last


def test_flux_kontext_preset_takes_its_pipelines_guidance_and_says_so():
    """Before: common.HUB's 4.5 (Flow-GRPO's SD3.5-M CFG), where FluxKontextPipeline.__call__ defaults to 3.5 and the
    authors' recipe takes 2.5."""
    import diffusers

    default = inspect.signature(diffusers.FluxKontextPipeline.__call__).parameters["guidance_scale"].default
    p, args = settings("--model", "flux-kontext")
    assert args.guidance_scale == default == 3.5
    row = next(line for line in config.report(p, args).splitlines() if line.startswith("--guidance-scale "))
    assert row.split("#", 1)[1].strip() == ("model preset (flux-kontext): FluxKontextPipeline.__call__'s default (the "
                                            "authors' recipe takes 2.5: recipes/flux_kontext_counting_grpo.args)")
    with open(os.path.join(ROOT, "recipes", "flux_kontext_counting_grpo.args")) as f:
        assert "--guidance-scale 2.5" in f.read()


# ----------------------------------------------------------------------------- the round: the prompt store's lock

STORE_RUN = ["--model", "tiny", "--prompts-per-step", "1", "--group-size", "2", "--sample-batch-size", "2",
             "--train-batch-size", "2", "--num-steps", "2", "--resolution", "32", "--log-images-every", "0",
             "--steps", "1", "--prompts", "prompts/tiny.txt"]


@pytest.mark.parametrize("squat", ["store.lock folder", "store.holder folder", "store.lock link"])
def test_a_lock_or_holder_that_is_not_a_file_is_one_line_naming_it(squat, tmp_path):
    """Before: 'cannot be written (IsADirectoryError ...): make this one writable' of a writable folder (or, for a
    link to nothing, 'holds files no prompt store wrote')."""
    store = tmp_path / "store"
    store.mkdir()
    name, kind = squat.split()
    if kind == "folder":
        (store / name).mkdir()
    else:
        (store / name).symlink_to(tmp_path / "nowhere")
    line = one_error_line(run([sys.executable, "train.py", *STORE_RUN, "--prompt-store", str(store), "--out",
                               str(tmp_path / "run")], tmp_path, check=False))
    assert line == (f"error: --prompt-store {store}: its {name} is not a file (a folder, or a link to nothing), and "
                    f"the store locks the folder with it: remove {store / name}, or give another --prompt-store "
                    "folder"), line
    assert sorted(os.listdir(store)) == [name]  # nothing written


def test_a_holder_left_alone_by_a_killed_build_is_a_stores_file(tmp_path):
    """A build killed by kill -9 before it wrote anything but its holder, whose lock file was then removed: the folder
    is the store's, built again (it was refused as 'holds files no prompt store wrote (store.holder)')."""
    import prompt_store

    store = tmp_path / "store"
    store.mkdir()
    (store / prompt_store.HOLDER).write_text('{"job": "gone", "host": "h", "pid": 1, "since": "then"}')
    lock = prompt_store.claim(str(store), "this run")
    try:
        assert lock.held and lock.writable and prompt_store._holder(str(store))["job"] == "this run"
    finally:
        lock.release()
    (store / prompt_store.HOLDER).write_text("{}")
    (store / "texts.json").write_text("[]")  # the user's own file beside it: still refused
    os.remove(store / prompt_store.LOCK)
    with pytest.raises(ValueError, match=r"holds files no prompt store wrote \(texts.json\)"):
        prompt_store.claim(str(store), "this run")


# ----------------------------------------------------------------------------- the round: flag values

def test_a_flag_beyond_float32_is_refused_before_it_makes_every_gradient_nan(tmp_path):
    """Before: --kl-beta 1e300 is inf in the float32 loss; the run stepped 3 times on NaN gradients and stopped
    blaming the learning rate. A plain float flag (--crd-temperature) alike."""
    line = one_error_line(run([sys.executable, "train.py", *STORE_RUN[:-2], "--lora-rank", "4", "--kl-beta", "1e300",
                               "--out", str(tmp_path / "run")], tmp_path, check=False))
    assert "argument --kl-beta: must be a number in [0, inf) that float32 holds (at most 3.4e+38" in line, line
    assert not (tmp_path / "run").exists()
    with pytest.raises(SystemExit):
        settings("--model", "tiny", "--loss", "crd", "--crd-temperature", "1e300")
    settings("--model", "tiny", "--lora-rank", "4", "--kl-beta", "3e38")  # within float32: a value, if a strange one


@pytest.mark.parametrize("argv, needle", [
    # what held: another loss's flag from a recipe, and the KL controller at its bounds
    (["@RECIPE"], "--clip-range is read by --loss grpo / guard / awm / dgpo, not by --loss nft: drop it"),
    (["--kl-beta", "0.04", "--kl-target", "0.03", "--kl-rate", "5"], "use a rate below 5"),
    (["--kl-beta", "0.04", "--kl-target", "-1"], "argument --kl-target: must be a number in [0, inf)"),
    (["--kl-beta", "0.04", "--kl-target", "0", "--kl-rate", "1"], "give --kl-target > 0, or drop --kl-rate"),
    (["--loss", "nft", "--nft-beta", "nan"], "argument --nft-beta: must be a number in (0, inf), got nan"),
])
def test_loss_and_controller_flags_at_their_edges_are_refused_in_one_line(argv, needle, tmp_path, capsys):
    recipe = tmp_path / "cross.args"
    recipe.write_text("--loss nft\n--clip-range 0.2\n")
    with pytest.raises(SystemExit):
        settings("--model", "tiny", "--lora-rank", "4", *[f"@{recipe}" if a == "@RECIPE" else a for a in argv])
    assert needle in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_kl_controller_just_below_its_bound_parses():
    _, args = settings("--model", "tiny", "--lora-rank", "4", "--kl-beta", "0.04", "--kl-target", "0.03",
                       "--kl-rate", "4.99", "--kl-floor", "0")
    assert (args.kl_rate, args.kl_floor) == (4.99, 0.0)


def test_a_byte_order_mark_at_the_start_of_any_recipe_line_is_read(tmp_path):
    """`cat a.args b.args`: the second file's mark starts a line in the middle (before: 'unrecognized arguments:
    \\ufeff--lr 0.0007', the mark invisible in the line)."""
    recipe = tmp_path / "joined.args"
    recipe.write_bytes("\ufeff--model tiny\n\ufeff--lr 0.0007\n".encode("utf-8"))
    _, args = settings(f"@{recipe}")
    assert (args.model, args.lr) == ("tiny", 0.0007) and args.sources["lr"] == f"{recipe}:2"


def test_the_non_finite_stop_at_the_last_step_asks_for_more_steps():
    """Before: 'continue with --resume auto' of a run at its last step, which then trained nothing."""
    import types

    import run as run_module
    args = types.SimpleNamespace(lr=3e-4, kl_target=0, mixed_precision="no", out="runs/x", steps=8)
    assert run_module.nonfinite_stop(args, 3, 8, {}).endswith(
        "continue with --resume auto --out runs/x after the change and a --steps above 8 (the run is at its last)")
    assert run_module.nonfinite_stop(args, 3, 7, {}).endswith("--resume auto --out runs/x after the change")


# ----------------------------------------------------------------------------- the round: --custom-rm-path

CUSTOM = {"badsyn.py": "def score(:\n", "raising.py": "raise RuntimeError('no GPU found')\n",
          "okrm.py": "def score(images, prompts, metadata, args):\n    return [0.0] * len(prompts)\n"}


@pytest.mark.parametrize("path, expected", [
    ("badsyn.score", "--custom-rm-path 'badsyn.score': {here}/badsyn.py line 1 is not valid Python (SyntaxError: "
                     "invalid syntax); fix the file"),
    ("badsyn.py:score", "--custom-rm-path 'badsyn.py:score': {here}/badsyn.py line 1 is not valid Python"),
    ("raising.score", "--custom-rm-path 'raising.score': importing it raised RuntimeError: no GPU found; fix the "
                      "module"),
    ("adir:score", "--custom-rm-path 'adir:score': adir is a folder: give module.name"),
    ("okrm", "--custom-rm-path 'okrm' names no function in a module: give module.name"),
    ("notes.txt:score", "--custom-rm-path 'notes.txt:score': notes.txt is not a Python file (.py): give"),
    ("missing.py:score", "--custom-rm-path 'missing.py:score': missing.py is not found: give"),
])
def test_custom_reward_paths_that_cannot_import_are_one_line(path, expected, tmp_path):
    """Before: a SyntaxError traceback; 'boom' alone for a module raising as it loads; 'NoneType' object has no
    attribute 'loader' for a folder or a file that is not Python; 'not enough values to unpack' for a bare name."""
    for name, text in CUSTOM.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "adir").mkdir()
    (tmp_path / "notes.txt").write_text("hello\n")
    import rewards

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(ValueError) as e:
            rewards.build_reward("custom", custom_rm_path=path, custom_rm_args="")
    finally:
        os.chdir(cwd)
    assert str(e.value).startswith(expected.format(here=tmp_path)) and "\n" not in str(e.value), str(e.value)


def test_train_names_a_custom_reward_with_a_syntax_error_in_one_line(tmp_path):
    (tmp_path / "badsyn.py").write_text(CUSTOM["badsyn.py"])
    path = f"{tmp_path}/badsyn.py:score"
    proc = run([sys.executable, "train.py", *STORE_RUN[:-2], "--reward", "custom", "--custom-rm-path", path,
                "--out", str(tmp_path / "run")], tmp_path, check=False)
    assert one_error_line(proc).startswith(f"error: --custom-rm-path '{path}': {tmp_path}/badsyn.py line 1 is not "
                                           "valid Python (SyntaxError: invalid syntax)")


# ----------------------------------------------------------------------------- the round: ledgers

def test_an_empty_ledger_says_it_holds_nothing(tmp_path):
    """Before: 'its runs are ' / 'its searches are ', and nothing after."""
    empty = tmp_path / "empty.jsonl"
    empty.touch()
    for script, argv, expected in (
            ("long_runs.py", ["--unfold", "judge/x", "--out", str(tmp_path / "u")],
             f"error: {empty} holds no run judge/x: it holds no run's evaluations"),
            ("loopholes.py", ["--report", "x"], "error: the ledger holds no search x: it holds none")):
        proc = run([sys.executable, os.path.join("scripts", script), *argv, "--ledger", str(empty)], tmp_path,
                   check=False)
        assert one_error_line(proc) == expected


# ----------------------------------------------------------------------------- the round: URL credentials

@pytest.mark.parametrize("url", ["http://alice:S3cret Pw@h:9/x", "http://alice:S3cret/Pw@h:9/x",
                                 "http://alice:S3c@ret@h:9/x"])
def test_a_password_holding_a_space_slash_or_at_is_redacted_too(url):
    """Before: `[^/\\s?#]*@` stopped at the space or the slash, and args.json kept 'S3cret Pw' / 'S3cret/Pw'."""
    import services

    assert services.redacted({"rm_url": url, "urls": [url]}) == {"rm_url": "http://***@h:9/x",
                                                                  "urls": ["http://***@h:9/x"]}
    mask = services.mask_secrets(services.url_secrets(url))
    password = url[len("http://alice:"):url.rindex("@")]
    assert password.startswith("S3c") and password not in mask(f"the server said: {password}")


def test_a_resume_with_another_password_writes_neither(tmp_path):
    """What held: the settings compared on resume are the redacted ones (no warning for a rotated password), and
    neither password reaches the run's files."""
    out = tmp_path / "run"
    small = [*STORE_RUN[:-2], "--log-images-every", "0", "--save-every", "1"]
    for steps, secret, resume in (("1", "firstSecret9", []), ("2", "secondSecret9", ["--resume", "auto"])):
        proc = run([sys.executable, "train.py", *small[:small.index("--steps")], *small[small.index("--steps") + 2:],
                    "--steps", steps, "--rm-url", f"http://bob:{secret}@127.0.0.1:9/x", *resume, "--out", str(out)],
                   tmp_path)
        assert "warning: resuming" not in proc.stdout and secret not in proc.stdout + proc.stderr
    for folder, _, names in os.walk(out):
        for name in names:
            with open(os.path.join(folder, name), "rb") as f:
                data = f.read()
            assert b"firstSecret9" not in data and b"secondSecret9" not in data, name


def test_a_prompt_store_in_the_run_folder_itself_is_refused_before_anything_is_made(tmp_path):
    """Before: after the model had loaded, 'holds files no prompt store wrote (.lock)', the run's own lock."""
    out = tmp_path / "run"
    line = one_error_line(run([sys.executable, "train.py", *STORE_RUN, "--prompt-store", f"{out}/", "--out",
                               str(out)], tmp_path, check=False))
    assert line.endswith(f"--prompt-store {out}/ is the run folder (--out), whose files are the run's: give the store "
                         f"a folder of its own, such as {out / 'prompt_store'}"), line
    assert not out.exists()


# ----------------------------------------------------------------------------- the round: eval.py --plot

def test_plot_of_figures_whose_span_no_float_holds_is_one_line(tmp_path, capsys):
    """Before: a matplotlib traceback (`arange: cannot compute length`) for a reward of 1e308 beside -1e308; a folder
    without metrics was already one line."""
    import eval as evaluation

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 1e308}\n{"step": 2, "reward_mean": -1e308}\n')
    with pytest.raises(SystemExit) as e:
        evaluation.main(["--plot", str(run_dir), "--out", str(tmp_path / "out")])
    assert str(e.value) == (f"error: {run_dir}: training reward spans -1e+308 to 1e+308, more than a float holds, and "
                            "cannot be drawn: check the run's metrics.jsonl and eval.jsonl for that figure")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no completed step or evaluation to plot yet"):
        evaluation.main(["--plot", str(tmp_path / "empty"), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out" / "curves.png").exists()
