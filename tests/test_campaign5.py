"""The fifth hostile campaign: resumes that would branch or stitch a run's history, weights and folders lost at the end
of the work, reward weights and flag values that train nothing or something else than asked, readers of run files
and replies that take a wrong number, waits without end, tracebacks and errors that blame the wrong thing. Each attack
ends in one `error:` line naming the fix (or a warning and the right number); each test fails without the handling
it names."""
import errno
import hashlib
import json
import os
import shutil
import sys

import pytest

import checkpoints
from test_run_safety import main, strict_rows
from test_train import ROOT, metrics


@pytest.fixture(autouse=True)
def at_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def exits(*flags, out, needle=""):
    """train.main must stop with one `error:` line holding needle; -> the line."""
    with pytest.raises(SystemExit) as e:
        main(*flags, out=out)
    message = str(e.value.code)
    assert message.startswith("error:") and "\n" not in message and "Traceback" not in message, message
    assert needle in message, message
    return message


def steps_of(out):
    return sorted(int(d) for d in os.listdir(os.path.join(out, "checkpoints")) if d.isdigit())


def garble(checkpoint):
    """A checkpoint whose weights no longer match its manifest (a torn or edited file)."""
    with open(os.path.join(checkpoint, "trainable.safetensors"), "r+b") as f:
        f.seek(200)
        f.write(b"\x00" * 16)


# ----------------------------------------------------------------------------- work or data lost
def test_a_resume_from_an_older_checkpoint_is_refused_not_branched(tmp_path):
    """Before: checkpoints 2 and 3 of the new branch were pruned by step number in favour of the abandoned step 3,
    which the next --resume auto continued from, a metrics row missing."""
    out = tmp_path / "run"
    main("--steps", "3", "--save-every", "1", out=out)
    before = metrics(out)
    message = exits("--steps", "3", "--resume", str(out / "checkpoints" / "1"), "--keep-checkpoints", "1", out=out,
                    needle="later checkpoints (2, 3)")
    assert "--resume auto" in message and "--out" in message
    assert steps_of(out) == [1, 2, 3] and metrics(out) == before  # nothing touched


def test_resume_auto_past_corrupt_later_checkpoints_keeps_the_new_ones(tmp_path, capsys):
    """--resume auto falls back past checkpoints that do not verify; --keep-checkpoints 1 then pruned the new
    checkpoint 2 and kept the corrupt 3 (nothing left to resume)."""
    out = tmp_path / "run"
    main("--steps", "3", "--save-every", "1", out=out)
    garble(out / "checkpoints" / "2")
    garble(out / "checkpoints" / "3")
    main("--steps", "2", "--resume", "auto", "--keep-checkpoints", "1", "--save-every", "1", out=out)
    assert "resumed from" in capsys.readouterr().out
    assert checkpoints.newest_verified(str(out)) == str(out / "checkpoints" / "2")
    assert 2 in steps_of(out) and 1 not in steps_of(out)
    assert [r["step"] for r in metrics(out)] == [1, 2]


def test_a_resume_into_another_runs_folder_is_refused_and_a_fork_into_a_new_one_is_whole(tmp_path, capsys):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    main("--steps", "2", "--save-every", "1", out=a)
    main("--steps", "1", "--seed", "5", out=b)
    args_b = (b / "args.json").read_bytes()
    exits("--steps", "3", "--resume", str(a / "checkpoints" / "1"), out=b, needle="holds another run")
    exits("--steps", "3", "--resume", str(a), out=b, needle="holds another run")
    assert (b / "args.json").read_bytes() == args_b and [r["step"] for r in metrics(b)] == [1]
    capsys.readouterr()
    main("--steps", "2", "--resume", str(a / "checkpoints" / "1"), out=c)
    assert "forked" in capsys.readouterr().out
    assert [r["step"] for r in metrics(c)] == [2]  # its own steps; the earlier ones are a's, said in one line
    assert [r["step"] for r in metrics(a)] == [1, 2] and steps_of(a) == [1, 2]  # the source is untouched


