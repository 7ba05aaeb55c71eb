"""LTX-2 (families/ltx2.py) against LTX2Pipeline.__call__ on the tiny twin, its packed video-and-audio latent under
sde.py's log-prob, the `clap` reward on the soundtrack, and the soundtrack saved beside the sample GIFs (no download).

The registry tests of tests/test_families.py (schedule, first-update ratio, LoRA round trip, train.py two steps) run
tiny-ltx2 too; here the schedule is checked at several frame counts, and train.py runs with LoRA and in full, the
first with `clap` in its reward mix.
"""

import json
import math
import os
import shutil
import wave

import numpy as np
import pytest
import torch

import eval as evaluation
import models
import rewards
import sde
import train
import reward_fixtures
from families import ltx2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ['a sign that says "hello"', "a dog barking at a red cube"]
NAME = "tiny-ltx2"

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread


@pytest.fixture(scope="module")
def pipe():
    return models.load_pipeline(NAME)


def noise(pipe, seed=0, batch=2, resolution=64, frames=5):
    return models.initial_noise(pipe, batch, resolution, num_frames=frames,
                                generator=torch.Generator().manual_seed(seed))


def split(pipe, x):
    """Packed [B, N] -> the pipeline's unpacked video [B, C, F', H', W'] and audio [B, C_a, L, M'] latents."""
    video, audio, (frames, height, width, length) = ltx2.unpack(pipe, x)
    bins = pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
    return (pipe._unpack_latents(video, frames, height, width),
            pipe._unpack_audio_latents(audio, length, num_mel_bins=bins))


# ----------------------------------------------------------------------------- against the pipeline

