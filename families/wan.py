"""Wan text-to-video: Wan 2.1, `wan` (`Wan-AI/Wan2.1-T2V-1.3B-Diffusers`; the 14B by --model-path) and `tiny-wan`,
and Wan 2.2 A14B, `wan2.2` (`Wan-AI/Wan2.2-T2V-A14B-Diffusers`) and `tiny-wan2.2`: two experts of Wan 2.1-14B's
architecture, `transformer` for the high-noise steps and `transformer_2` for the rest, both trained (the record's
trained), each step's samples routed by the pipeline's boundary (velocity). Wan 2.2 TI2V-5B, `wan2.2-5b`
(`Wan-AI/Wan2.2-TI2V-5B-Diffusers`) and `tiny-wan2.2-5b`: one dense 5B on the Wan 2.2 VAE, a timestep per token (its
section, at the end).

Checked against diffusers/pipelines/wan/pipeline_wan.py (WanPipeline.__call__) and
schedulers/scheduling_unipc_multistep.py (UniPCMultistepScheduler.set_timesteps) by tests/test_families.py; the
conventions are load's docstring. Samples are videos [B, F, H, W, 3] (the record's video); --num-frames sets F.
"""

import numpy as np
import torch

import distributed
import sde
from families import common

WAN_ID = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
WAN22_ID = "Wan-AI/Wan2.2-T2V-A14B-Diffusers"
# Flow-GRPO's train_wan2_1.py list, which on the T2V blocks matches these (attn1 self-, attn2 cross-attention)
LORA_TARGETS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0")


def load(model_path=None, dtype=torch.float32, device="cpu"):
    """Wan 2.1 text-to-video (`Wan-AI/Wan2.1-T2V-1.3B-Diffusers`, or the 14B by --model-path).

    Conventions: latents [B, 16, F', H/8, W/8] with F' = (F - 1) / 4 + 1 (unpacked; the transformer
    patches 1 x 2 x 2 itself); the network predicts the flow velocity eps - x0 directly (same sign as
    ours); it is conditioned on the integer timestep floor(1000 s), because UniPC stores its flow
    timesteps as int64 (Flow-GRPO's train_wan2_1.py trains on these too). Guidance: true CFG
    v_u + g (v_c - v_u), one forward per half in the pipeline, batched here. Text: UMT5-XXL, padded
    with zeros to max_sequence_length (512, WanPipeline.__call__'s default and Flow-GRPO's) and no
    mask. Native schedule: UniPC flow sigmas, linspace(1, 1/1000, N + 1)[:-1] shifted statically by
    flow_shift (3 for the T2V checkpoints, diffusers' convert_wan_to_diffusers.py), the first one
    lowered by 1e-6, then 0. The pipeline integrates it with UniPC (2nd order); its first step is
    exactly Euler, our step. The VAE is kept in float32 whatever `dtype` (diffusers' and
    Flow-GRPO's advice: bf16 decoding of the Wan VAE loses detail).
    """
    from diffusers import WanPipeline

    pipe = common.from_pretrained(WanPipeline, "wan", model_path or WAN_ID, WAN_ID, dtype)
    pipe.vae.to(torch.float32)
    return pipe


def load_a14b(model_path=None, dtype=torch.float32, device="cpu"):
    """Wan 2.2 A14B text-to-video (`Wan-AI/Wan2.2-T2V-A14B-Diffusers`): Wan 2.1's conventions (load), two experts of
    14 B and the boundary_ratio (0.875) in the pipeline's config."""
    from diffusers import WanPipeline

    pipe = common.from_pretrained(WanPipeline, "wan2.2", model_path or WAN22_ID, WAN22_ID, dtype)
    pipe.vae.to(torch.float32)
    return pipe


def tiny_a14b(model_path=None, dtype=torch.float32, device="cpu"):
    """Wan 2.2 A14B at toy size: tiny-wan with a second expert (the same architecture, seed 1) below a boundary
    ratio of 0.875, the published model's."""
    common.check_no_path("tiny-wan2.2", model_path)
    pipe = tiny(dtype=dtype, device=device)
    with common.seeded_build(1, device):
        expert = _tiny_transformer()
    pipe.register_modules(transformer_2=expert if dtype == torch.float32 else expert.to(dtype))
    pipe.register_to_config(boundary_ratio=0.875)
    return pipe


