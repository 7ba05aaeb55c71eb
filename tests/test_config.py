"""config.py: where each setting comes from (--print-config, args.json), in the order its docstring gives."""
import json
import os

import pytest

import config
import models
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_each_value_names_its_source(tmp_path):
    recipe = tmp_path / "r.args"
    recipe.write_text("# a recipe\n--model shapes --lr 1e-4\n\n--group-size 4  # a comment\n--eval-every 0\n")
    _, args = config.parse_args([f"@{recipe}", "--lr", "2e-4", "--seed", "3"])
    s = args.sources
    assert (args.lr, s["lr"]) == (2e-4, "command line")  # flags after a recipe win over it
    assert (args.group_size, s["group_size"]) == (4, f"{recipe}:4")
    assert s["model"] == f"{recipe}:2" and s["seed"] == "command line"
    assert (args.loss, s["loss"]) == ("nft", "model preset (shapes)")
    assert (args.num_steps, s["num_steps"]) == (6, "model and loss preset (shapes, nft)")  # config.LOSS_PRESETS
    assert (args.old_decay, s["old_decay"]) == ("nft", "loss default (nft)")  # losses.LOSSES["nft"].defaults
    assert (args.sampler, s["sampler"]) == ("dpm2", "loss default (nft)")
    assert (args.resolution, s["resolution"]) == (32, "model preset (shapes)")
    assert s["window_size"] == "default" and s["lora_alpha"] == "derived: --lora-rank"
    flagged = {a.dest for a in config.parse_args([])[0]._actions} - {"help"}
    assert set(s) == flagged  # every setting has a source


def test_abbreviations_and_equals_are_attributed():
    _, args = config.parse_args(["--model=tiny", "--updates-per", "2"])
    assert args.sources["model"] == "command line" and args.updates_per_batch == 2
    assert args.sources["updates_per_batch"] == "command line"


def test_hub_model_without_a_preset_says_so():
    _, args = config.parse_args(["--model", "sd3", "--loss", "grpo"])
    assert args.sources["steps"] == "model preset (sd3)" and args.sources["loss"] == "command line"


def test_print_config_reports_and_loads_nothing(monkeypatch, capsys):
    def refuse(*a, **k):
        raise AssertionError("--print-config loaded a model")
    monkeypatch.setattr(models, "load_pipeline", refuse)
    train.main([f"@{os.path.join(ROOT, 'recipes', 'sd3_ocr_grpo.args')}", "--lr", "5e-5", "--print-config"])
    out = capsys.readouterr().out.splitlines()
    row = {line.split()[0]: line for line in out if line.startswith("--")}
    assert out[0].startswith("# ") and row["--lr"].startswith("--lr 5e-05") and row["--lr"].endswith("# command line")
    assert row["--group-size"].split("# ")[1].startswith(os.path.join(ROOT, "recipes", "sd3_ocr_grpo.args") + ":")


def test_args_json_records_the_sources(tmp_path):
    out = tmp_path / "run"
    train.main(["--model", "tiny", "--steps", "1", "--prompts-per-step", "2", "--group-size", "2",
                "--sample-batch-size", "2", "--train-batch-size", "2", "--resolution", "32", "--num-steps", "3",
                "--log-images-every", "0", "--out", str(out)])
    with open(out / "args.json") as f:
        saved = json.load(f)["args"]
    assert saved["sources"]["steps"] == "command line" and saved["sources"]["lr"] == "model preset (tiny)"


def test_fsdp_of_several_experts_reduces_every_micro_step(capsys):
    """--fsdp shards Wan 2.2's two experts (tests/test_wan22_routing.py), reducing after every micro-step; once per
    optimizer step is refused in one line naming the fix, as the last micro-step may not reach every expert."""
    import pytest

    argv = ["--model", "tiny-wan2.2", "--lora-rank", "0", "--fsdp", "--group-size", "2", "--prompts-per-step", "2",
            "--sample-batch-size", "2", "--train-batch-size", "2"]
    p, args = config.parse_args(argv)
    config.check_args(p, args, 2)
    p, args = config.parse_args([*argv, "--fsdp-reduce", "optimizer-step"])
    with pytest.raises(SystemExit):
        config.check_args(p, args, 2)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "transformer and transformer_2" in last and last.endswith("use --fsdp-reduce micro-step"), last


@pytest.mark.parametrize("flag, needle, model", [
    ("--guidance-scale-2", "--guidance-scale-2 is the CFG scale of a second expert", "tiny-wan2.2"),
    ("--audio-guidance-scale", "--audio-guidance-scale guides a soundtrack, and tiny-wan makes none", "tiny-ltx2")])
def test_a_second_guidance_scale_needs_what_it_guides(flag, needle, model, capsys):
    """A second expert's or a soundtrack's CFG scale is refused in one line for a model without it (tiny-wan), and
    taken by the model that has it."""
    p, args = config.parse_args(["--model", "tiny-wan", flag, "3"])
    with pytest.raises(SystemExit):
        config.check_args(p, args, 1)
    assert needle in capsys.readouterr().err
    p, args = config.parse_args(["--model", model, "--guidance-scale", "4", flag, "3"])
    config.check_args(p, args, 1)


def test_a_reward_that_hears_needs_a_model_with_sound(capsys):
    """--reward clap scores the soundtrack: a model that makes none is refused before anything loads, naming the one
    that does; with LTX-2 (its tiny twin) the same spec passes, mixed with a frame reward too."""
    import pytest

    for spec in ("clap", "jpeg_compressibility=1,clap=0.5"):
        p, args = config.parse_args(["--model", "tiny", "--reward", spec])
        with pytest.raises(SystemExit):
            config.check_args(p, args, 1)
        assert "--reward clap scores the samples' sound, which --model tiny does not make" in capsys.readouterr().err
        p, args = config.parse_args(["--model", "tiny-ltx2", "--reward", spec])
        config.check_args(p, args, 1)
