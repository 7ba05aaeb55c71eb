"""Z-Image: `z-image` (`Tongyi-MAI/Z-Image`; `Z-Image-Turbo` by --model-path) and `tiny-z-image`.

Checked against diffusers/pipelines/z_image/pipeline_z_image.py (ZImagePipeline.__call__) by tests/test_families.py;
the conventions are load's docstring (its output sign and its guidance count differ from ours, and are converted
here).
"""

import torch

from families import common

Z_IMAGE_ID = "Tongyi-MAI/Z-Image"
# Flow-Factory's z_image adapter: attention and SwiGLU MLP of every layer
LORA_TARGETS = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


def load(model_path=None, dtype=torch.float32, device="cpu"):
    """Z-Image (`Tongyi-MAI/Z-Image`, a 6 B single-stream DiT with a Qwen3-4B text encoder;
    `Tongyi-MAI/Z-Image-Turbo`, step-distilled, by --model-path with --guidance-scale 1).

    Conventions: latents [B, 16, H/8, W/8] (unpacked; the transformer patches 2 x 2 and takes a
    list of [C, 1, h, w]). The network is conditioned on t = 1 - s (the pipeline passes
    (1000 - t) / 1000) and predicts x0 - eps: the pipeline negates its output before the Euler
    step, and so do we. Guidance: the pipeline's guidance_scale w counts from 0
    (pred = c + w (c - u)), which is our g = 1 + w: `--guidance-scale 5` here is the pipeline's 4.
    CFG-truncation and -normalisation are left at the pipeline's defaults (off). Text: the
    second-to-last Qwen3 hidden layer over the chat-templated prompt (thinking enabled, so no
    empty think block), padded to max_sequence_length (512, the pipeline's default) for the encoder
    and then cut to each prompt's own tokens (kept here as a zero-padded tensor and a mask).
    Native schedule: linspace(1, 1/N, N) shifted by the scheduler (static shift 3 for Z-Image-Turbo;
    the pipeline also passes a resolution-dependent mu, used only when the config shifts
    dynamically), then 0.
    """
    from diffusers import ZImagePipeline

    return common.from_pretrained(ZImagePipeline, "z-image", model_path or Z_IMAGE_ID, Z_IMAGE_ID, dtype)


def tiny(model_path=None, dtype=torch.float32, device="cpu"):
    """Z-Image at toy size: 2 main and 1 refiner layers of width 32 (2 heads), a 2-layer Qwen3 of width
    16, a 4x VAE with 16 channels and FLUX.1's scaling; static shift 3 (Z-Image-Turbo's scheduler);
    seed 0. The transformer's padding tokens, left uninitialised by diffusers, are drawn from the seed."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Model

    common.check_no_path("tiny-z-image", model_path)
    tokenizer = common.qwen_tokenizer(128)
    with common.seeded_build(0, device):
        text_encoder = common.qwen3_encoder(Qwen3Model, len(tokenizer), 16, 2)
        transformer = ZImageTransformer2DModel(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=1,
            n_heads=2, n_kv_heads=2, qk_norm=True, cap_feat_dim=16, axes_dims=[8, 4, 4], axes_lens=[256, 32, 32]).eval()
        with torch.no_grad():
            transformer.x_pad_token.normal_()
            transformer.cap_pad_token.normal_()
        vae = common.small_vae(16, 0.3611, 0.1159)  # FLUX.1's VAE scaling and shift, which Z-Image reuses
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


def shape(pipe, height, width, num_frames):
    common.no_frames(num_frames)
    f = pipe.vae_scale_factor
    common.check_multiple(height, width, 2 * f)
    return (pipe.transformer.in_channels, height // f, width // f)


def noise(pipe, batch, height, width, num_frames, generator):
    from diffusers.utils.torch_utils import randn_tensor

    return randn_tensor((batch, *shape(pipe, height, width, num_frames)), generator=generator,
                        device=pipe._execution_device, dtype=torch.float32)


def encode(pipe, prompts, negative_prompt, guidance_scale, tokens):
    def encode_texts(texts):
        # ZImagePipeline._encode_prompt writes the chat template into the list it is given: pass a copy
        per_prompt = pipe._encode_prompt(list(texts), device=pipe._execution_device, max_sequence_length=tokens)
        length = max(len(e) for e in per_prompt)
        embeds = torch.stack([torch.nn.functional.pad(e, (0, 0, 0, length - len(e))) for e in per_prompt])
        mask = torch.stack([torch.arange(length) < len(e) for e in per_prompt])  # on the CPU (host_mask)
        return {"prompt_embeds": embeds, "prompt_mask": mask}

    out = encode_texts(prompts)
    if guidance_scale <= 1:
        return out
    return common.with_negative(out, encode_texts, negative_prompt, len(prompts), masked=True)


def velocity(pipe, modules, x, sigma, embeds, guidance_scale):
    model = modules["transformer"]
    dtype = pipe.transformer.dtype
    keys = ["prompt_embeds", "prompt_mask"]
    text, mask = common.cfg_halves(embeds, keys) if guidance_scale > 1 else [embeds[k] for k in keys]
    if guidance_scale > 1:
        x, sigma = torch.cat([x, x]), torch.cat([sigma, sigma])
    # each prompt's own tokens, as the pipeline passes them: the first n of its right-padded row (the same as e[m]),
    # n counted on the CPU (host_mask), where e[m] on a GPU would wait for the mask's nonzero at every forward
    captions = [e[:n].to(dtype) for e, n in zip(text, mask.sum(1).tolist())]
    out = model(x=list(x.to(dtype).unsqueeze(2).unbind(0)), t=1 - sigma, cap_feats=captions,  # float32 t, as there
                return_dict=False)[0]
    pred = torch.stack([o.float() for o in out]).squeeze(2)  # predicts x0 - eps
    if guidance_scale > 1:
        pred, _ = common.guided(pred, guidance_scale)  # the pipeline's cond + w (cond - uncond), with its w = g - 1
    return -pred  # eps - x0, our sign


@torch.no_grad()
def decode(pipe, latents):
    return common.decode_kl(pipe.vae, latents)


def sigmas(pipe, num_steps, height, width, shift):
    base = torch.linspace(1.0, 1 / num_steps, num_steps).numpy()  # get_default_z_image_sigmas: float32 linspace
    mu = common.dynamic_shift_mu(pipe.scheduler.config, common.image_tokens(pipe, height, width))
    return common.flow_match_sigmas(pipe.scheduler.config, base, mu=mu, shift=shift)


# ----------------------------------------------------------------------------- published configs
# name -> component -> (class, config), from the hub repo's config.json files; {}: the diffusers class defaults, which
# are the published model
PUBLISHED = {"z-image": dict(transformer=("ZImageTransformer2DModel", {}),
                             text_encoder=("Qwen3Model", common.QWEN3_4B), vae=("AutoencoderKL", common.KL_16))}


# ----------------------------------------------------------------------------- records (families.MODELS)

Z_IMAGE = dict(name="z-image", load=load, hub_id=Z_IMAGE_ID, hub=True, multiple=16, preset=common.HUB,
               tokens=512, shape=shape, noise=noise, encode=encode, velocity=velocity, decode=decode, sigmas=sigmas,
               lora_targets=LORA_TARGETS)
TINY = dict(Z_IMAGE, load=tiny, hub_id=None, hub=False, multiple=8, preset=common.TINY)
