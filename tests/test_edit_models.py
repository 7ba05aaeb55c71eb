"""The edit models of families/ against their diffusers pipelines, with source images, on the tiny twins.

For FLUX.1 Kontext, Qwen-Image-Edit, Qwen-Image-Edit-Plus (two references) and FLUX.2 [klein] with references:
an Euler ODE through models.velocity, conditioned on the source images, reproduces the pipeline's own __call__
given the same images (float32); the references change the velocity; the SDE step and its log-prob see the target
latent alone, whatever the size of the references; a rollout scored again gives the same log-probs; text-to-image
models refuse source images; and train.py runs every loss on each edit twin with a prompt file of source images.
"""

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

import data
import losses
import models
import sde
import train

PROMPTS = ['a sign that says "hello"', "a red cube on a blue sphere"]
EDIT = [name for name, f in models.MODELS.items() if name.startswith("tiny") and f.source_images]  # the edit twins
REFERENCES = {"tiny-qwen-image-edit-plus": 2, "tiny-flux2-klein": 2}  # references per prompt (else 1)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pipes():
    return {name: models.load_pipeline(name) for name in EDIT}


def sources(name, seed=0, side=64, batch=2):
    """Per prompt, its source images: uint8 [side, side, 3] of random blocks (8 x 8 px), different per prompt."""
    rng = np.random.default_rng(seed)
    def blocks():
        return np.kron(rng.integers(0, 256, (side // 8, side // 8, 3)), np.ones((8, 8, 1))).astype(np.uint8)
    return [[blocks() for _ in range(REFERENCES.get(name, 1))] for _ in range(batch)]


def noise(pipe, seed=0, batch=2):
    return models.initial_noise(pipe, batch, 64, generator=torch.Generator().manual_seed(seed))


def euler(pipe, x, sigmas, embeds, guidance_scale):
    for s, s_next in zip(sigmas[:-1].tolist(), sigmas[1:].tolist()):
        x = x + (s_next - s) * models.velocity(pipe, x, s, embeds, guidance_scale=guidance_scale).float()
    return x


@pytest.fixture
def twin_areas(monkeypatch, pipes):
    """The Qwen-Image-Edit pipelines size their references by fixed areas (1024^2 px for the VAE, 384^2 for Plus's VL
    encoder); the twins use smaller ones (their reference_area, condition_area), and so must the pipelines here."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as edit
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus

    twin = pipes["tiny-qwen-image-edit"]
    original = edit.calculate_dimensions
    monkeypatch.setattr(edit, "calculate_dimensions",
                        lambda area, ratio: original(twin.reference_area if area == 1024 * 1024 else area, ratio))
    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", twin.reference_area)
    monkeypatch.setattr(plus, "CONDITION_IMAGE_SIZE", twin.condition_area)


# ----------------------------------------------------------------------------- against the pipelines

def test_kontext_matches_the_pipeline(pipes):
    pipe = pipes["tiny-flux-kontext"]
    x, src = noise(pipe), sources("tiny-flux-kontext")
    call = dict(prompt=list(PROMPTS), image=[Image.fromarray(s[0]) for s in src], num_inference_steps=4,
                guidance_scale=3.5, height=64, width=64, max_area=64 * 64, _auto_resize=False, latents=x.clone(),
                max_sequence_length=models.default_tokens(pipe))
    expected = pipe(**call, output_type="latent").images
    embeds = models.encode_prompts(pipe, PROMPTS, guidance_scale=3.5, images=src, resolution=64)
    assert embeds["ref_latents"].shape == (2, 64, 64) and embeds["ref_shapes"].tolist() == [[[8, 8]]] * 2
    with torch.no_grad():
        ours = euler(pipe, x, models.sigmas(pipe, 4, 64), embeds, 3.5)
    assert (ours - x).abs().mean() > 0.1
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    images = torch.from_numpy(pipe(**call, output_type="np").images * 255)
    assert (models.decode(pipe, ours).float() - images).abs().max() <= 1
    g = torch.Generator().manual_seed(3)
    theirs = pipe.prepare_latents(None, 2, pipe.transformer.config.in_channels // 4, 64, 64, torch.float32, "cpu", g)
    assert torch.equal(noise(pipe, seed=3), theirs[0])


@pytest.mark.parametrize("name", ["tiny-qwen-image-edit", "tiny-qwen-image-edit-plus"])
def test_qwen_image_edit_matches_the_pipeline(name, pipes, twin_areas):
    """Our batch of two against the pipeline one prompt at a time (Plus takes one prompt per call; the Edit
    pipeline's batched path hands its VL encoder the images before resizing them), with true CFG."""
    pipe, plus = pipes[name], name.endswith("plus")
    x, src = noise(pipe), sources(name)
    expected = []
    for i, prompt in enumerate(PROMPTS):
        images = [Image.fromarray(s) for s in src[i]]
        expected.append(pipe(prompt=prompt, image=images if plus else images[0], negative_prompt="",
                             true_cfg_scale=4.0, num_inference_steps=4, height=64, width=64, latents=x[i:i + 1].clone(),
                             max_sequence_length=models.default_tokens(pipe), output_type="latent").images)
    embeds = models.encode_prompts(pipe, PROMPTS, guidance_scale=4.0, images=src, resolution=64)
    assert embeds["ref_shapes"].tolist() == [[[8, 8]] * len(src[0])] * 2  # 64^2 px references: 8 x 8 tokens each
    with torch.no_grad():
        ours = euler(pipe, x, models.sigmas(pipe, 4, 64), embeds, 4.0)
        text_only = dict(embeds, ref_latents=torch.zeros_like(embeds["ref_latents"]))
        assert (models.velocity(pipe, x, 0.6, embeds) - models.velocity(pipe, x, 0.6, text_only)).abs().max() > 1e-3
    assert (ours - x).abs().mean() > 0.1
    torch.testing.assert_close(ours, torch.cat(expected), atol=1e-4, rtol=1e-4)


def test_the_image_reaches_the_qwen_edit_text(pipes, twin_areas):
    """Qwen-Image-Edit reads the source twice: as reference tokens and inside its VL text encoder."""
    pipe = pipes["tiny-qwen-image-edit"]
    a = models.encode_prompts(pipe, PROMPTS[:1], images=sources("tiny-qwen-image-edit", seed=1)[:1], resolution=64)
    b = models.encode_prompts(pipe, PROMPTS[:1], images=sources("tiny-qwen-image-edit", seed=2)[:1], resolution=64)
    assert a["prompt_embeds"].shape == b["prompt_embeds"].shape
    assert (a["prompt_embeds"] - b["prompt_embeds"]).abs().max() > 1e-4


def test_klein_with_references_matches_the_pipeline(pipes):
    pipe = pipes["tiny-flux2-klein"]
    x = noise(pipe)
    refs = sources("tiny-flux2-klein")[0]  # the pipeline gives every prompt of a call the same references
    side = 16
    call = dict(prompt=list(PROMPTS), image=[Image.fromarray(r) for r in refs], num_inference_steps=4,
                guidance_scale=4.0, height=64, width=64, latents=x.permute(0, 2, 1).reshape(2, 16, 8, 8).clone(),
                max_sequence_length=models.default_tokens(pipe))
    expected = pipe(**call, output_type="latent").images  # unpacked, batch-norm undone, unpatchified
    embeds = models.encode_prompts(pipe, PROMPTS, guidance_scale=4.0, images=[refs, refs], resolution=64)
    assert embeds["ref_shapes"].tolist() == [[[8, 8], [8, 8]]] * 2
    with torch.no_grad():
        ours = euler(pipe, x, models.sigmas(pipe, 4, 64), embeds, 4.0)
        plain = models.encode_prompts(pipe, PROMPTS, guidance_scale=4.0)
        assert (models.velocity(pipe, x, 0.6, embeds, guidance_scale=4.0)
                - models.velocity(pipe, x, 0.6, plain, guidance_scale=4.0)).abs().max() > 1e-3
    vae = pipe.vae
    z = ours.permute(0, 2, 1).reshape(2, 16, side // 2, side // 2)
    z = z * torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps) + vae.bn.running_mean.view(
        1, -1, 1, 1)
    torch.testing.assert_close(pipe._unpatchify_latents(z), expected, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- the references are conditioning only

class TokenWise(torch.nn.Module):
    """A stand-in transformer whose output at each token depends on that token alone (and the timestep): with it,
    the target's velocity cannot depend on the references, so anything the references change is a leak."""

    def forward(self, hidden_states, timestep, **_):
        return (0.5 * hidden_states - timestep.view(-1, 1, 1).to(hidden_states.dtype),)


@pytest.mark.parametrize("name", EDIT)
def test_log_prob_does_not_change_with_the_reference_shape(name, pipes, twin_areas):
    pipe = pipes[name]
    x = noise(pipe, seed=4)
    sigmas = models.sigmas(pipe, 4, 64)
    x_next = noise(pipe, seed=5)  # any transition: its log-prob is scored, not sampled
    area = getattr(pipe, "reference_area", None)
    outs = []
    try:
        for side in (64, 32, 96):  # references of 8 x 8, 4 x 4 and 12 x 12 tokens
            if area:  # Qwen-Image-Edit sizes its references by area
                pipe.reference_area = side * side
            embeds = models.encode_prompts(pipe, PROMPTS, images=sources(name, side=side), resolution=side)
            assert embeds["ref_shapes"][0, 0].tolist() == [side // 8, side // 8]
            v = models.velocity(pipe, x, sigmas[1].item(), embeds, modules={"transformer": TokenWise()})
            assert v.shape == x.shape  # the target's tokens only
            outs.append(sde.sde_step(v, x, sigmas[1].item(), sigmas[2].item(), prev_sample=x_next,
                                     sigma_max=sigmas[1].item()))
    finally:
        if area:
            pipe.reference_area = area
    for out in outs[1:]:
        assert torch.equal(out.log_prob, outs[0].log_prob) and torch.equal(out.mean, outs[0].mean)
    assert outs[0].log_prob.shape == (2,) and outs[0].mean.shape == x.shape


@pytest.mark.parametrize("name", EDIT)
def test_first_update_ratio_is_exactly_one_with_references(name, pipes, twin_areas):
    pipe = pipes[name]
    g = 1.0 if name == "tiny-flux-kontext" else 3.0
    embeds = models.encode_prompts(pipe, PROMPTS, guidance_scale=g, images=sources(name), resolution=64)
    sigmas = models.sigmas(pipe, 4, 64)

    def v(x_, s_):
        return models.velocity(pipe, x_, s_, embeds, guidance_scale=g)

    traj = sde.rollout(v, noise(pipe, seed=5), sigmas, sde_steps=[0, 1, 2], generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        for j, k in enumerate(traj["steps"].tolist()):
            xk = traj["latents"][:, k].contiguous()
            out = sde.sde_step(v(xk, sigmas[k].item()), xk, sigmas[k].item(), sigmas[k + 1].item(),
                               prev_sample=traj["latents"][:, k + 1], sigma_max=sigmas[1].item())
            assert torch.equal(out.log_prob, traj["log_probs"][:, j]), (name, k)


# ----------------------------------------------------------------------------- refusals

def test_text_to_image_models_refuse_source_images():
    pipe = models.load_pipeline("tiny")
    with pytest.raises(ValueError, match="generates from text alone and takes no source images; edit with flux"):
        models.encode_prompts(pipe, PROMPTS, images=sources("tiny"), resolution=64)
    assert "ref_latents" not in models.encode_prompts(pipe, PROMPTS, images=[[], []], resolution=64)  # none: fine


def test_edit_inputs_are_checked(pipes):
    with pytest.raises(ValueError, match="qwen-image-edit edits source images"):
        models.encode_prompts(pipes["tiny-qwen-image-edit"], PROMPTS)
    with pytest.raises(ValueError, match="flux-kontext takes one source image per prompt"):
        models.encode_prompts(pipes["tiny-flux-kontext"], PROMPTS, images=sources("tiny-flux2-klein"), resolution=64)
    with pytest.raises(ValueError, match="the same number of source images"):
        uneven = [sources("tiny-flux2-klein")[0], sources("tiny-flux2-klein")[0][:1]]
        models.encode_prompts(pipes["tiny-flux2-klein"], PROMPTS, images=uneven, resolution=64)


# ----------------------------------------------------------------------------- train.py on the edit twins

def edit_prompt_file(folder, name, rows=4):
    """A JSONL prompt file whose rows name PNG source images (relative paths), as data.load_prompts reads them."""
    lines = []
    for i in range(rows):
        paths = []
        for k, image in enumerate(sources(name, seed=10 + i, batch=1)[0]):
            paths.append(f"src_{i}_{k}.png")
            Image.fromarray(image).save(folder / paths[-1])
        lines.append(json.dumps({"input": f"make the picture {['red', 'blue', 'green', 'white'][i]}",
                                 "image": paths if len(paths) > 1 else paths[0]}))
    path = folder / "edits.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def two_steps(name, loss, folder):
    out = folder / f"run-{name}-{loss}"
    train.main(["--model", name, "--loss", loss, "--prompts", str(edit_prompt_file(folder, name)), "--steps", "2",
                "--num-steps", "4", "--prompts-per-step", "2", "--group-size", "4", "--sample-batch-size", "4",
                "--train-batch-size", "4", "--log-images-every", "0", "--out", str(out)]
               + (["--guidance-scale", "2"] if "qwen" in name else [])  # true CFG: the negative sees the images
               + (["--train-timesteps", "2"] if loss in ("awm", "dgpo") else []))  # strata of a 4-step schedule
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


# Every loss on an edit model, and every edit model under a loss of each process (grpo, nft), in CI; the other pairs
# of the full cross (each about 2 s) are slow.
COVERING = {(EDIT[i % len(EDIT)], loss) for i, loss in enumerate(losses.LOSSES)} | {
    (name, loss) for name in EDIT for loss in ("grpo", "nft")}


@pytest.mark.parametrize("name, loss", [
    (name, loss) if (name, loss) in COVERING else pytest.param(name, loss, marks=pytest.mark.slow)
    for name in EDIT for loss in losses.LOSSES])
def test_every_loss_trains_every_edit_model(name, loss, tmp_path):
    rows = two_steps(name, loss, tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and not any(r.get("skipped") for r in rows)
    assert all(math.isfinite(r["loss"]) for r in rows)
    if losses.LOSSES[loss].process == "reverse":  # the stored rollout is scored again by the same forward: ratio 1
        assert rows[0]["first_ratio_dev"] < 1e-5


def test_source_images_are_refused_before_a_text_to_image_model_loads(tmp_path, capsys):
    path = edit_prompt_file(tmp_path, "tiny")
    with pytest.raises(SystemExit, match=r"^error: .*edits.jsonl: 4 of 4 rows name source images, but --model tiny "
                                         r"generates from text alone; edit with .*flux-kontext"):
        train.main(["--model", "tiny", "--prompts", str(path), "--out", str(tmp_path / "run")])
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"input": "a cat"}) + "\n")
    with pytest.raises(SystemExit, match=r"--model tiny-qwen-image-edit edits source images and 1 of 1 rows have none"):
        train.main(["--model", "tiny-qwen-image-edit", "--prompts", str(plain), "--out", str(tmp_path / "run")])
    assert data.SOURCE_KEY == "source_images"


def test_memory_rows_of_the_edit_models():
    """scripts/family_memory.py's rows: FLUX.1 Kontext [dev] is FLUX.1-dev's 12 B transformer; the reference tokens
    raise the activations over the text-to-image row of the same model."""
    import importlib.util
    import os

    import families

    kontext = families.build_published("flux1-kontext", "transformer")
    assert 11.5e9 < sum(p.numel() for p in kontext.parameters()) < 12.5e9 and kontext.config.guidance_embeds
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "family_memory.py")
    spec = importlib.util.spec_from_file_location("family_memory", path)
    memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(memory)
    edit, plain = memory.estimate("flux2-klein-4b-edit"), memory.estimate("flux2-klein-4b")
    assert edit["weights"] == plain["weights"] and edit["activations"] > 1.3 * plain["activations"]
    assert memory.estimate("qwen-image-edit-2509")["activations"] > memory.estimate("qwen-image-edit")["activations"]