@pytest.mark.parametrize("g, g_audio", [(1.0, None), (4.0, None), (4.0, 7.0), (1.0, 7.0), (0.5, 3.0)])
def test_rollout_matches_the_pipeline_for_video_and_audio(pipe, g, g_audio, monkeypatch):
    """Three Euler steps through models.velocity on models.sigmas from models.initial_noise are __call__'s, for the
    video latents, the audio latents, the frames and the waveform; CFG on both modalities at one scale or, with
    --audio-guidance-scale (pipe.guidance_scale_audio), the sound at its own, the other guidance terms off. CFG runs
    where either scale is above 1 (LTX2Pipeline.do_classifier_free_guidance): at a video scale of 1 or below too."""
    monkeypatch.setattr(pipe, "guidance_scale_audio", g_audio, raising=False)
    call = dict(prompt=list(PROMPTS), negative_prompt="", num_inference_steps=3, guidance_scale=g,
                audio_guidance_scale=g_audio or g, stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0,
                audio_modality_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0, height=64, width=64,
                num_frames=5, max_sequence_length=models.default_tokens(pipe), return_dict=False)
    video_latents, audio_latents = pipe(**call, generator=torch.Generator().manual_seed(3), output_type="latent")
    frames, waveform = pipe(**call, generator=torch.Generator().manual_seed(3), output_type="np")
    x0 = noise(pipe, seed=3)
    assert x0.shape == (2, 4 * 3 * 8 * 8 + 4 * 5)  # video 4 ch x 3 x 8 x 8, audio 5 frames x 2 ch x 2 bins
    embeds = models.encode_prompts(pipe, PROMPTS, guidance_scale=g)
    x = x0
    with torch.no_grad():
        for s, s_next in zip(models.sigmas(pipe, 3, 64)[:-1].tolist(), models.sigmas(pipe, 3, 64)[1:].tolist()):
            x = x + (s_next - s) * models.velocity(pipe, x, s, embeds, guidance_scale=g).float()
        if g > 1 or (g_audio or 0) > 1:
            uncond = models.velocity(pipe, x0, 0.9, embeds)  # guidance 1, and the sound's scale where it is set
            monkeypatch.setattr(pipe, "guidance_scale_audio", None)
            off = models.velocity(pipe, x0, 0.9, embeds)  # no CFG at all
            monkeypatch.setattr(pipe, "guidance_scale_audio", g_audio)
            assert (off - models.velocity(pipe, x0, 0.9, embeds, guidance_scale=g)).abs().max() > 1e-3
            assert (off - uncond).abs().max() > 1e-3 if (g_audio or 0) > 1 else torch.equal(off, uncond)
    video, audio = split(pipe, x)
    start_video, start_audio = split(pipe, x0)
    assert (video - start_video).abs().mean() > 0.1 and (audio - start_audio).abs().mean() > 0.1  # both move
    torch.testing.assert_close(video, video_latents, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(audio, audio_latents, atol=1e-5, rtol=1e-5)
    out = models.decode(pipe, x)
    assert out.shape == (2, 5, 64, 64, 3) and out.dtype == torch.uint8 and out.float().std() > 1
    assert (out.float() - torch.as_tensor(frames) * 255).abs().max() <= 0.5 + 1e-3  # uint8 of the same frames
    assert out.audio.shape == waveform.shape and out.sample_rate == pipe.vocoder.config.output_sampling_rate
    assert waveform.abs().mean() > 1e-3
    torch.testing.assert_close(out.audio, waveform.float(), atol=1e-6, rtol=1e-5)


def test_schedule_is_the_pipelines(pipe):
    """models.sigmas is what __call__ hands its scheduler (linspace(1, 1/N, N), mu of the video tokens, frames
    included) at several sizes, once the size's latents are drawn; shift_terminal ends it at 0.1."""
    from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, retrieve_timesteps

    config = pipe.scheduler.config
    assert config.use_dynamic_shifting and config.shift_terminal == 0.1 and config.base_shift == 0.95
    for steps, resolution, frames in [(4, 64, 5), (10, 64, 9), (30, 128, 17)]:
        models.latent_shape(pipe, resolution, num_frames=frames)
        ours = models.sigmas(pipe, steps, resolution)
        tokens = ((frames - 1) // 2 + 1) * (resolution // 8) ** 2  # the twin's VAE: 2x temporal, 8x spatial
        scheduler = type(pipe.scheduler).from_config(config)
        mu = calculate_shift(tokens, config.base_image_seq_len, config.max_image_seq_len, config.base_shift,
                             config.max_shift)
        retrieve_timesteps(scheduler, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        torch.testing.assert_close(ours, scheduler.sigmas.float(), atol=0, rtol=0, msg=f"{steps} {resolution} {frames}")
        assert ours[-2] == pytest.approx(0.1) and ours[-1] == 0
    assert not torch.equal(models.sigmas(pipe, 10, 64), models.sigmas(pipe, 10, 128))  # mu grows with the tokens


def test_latent_shape_and_its_errors(pipe):
    assert models.latent_shape(pipe, 64, num_frames=9) == (4 * 5 * 8 * 8 + 4 * 9,)  # 9 frames: 0.375 s of sound
    with pytest.raises(ValueError, match="--num-frames 6 must be 2 k \\+ 1 .*the nearest are 5 and 7"):
        models.latent_shape(pipe, 64, num_frames=6)
    with pytest.raises(ValueError, match="multiple of 32"):
        models.latent_shape(pipe, 48, num_frames=5)
    # 64 x 128 and 128 x 64 pack to as many values: a latent of that length names no grid
    assert models.latent_shape(pipe, (64, 128), num_frames=5) == models.latent_shape(pipe, (128, 64), num_frames=5)
    x = torch.zeros(1, models.latent_shape(pipe, (64, 128), num_frames=5)[0])
    with pytest.raises(ValueError, match="several grids"):
        models.velocity(pipe, x, 0.5, models.encode_prompts(pipe, PROMPTS[:1]))
    with pytest.raises(ValueError, match="no grid .* models.initial_noise"):
        models.decode(pipe, torch.zeros(1, 7))


def test_published_configs_have_the_published_sizes():
    """The transcribed configs build (meta device) to the model card's 19B transformer and Gemma 3 12B; the audio
    stream is about 5.7 B of it."""
    import families

    transformer = families.build_published("ltx2", "transformer")
    assert 18.5e9 < sum(p.numel() for p in transformer.parameters()) < 19.5e9
    audio = sum(p.numel() for n, p in transformer.named_parameters() if "audio" in n)
    assert 5e9 < audio < 6.5e9
    gemma = families.build_published("ltx2", "text_encoder")
    assert 11.8e9 < sum(p.numel() for p in gemma.parameters()) < 12.6e9
    extra = ltx2.build_extra()
    assert extra["connectors"].config.text_proj_in_factor == gemma.config.text_config.num_hidden_layers + 1
    assert extra["vocoder"].config.in_channels == 2 * 64  # the audio VAE's 2 output channels x 64 mel bins


# ----------------------------------------------------------------------------- the action covers both

def test_log_prob_covers_video_and_audio(pipe):
    """sde_step's log-prob of the packed latent is torch.distributions.Normal's summed over the video and the audio
    latents, divided by their count (its mean over dimensions); moving only the audio changes it."""
    x = noise(pipe, seed=1)
    embeds = models.encode_prompts(pipe, PROMPTS)
    with torch.no_grad():
        v = models.velocity(pipe, x, 0.8, embeds)
    step = sde.sde_step(v, x, 0.8, 0.6, eta=0.7, generator=torch.Generator().manual_seed(2))
    (mean_video, mean_audio), (prev_video, prev_audio) = split(pipe, step.mean), split(pipe, step.prev_sample)
    std = step.std[:, None, None, None]

    def reference(video, audio):
        nv = torch.distributions.Normal(mean_video, std[..., None]).log_prob(video).flatten(1).sum(1)
        na = torch.distributions.Normal(mean_audio, std).log_prob(audio).flatten(1).sum(1)
        return (nv + na) / (video[0].numel() + audio[0].numel()), nv

    expected, video_part = reference(prev_video, prev_audio)
    torch.testing.assert_close(step.log_prob, expected, atol=1e-5, rtol=1e-5)
    moved = prev_audio + 0.5 * std  # the audio only, half a std
    packed = ltx2.pack(*ltx2.unpack(pipe, step.prev_sample)[:1], pipe._pack_audio_latents(moved))
    again = sde.sde_step(v, x, 0.8, 0.6, eta=0.7, prev_sample=packed)
    expected_again, video_again = reference(prev_video, moved)
    torch.testing.assert_close(again.log_prob, expected_again, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(video_again, video_part)  # the video's term is untouched
    assert (again.log_prob - step.log_prob).abs().min() > 1e-4  # the audio's term moved the whole log-prob


# ----------------------------------------------------------------------------- the soundtrack beside the frames

def test_videos_carry_their_sound_through_batch_operations(pipe):
    out = models.decode(pipe, noise(pipe, seed=4, batch=3))
    assert isinstance(out, torch.Tensor) and out.audio.shape[0] == 3
    torch.testing.assert_close(out[[2, 0]].audio, out.audio[[2, 0]])
    torch.testing.assert_close(out[1:].audio, out.audio[1:])
    torch.testing.assert_close(out[torch.tensor([1])].audio, out.audio[[1]])
    both = torch.cat([out[:1], out[2:]])
    torch.testing.assert_close(both.audio, out.audio[[0, 2]])
    assert both.sample_rate == out.sample_rate == 16000
    torch.testing.assert_close(out[1:, :2].audio, out.audio[1:])  # the index's first entry picks the videos
    torch.testing.assert_close(out[1:, :2], torch.as_tensor(out.numpy())[1:, :2])  # frames as a plain tensor's
    for plain in (out[0], out.float(), out.permute(0, 2, 3, 4, 1), out[..., 0], out.numpy()):
        assert not hasattr(plain, "audio")  # what is no longer a batch of these videos carries no sound


@pytest.fixture(scope="module")
def clap_folder(tmp_path_factory):
    return reward_fixtures.tiny_clap(str(tmp_path_factory.mktemp("clap")))


def test_clap_scores_the_soundtrack_beside_a_frame_reward(pipe, clap_folder):
    """`--reward jpeg_compressibility=1,clap=1` on decoded videos: clap is the cosine of CLAP's text and audio
    embeddings of each sample's waveform (made mono, resampled to 48 kHz), the frames score as always, the total is
    the weighted sum; new sound moves clap alone; samples without sound are refused in one line."""
    from transformers import ClapModel, ClapProcessor

    videos = models.decode(pipe, noise(pipe, seed=5))
    reward_fn = rewards.build_reward("jpeg_compressibility=1,clap=0.5", clap_model_path=clap_folder)
    out = reward_fn(videos, PROMPTS, [{}, {}])
    model, processor = ClapModel.from_pretrained(clap_folder).eval(), ClapProcessor.from_pretrained(clap_folder)
    waves = torch.nn.functional.interpolate(videos.audio.mean(1, keepdim=True), scale_factor=3, mode="linear")[:, 0]
    with torch.no_grad():  # 16 kHz -> 48 kHz: three times the samples
        a = model.get_audio_features(**processor.feature_extractor(list(waves.numpy()), sampling_rate=48000,
                                                                   return_tensors="pt")).pooler_output
        t = model.get_text_features(**processor.tokenizer(PROMPTS, padding=True, return_tensors="pt")).pooler_output
    expected = torch.nn.functional.cosine_similarity(a, t)
    torch.testing.assert_close(out["clap"], expected, atol=1e-5, rtol=1e-4)
    frames_only = rewards.build_reward("jpeg_compressibility")(videos.numpy(), PROMPTS)["reward"]
    torch.testing.assert_close(out["jpeg_compressibility"], frames_only)
    torch.testing.assert_close(out["reward"], frames_only + 0.5 * expected)
    louder = ltx2.with_audio(torch.as_tensor(videos.numpy()), videos.audio.flip(-1), videos.sample_rate)
    moved = reward_fn(louder, PROMPTS, [{}, {}])
    assert (moved["clap"] - out["clap"]).abs().min() > 1e-6
    torch.testing.assert_close(moved["jpeg_compressibility"], out["jpeg_compressibility"])
    with pytest.raises(ValueError, match="reward 'clap' scores the samples' sound.*--model ltx2") as error:
        reward_fn(videos.numpy(), PROMPTS, [{}, {}])
    assert "\n" not in str(error.value)


def test_clap_offline_names_the_flag(monkeypatch, tmp_path):
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for path in ("laion/clap-htsat-unfused", str(tmp_path / "missing")):
        with pytest.raises(RuntimeError, match="clap: cannot load .*--clap-model-path") as error:
            rewards.build_reward("clap", clap_model_path=path)
        assert "\n" not in str(error.value)


def test_sample_grid_writes_each_soundtrack(pipe, tmp_path):
    """save_sample_grid: a GIF per prompt and, for videos with sound, a 16-bit WAV per sample holding its waveform
    (and an MP4 with sound where a codec is at hand: test_sample_mp4); save_compare_grid: a WAV per cell."""
    videos = models.decode(pipe, noise(pipe, seed=6, batch=3))
    captions = ["a dog\nreward 0.1", "a cat\nreward 0.2", "a dog\nreward 0.3"]  # grouped by the first line
    paths = evaluation.save_sample_grid(str(tmp_path / "000002.png"), videos, captions, ids=[2, 1, 0])
    names = sorted(os.path.basename(p) for p in paths if not p.endswith(".mp4"))
    assert names == ["000002_0.gif", "000002_0_0.wav", "000002_0_1.wav", "000002_1.gif", "000002_1_0.wav"]
    with wave.open(str(tmp_path / "000002_0_1.wav")) as f:  # the row's second sample of "a dog": sample 0
        assert (f.getnchannels(), f.getsampwidth(), f.getframerate()) == (2, 2, 16000)
        pcm = np.frombuffer(f.readframes(f.getnframes()), dtype="<i2").reshape(-1, 2).T
    expected = (videos.audio[0].clamp(-1, 1) * 32767).round().numpy()
    assert pcm.shape == expected.shape and np.abs(expected).max() > 100
    np.testing.assert_array_equal(pcm, expected)
    # eval.py's before / after grid: each cell's soundtrack beside grid.gif, column by column
    folder = tmp_path / "grid"
    folder.mkdir()
    paths = evaluation.save_compare_grid(str(folder), [videos[:2], videos[1:]], ["base", "step 1"], ["a", "b"],
                                         ["", ""], [[("reward +0.100", None)] * 2] * 2)
    names = [os.path.basename(p) for p in paths if not p.endswith(".mp4")]
    assert names == ["grid.png", "grid.gif", "grid_0_0.wav", "grid_0_1.wav", "grid_1_0.wav", "grid_1_1.wav"]
    with wave.open(str(folder / "grid_1_0.wav")) as f:  # column "step 1", row 0: sample 1
        pcm = np.frombuffer(f.readframes(f.getnframes()), dtype="<i2").reshape(-1, 2).T
    np.testing.assert_array_equal(pcm, (videos.audio[1].clamp(-1, 1) * 32767).round().numpy())


@pytest.mark.skipif(not (shutil.which("ffmpeg") or __import__("importlib").util.find_spec("av")),
                    reason="no video codec: neither PyAV nor an ffmpeg binary")
def test_sample_mp4(pipe, tmp_path):
    """The MP4 holds the video's frames and its sound: read back (PyAV where installed), a video stream of the
    frames' size and count and an audio stream at the sample rate."""
    videos = models.decode(pipe, noise(pipe, seed=6, batch=1))
    paths = evaluation.save_sound(str(tmp_path / "s"), videos.numpy()[0], videos.audio[0], videos.sample_rate, 16)
    assert paths[-1].endswith(".mp4") and os.path.getsize(paths[-1]) > 100
    av = pytest.importorskip("av")
    with av.open(paths[-1]) as container:
        (video,), (audio,) = container.streams.video, container.streams.audio
        assert (video.codec_context.width, video.codec_context.height) == videos.shape[3:1:-1]
        assert audio.codec_context.sample_rate == videos.sample_rate
        frames = sum(1 for _ in container.decode(video=0))
    assert frames == videos.shape[1]


# ----------------------------------------------------------------------------- train.py

@pytest.mark.parametrize("rank", [4, 0])
def test_train_runs_two_steps_with_sound(rank, tmp_path, monkeypatch, clap_folder):
    """`python train.py --model tiny-ltx2 --steps 2`, shrunk, with LoRA (the reward mixing frames and `clap`) and in
    full (guided, the sound at its own scale: the rollouts and the training forwards guide alike): on-policy ratio
    1, finite losses, a GIF per prompt and a WAV per shown sample."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    reward = (["--reward", "jpeg_compressibility=1,clap=1", "--clap-model-path", clap_folder] if rank else
              ["--guidance-scale", "2", "--audio-guidance-scale", "3"])
    train.main(["--model", NAME, "--steps", "2", "--num-steps", "4", "--prompts-per-step", "2", "--group-size", "2",
                "--sample-batch-size", "2", "--train-batch-size", "2", "--log-images-every", "2", "--lora-rank",
                str(rank), "--out", str(out)] + reward)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2] and not any(r.get("skipped") for r in rows)
    assert rows[0]["first_ratio_dev"] < 1e-5 and all(math.isfinite(r["loss"]) for r in rows)
    if rank:
        assert any("clap" in key for key in rows[0]), sorted(rows[0])
    saved = sorted(n for n in os.listdir(out / "samples") if not n.endswith(".mp4"))
    assert saved == ["000002_0.gif", "000002_0_0.wav", "000002_0_1.wav", "000002_1.gif", "000002_1_0.wav",
                     "000002_1_1.wav"]