def _tiny_transformer():
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=32, ffn_dim=48, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32).eval()


def tiny(model_path=None, dtype=torch.float32, device="cpu"):
    """Wan 2.1 at toy size: 2 blocks of width 24 (2 heads), UMT5 encoder of width 32, a causal 3D VAE
    with 8x spatial / 4x temporal compression and base width 8; UniPC with flow_shift 3; seed 0."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    common.check_no_path("tiny-wan", model_path)
    tokenizer = common.t5_tokenizer(32)
    with common.seeded_build(0, device):
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
            pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).eval()
        transformer = _tiny_transformer()
        vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True]).eval()
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=3.0)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                       transformer=transformer)
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


def shape(pipe, height, width, num_frames):
    multiple = pipe.vae_scale_factor_spatial * pipe.transformer.config.patch_size[1]
    common.check_multiple(height, width, multiple)
    f, config = pipe.vae_scale_factor_spatial, pipe.transformer.config
    pt, ph, pw = config.patch_size
    # WanRotaryPosEmbed holds rope_max_seq_len positions a side: a longer side fails in its first forward
    if max(height // f // ph, width // f // pw) > config.rope_max_seq_len:
        raise ValueError(f"--resolution {height}x{width}: Wan's positions reach {config.rope_max_seq_len * f * ph} px "
                         "a side; lower --resolution")
    frame_tokens = (height // f // ph) * (width // f // pw)  # a latent frame's (patch_size's time side is 1)
    samples = common.forward_samples(pipe)
    most = min(common.sample_tokens(pipe.transformer, pipe._execution_device, samples),
               config.rope_max_seq_len * pt * frame_tokens)  # and at most rope_max_seq_len latent frames
    frames = common.video_frames("Wan", num_frames, 81, pipe.vae_scale_factor_temporal, frame_tokens,
                                 most, samples)  # 81: WanPipeline.__call__'s default
    return (config.in_channels, frames, height // f, width // f)


def noise(pipe, batch, height, width, num_frames, generator):
    from diffusers.utils.torch_utils import randn_tensor

    return randn_tensor((batch, *shape(pipe, height, width, num_frames)), generator=generator,
                        device=pipe._execution_device, dtype=torch.float32)


def encode(pipe, prompts, negative_prompt, guidance_scale, tokens):
    def encode_texts(texts):
        embeds, _ = pipe.encode_prompt(texts, do_classifier_free_guidance=False, max_sequence_length=tokens,
                                       device=pipe._execution_device)
        return {"prompt_embeds": embeds}

    out = encode_texts(prompts)
    if guidance_scale <= 1:
        return out
    return common.with_negative(out, encode_texts, negative_prompt, len(prompts), masked=False)


def velocity(pipe, modules, x, sigma, embeds, guidance_scale):
    """Wan 2.1: the transformer. Wan 2.2: each sample's expert by its timestep t = floor(1000 s), as WanPipeline.__call__
    chooses it: `transformer` where t >= boundary_ratio x 1000, `transformer_2` below (both in one batch only when a
    micro-batch holds samples of both sides: a training forward of steps drawn per sample). The routes are read where
    sigma is: on the host (models.velocity leaves a caller's float or CPU tensor there) without waiting for the device,
    on the device with one host read. CFG runs where guidance_scale > 1 (WanPipeline.do_classifier_free_guidance reads
    that scale alone), and guides the low-noise expert by pipe.guidance_scale_2 where it is set (--guidance-scale-2;
    the model card's 4.0 and 3.0), as WanPipeline's guidance_scale_2, whatever its value: below 1 too (v_u + g_2 (v_c -
    v_u), as __call__ computes it)."""
    ratio = pipe.config.get("boundary_ratio")
    cfg = guidance_scale > 1
    if "transformer_2" not in modules or ratio is None:
        return _velocity(pipe, modules["transformer"], x, sigma.to(x.device, non_blocking=True), embeds,
                         guidance_scale, cfg=cfg)
    second = getattr(pipe, "guidance_scale_2", None)
    scales = {"transformer": guidance_scale,
              "transformer_2": second if second is not None and cfg else guidance_scale}
    routes = _routes(pipe, modules, sigma, ratio)  # {expert: its rows, on the host}
    sigma = sigma.to(x.device, non_blocking=True)  # from the host: staged at once, no wait for the device's queue
    if len(routes) == 1 and all(len(rows) == len(x) for rows in routes.values()):  # the whole batch: no copies
        (name,) = routes
        return _velocity(pipe, modules[name], x, sigma, embeds, scales[name], cfg=cfg)
    v = None
    for name, rows in routes.items():
        # A rank with none of an expert's rows that the other ranks reach (FSDP, _routes) runs it on its first row
        # and keeps none of the output: the expert's gathers and its backward's reduce-scatter (of a zero gradient)
        # pair with theirs.
        index = (rows if len(rows) else rows.new_zeros(1)).to(x.device, non_blocking=True)
        part = _velocity(pipe, modules[name], x[index], sigma[index], {k: t[index] for k, t in embeds.items()},
                         scales[name], cfg=cfg)
        v = part.new_empty((len(x), *part.shape[1:])) if v is None else v
        v[index[:len(rows)]] = part if len(rows) else part[:0]
    return v


def _routes(pipe, modules, sigma, ratio):
    """{expert: its rows, int64 on the host}, in the order the experts are called; an expert no row reaches is left
    out. Under FSDP the ranks agree first (one all-reduce on the host): each expert that any rank's rows reach is in
    every rank's routes, with no rows where this rank has none, because its forward's all-gathers and its backward's
    reduce-scatter are collectives that every rank must call, in the same order."""
    bound = ratio * pipe.scheduler.config.num_train_timesteps
    high = (_timestep(pipe, sigma) >= bound).cpu()  # [B] bool; a sigma on the device: the one host read
    rows = {"transformer": high.nonzero()[:, 0], "transformer_2": (~high).nonzero()[:, 0]}
    reached = [len(r) > 0 for r in rows.values()]
    if distributed.sharded(modules["transformer"]):
        reached = distributed.any_rank_each(reached)
    return {name: r for (name, r), keep in zip(rows.items(), reached) if keep}


def _timestep(pipe, sigma):
    return torch.floor(sigma.double() * pipe.scheduler.config.num_train_timesteps).long()  # int64, as UniPC's


def _velocity(pipe, model, x, sigma, embeds, guidance_scale, timestep=None, cfg=None):
    """One module's velocity, guided by guidance_scale where cfg (default: guidance_scale > 1); timestep: the
    transformer's input, default each sample's floor(1000 s)."""
    dtype = pipe.transformer.dtype
    cfg = guidance_scale > 1 if cfg is None else cfg
    timestep = _timestep(pipe, sigma) if timestep is None else timestep
    (text,) = common.cfg_halves(embeds, ["prompt_embeds"]) if cfg else (embeds["prompt_embeds"],)
    if cfg:
        x, timestep = torch.cat([x, x]), torch.cat([timestep, timestep])
    v = model(hidden_states=x.to(dtype), timestep=timestep, encoder_hidden_states=text.to(dtype), return_dict=False)[0]
    if cfg:
        v, _ = common.guided(v, guidance_scale)
    return v


@torch.no_grad()
def decode(pipe, latents):
    vae = pipe.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    videos = []
    for chunk in latents.split(1):  # one video at a time: the 3D decoder's activations are large
        z = chunk.to(vae.device, torch.float32) * std.to(vae.device) + mean.to(vae.device)  # the pipeline's
        video = vae.decode(z.to(vae.dtype), return_dict=False)[0]  # [1, 3, F, H, W] in [-1, 1]
        videos.append(common.to_uint8(video).permute(0, 2, 3, 4, 1).cpu())  # [1, F, H, W, 3]
    return torch.cat(videos)


def sigmas(pipe, num_steps, height, width, shift):
    config = pipe.scheduler.config
    kind = type(pipe.scheduler).__name__
    if kind != "UniPCMultistepScheduler" or not config.use_flow_sigmas or config.use_dynamic_shifting:
        raise ValueError(f"wan: expected the UniPC flow-sigma scheduler with a static flow_shift, got {kind}")
    base = np.linspace(1, 1 / config.num_train_timesteps, num_steps + 1)[:-1]  # float64, as UniPC computes it
    s = sde.time_shift(base, config.flow_shift if shift is None else shift)
    if config.shift_terminal:
        raise ValueError("wan: a shift_terminal scheduler is not supported")
    if abs(s[0] - 1) < 1e-6:
        s[0] -= 1e-6  # UniPC keeps the first sigma below 1
    return torch.from_numpy(np.concatenate([s, [0.0]]).astype(np.float32))


# ----------------------------------------------------------------------------- published configs

_UMT5_XXL = dict(common.T5_XXL, vocab_size=256384)  # google/umt5-xxl, Wan's text encoder
_WAN_T2V = dict(patch_size=(1, 2, 2), attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
                freq_dim=256, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6)
# name -> component -> (class, config), from the hub repos' config.json (diffusers' convert_wan_to_diffusers.py writes
# them); {} means the diffusers class defaults, which are the published model
PUBLISHED = {
    "wan-1.3b": dict(transformer=("WanTransformer3DModel", dict(_WAN_T2V, num_attention_heads=12, ffn_dim=8960,
                                                                num_layers=30)),
                     text_encoder=("UMT5EncoderModel", _UMT5_XXL), vae=("AutoencoderKLWan", {})),
    "wan-14b": dict(transformer=("WanTransformer3DModel", dict(_WAN_T2V, num_attention_heads=40, ffn_dim=13824,
                                                               num_layers=40)),
                    text_encoder=("UMT5EncoderModel", _UMT5_XXL), vae=("AutoencoderKLWan", {})),
}


# ----------------------------------------------------------------------------- records (families.MODELS)

WAN = dict(name="wan", load=load, hub_id=WAN_ID, hub=True, multiple=16,
           preset=dict(common.HUB, guidance_scale=5.0),  # WanPipeline.__call__'s guidance_scale (2.1, 2.2, the 5B)
           preset_notes=dict(guidance_scale="WanPipeline.__call__'s default"),
           tokens=512, shape=shape, noise=noise, encode=encode, velocity=velocity, decode=decode, sigmas=sigmas,
           lora_targets=LORA_TARGETS, video=True, temporal=4)  # AutoencoderKLWan's (and Wan 2.2's) 4x
TINY = dict(WAN, load=tiny, hub_id=None, hub=False, preset=dict(common.TINY, num_frames=5),  # 5 frames: 2 latent
            preset_notes=None)
WAN22 = dict(WAN, load=load_a14b, hub_id=WAN22_ID, trained=("transformer", "transformer_2"))
TINY22 = dict(WAN22, load=tiny_a14b, hub_id=None, hub=False, preset=TINY["preset"], preset_notes=None)


# ----------------------------------------------------------------------------- Wan 2.2 TI2V-5B
# `wan2.2-5b` and `tiny-wan2.2-5b`: Wan 2.1's adapter (encode, shape, noise, decode, sigmas) where the 5B only changes
# sizes, and its own velocity (per-token timesteps). Checked against WanPipeline.__call__ with expand_timesteps
# (diffusers/pipelines/wan/pipeline_wan.py) and AutoencoderKLWan's patchify (models/autoencoders/autoencoder_kl_wan.py)
# by tests/test_video_families.py.

WAN22_5B_ID = "Wan-AI/Wan2.2-TI2V-5B-Diffusers"
# Wan 2.2's VAE, as diffusers' scripts/convert_wan_to_diffusers.py (vae22_diffusers_config) writes the hub repo's
# vae/config.json: 48 latent channels, 8x spatial convolutions on a 2 x 2-patchified (12-channel) input: 16x in all
_VAE22 = dict(
    base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True, in_channels=12, out_channels=12, patch_size=2,
    scale_factor_temporal=4, scale_factor_spatial=16,
    latents_mean=[-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
                  0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
                  -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
                  -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681,
                  -0.0667],
    latents_std=[0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901, 0.6885,
                 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659, 0.7069, 0.5338,
                 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458,
                 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744])


def load_5b(model_path=None, dtype=torch.float32, device="cpu"):
    """Wan 2.2 TI2V-5B text to video (`Wan-AI/Wan2.2-TI2V-5B-Diffusers`): one dense transformer of Wan's architecture
    (30 blocks of width 3072) on the Wan 2.2 VAE; WanPipeline with expand_timesteps (the hub config's).

    Where it differs from Wan 2.1 (load's conventions hold otherwise): latents [B, 48, F', H/16, W/16] with
    F' = (F - 1) / 4 + 1, the VAE's 16x being a 2 x 2 patchify of the pixels (12 channels) and 8x convolutions, so a
    token (1 x 2 x 2 latent patch) is 32 x 32 px and sides are multiples of 32; the timestep is one per token,
    [B, F' (H/32)(W/32)], each floor(1000 s) (WanPipeline.__call__'s expand_timesteps branch: a mask of ones over the
    tokens times t; its image-to-video use sets the first frame's tokens to 0, text to video none); the transformer
    embeds it per token (WanTransformer3DModel.forward, timestep.ndim == 2). UniPC flow sigmas with flow_shift 5
    (convert_wan_to_diffusers.py for TI2V). The decode undoes the VAE's per-channel latents_mean / latents_std of 48
    channels, then AutoencoderKLWan.decode unpatchifies; the VAE is kept in float32 whatever `dtype`, as load.
    """
    from diffusers import WanPipeline

    pipe = common.from_pretrained(WanPipeline, "wan2.2-5b", model_path or WAN22_5B_ID, WAN22_5B_ID, dtype)
    pipe.vae.to(torch.float32)
    return pipe


def tiny_5b(model_path=None, dtype=torch.float32, device="cpu"):
    """Wan 2.2 TI2V-5B at toy size: tiny-wan's tokenizer and UMT5 encoder, 2 blocks of width 24 (2 heads) on 48
    channels, the Wan 2.2 VAE at base width 8 with its published patchify, compression and latent statistics; UniPC
    with flow_shift 5 and expand_timesteps, as the hub pipeline; seed 0."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    common.check_no_path("tiny-wan2.2-5b", model_path)
    base = tiny(device=device)  # its tokenizer and text encoder
    with common.seeded_build(0, device):
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=48, out_channels=48,
            text_dim=32, freq_dim=32, ffn_dim=48, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32).eval()
        vae = AutoencoderKLWan(**dict(_VAE22, base_dim=8, decoder_base_dim=8, dim_mult=[1, 1, 1, 1],
                                      num_res_blocks=1)).eval()
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=5.0)
    pipe = WanPipeline(tokenizer=base.tokenizer, text_encoder=base.text_encoder, vae=vae, scheduler=scheduler,
                       transformer=transformer, expand_timesteps=True)
    if dtype != torch.float32:
        pipe.to(dtype=dtype)
        pipe.vae.to(torch.float32)  # as load_5b
    return pipe


def velocity_5b(pipe, modules, x, sigma, embeds, guidance_scale):
    """The 5B's transformer on per-token timesteps: each sample's floor(1000 s) (UniPC's integer timestep, as Wan 2.1)
    for every one of its F' (h / 2)(w / 2) tokens, float32 [B, L], as WanPipeline.__call__ builds it under
    expand_timesteps (`mask[0][0][:, ::2, ::2] * t`, flattened); true CFG on batched halves."""
    _, ph, pw = pipe.transformer.config.patch_size
    tokens = x.shape[2] * (x.shape[3] // ph) * (x.shape[4] // pw)
    timestep = _timestep(pipe, sigma).float()[:, None].expand(-1, tokens)  # [B, L]
    return _velocity(pipe, modules["transformer"], x, sigma, embeds, guidance_scale, timestep=timestep)


# from the hub repo's transformer/config.json (convert_wan_to_diffusers.py, "Wan2.2-TI2V-5B"), UMT5-XXL and _VAE22
PUBLISHED["wan2.2-5b"] = dict(
    transformer=("WanTransformer3DModel", dict(_WAN_T2V, in_channels=48, out_channels=48, num_attention_heads=24,
                                               ffn_dim=14336, num_layers=30)),
    text_encoder=("UMT5EncoderModel", _UMT5_XXL), vae=("AutoencoderKLWan", _VAE22))

# Flow-GRPO's train_wan2_1.py targets (LORA_TARGETS): the same attention projections in every block of the 5B
WAN22_5B = dict(WAN, load=load_5b, hub_id=WAN22_5B_ID, multiple=32, velocity=velocity_5b)
TINY22_5B = dict(WAN22_5B, load=tiny_5b, hub_id=None, hub=False, preset=TINY["preset"], preset_notes=None)
