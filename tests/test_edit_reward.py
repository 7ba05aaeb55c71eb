"""The edit recipes as the authors ran them: the source-similarity reward (image_similarity), Qwen-Image-Edit's VL input
switch, and the numbers the departures quote for Kontext's last step."""
import math
import os

import numpy as np
import pytest
import torch
from PIL import Image

import data
import families
import models
import reward_fixtures
import rewards
import sde
import train

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    return reward_fixtures.tiny_pickscore(str(tmp_path_factory.mktemp("clip")))


def random_images(n, size, seed):
    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


def save_sources(folder, arrays):
    paths = []
    for k, a in enumerate(arrays):
        paths.append(os.path.join(folder, f"source{k}.png"))
        Image.fromarray(a).save(paths[-1])
    return paths


def test_image_similarity_formula(tiny_clip, tmp_path):
    """cos of the CLIP image embeddings of sample and source (the source resized to the sample's size), computed here
    through the vision tower and projection by hand; the mean over several sources; 1 for the source itself."""
    from transformers import AutoProcessor, CLIPModel

    model, processor = CLIPModel.from_pretrained(tiny_clip).eval(), AutoProcessor.from_pretrained(tiny_clip)
    samples = random_images(3, 40, seed=0)
    srcs = list(random_images(2, 40, seed=1)) + [random_images(1, 56, seed=2)[0]]  # the third at another size
    paths = save_sources(str(tmp_path), srcs)
    metadata = [{data.SOURCE_KEY: [paths[0]]}, {data.SOURCE_KEY: [paths[1], paths[2]]}, {data.SOURCE_KEY: [paths[1]]}]

    def embed(array):
        with torch.no_grad():
            pix = processor(images=[Image.fromarray(array)], return_tensors="pt")["pixel_values"]
            v = model.visual_projection(model.vision_model(pixel_values=pix).pooler_output)[0]
        return v / v.norm()

    resized = np.asarray(Image.fromarray(srcs[2]).resize((40, 40)))
    expected = [float(embed(samples[0]) @ embed(srcs[0])),
                (float(embed(samples[1]) @ embed(srcs[1])) + float(embed(samples[1]) @ embed(resized))) / 2,
                float(embed(samples[2]) @ embed(srcs[1]))]
    for batch_size in (8, 1):
        score = rewards.REWARDS["image_similarity"](device="cpu", **{
            **rewards.option_defaults(), "image_similarity_model_path": tiny_clip,
            "image_similarity_batch_size": batch_size})
        got = score(samples, ["p"] * 3, metadata)
        assert got.dtype == torch.float32 and got.shape == (3,)
        assert got.tolist() == pytest.approx(expected, abs=1e-5)
    assert len({round(e, 4) for e in expected}) == 3  # the scores tell the pairs apart
    same = score(np.stack([srcs[0]]), ["p"], [{data.SOURCE_KEY: [paths[0]]}])
    assert same.item() == pytest.approx(1.0, abs=1e-5)


def test_image_similarity_mixture_and_errors(tiny_clip, tmp_path):
    """In a mixture at the Kontext recipe's weights: reward = 0.5 geneval + 0.5 image_similarity; a sample without a
    source and an offline model path are refused in one line naming the fix."""
    paths = save_sources(str(tmp_path), random_images(1, 32, seed=3))
    fn = rewards.build_reward("jpeg_compressibility=0.5,image_similarity=0.5", image_similarity_model_path=tiny_clip)
    images = random_images(2, 32, seed=4)
    out = fn(images, ["a", "b"], [{data.SOURCE_KEY: paths}] * 2)
    assert out["reward"].tolist() == pytest.approx(
        (0.5 * out["jpeg_compressibility"] + 0.5 * out["image_similarity"]).tolist(), abs=1e-6)
    with pytest.raises(ValueError, match="has none: give its prompt row an 'image'"):
        fn(images, ["a", "b"], [{data.SOURCE_KEY: paths}, {}])
    with pytest.raises(RuntimeError, match="--image-similarity-model-path"):
        rewards.build_reward("image_similarity", image_similarity_model_path=str(tmp_path / "absent"))


EDIT_RECIPES = {"flux_kontext_counting_grpo.args": "geneval=0.5,image_similarity=0.5",
                "qwen_image_edit_counting_grpo.args": "geneval=0.8,image_similarity=0.2",
                "qwen_image_edit_counting_fast.args": "geneval=0.8,image_similarity=0.2"}


