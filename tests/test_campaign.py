"""A hostile campaign against the run folder, the flags, the prompt and source files, the reward combination and the
pretraining scripts: each attack ends in one `error:` line (or a warning and a correct number), never in a deleted
folder of the user's, a traceback or a silently wrong number. Each test fails without the handling it names."""
import importlib.util
import json
import os
import signal
import struct
import sys
import textwrap
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

import advantages
import checkpoints
import data
import eval as evaluation
import rewards
import reward_services
import run as run_module
import train as train_module
from test_faults import start
from test_run_safety import FAST, main, strict_rows
from test_train import ROOT, metrics


@pytest.fixture(autouse=True)
def at_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def exits(*flags, out, code=None, needle=""):
    """train.main must stop with one line (argparse's code 2 or an `error:` message) holding needle."""
    with pytest.raises(SystemExit) as e:
        main(*flags, out=out)
    message = str(e.value.code)
    if code is not None:
        assert e.value.code == code
    else:
        assert message.startswith("error:") and "\n" not in message and "Traceback" not in message, message
    assert needle in message or code is not None, message
    return message


# ----------------------------------------------------------------------------- user data is never deleted
@pytest.mark.parametrize("flags", [[], ["--resume", "auto"], ["--overwrite"]])
def test_a_folder_of_the_users_own_samples_and_checkpoints_is_never_deleted(tmp_path, flags):
    out = tmp_path / "project"
    (out / "samples").mkdir(parents=True)
    (out / "samples" / "mine.png").write_bytes(b"my picture")
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "model.bin").write_bytes(b"my weights")
    message = exits("--steps", "1", *flags, out=out, needle="no args.json of a train.py run")
    assert "pick another --out" in message
    assert (out / "samples" / "mine.png").read_bytes() == b"my picture"
    assert (out / "checkpoints" / "model.bin").read_bytes() == b"my weights"
    assert not (out / "args.json").exists()


