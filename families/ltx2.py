"""LTX-2 text to video with sound: `ltx2` (`Lightricks/LTX-2`, the 19B audio-video transformer) and `tiny-ltx2`.

Checked against diffusers/pipelines/ltx2/pipeline_ltx2.py (LTX2Pipeline.__call__, diffusers 0.42) and
models/transformers/transformer_ltx2.py by tests/test_ltx2.py; the conventions are load's docstring. Samples are videos
[B, F, H, W, 3] (the record's video; --num-frames sets F) that carry their soundtrack beside them (WithAudio, at the
end): rewards that hear (rewards.py's `clap`) and the sample saver (eval.save_sample_grid) read `.audio` from them.

The action is both latents. One flat vector a sample holds the video's latent tokens and then the audio's, each in the
order the pipeline packs them (_pack_latents, _pack_audio_latents), so sde.py's step and its log-prob (a mean over the
latent's dimensions) cover the picture and the sound without knowing there are two; velocity unpacks the vector, runs
the joint transformer and packs both velocities back. A flat vector does not say which grid it came from (a 64 x 128
video has as many values as a 128 x 64 one), so shape() records each grid it hands out (_GRIDS) and velocity and
decode look it up by the vector's length and the model's sizes.
"""

import math

import numpy as np
import torch

from families import common

LTX2_ID = "Lightricks/LTX-2"
FRAME_RATE = 24.0  # LTX2Pipeline.__call__'s default frame_rate: the audio's length and the video's RoPE positions
# DiffSynth-Studio's LTX-2 text-to-audio-video LoRA examples (examples/ltx2/model_training/lora/LTX-2-T2AV-*.sh,
# --lora_target_modules "to_k,to_q,to_v,to_out.0"): every attention of both streams, their cross-modal attention
# included, by peft's suffix match
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


def load(model_path=None, dtype=torch.float32, device="cpu"):
    """LTX-2 (`Lightricks/LTX-2`), text to video and audio in one transformer.

    Conventions (pipeline_ltx2.py, diffusers 0.42): video latents [B, 128, F', H/32, W/32] with F' = (F - 1) / 8 + 1
    (__call__ L1272, prepare_latents L797) and audio latents [B, 8, L, 16] with L = round(F / 24 fps x 16000 / 160 /
    4) (__call__ L1307-1310; 64 mel bins / 4), both standard normal from one generator, video first (L1293, L1332),
    packed into tokens of 128 values each (_pack_latents L651, _pack_audio_latents L727). One schedule for both
    (__call__ copies its scheduler for the audio, L1354): FlowMatchEuler sigmas on linspace(1, 1/N, N) with the
    exponential shift mu of the video tokens (calculate_shift with the scheduler's base/max, 1024 -> 0.95, 4096 ->
    2.05, L1345-1352) stretched to shift_terminal 0.1 (the hub scheduler's, diffusers' convert_ltx2_to_diffusers.py),
    then 0; integrated with Euler, our step, on both latents (L1593, L1596). The transformer takes both token
    sequences, the timestep 1000 s in float32 for both modalities and as the cross-attention sigma
    (`timestep=t.expand(B), sigma=timestep`, L1412-1421; use_cross_timestep True, L965), the frame rate 24, and
    returns eps - x0 for each (our sign).
    Guidance: __call__'s CFG forms x0_u, x0_c from each velocity and adds (g - 1)(x0_c - x0_u) (L1440-1458); with one
    sigma per step that is v_u + g (v_c - v_u), ours, one batched forward. The video's g is --guidance-scale, the
    sound's --audio-guidance-scale (the pipeline's audio_guidance_scale; without it the same g), and CFG runs where
    either is above 1 (guidance, below). The rollouts run without the pipeline's other guidance terms (STG,
    modality isolation, guidance rescale: stg_scale 0, modality_scale 1, guidance_rescale 0 in __call__'s terms), each
    of which costs another forward. Text: Gemma 3 12B's hidden states of every layer, left-padded to
    max_sequence_length (1024, __call__'s default; the record's tokens) with a mask (_get_gemma_prompt_embeds, L303),
    through the pipeline's text connectors (frozen, part of encode) into a video and an audio text sequence and the
    mask the transformer reads. Decode: video tokens unpacked, de-normalised by the VAE's latents_mean / latents_std,
    decoded at decode_timestep 0 (its noise scale 0; L1637-1660); audio tokens de-normalised by the audio VAE's
    statistics, unpacked to [B, 8, L, 16], decoded to a mel spectrogram and turned into a waveform by the vocoder
    (24 kHz, stereo; L1663-1664).
    """
    from diffusers import LTX2Pipeline

    return common.from_pretrained(LTX2Pipeline, "ltx2", model_path or LTX2_ID, LTX2_ID, dtype)


