"""Issue 78, items 1, 8 and 9 on the video families: frame counts no model makes refused at start-up in one line
(train.py and eval.py), a schedule that is not finite refused where it is built, the guidance the hub presets take
(each pipeline's __call__ default) and where --print-config says it came from, and LTX-2's soundtrack scale beside
the training forward's CFG. The guidance itself against the pipelines: tests/test_ltx2.py and
tests/test_wan22_routing.py."""
import inspect
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import config
import families
from families import common, hunyuan_video, ltx2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread


def run(script, *flags, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *flags], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


# ----------------------------------------------------------------------------- frame counts (item 1)

@pytest.mark.parametrize("script, model, frames, expected", [
    # 4097 frames: 1025 latent frames, past tiny-wan's RoPE table of 32 positions a side (an invalid view before)
    ("train.py", "tiny-wan", 4097, "--num-frames 4097: 16,400 tokens a sample, above the 512 .* the most this size "
                                   "allows is 125"),
    # 100001 frames: 3.2 M tokens, whose shift overflowed the schedule (NaN sigmas) before
    ("train.py", "tiny-ltx2", 100001, "--num-frames 100001: 3,200,064 tokens a sample, above the [0-9,]+ that LTX-2"),
    ("eval.py", "tiny-hunyuan-video-1.5", 100001, "--num-frames 100001: 400,016 tokens a sample, above the [0-9,]+ "
                                                  "that HunyuanVideo 1.5"),
])
def test_frame_counts_no_model_makes_are_refused_in_one_line(script, model, frames, expected, tmp_path):
    """The real command lines: one `error:` line naming the counts that work, exit 2 (train.py) or 1 (eval.py), no
    traceback, before any rollout (nothing sampled, no run folder with a sample)."""
    flags = ["--model", model, "--num-frames", str(frames), "--out", str(tmp_path / "out")]
    flags += ["--steps", "1"] if script == "train.py" else ["--max-prompts", "1"]
    out = run(script, *flags, tmp_path=tmp_path)
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert last.startswith("error: --num-frames") and re.search(expected, last), last
    assert not (tmp_path / "out" / "samples").exists() and not (tmp_path / "out" / "summary.json").exists()


@pytest.mark.parametrize("argv, message", [
    (["--model", "ltx2", "--num-frames", "100"], "--num-frames 100 must be 8 k \\+ 1 for ltx2 .*nearest are 97 and 105"),
    (["--model", "wan2.2", "--num-frames", "80"], "--num-frames 80 must be 4 k \\+ 1 for wan2.2 .*nearest are 77 and 81"),
    (["--model", "sd3", "--num-frames", "5"], "--num-frames 5: sd3 makes images; drop the flag"),
])
def test_frame_rule_is_refused_before_a_hub_model_loads(argv, message, capsys):
    """check_args refuses the rule from the record (nothing is loaded or downloaded: the hub models are not here)."""
    with pytest.raises(SystemExit):
        settings(*argv)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(message, last), last


def test_records_know_their_vaes_temporal_compression():
    """The record's temporal (the rule checked before loading) is the loaded twin's VAE's, and the published VAE's."""
    import diffusers
    import models

    for name in ("tiny-wan", "tiny-wan2.2-5b", "tiny-hunyuan-video-1.5", "tiny-ltx2"):
        pipe = models.load_pipeline(name)
        factor = getattr(pipe, "vae_scale_factor_temporal", None) or pipe.vae_temporal_compression_ratio
        assert families.MODELS[name].temporal == factor, name
    published = {"wan": inspect.signature(diffusers.AutoencoderKLWan.__init__).parameters["scale_factor_temporal"]
                 .default, "hunyuan-video-1.5": inspect.signature(diffusers.AutoencoderKLHunyuanVideo15.__init__)
                 .parameters["temporal_compression_ratio"].default,
                 "ltx2": ltx2._VAE["temporal_compression_ratio"]}
    for name, factor in published.items():
        assert families.MODELS[name].temporal == factor == (8 if name == "ltx2" else 4)


def test_video_frames_names_the_nearest_counts():
    assert common.video_frames("Wan", None, 81, 4, 16, 10**6) == 21  # the pipeline's default
    assert common.video_frames("Wan", 1, 81, 4, 16, 10**6) == 1  # one frame: an image
    with pytest.raises(ValueError, match="--num-frames 100 must be 8 k \\+ 1 for LTX-2 .*nearest are 97 and 105"):
        common.video_frames("LTX-2", 100, 121, 8, 16, 10**6)
    assert common.video_frames("LTX-2", 97, 121, 8, 16, 13 * 16) == 13  # 13 latent frames: exactly the bound
    with pytest.raises(ValueError, match="208 that LTX-2.* the most this size allows is 97$"):
        common.video_frames("LTX-2", 105, 121, 8, 16, 13 * 16)
    with pytest.raises(ValueError, match="no count fits this size: lower --resolution"):
        common.video_frames("LTX-2", 1, 121, 8, 16, 15)