def test_a_run_that_never_stepped_is_still_started_over(tmp_path):
    """The proof of ownership is the run's own args.json: a run whose set-up failed is still rerun in place."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "args.json").write_text(json.dumps({"args": {}, "commit": "x", "started": "2026-01-01T00:00:00"}))
    (out / "samples").mkdir()
    main("--steps", "1", out=out)
    assert [r["step"] for r in metrics(out)] == [1]
    assert checkpoints.wrote_args(str(out))


def test_out_root_is_refused(tmp_path):
    exits("--steps", "1", out="/", needle="filesystem root")


def test_overwrite_with_a_logger_that_cannot_start_keeps_the_old_run(tmp_path, monkeypatch):
    out = tmp_path / "run"
    main("--steps", "1", out=out)
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError, as without the package
    exits("--steps", "1", "--overwrite", "--log-to", "wandb", out=out, needle="pip install wandb")
    exits("--steps", "1", "--overwrite", "--wandb", out=out, needle="pip install wandb")
    (out / "tensorboard").write_text("not a folder")
    exits("--steps", "1", "--overwrite", "--log-to", "tensorboard", out=out, needle="tensorboard is a file")
    assert [r["step"] for r in metrics(out)] == [1] and os.listdir(out / "checkpoints") == ["1"]


# ----------------------------------------------------------------------------- silent wrong numbers
EVAL = ["--eval-every", "1", "--eval-steps", "2", "--save-every", "1"]


def test_a_resume_with_other_held_out_prompts_or_eval_steps_drops_the_rise(tmp_path, capsys):
    out = tmp_path / "run"
    held_out, _ = data.load_prompts(os.path.join(ROOT, "prompts", "tiny.txt"))
    other = tmp_path / "other.txt"
    other.write_text("\n".join(f"a picture of number {i}" for i in range(len(held_out))) + "\n")  # the same length
    main("--steps", "1", *EVAL, "--eval-prompts", "prompts/tiny.txt", out=out)
    capsys.readouterr()
    main("--steps", "2", "--resume", "auto", *EVAL, "--eval-prompts", str(other), out=out)
    assert "other held-out prompts or evaluation flags" in capsys.readouterr().out
    main("--steps", "3", "--resume", "auto", "--eval-every", "1", "--eval-steps", "3", "--save-every", "1",
         "--eval-prompts", "prompts/tiny.txt", out=out)
    assert "other held-out prompts or evaluation flags" in capsys.readouterr().out
    rows = strict_rows(out, "eval.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert "rise" in rows[1] and "rise" not in rows[2] and "rise" not in rows[3]  # never against the other set


@pytest.mark.parametrize("content", [[1, 2, 3], {"reward": "text"}, "pickle"])
def test_an_eval_base_replaced_by_another_object_costs_the_rise_not_the_run(tmp_path, capsys, content):
    path = tmp_path / "eval_base.pt"
    if content == "pickle":  # an object torch.load(weights_only=True) refuses to build
        torch.save({"reward": torch.zeros(2), "x": np.random.default_rng(0)}, path)
    else:
        torch.save(content, path)
    assert run_module.Run.eval_base(str(path)) is None
    assert "eval.jsonl goes on without `rise`" in capsys.readouterr().out


SIGNAL_IN_STEP_1 = textwrap.dedent('''
    import os, signal, time
    def score(images, prompts, metadata, marker):
        calls = int(open(marker).read()) if os.path.exists(marker) else 0
        with open(marker, "w") as f:
            f.write(str(calls + 1))
        if calls == 1:  # the first rollout batch of step 1 (call 0 is the evaluation of step 0)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)
        return images.reshape(len(images), -1).float().mean(1) / 255
''')


def test_sigterm_in_step_1_then_resume_writes_one_step_0_evaluation(tmp_path):
    (tmp_path / "signalreward.py").write_text(SIGNAL_IN_STEP_1)
    out, marker = str(tmp_path / "run"), str(tmp_path / "calls")
    flags = [*FAST, "--sample-batch-size", "8", "--out", out, "--reward", "custom", "--custom-rm-path",
             "signalreward.score", "--custom-rm-args", marker, "--eval-every", "1", "--eval-steps", "2",
             "--eval-prompts", "prompts/tiny.txt"]
    proc = start([sys.executable, "train.py", *flags, "--steps", "2"], env={"PYTHONPATH": str(tmp_path)})
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "while waiting for rewards in step 1" in stdout, stderr[-2000:]
    assert os.listdir(os.path.join(out, "checkpoints")) == ["0"]
    sys.path.insert(0, str(tmp_path))
    try:
        train_module.main([*flags, "--steps", "2", "--resume", "auto"])
    finally:
        sys.path.remove(str(tmp_path))
    assert [r["step"] for r in strict_rows(out, "eval.jsonl")] == [0, 1, 2]  # not [0, 0, 1, 2]


def test_a_16_bit_source_image_keeps_its_grey_levels(tmp_path):
    grey = np.full((8, 8), 32768, dtype=np.uint16)  # mid-grey of 16 bits
    Image.fromarray(grey).save(tmp_path / "g16.png")
    (tmp_path / "rows.jsonl").write_text(json.dumps({"input": "edit it", "image": "g16.png"}) + "\n")
    _, metadata = data.load_prompts(tmp_path / "rows.jsonl")
    image = data.source_images(metadata[0])[0]
    assert image.shape == (8, 8, 3) and abs(int(image[0, 0, 0]) - 128) <= 1  # not 255, clipped to white


def test_a_utf16_prompt_file_is_refused_not_trained_on_nul_filled_prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("a cat\na dog\n", encoding="utf-16")
    with pytest.raises(ValueError, match="NUL bytes.*re-save it as UTF-8"):
        data.load_prompts(path)


def test_advantage_weights_are_normalised_by_their_sum_as_mixgrpo_does():
    g = torch.Generator().manual_seed(0)
    parts = {"a": torch.randn(8, generator=g), "b": 5 * torch.randn(8, generator=g)}
    ids = [0] * 4 + [1] * 4
    adv_raw, _ = advantages.combined_advantages(parts, {"a": 2.0, "b": 1.0}, ids, clip=1e9)
    adv_norm, _ = advantages.combined_advantages(parts, {"a": 2 / 3, "b": 1 / 3}, ids, clip=1e9)
    by_hand = (2 * advantages.group_advantages(parts["a"], ids, clip=1e9)
               + advantages.group_advantages(parts["b"], ids, clip=1e9)) / 3
    assert torch.allclose(adv_raw, by_hand, atol=1e-6) and torch.allclose(adv_norm, by_hand, atol=1e-6)
    with pytest.raises(ValueError, match="sum to a positive number"):
        advantages.combined_advantages(parts, {"a": 0.0, "b": 0.0}, ids)


def test_advantage_weights_summing_to_zero_are_refused_before_any_model(tmp_path):
    exits("--steps", "1", "--reward", "jpeg_compressibility=0,jpeg_incompressibility=0", "--reward-combine",
          "advantage", out=tmp_path / "run", code=2)


def test_a_group_spread_beyond_float32_still_gives_advantages():
    huge = torch.tensor([3e38, -3e38, 1e38, 0.0, 1.0, 2.0, 3.0, 4.0])
    ids = [0] * 4 + [1] * 4
    expected = advantages.group_advantages(huge / 1e30, ids)  # the same ranks and ratios, in range
    got = advantages.group_advantages(huge, ids)
    assert torch.isfinite(got).all() and torch.allclose(got[:4], expected[:4], atol=1e-5)
    assert got[:4].abs().min() > 0.1  # not the all-zero advantages of an infinite std


@pytest.mark.parametrize("reply,value", [("Final Score: 4.9e10", None), ("**Final Score:** 4.5", 4.5),
                                         ("Final Score: 3. Done", 3.0), ("Final Score: 2e0", 2.0)])
def test_unifiedreward_reads_the_whole_number(reply, value):
    judge = reward_services.UnifiedRewardJudge(model="UnifiedReward", base_url="http://127.0.0.1:1/v1")
    response = {"choices": [{"message": {"content": "element (object): 1\n" + reply}}]}
    if value is None:
        with pytest.raises(rewards.BadReply, match="outside"):
            judge.parse_response(response)
    else:
        assert judge.parse_response(response) == value


# ----------------------------------------------------------------------------- memory and hangs
def test_device_huge_and_binary_recipes_are_refused_before_they_are_read(tmp_path, capsys):
    huge = tmp_path / "huge.args"
    with open(huge, "wb") as f:
        f.truncate(2 << 20)  # 2 MiB of NUL bytes (sparse)
    for recipe, needle in (("/dev/zero", "not a regular file"), (str(huge), "more than the 1024 KiB")):
        with pytest.raises(SystemExit) as e:
            train_module.parse_args([f"@{recipe}"])
        assert e.value.code == 2 and needle in capsys.readouterr().err


def test_a_prompt_file_over_the_size_cap_is_refused_before_it_is_read(tmp_path, monkeypatch):
    path = tmp_path / "big.txt"
    path.write_text("a cat\n" * 100)
    monkeypatch.setattr(data, "MAX_PROMPT_BYTES", 100)  # the cap (256 MiB) at a testable size
    with pytest.raises(ValueError, match="more than the 0 MiB a prompt file may hold"):
        data.load_prompts(path)


# ----------------------------------------------------------------------------- source images
def png_with_garbled_pixels(path):
    """A PNG whose chunks and checksums are valid but whose pixel stream is too short (verify() passes it)."""
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
    header = struct.pack(">IIBBBBB", 64, 64, 8, 2, 0, 0, 0)
    pixels = zlib.compress(b"\x00" + b"\x7f" * 30)  # one short row of a 64 x 64 RGB image
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b""))


def test_sources_whose_pixels_cannot_be_decoded_fail_when_the_prompts_load(tmp_path, monkeypatch):
    png_with_garbled_pixels(tmp_path / "torn.png")
    Image.fromarray(np.zeros((64, 64, 3), dtype=np.uint8)).save(tmp_path / "big.png")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"input": "edit", "image": "torn.png"}) + "\n")
    with pytest.raises(ValueError, match="line 1: source image 'torn.png' cannot be read"):
        data.load_prompts(rows)
    data._read_image.cache_clear()
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 64 x 64 is then a decompression bomb
    rows.write_text(json.dumps({"input": "edit", "image": "big.png"}) + "\n")
    with pytest.raises(ValueError, match="line 1: source image 'big.png' is too large to decode"):
        data.load_prompts(rows)


def test_two_sources_for_a_one_source_model_are_refused_before_it_loads():
    two = [{data.SOURCE_KEY: ["/a.png", "/b.png"]}]
    with pytest.raises(SystemExit, match="edits one source image per prompt"):
        run_module.check_sources("rows.jsonl", "tiny-flux-kontext", two)
    with pytest.raises(SystemExit, match="rows name 1 or 2 source images"):
        run_module.check_sources("rows.jsonl", "tiny-qwen-image-edit-plus", two + [{data.SOURCE_KEY: ["/a.png"]}])
    run_module.check_sources("rows.jsonl", "tiny-qwen-image-edit-plus", two)  # several, as many on every row


# ----------------------------------------------------------------------------- flags
@pytest.mark.parametrize("flags", [["--lr", "1e300"], ["--lr", "2"], ["--shift", "1e300"]])
def test_overflowing_flag_values_are_refused_in_one_line(tmp_path, flags):
    exits("--steps", "1", *flags, out=tmp_path / "run", code=2)


def test_a_checkpoint_refused_by_a_file_size_limit_is_one_line(tmp_path, monkeypatch):
    import safetensors.torch
    from safetensors import SafetensorError

    import diffusers.models.modeling_utils  # noqa: F401  these bind save_file at import: import them before the
    import transformers.modeling_utils  # noqa: F401  patch, which is for checkpoints' call, made at save time

    def too_large(*a, **k):
        raise SafetensorError("Error while serializing: IoError(Os { code: 27, kind: FileTooLarge })")
    monkeypatch.setattr(safetensors.torch, "save_file", too_large)
    message = exits("--steps", "1", out=tmp_path / "run", needle="could not write checkpoint 1")
    assert "FileTooLarge" in message and "ulimit -f" in message
    assert os.listdir(tmp_path / "run" / "checkpoints") == []  # no partial folder


# ----------------------------------------------------------------------------- eval.py
@pytest.mark.parametrize("flags", [["--max-prompts", "-3"], ["--max-prompts", "0"]])
def test_eval_refuses_a_prompt_count_below_one(flags, capsys):
    with pytest.raises(SystemExit) as e:
        evaluation.main(flags)
    assert e.value.code == 2 and "--max-prompts" in capsys.readouterr().err


def test_eval_refuses_an_out_that_is_a_file_before_sampling(tmp_path, capsys, monkeypatch):
    taken = tmp_path / "taken"
    taken.write_text("mine")
    monkeypatch.setattr(evaluation, "sample_images", lambda *a, **k: pytest.fail("sampled before refusing"))
    for flags in (["--out", str(taken)], ["--out", str(taken / "sub")], ["--plot", str(tmp_path), "--out", str(taken)]):
        with pytest.raises(SystemExit) as e:
            evaluation.main(flags)
        assert e.value.code == 2 and "is a file" in capsys.readouterr().err
    assert taken.read_text() == "mine"


# ----------------------------------------------------------------------------- the pretraining scripts
def pretrain(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize("name", ["pretrain_shapes", "pretrain_shapes_edit"])
@pytest.mark.parametrize("flags,needle", [(["--warmup", "-5"], "--warmup"), (["--lr", "nan"], "--lr"),
                                          (["--lr", "-1e-3"], "--lr"), (["--steps", "0"], "--steps"),
                                          (["--out", "{dir}"], "is a folder")])
def test_pretraining_refuses_bad_flags_and_an_unwritable_out_before_training(tmp_path, capsys, name, flags, needle):
    flags = [f.replace("{dir}", str(tmp_path)) for f in flags]
    with pytest.raises(SystemExit) as e:
        pretrain(name)(["--out", str(tmp_path / "w.safetensors"), *flags])
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_pretraining_without_warmup_trains_and_saves(tmp_path):
    out = tmp_path / "w.safetensors"
    pretrain("pretrain_shapes")(["--steps", "1", "--batch-size", "2", "--warmup", "0", "--threads", "1",
                                 "--out", str(out)])
    assert out.stat().st_size > 0


# ----------------------------------------------------------------------------- HPSv2's preprocessing
OPENAI_MEAN, OPENAI_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def hps_pixels_by_hand(image, side):
    """HPSv2's evaluation transform written independently with PIL and numpy: the longest side to `side` (bicubic),
    pasted centred on a black square, scaled to [0, 1] and normalised with OpenAI CLIP's mean and std."""
    width, height = image.size
    new_w, new_h = round(width * side / max(width, height)), round(height * side / max(width, height))
    canvas = Image.new("RGB", (side, side))
    canvas.paste(image.resize((new_w, new_h), Image.BICUBIC), ((side - new_w) // 2, (side - new_h) // 2))
    x = (np.asarray(canvas, dtype=np.float32) / 255 - OPENAI_MEAN) / OPENAI_STD
    return torch.from_numpy(x.astype(np.float32)).permute(2, 0, 1)  # [3, side, side]


@pytest.mark.parametrize("height,width", [(40, 64), (64, 40), (33, 32)])
def test_hps_pads_the_longest_side_to_a_square_as_hpsv2_does(tmp_path, height, width):
    import open_clip

    import reward_fixtures
    import reward_models

    images = np.random.default_rng(0).integers(0, 256, (2, height, width, 3), dtype=np.uint8)
    by_hand = torch.stack([hps_pixels_by_hand(Image.fromarray(im), 32) for im in images])  # [2, 3, 32, 32]
    ours = torch.stack([reward_models.hps_preprocess(Image.fromarray(im), 32, OPENAI_MEAN, OPENAI_STD)
                        for im in images])
    assert torch.allclose(ours, by_hand, atol=1e-5)
    if max(height, width) == 64:  # scaled by 1/2: 12 pixels of black pad, 6 before the image
        black = torch.tensor([-m / s for m, s in zip(OPENAI_MEAN, OPENAI_STD)], dtype=torch.float32)
        assert torch.allclose(by_hand[:, :, 0, 0], black.expand(2, 3)) and torch.allclose(ours[:, :, 5, 5],
                                                                                         black.expand(2, 3))
    name, path = reward_fixtures.tiny_hps(str(tmp_path / "hps"))
    prompts = ["a red cat", "two dogs"]
    score = rewards.REWARDS["hps"](device="cpu", **{**rewards.option_defaults(), "hps_model_name": name,
                                                   "hps_checkpoint_path": path})
    model = open_clip.create_model(name, pretrained=None).eval()
    model.load_state_dict(torch.load(path)["state_dict"])
    with torch.no_grad():
        image_features = model.encode_image(by_hand, normalize=True)
        text_features = model.encode_text(open_clip.get_tokenizer(name)(prompts), normalize=True)
    expected = (image_features * text_features).sum(-1)
    assert torch.allclose(score(images, prompts, None), expected, atol=1e-5)