def gemma_tokenizer(max_length):
    """GemmaTokenizer (byte-fallback BPE) without merges, built offline: Gemma's special tokens, the 256 byte tokens,
    then the printable ASCII characters and the word mark; a prompt is one token a character. Left padding, as
    LTX2Pipeline sets it."""
    from transformers import GemmaTokenizer

    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += ["▁"] + [chr(c) for c in range(33, 127)]
    return GemmaTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[], model_max_length=max_length,
                          padding_side="left")


def _tiny_text_encoder(vocab_size):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=dict(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=128,
                         sliding_window=32, pad_token_id=0, eos_token_id=1, bos_token_id=2),
        vision_config=dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                           image_size=8, patch_size=4), mm_tokens_per_image=1)).eval()


def _tiny_models():
    """(transformer, connectors, vae, audio_vae, vocoder) at toy size, sizes from diffusers' LTX-2 tests."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2 import LTX2TextConnectors, LTX2Vocoder

    transformer = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=4,
        audio_cross_attention_dim=8, num_layers=2, caption_channels=16, rope_double_precision=False,
        rope_type="split").eval()
    connectors = LTX2TextConnectors(  # the 3 hidden states of the 2-layer Gemma, width 16 as it (2 heads of 8)
        caption_channels=16, text_proj_in_factor=3, video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_double_precision=False,
        rope_type="split").eval()
    vae = AutoencoderKLLTX2Video(  # 4 x 4 patchify and one 2x spatio-temporal stage: 8x spatial, 2x temporal
        latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,), layers_per_block=(1,),
        decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,), decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False), downsample_type=("spatiotemporal",), upsample_residual=(False,),
        upsample_factor=(1,), patch_size=4, decoder_causal=False).eval()
    audio_vae = AutoencoderKLLTX2Audio(  # 8 mel bins / 4 = 2 latent bins x 2 channels: 4 values a token
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, in_channels=2, resolution=32,
        latent_channels=2, mel_bins=8).eval()
    vocoder = LTX2Vocoder(  # 4 x 4 x 5 x 2 = 160 samples a mel frame: 16 kHz from the 100 Hz mel, as the audio VAE's
        in_channels=16, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[8, 8, 10, 4],
        upsample_factors=[4, 4, 5, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
        output_sampling_rate=16000).eval()
    return transformer, connectors, vae, audio_vae, vocoder


def tiny(model_path=None, dtype=torch.float32, device="cpu"):
    """LTX-2 at toy size: 2 blocks of width 16 (video) and 8 (audio), one-layer connectors, a 2-layer Gemma 3 of
    width 16 (and a one-layer vision tower it never runs), the LTX-2 video VAE at width 8 (8x spatial, 2x temporal,
    4 channels), the audio VAE (8 mel bins, 2 channels) and a vocoder to 16 kHz stereo; the published scheduler;
    seed 0. 64 text tokens (the tokenizer's context)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline

    common.check_no_path("tiny-ltx2", model_path)
    tokenizer = gemma_tokenizer(64)
    with common.seeded_build(0, device):
        text_encoder = _tiny_text_encoder(len(tokenizer))
        transformer, connectors, vae, audio_vae, vocoder = _tiny_models()
    pipe = LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae, audio_vae=audio_vae,
                        text_encoder=text_encoder, tokenizer=tokenizer, connectors=connectors,
                        transformer=transformer, vocoder=vocoder)
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


# ----------------------------------------------------------------------------- the packed latent

_GRIDS = {}  # (length, sizes) -> {grid}: every grid shape() has handed out (the module docstring)
_FRAMES = {}  # (sizes, H', W') -> the latent frames shape() last handed out at that size (sigmas)