def test_a_checkpoint_folder_that_cannot_be_written_is_refused_at_start_up(tmp_path):
    out = tmp_path / "run"
    main("--steps", "1", out=out)
    shutil.rmtree(out / "checkpoints")
    os.symlink("/proc", out / "checkpoints")  # a folder nobody can write in, root included
    exits("--steps", "2", "--resume", "auto", out=out, needle="checkpoints cannot be written")
    (out / "checkpoints").unlink()
    os.symlink(tmp_path / "gone", out / "checkpoints")  # an unmounted drive
    exits("--steps", "2", "--resume", "auto", out=out, needle="checkpoints cannot be written")
    assert [r["step"] for r in metrics(out)] == [1]  # refused before any step, and nothing removed


def test_overwrite_removes_the_old_tensorboard_events_and_a_failing_args_json_keeps_the_old_run(tmp_path,
                                                                                                monkeypatch):
    out = tmp_path / "run"
    main("--steps", "1", "--log-to", "tensorboard", out=out)
    main("--steps", "1", "--log-to", "tensorboard", "--overwrite", out=out)
    assert len(os.listdir(out / "tensorboard")) == 1  # one run's events, not two drawn as one curve
    write = checkpoints._write_json

    def full_disk(path, obj):
        if "args.json" in os.fspath(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(path, obj)
    monkeypatch.setattr(checkpoints, "_write_json", full_disk)
    exits("--steps", "2", "--overwrite", out=out, needle="No space left on device")
    assert [r["step"] for r in metrics(out)] == [1] and steps_of(out) == [1] and checkpoints.wrote_args(str(out))
    assert not (out / "args.json.tmp").exists()


def test_metrics_that_cannot_be_rewritten_at_resume_are_refused_before_any_model(tmp_path, monkeypatch):
    out = tmp_path / "run"
    main("--steps", "1", out=out)
    (out / "metrics.jsonl").unlink()
    os.symlink("/proc/version", out / "metrics.jsonl")  # a file nobody can write, root included
    import train
    monkeypatch.setattr(train, "Policy", lambda *a, **k: pytest.fail("a model loaded before the refusal"))
    exits("--steps", "2", "--resume", "auto", out=out, needle="metrics.jsonl cannot be written")


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_pretraining_refuses_to_overwrite_the_shipped_weights_without_its_flag(tmp_path, monkeypatch, capsys):
    """Before: `python scripts/pretrain_shapes.py --steps 2` wrote a 2-step model over
    weights/shapes.safetensors, which every later `python train.py` trained. Run from a folder holding a copy (its
    default --out), and at the repository's own file (save_ema must not be reached)."""
    from test_campaign import pretrain

    import families
    shipped = os.path.join(ROOT, "weights", "shapes.safetensors")
    (tmp_path / "weights").mkdir()
    shutil.copyfile(shipped, tmp_path / "weights" / "shapes.safetensors")
    monkeypatch.chdir(tmp_path)
    digest = sha256(shipped)
    main_fn = pretrain("pretrain_shapes")
    quick = ["--steps", "1", "--batch-size", "2", "--threads", "1", "--log-every", "1"]
    with pytest.raises(SystemExit) as e:
        main_fn(quick)  # the default --out: weights/shapes.safetensors, here the copy train.py would read
    assert e.value.code == 2 and "--replace-shipped" in capsys.readouterr().err
    assert sha256(tmp_path / "weights" / "shapes.safetensors") == digest
    with monkeypatch.context() as m:
        m.setattr(families.shapes, "save_ema", lambda *a, **k: pytest.fail("wrote over the shipped weights"))
        with pytest.raises(SystemExit) as e:
            main_fn([*quick, "--out", shipped])
    assert e.value.code == 2 and "--replace-shipped" in capsys.readouterr().err
    main_fn([*quick, "--replace-shipped"])  # asked for: written
    assert sha256(tmp_path / "weights" / "shapes.safetensors") != digest and sha256(shipped) == digest


# ----------------------------------------------------------------------------- silent wrong numbers
def refused(*flags, needle, world_size=1):
    """train.py's parser and checks must stop with argparse's one line (code 2) holding needle, before any model."""
    import train
    with pytest.raises(SystemExit) as e:
        p, args = train.parse_args(["--model", "tiny", *flags])
        train.check_args(p, args, world_size)
    assert e.value.code == 2
    return e


def last_error(capsys):
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("train.py: error:") or "error:" in line, line
    return line


@pytest.mark.parametrize("spec", ["jpeg_compressibility=0", "jpeg_compressibility=0,jpeg_incompressibility=0"])
def test_reward_weights_that_are_all_zero_are_refused(spec, capsys):
    """Before: the weighted total was 0 for every sample, every advantage 0; the run trained nothing and exited 0."""
    refused("--reward", spec, needle="")
    assert "weighs every component 0" in last_error(capsys)
    import train
    p, args = train.parse_args(["--model", "tiny", "--reward", spec, "--reward-key",
                                "jpeg_compressibility"])
    train.check_args(p, args, 1)  # one component trained alone, whatever its weight in the total: allowed


@pytest.mark.parametrize("flags,name", [
    (["--loss", "crd", "--crd-temperature", "nan"], "--crd-temperature"),
    (["--lora-rank", "4", "--kl-beta", "0.1", "--gardo-reference", "--gardo-kl-thres", "nan"], "--gardo-kl-thres"),
    (["--reward-timeout", "inf"], "--reward-timeout"),
])
def test_non_finite_values_of_plain_float_flags_are_refused(flags, name, capsys):
    """Before: NaN failed every comparison: --crd-temperature nan took the T = 0 branch, --gardo-kl-thres nan never
    renewed the reference."""
    refused(*flags, needle="")
    line = last_error(capsys)
    assert name in line and "finite" in line


@pytest.mark.parametrize("flags,name", [(["--guidance-scale", "nan"], "--guidance-scale"),
                                        (["--guidance-scale", "-7"], "--guidance-scale"),
                                        (["--max-sequence-length", "0"], "--max-sequence-length"),
                                        (["--batch-size", "0"], "--batch-size"),
                                        (["--shift", "nan"], "--shift"), (["--seed", "-1"], "--seed")])
def test_eval_refuses_the_values_train_refuses_before_any_model(flags, name, capsys, monkeypatch):
    import eval as evaluation
    import models
    monkeypatch.setattr(models, "load_pipeline", lambda *a, **k: pytest.fail("a model loaded before the refusal"))
    with pytest.raises(SystemExit) as e:
        evaluation.main(["--max-prompts", "1", *flags])
    assert e.value.code == 2 and name in capsys.readouterr().err


def league_module():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import league
    return league


def test_the_league_never_chooses_a_nan_accuracy_and_reports_damaged_records_in_one_line(tmp_path, capsys):
    """Before: a NaN final accuracy listed first won the sweep (max's comparisons with NaN are all False); a null
    accuracy or evaluation in a record's curve, or a null machine, was a TypeError traceback."""
    league = league_module()
    assert league.choose_lr({1e-4: float("nan"), 2e-4: 0.30, 4e-4: 0.20}) == 2e-4
    assert league.choose_lr({1e-4: float("nan"), 2e-4: None}) is None
    from test_league import fake_run, league_args
    args = league_args(tmp_path, "--only", "nft", "--lrs", "1e-4", "2e-4", "--sweep-seed", "0", "--seeds", "0")
    for lr, final in ((1e-4, 0.4), (2e-4, 0.3)):
        fake_run(args, ("nft", lr, 0), [1.0] * 4, [0.3, 0.35, final], machine={"cpu": "x"} if lr == 1e-4 else None)
    record = league.read_record(args.out, ("nft", 1e-4, 0))
    points = league.read_curve(os.path.join(args.out, league.run_name("nft", 1e-4, 0)))
    record.update(curve=points[:-1] + [dict(points[-1], accuracy=float("nan"))], machine=None)
    league.write_record(args.out, ("nft", 1e-4, 0), record)
    report = ["--report", "--out", str(tmp_path), "--samples", "128", "--evals", "3", "--only", "nft", "--lrs", "1e-4",
              "2e-4", "--sweep-seed", "0", "--seeds", "0"]
    assert league.main(report)["nft"]["lr"] == 2e-4
    for damaged in (dict(points[-1], accuracy=None), None):
        league.write_record(args.out, ("nft", 1e-4, 0), dict(record, curve=points[:-1] + [damaged]))
        with pytest.raises(SystemExit) as e:
            league.main(report)
        assert str(e.value).startswith("error:") and "nft-lr1e-4-s0.json: evaluation 2" in str(e.value)


@pytest.mark.parametrize("flags,needle", [
    (["--loss", "grpo", "--dpo-beta", "10"], "--dpo-beta"),
    (["--loss", "grpo", "--ref-update-every", "5"], "--ref-update-every"),
    (["--loss", "nft", "--ref-update-every", "5"], "--ref-update-every"),
    (["--lora-rank", "4", "--kl-beta", "0.1", "--gardo-reset-freq", "3"], "--gardo-reset-freq"),
    (["--lora-rank", "4", "--kl-beta", "0.1", "--gardo-kl-thres", "0.5"], "--gardo-kl-thres"),
    (["--kl-rate", "0.5"], "--kl-rate"),
    (["--kl-beta", "0.1", "--lora-rank", "4", "--kl-floor", "0"], "--kl-floor"),
    (["--lr-final", "0.2"], "--lr-final"),
])
def test_flags_that_would_be_silently_ignored_are_refused(flags, needle, capsys):
    """As --sampling-decay and --sde with a forward-process loss already were."""
    refused(*flags, needle="")
    line = last_error(capsys)
    assert needle in line and "drop" in line


def test_flags_that_are_read_still_parse():
    import train
    for flags in (["--loss", "dgpo", "--dpo-beta", "10", "--lora-rank", "4"],
                  ["--loss", "dpo", "--old-decay", "copy", "--ref-update-every", "5", "--lora-rank", "4"],
                  ["--lora-rank", "4", "--kl-beta", "0.1", "--gardo-reference", "--gardo-reset-freq", "3"],
                  ["--kl-beta", "0.1", "--lora-rank", "4", "--kl-target", "0.1", "--kl-rate", "0.5"],
                  ["--kl-beta", "0.1", "--lora-rank", "4", "--kl-target", "0.1", "--kl-floor", "0"],
                  ["--lr-schedule", "cosine", "--lr-final", "0.2"],
                  ["--lora-rank", "4", "--gardo-reference", "--gardo-reset-freq", "3", "--kl-beta", "0"]):
        p, args = train.parse_args(["--model", "tiny", *flags])  # (the last: GARDO turned off by --kl-beta 0)
        train.check_args(p, args, 1)


def test_the_gate_refuses_a_component_the_weighted_total_trains(capsys):
    """Before: --gardo-gate accepted a component weighted into the trained total, against its help."""
    gate = ["--lora-rank", "4", "--kl-beta", "0.1", "--gardo-gate", "jpeg_incompressibility"]
    refused("--reward", "jpeg_compressibility=1,jpeg_incompressibility=0.5", *gate, needle="")
    assert "other than the trained ones (jpeg_compressibility, jpeg_incompressibility)" in last_error(capsys)
    import train
    p, args = train.parse_args(["--model", "tiny", "--reward", "jpeg_compressibility=1,jpeg_incompressibility=0",
                                *gate])
    train.check_args(p, args, 1)  # weighted 0: scored, not trained


# ----------------------------------------------------------------------------- inputs read as other numbers
def test_a_float32_tiff_source_image_keeps_its_grey_levels(tmp_path):
    """Before: PIL's convert("RGB") read a float image's [0, 1] as 0 or 1 of 255: black."""
    import numpy as np
    from PIL import Image

    import data
    grey = np.linspace(0, 1, 64, dtype=np.float32).reshape(8, 8)
    Image.fromarray(grey, mode="F").save(tmp_path / "source.tiff")
    pixels = data._read_image(str(tmp_path / "source.tiff"))
    assert pixels.shape == (8, 8, 3)
    assert np.abs(pixels[..., 0].astype(float) - grey * 255).max() <= 0.5
    assert pixels.mean() == pytest.approx(127.5, abs=1)


@pytest.mark.parametrize("reply,value", [("Final Score: 4,5", 4.5), ("Final Score: **3,25**", 3.25),
                                         ("Final Score: 4, as the caption asks", 4.0)])
def test_unifiedreward_reads_a_decimal_comma(reply, value):
    import reward_services
    judge = reward_services.UnifiedRewardJudge(model="UnifiedReward", base_url="http://127.0.0.1:1/v1")
    assert judge.parse_response({"choices": [{"message": {"content": "element: 1\n" + reply}}]}) == value


@pytest.mark.parametrize("where", ["scoring", "import"])
def test_a_custom_reward_calling_sys_exit_stops_the_run_in_one_line(tmp_path, where):
    """Before: sys.exit(0) in the scorer ended the run with exit 0, no message and no checkpoint."""
    body = "import sys\n" + ("sys.exit(0)\n" if where == "import" else "") + \
        "def score(images, prompts, metadata, args):\n    sys.exit(0)\n"
    (tmp_path / "quitter.py").write_text(body)
    message = exits("--steps", "1", "--reward", "custom", "--custom-rm-path", f"{tmp_path / 'quitter.py'}:score",
                    out=tmp_path / "run", needle="sys.exit(0)")
    assert "remove that call" in message or "return scores" in message


def test_an_eval_base_without_its_fingerprint_costs_the_rise(tmp_path, capsys):
    """Before: a step-0 file from before the fingerprint was paired with any held-out set of the same size."""
    import torch

    import run as run_module
    path = tmp_path / "eval_base.pt"
    torch.save({"reward": torch.zeros(3)}, path)
    assert run_module.Run.eval_base(str(path), "fingerprint of this run's held-out set") is None
    assert "holds no fingerprint" in capsys.readouterr().out
    torch.save({"reward": torch.zeros(3), "fingerprint": "abc"}, path)
    assert run_module.Run.eval_base(str(path), "abc")["reward"].shape == (3,)  # its own: paired


# ----------------------------------------------------------------------------- hangs
def test_a_reward_backoff_beyond_its_bound_is_refused(capsys):
    """Before: --reward-backoff 1e9 waited 31 years before a retry."""
    import rewards
    import services
    refused("--reward-backoff", "1e9", needle="")
    assert "--reward-backoff" in last_error(capsys)
    with pytest.raises(ValueError, match="--reward-backoff 1e\\+09: at most 300"):
        rewards.build_reward("remote", rm_url="http://127.0.0.1:1/score", reward_backoff=1e9)
    assert services.MAX_BACKOFF == 300


# ----------------------------------------------------------------------------- tracebacks
def test_rows_mixing_none_and_one_source_image_are_refused_when_the_prompts_load(tmp_path):
    """Before: FLUX.1 Kontext and FLUX.2 klein batched such rows and failed inside the step, and again on resume."""
    import numpy as np
    from PIL import Image

    import data
    import run as run_module
    mixed = [{data.SOURCE_KEY: ["/a.png"]}, {}]
    for model in ("tiny-flux-kontext", "tiny-flux2-klein"):
        with pytest.raises(SystemExit, match="1 of 2 rows name source images and the others none"):
            run_module.check_sources("rows.jsonl", model, mixed)
        run_module.check_sources("rows.jsonl", model, [{}, {}])  # text to image alone: allowed
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(tmp_path / "a.png")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"input": "a red cat", "image": "a.png"}) + "\n" + json.dumps({"input": "a dog"}) + "\n")
    import train
    with pytest.MonkeyPatch.context() as m:
        m.setattr(train, "Policy", lambda *a, **k: pytest.fail("a model loaded before the refusal"))
        exits("--steps", "1", "--model", "tiny-flux-kontext", "--prompts", str(rows), out=tmp_path / "run",
              needle="and the others none")