@pytest.mark.parametrize("recipe", sorted(EDIT_RECIPES))
def test_edit_recipes_train_on_the_authors_reward(recipe):
    """flow_grpo config/grpo.py L686 / L818 / L860: GenEval plus the source similarity, GenEval on JPEG-compressed
    samples (flow_grpo/rewards.py L241-245, geneval_score's client)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "recipes", recipe)) as f:
        words = [w for line in f if not line.startswith("#") for w in __import__("shlex").split(line)]
    assert words[words.index("--reward") + 1] == EDIT_RECIPES[recipe]
    assert "--geneval-jpeg" in words


def test_kontext_last_step_numbers_of_the_departure():
    """Departure 3 quotes the Kontext recipe's last step: FLUX.1 Kontext's scheduler (dynamic shift, exponential, mu
    from 1024 image tokens at 512 px), 6 steps -> last sigma 0.273; Flow-GRPO's SDE std there at noise level 0.9
    is about 0.29 (the authors' rollout adds it; this project's last step is an ODE step)."""
    config = dict(use_dynamic_shifting=True, base_image_seq_len=256, max_image_seq_len=4096, base_shift=0.5,
                  max_shift=1.15, time_shift_type="exponential")  # black-forest-labs/FLUX.1-Kontext-dev scheduler
    mu = families.common.dynamic_shift_mu(config, (512 // 16) ** 2)
    sigmas = families.common.flow_match_sigmas(config, np.linspace(1.0, 1 / 6, 6), mu=mu)
    last = float(sigmas[-2])
    assert last == pytest.approx(0.2730, abs=5e-4)
    x = torch.zeros(1, 4)
    std = float(sde.sde_step(x, x, last, 0.0, kind="flow", eta=0.9).std)  # the SDE step 0.273 -> 0 the authors take
    assert std == pytest.approx(0.9 * math.sqrt(last / (1 - last)) * math.sqrt(last), rel=1e-4)
    assert std == pytest.approx(0.288, abs=1e-3)
    assert sde.sde_steps(6, timestep_fraction=0.99) == [0, 1, 2, 3, 4]  # the last step is not trained
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "departures.md")) as f:
        departures = f.read()
    assert "0.273" in departures and "0.29" in departures


def vl_pixels(pipe, prompts, images):
    """The pixel values Qwen-Image-Edit's VL encoder receives, per call, and the encode_prompts output."""
    seen = []
    hook = pipe.text_encoder.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["pixel_values"].detach().clone()), with_kwargs=True)
    try:
        out = models.encode_prompts(pipe, prompts, images=images, resolution=64)
    finally:
        hook.remove()
    return seen, out


def test_edit_vl_input_authors_shows_the_vl_encoder_the_rescaled_tensor():
    """--edit-vl-input authors: the VL encoder receives what Qwen2VLImageProcessor makes of the VAE's input tensor in
    [-1, 1] (rescaled by 1/255, normalised by CLIP's mean / std): every value within 1 / (255 std) of -mean / std.
    diffusers (the default) shows the image itself. The VAE reference is the same in both."""
    pipe = models.load_pipeline("tiny-qwen-image-edit")
    rng = np.random.default_rng(0)
    images = [[np.kron(rng.integers(0, 256, (8, 8, 3)), np.ones((8, 8, 1))).astype(np.uint8)]]
    default, a = vl_pixels(pipe, ["make it two"], images)
    pipe.edit_vl_input = "authors"
    authors, b = vl_pixels(pipe, ["make it two"], images)
    processor = pipe.processor.image_processor
    mean, std = np.array(processor.image_mean), np.array(processor.image_std)
    channels = authors[0].view(authors[0].shape[0], 3, -1)  # Qwen2-VL patches: [n, 3 x (2 x 14 x 14)]
    expected = torch.tensor(-mean / std, dtype=torch.float32).view(1, 3, 1)
    assert (channels - expected).abs().max() <= (1 / (255 * std)).max() + 1e-5
    assert float((default[0] - authors[0]).abs().max()) > 1.0  # the image itself spans the normalised range
    ref = pipe.image_processor.preprocess(pipe.image_processor.resize(Image.fromarray(images[0][0]), 64, 64), 64, 64)
    again = processor(images=[ref[0]], return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(authors[0], again.to(authors[0].dtype))  # exactly the processor on that tensor
    torch.testing.assert_close(a["ref_latents"], b["ref_latents"])
    assert (a["prompt_embeds"] - b["prompt_embeds"]).abs().max() > 1e-4


def test_edit_vl_input_is_refused_for_other_models(capsys):
    with pytest.raises(SystemExit):
        train.main(["--model", "tiny", "--edit-vl-input", "authors", "--steps", "1", "--out", "unused"])
    assert "error: --edit-vl-input authors" in capsys.readouterr().err


def test_image_similarity_rows_without_a_source_are_refused_at_load(tmp_path):
    """Checked when the prompt file loads, before any model: a row the reward could not score fails with its line."""
    check = rewards.rows_check("jpeg_compressibility=0.5,image_similarity=0.5", None)
    with pytest.raises(ValueError, match="has none: give it an 'image'"):
        check({})
    check({data.SOURCE_KEY: ["/abs/source.png"]})  # a row with its source passes
    rewards.rows_check("jpeg_compressibility", None)({})  # without the reward, no source is needed
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "make it two"}\n')
    with pytest.raises(ValueError, match="line 1 .*has none: give it an 'image'"):
        data.load_prompts(str(path), input_key="prompt", check=check)