def _sizes(pipe):
    """What the packed length depends on besides the grid: values per video and per audio token."""
    audio = pipe.audio_vae.config
    bins = audio.mel_bins // pipe.audio_vae_mel_compression_ratio
    return pipe.transformer.config.in_channels, audio.latent_channels * bins


def _grid(pipe, height, width, num_frames):
    """(F', H', W', L): the video's latent frames and sides, the audio's latent frames (pipeline_ltx2.py L1272-1310)."""
    common.check_multiple(height, width, 32)  # LTX2Pipeline.check_inputs, L476
    f, config = pipe.vae_spatial_compression_ratio, pipe.transformer.config
    frame_tokens = (height // f // config.patch_size) * (width // f // config.patch_size)
    samples = common.forward_samples(pipe)
    latent = common.video_frames("LTX-2", num_frames, 121, pipe.vae_temporal_compression_ratio, frame_tokens,
                                 common.sample_tokens(pipe.transformer, pipe._execution_device, samples),
                                 samples)  # 121: __call__'s
    frames = 121 if num_frames is None else num_frames  # (without a duration head, L1212)
    per_second = pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)
    return latent, height // f, width // f, round(frames / FRAME_RATE * per_second)


def shape(pipe, height, width, num_frames):
    grid = _grid(pipe, height, width, num_frames)
    video, audio = _sizes(pipe)
    length = video * math.prod(grid[:3]) + audio * grid[3]
    _GRIDS.setdefault((length, video, audio), set()).add(grid)
    _FRAMES[(video, audio, *grid[1:3])] = grid[0]
    return (length,)


def _lookup(pipe, length):
    grids = _GRIDS.get((length, *_sizes(pipe)), set())
    if len(grids) != 1:
        why = "no grid" if not grids else f"several grids ({sorted(grids)})"
        raise ValueError(f"ltx2: {why} for a packed latent of {length} values; draw it with models.initial_noise at "
                         "one --resolution and --num-frames (a run samples one size)")
    return next(iter(grids))


def _frames_for(pipe, height, width):
    """(F', H', W') of the video the schedule is for: its mu counts the video tokens, frames included, which a
    family's sigmas is not given; the frames shape() last handed out at this size (models.sigmas(num_frames=...) asks
    for the latent shape first, as train.py and eval.py call it), else __call__'s default 121."""
    f = pipe.vae_spatial_compression_ratio
    h, w = height // f, width // f
    frames = _FRAMES.get((*_sizes(pipe), h, w))
    return (frames if frames is not None else _grid(pipe, height, width, None)[0]), h, w


def unpack(pipe, x):
    """[B, N] -> (video tokens [B, F' H' W', C], audio tokens [B, L, D], grid), in the pipeline's packed layouts."""
    grid = _lookup(pipe, x.shape[1])
    video, audio = _sizes(pipe)
    n = video * math.prod(grid[:3])
    return x[:, :n].unflatten(1, (-1, video)), x[:, n:].unflatten(1, (grid[3], audio)), grid


def pack(video, audio):
    return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)