def hacking_module():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import hacking
    return hacking


def test_the_hacking_report_reads_null_figures_and_names_a_damaged_file(tmp_path, capsys):
    """Before: a null figure (train.py writes NaN as null) or a damaged <run>.json / .eval0.json was a traceback."""
    hacking = hacking_module()
    args = hacking.parse_args(["--report", "--out", str(tmp_path), "--brakes", "none", "--seeds", "0", "--steps", "2",
                               "--eval-every", "1"])
    folder = tmp_path / hacking.run_name("none", 0)
    folder.mkdir()
    rows = [{"step": 0, "reward": 0.1, "geneval_overall": 0.2, "diversity_color": 0.5},
            {"step": 1, "reward": 0.3, "geneval_overall": None, "diversity_color": 0.5},
            {"step": 2, "reward": None, "geneval_overall": 0.25, "diversity_color": None}]
    (folder / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    hacking.write_json(str(tmp_path / "none-s0.json"), dict(flags=hacking.train_flags("none", 0, args)))
    row = hacking.main(["--report", "--out", str(tmp_path), "--brakes", "none", "--seeds", "0", "--steps", "2",
                        "--eval-every", "1"])[("none", 0)]
    assert row["exact_peak"] == 0.25 and row["exact_peak_step"] == 2 and np_isnan(row["proxy_end"])
    assert "| none-s0 | 0.100 -> nan |" in (tmp_path / "hacking.md").read_text()
    for name, text in (("none-s0.json", '{"flags": ["--seed"'), ("none-s0.json", "[1, 2]")):
        (tmp_path / name).write_text(text)
        with pytest.raises(SystemExit) as e:
            hacking.main(["--report", "--out", str(tmp_path), "--brakes", "none", "--seeds", "0", "--steps", "2",
                          "--eval-every", "1"])
        assert str(e.value).startswith("error:") and name in str(e.value) and "\n" not in str(e.value)


def np_isnan(x):
    return x != x


def test_ctrl_c_while_the_models_load_is_one_line(tmp_path):
    """Before: a KeyboardInterrupt traceback from inside whatever library was loading."""
    import signal
    import time

    from test_faults import start, wait_for
    marker = tmp_path / "loading"
    (tmp_path / "slow.py").write_text(f"import pathlib, time\npathlib.Path({str(marker)!r}).touch()\ntime.sleep(60)\n"
                                      "def score(images, prompts, metadata, args):\n    return [0.0] * len(images)\n")
    proc = start([sys.executable, "train.py", "--model", "tiny", "--steps", "1", "--out", str(tmp_path / "run"),
                  "--reward", "custom", "--custom-rm-path", f"{tmp_path / 'slow.py'}:score"])
    wait_for(marker.exists, proc)  # the reward's module is importing: the models load after it
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines()[-1].startswith("error: interrupted (Ctrl-C) during start-up")


# ----------------------------------------------------------------------------- errors that blamed the wrong thing
def test_a_huge_reward_weight_is_refused_and_an_overflowing_total_is_named(tmp_path, capsys):
    """Before: --reward x=1e300 made the weighted total inf, reported as 'NaN for some samples (an rm_type override
    without it?)'."""
    refused("--reward", "jpeg_compressibility=1e300", needle="")
    assert "within +-1e+06" in last_error(capsys)
    (tmp_path / "huge.py").write_text("def score(images, prompts, metadata, args):\n"
                                      "    return [3e38 * (1 + i / 100) for i in range(len(images))]\n")
    message = exits("--steps", "2", "--max-bad-steps", "1", "--reward", "custom=2", "--custom-rm-path",
                    f"{tmp_path / 'huge.py'}:score", out=tmp_path / "run", needle="overflows float32")
    assert "rm_type" not in message


def test_a_timestep_fraction_that_leaves_no_index_names_the_smallest_that_works(capsys):
    """Before: --loss dgpo --timestep-fraction 1e-9 advised 'use 1 to 0 of them' (strata)."""
    refused("--loss", "dgpo", "--lora-rank", "4", "--timestep-fraction", "1e-9", needle="")
    line = last_error(capsys)
    assert "no schedule index" in line and "--timestep-fraction 0.1 or more" in line and "1 to 0" not in line


def test_offloading_the_text_encoders_without_a_prompt_cache_is_refused_before_any_model(capsys):
    refused("--offload-text-encoders", "--prompt-cache-gb", "0", needle="")
    assert "--prompt-cache-gb > 0" in last_error(capsys)


def test_a_fifo_prompt_file_is_named_as_one_not_as_missing(tmp_path):
    import data
    fifo = tmp_path / "prompts.txt"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        data.load_prompts(fifo)  # opened, it would wait for a writer


# ----------------------------------------------------------------------------- docs/departures.md item 15, measured
def test_the_online_sft_dpo_sigmas_differ_from_flow_grpos_grid_as_departure_15_says():
    """Departure 15 said the interpolated sigmas equal flow_grpo's 1000-step grid at the schedule's own points; they do
    not (diffusers' 40-step schedule is shift(linspace(1, 0.003, 40))). The figures the departure now gives."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler

    import sde
    import train
    grid = FlowMatchEulerDiscreteScheduler(shift=3.0).sigmas  # [1000], sigma 1 down
    ours = train.schedule_at(sde.sd3_sigmas(40, 3.0), (torch.arange(1000) / 1000 * 40).unsqueeze(0))[0]
    assert [round(ours[i].item(), 3) for i in (750, 900, 975)] == [0.477, 0.206, 0.009]
    assert [round(grid[i].item(), 3) for i in (750, 900, 975)] == [0.5, 0.25, 0.071]
    assert (ours <= grid + 1e-6).all() and round((grid - ours).mean().item(), 3) == 0.015
    u = torch.sigmoid(torch.randn(1_000_000, generator=torch.Generator().manual_seed(0)))  # the logit-normal draws
    assert round((grid - ours)[torch.floor(u * 1000).clamp(max=999).long()].mean().item(), 3) == 0.012
    text = open(os.path.join(ROOT, "docs", "departures.md")).read()
    assert "0.477 here" in text and "by 0.012 on average" in text and "the same sigmas at the" not in text


def test_the_feature_model_fails_fast_where_the_hub_does_not_answer(tmp_path):
    """Before: without HF_HUB_OFFLINE, --diversity dinov2 offline failed after huggingface_hub's five retries, 48 s."""
    import subprocess
    import time

    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env["HF_HUB_CACHE"] = str(tmp_path / "cache")  # nothing cached: the hub is the only source
    code = ("import diversity\ntry:\n    diversity.featurizer('dinov2', 'flowrl-tests/no-such-model')\n"
            "except ValueError as e:\n    print(e)\n")
    started = time.time()
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert "--diversity-path" in proc.stdout, proc.stdout + proc.stderr
    assert time.time() - started < 25  # imports included; the retries alone took 48 s