def test_sample_tokens_follows_the_memory_formula(monkeypatch):
    """The bound solves a L^2 + b L <= memory: on the CPU with the attention's float32 scores (a = 4 heads), on a GPU
    the formula's linear term alone (b = (2 blocks + 16 + 4 r) h, scripts/family_memory.py)."""
    import torch

    class Transformer:
        config = dict(num_attention_heads=2, attention_head_dim=8, num_layers=3, ffn_dim=64)  # h 16, r 4

    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 2**18}[name])  # 1 GiB
    b, a = (2 * 3 + 16 + 4 * 4) * 16, 4 * 2
    most = common.sample_tokens(Transformer, "cpu")
    assert a * most**2 + b * most <= 2**30 < a * (most + 1)**2 + b * (most + 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("P", (), {"total_memory": 2**30}))
    assert common.sample_tokens(Transformer, "cuda") == 2**30 // b


@pytest.mark.parametrize("mu", [100.0, 1000.0])
def test_a_schedule_that_is_not_finite_is_refused_where_it_is_built(mu):
    """LTX-2's shift mu grows with the video's tokens: exp(mu) past float32 (mu > 88) made NaN sigmas, past float64
    (mu > 709) an OverflowError; both are one ValueError naming the flags, and a finite mu is unchanged."""
    base = np.linspace(1.0, 1 / 4, 4)
    with pytest.raises(ValueError, match="schedule is not finite .*mu = .*lower --num-frames or --resolution"):
        common.flow_match_sigmas(ltx2.SCHEDULER, base, mu=mu)
    sigmas = common.flow_match_sigmas(ltx2.SCHEDULER, base, mu=2.0)
    assert sigmas[0] == 1 and sigmas[-2] == pytest.approx(0.1) and sigmas[-1] == 0


# ----------------------------------------------------------------------------- the hub presets' guidance (item 9)

def defaults(cls):
    return {k: p.default for k, p in inspect.signature(cls.__call__).parameters.items()}


def test_video_presets_take_their_pipelines_call_defaults():
    import diffusers

    wan = defaults(diffusers.WanPipeline)
    for name in ("wan", "wan2.2", "wan2.2-5b"):
        assert families.MODELS[name].preset["guidance_scale"] == wan["guidance_scale"] == 5.0
    ltx = defaults(diffusers.LTX2Pipeline)
    preset = families.MODELS["ltx2"].preset
    assert (preset["guidance_scale"], preset["audio_guidance_scale"]) == (ltx["guidance_scale"],
                                                                           ltx["audio_guidance_scale"]) == (3.0, 7.0)
    # HunyuanVideo15Pipeline takes no scale: its published guider's (ClassifierFreeGuidance(guidance_scale=6.0))
    assert "guidance_scale" not in defaults(diffusers.HunyuanVideo15Pipeline)
    assert families.MODELS["hunyuan-video-1.5"].preset["guidance_scale"] == hunyuan_video.GUIDANCE_SCALE == 6.0


def settings(*argv):
    p, args = config.parse_args(list(argv))
    config.check_args(p, args, 1)
    return args, config.report(p, args)


@pytest.mark.parametrize("model, line", [
    ("wan2.2", "--guidance-scale 5.0  # model preset (wan2.2): WanPipeline.__call__'s default"),
    ("hunyuan-video-1.5", "--guidance-scale 6.0  # model preset (hunyuan-video-1.5): the published guider's scale"),
    ("ltx2", "--audio-guidance-scale 7.0  # model preset (ltx2): LTX2Pipeline.__call__'s default"),
    ("sd3", "--guidance-scale 4.5  # model preset (sd3): Flow-GRPO's SD3.5-M setting (families/common.py HUB)"),
])
def test_print_config_says_where_a_presets_guidance_came_from(model, line):
    _, report = settings("--model", model)
    assert any(" ".join(row.split()).startswith(" ".join(line.split())) for row in report.splitlines()), report


def test_ltx2_soundtrack_scale_goes_with_its_preset_or_follows_the_video():
    """The preset's pair (3, 7) holds where every forward runs CFG; a loss's "no CFG" (nft's 1) or a training forward
    without CFG leaves the soundtrack at the video's scale, as before; one given on the command line stays."""
    args, _ = settings("--model", "ltx2")
    assert (args.guidance_scale, args.audio_guidance_scale, args.train_cfg) == (3.0, 7.0, True)
    for argv in (["--loss", "nft"], ["--no-train-cfg"]):
        args, _ = settings("--model", "ltx2", *argv)
        assert args.audio_guidance_scale is None and args.sources["audio_guidance_scale"].startswith("derived")
    args, _ = settings("--model", "ltx2", "--guidance-scale", "1", "--audio-guidance-scale", "7")
    assert (args.guidance_scale, args.audio_guidance_scale, args.train_cfg) == (1.0, 7.0, False)


@pytest.mark.parametrize("argv, message", [
    (["--no-train-cfg", "--audio-guidance-scale", "7"], "--audio-guidance-scale 7 keeps CFG on ltx2's soundtrack .* "
                                                        "drop --no-train-cfg, or give --audio-guidance-scale 1"),
    (["--guidance-scale", "1", "--audio-guidance-scale", "7", "--prompt-store", "store"],
     "runs CFG on the soundtrack alone, whose negative prompt the prompt store serves only at --guidance-scale > 1"),
])
def test_ltx2_soundtrack_cfg_that_cannot_run_as_asked_is_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        settings("--model", "ltx2", *argv)
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # argparse's usage, then the one line
    assert stop.value.code == 2 and "Traceback" not in err and ": error: " in last
    assert re.search(message, last), last