def noise(pipe, batch, height, width, num_frames, generator):
    """As LTX2Pipeline.prepare_latents and prepare_audio_latents draw them (the video first, from the same generator),
    packed, in float32 (as __call__ draws them)."""
    from diffusers.utils.torch_utils import randn_tensor

    shape(pipe, height, width, num_frames)  # records the grid
    frames, h, w, length = _grid(pipe, height, width, num_frames)
    device = pipe._execution_device
    video = randn_tensor((batch, pipe.transformer.config.in_channels, frames, h, w), generator=generator,
                         device=device, dtype=torch.float32)
    audio_config = pipe.audio_vae.config
    audio = randn_tensor((batch, audio_config.latent_channels, length,
                          audio_config.mel_bins // pipe.audio_vae_mel_compression_ratio),
                         generator=generator, device=device, dtype=torch.float32)
    config = pipe.transformer.config
    return pack(pipe._pack_latents(video, config.patch_size, config.patch_size_t), pipe._pack_audio_latents(audio))


# ----------------------------------------------------------------------------- text, velocity, decode, schedule

def encode(pipe, prompts, negative_prompt, guidance_scale, tokens):
    """prompt_embeds / audio_prompt_embeds: the connectors' video and audio text sequences, and prompt_mask, their
    mask, as LTX2Pipeline.__call__ builds them (encode_prompt, then self.connectors with the tokenizer's padding side,
    L1229-1253); `tokens` is its max_sequence_length. Each text is encoded alone where __call__ runs the connectors on
    [negative; prompt] together: the connectors read each row by itself."""
    device = pipe._execution_device
    side = getattr(pipe.tokenizer, "padding_side", "left")

    def encode_texts(texts):
        embeds, mask = pipe._get_gemma_prompt_embeds(list(texts), max_sequence_length=tokens, device=device)
        video, audio, mask = pipe.connectors(embeds, mask, padding_side=side)
        return {"prompt_embeds": video, "audio_prompt_embeds": audio, "prompt_mask": mask}

    out = encode_texts(prompts)
    if not guidance(pipe, guidance_scale)[2]:
        return out
    return common.with_negative(out, encode_texts, negative_prompt, len(prompts), masked=False)  # all tokens long


def guidance(pipe, guidance_scale):
    """(video scale, audio scale, whether CFG runs) of a forward at guidance_scale: the soundtrack's scale is
    pipe.guidance_scale_audio where it is set (--audio-guidance-scale, LTX2Pipeline's audio_guidance_scale), else the
    same; CFG runs where either is above 1, as LTX2Pipeline.do_classifier_free_guidance decides (L902-903), so
    --guidance-scale 1 --audio-guidance-scale 7 guides the sound alone (the video's v_u + 1 (v_c - v_u) = v_c)."""
    audio = getattr(pipe, "guidance_scale_audio", None)
    audio = guidance_scale if audio is None else audio
    return guidance_scale, audio, guidance_scale > 1 or audio > 1


def velocity(pipe, modules, x, sigma, embeds, guidance_scale):
    """The joint transformer on the packed latent (load's conventions): both modalities' velocities, packed as x. A
    forward with CFG (guidance: either scale above 1) guides the video by guidance_scale and the sound by
    pipe.guidance_scale_audio where it is set, else by the same."""
    video_scale, audio_scale, cfg = guidance(pipe, guidance_scale)
    keys = ["prompt_embeds", "audio_prompt_embeds", "prompt_mask"]
    text, audio_text, mask = common.cfg_halves(embeds, keys) if cfg else [embeds[k] for k in keys]
    if cfg:  # both halves in one forward
        x, sigma = torch.cat([x, x]), torch.cat([sigma, sigma])
    video, audio, (frames, height, width, audio_frames) = unpack(pipe, x)
    dtype = pipe.transformer.dtype  # __call__ casts both latents to the text's, which is the model's (L1405, L1409)
    t = sigma * pipe.scheduler.config.num_train_timesteps  # float32, the scheduler's timesteps
    v_video, v_audio = modules["transformer"](
        hidden_states=video.to(dtype), audio_hidden_states=audio.to(dtype), encoder_hidden_states=text.to(dtype),
        audio_encoder_hidden_states=audio_text.to(dtype), timestep=t, sigma=t, encoder_attention_mask=mask.to(x.device),
        audio_encoder_attention_mask=mask.to(x.device), num_frames=frames, height=height, width=width, fps=FRAME_RATE,
        audio_num_frames=audio_frames, use_cross_timestep=True, return_dict=False)
    if not cfg:
        return pack(v_video, v_audio)
    return pack(common.guided(v_video, video_scale)[0], common.guided(v_audio, audio_scale)[0])


@torch.no_grad()
def decode(pipe, latents):
    """Packed latents -> uint8 videos [B, F, H, W, 3] on the CPU, carrying their waveforms (WithAudio)."""
    video, audio, (frames, height, width, audio_frames) = unpack(pipe, latents.float())
    vae, audio_vae, config = pipe.vae, pipe.audio_vae, pipe.transformer.config
    videos = []
    for chunk in video.split(1):  # one video at a time: the 3D decoder's activations are large
        z = pipe._unpack_latents(chunk, frames, height, width, config.patch_size, config.patch_size_t)
        z = pipe._denormalize_latents(z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        timestep = torch.zeros(1, device=z.device, dtype=z.dtype) if vae.config.timestep_conditioning else None
        out = vae.decode(z.to(vae.dtype), timestep, return_dict=False)[0]  # [1, 3, F, H, W] in [-1, 1]
        videos.append(common.to_uint8(out).permute(0, 2, 3, 4, 1).cpu())  # [1, F, H, W, 3]
    audio = pipe._denormalize_audio_latents(audio, audio_vae.latents_mean, audio_vae.latents_std)
    bins = audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
    mel = audio_vae.decode(pipe._unpack_audio_latents(audio, audio_frames, num_mel_bins=bins).to(audio_vae.dtype),
                           return_dict=False)[0]
    waveform = pipe.vocoder(mel.to(pipe.vocoder.dtype)).float().cpu()  # [B, channels, samples]
    return with_audio(torch.cat(videos), waveform, pipe.vocoder.config.output_sampling_rate)


def sigmas(pipe, num_steps, height, width, shift):
    config = pipe.scheduler.config
    kind = type(pipe.scheduler).__name__
    if kind != "FlowMatchEulerDiscreteScheduler":
        raise ValueError(f"ltx2: expected FlowMatchEulerDiscreteScheduler, got {kind}")
    frames, h, w = _frames_for(pipe, height, width)
    base = np.linspace(1.0, 1 / num_steps, num_steps)  # LTX2Pipeline.__call__, L1345
    # calculate_shift of the video tokens (L1346-1352): the pipeline's fallbacks are the published scheduler's values
    mu = common.dynamic_shift_mu({"base_image_seq_len": config.get("base_image_seq_len", 1024),
                                  "max_image_seq_len": config.get("max_image_seq_len", 4096),
                                  "base_shift": config.get("base_shift", 0.95),
                                  "max_shift": config.get("max_shift", 2.05)}, frames * h * w)
    return common.flow_match_sigmas(config, base, mu=mu, shift=shift)


# ----------------------------------------------------------------------------- videos that carry their sound

class WithAudio(torch.Tensor):
    """uint8 videos [B, F, H, W, 3] with `.audio`, float32 waveforms [B, channels, samples] in [-1, 1], and
    `.sample_rate` (Hz): decode's output, a tensor to everything that reads frames. The waveforms follow the videos
    through what train.py and rewards.py do to a batch, indexing along the batch (`videos[idx]`, `videos[:n]`) and
    torch.cat along it; any other operation gives a plain tensor (no sound)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        audio, rate = _follow(func, args, kwargs)
        if audio is None or not isinstance(out, torch.Tensor) or out.ndim == 0 or len(out) != len(audio):
            return out
        return with_audio(out, audio, rate)


def with_audio(videos, audio, sample_rate):
    out = videos.as_subclass(WithAudio)
    out.audio, out.sample_rate = audio, sample_rate
    return out


def _follow(func, args, kwargs):
    """The waveforms of an indexing or concatenation along the batch, else (None, None)."""
    if func is torch.Tensor.__getitem__ and isinstance(args[0], WithAudio):
        index = args[1][0] if isinstance(args[1], tuple) and args[1] else args[1]
        if isinstance(index, (slice, list, np.ndarray, torch.Tensor)):
            return args[0].audio[index], args[0].sample_rate
    if func in (torch.cat, torch.concat, torch.concatenate):
        parts = args[0] if args else kwargs.get("tensors")
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        sounds = [getattr(p, "audio", None) for p in parts]
        rates = {getattr(p, "sample_rate", None) for p in parts}
        if dim == 0 and all(s is not None for s in sounds) and len(rates) == 1 and \
                len({s.shape[1:] for s in sounds}) == 1:
            return torch.cat(sounds), rates.pop()
    return None, None


# ----------------------------------------------------------------------------- published configs
# name -> component -> (class, config), for parameter counts and memory estimates on the meta device. The transformer,
# video VAE and audio VAE as diffusers' scripts/convert_ltx2_to_diffusers.py writes them for version "2.0" (the hub
# repo's config.json files; the transformer's other values are the class defaults). The text encoder is
# google/gemma-3-12b-it's (the script's text_encoder_model_id, its QAT-unquantized twin): Gemma 3 12B's language model
# (width 3840, 48 layers, whose 49 hidden states the connectors' caption_channels 3840 and text_proj_in_factor 49
# read) and its SigLIP-so400m vision tower at 896 px, from that repo's config.json. The text connectors (about 0.8 B:
# text_proj_in 188160 -> 3840 and two 2-layer connectors of width 3840) and the vocoder (LTX2Vocoder, hidden 1024) are
# classes of diffusers.pipelines.ltx2, which common.build_published does not reach: CONNECTORS and VOCODER, built by
# build_extra.
_GEMMA3_12B = dict(
    text_config=dict(vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                     num_attention_heads=16, num_key_value_heads=8, head_dim=256),
    vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                       image_size=896, patch_size=14),
    mm_tokens_per_image=256)
_VAE = dict(latent_channels=128, block_out_channels=(256, 512, 1024, 2048), decoder_block_out_channels=(256, 512, 1024),
            layers_per_block=(4, 6, 6, 2, 2), decoder_layers_per_block=(5, 5, 5, 5),
            spatio_temporal_scaling=(True, True, True, True), decoder_spatio_temporal_scaling=(True, True, True),
            decoder_inject_noise=(False, False, False, False),
            downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
            upsample_residual=(True, True, True), upsample_factor=(2, 2, 2), patch_size=4, patch_size_t=1,
            decoder_causal=False, spatial_compression_ratio=32, temporal_compression_ratio=8)
_AUDIO_VAE = dict(base_channels=128, output_channels=2, ch_mult=(1, 2, 4), num_res_blocks=2, in_channels=2,
                  resolution=256, latent_channels=8, sample_rate=16000, mel_hop_length=160, mel_bins=64,
                  double_z=True)
PUBLISHED = {"ltx2": dict(
    transformer=("LTX2VideoTransformer3DModel", dict(
        num_layers=48, num_attention_heads=32, attention_head_dim=128, cross_attention_dim=4096,
        audio_num_attention_heads=32, audio_attention_head_dim=64, audio_cross_attention_dim=2048,
        caption_channels=3840, rope_type="split")),
    text_encoder=("Gemma3ForConditionalGeneration", _GEMMA3_12B),
    vae=("AutoencoderKLLTX2Video", _VAE), audio_vae=("AutoencoderKLLTX2Audio", _AUDIO_VAE))}
CONNECTORS = dict(caption_channels=3840, text_proj_in_factor=49, video_connector_num_attention_heads=30,
                  video_connector_attention_head_dim=128, video_connector_num_layers=2,
                  video_connector_num_learnable_registers=128, audio_connector_num_attention_heads=30,
                  audio_connector_attention_head_dim=128, audio_connector_num_layers=2,
                  audio_connector_num_learnable_registers=128, connector_rope_base_seq_len=4096, rope_type="split")
VOCODER = dict(in_channels=128, hidden_channels=1024, out_channels=2, upsample_kernel_sizes=[16, 15, 8, 4, 4],
               upsample_factors=[6, 5, 2, 2, 2], resnet_kernel_sizes=[3, 7, 11],
               resnet_dilations=[[1, 3, 5], [1, 3, 5], [1, 3, 5]], output_sampling_rate=24000)
SCHEDULER = dict(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
                 max_image_seq_len=4096, shift_terminal=0.1)  # the script's FlowMatchEulerDiscreteScheduler


def build_extra(device="meta"):
    """{connectors, vocoder} of the published model, built from CONNECTORS and VOCODER on `device`."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors, LTX2Vocoder

    with torch.device(device):
        return {"connectors": LTX2TextConnectors(**CONNECTORS), "vocoder": LTX2Vocoder(**VOCODER)}


# ----------------------------------------------------------------------------- records (families.MODELS)

LTX2 = dict(name="ltx2", load=load, hub_id=LTX2_ID, hub=True, multiple=32,
            preset=dict(common.HUB, guidance_scale=3.0, audio_guidance_scale=7.0),  # LTX2Pipeline.__call__'s
            preset_notes=dict(guidance_scale="LTX2Pipeline.__call__'s default",
                              audio_guidance_scale="LTX2Pipeline.__call__'s default"), tokens=1024,
            shape=shape, noise=noise, encode=encode, velocity=velocity, decode=decode, sigmas=sigmas,
            lora_targets=LORA_TARGETS, video=True, sound=True, temporal=8)  # _VAE's temporal_compression_ratio
TINY = dict(LTX2, load=tiny, hub_id=None, hub=False, preset=dict(common.TINY, num_frames=5),  # 3 latent frames
            preset_notes=None, temporal=2)  # the twin's VAE: one spatio-temporal stage
