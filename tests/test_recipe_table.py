"""Every recipe against the authors' settings, transcribed from their code, so that no recipe drifts silently.

Sources (read at these commits):
  flow_grpo   github.com/yifan123/flow_grpo at 9745241 (Nov 2025, the merge of GRPO-Guard's pull request #175):
              config/base.py get_config (defaults), config/grpo.py, config/grpo_guard.py, scripts/train_sd3.py,
              scripts/train_sd3_fast.py, scripts/train_sd3_GRPO_Guard.py, flow_grpo/ema.py
  flow_grpo   (edits) config/grpo.py counting_flux_kontext, counting_qwenimage_edit(_fast) at 31c71b9;
              scripts/train_flux_kontext.py at 74db691; scripts/train_qwenimage_edit.py as the fork
              github.com/andressrg/flow_grpo carries it at 600c14a
  MixGRPO     github.com/Tencent-Hunyuan/MixGRPO at e5cdd6a: scripts/finetune/finetune_flux_grpo_MixGRPO.sh,
              finetune_flux_grpo_MixGRPO_Flash.sh, fastvideo/train_grpo_flux.py, fastvideo/utils/sampling_utils.py
  DiffusionNFT github.com/NVlabs/DiffusionNFT at 24af555: config/base.py, config/nft.py, scripts/train_nft_sd3.py,
              flow_grpo/ema.py
  AWM         github.com/scxue/advantage_weighted_matching at be51372: advantage_weighted_matching/config/base_awm.py,
              config/dgx_awm.py, scripts/train_sd3_awm.py, flow_grpo/ema.py
  UniRL       github.com/Tencent-Hunyuan/UniRL at 1a7b501 (FlowDPPO): examples/diffusion/sd3_flowdppo.yaml,
              FlowDPPO/config.yaml, unirl/algorithms/flowdppo.py, unirl/utils/scheduler_utils.py, unirl/train/stack.py,
              unirl/types/rollout_resp.py, unirl/models/sd3/text_embed.py

How the authors' knobs map onto train.py's flags:
  sample.num_image_per_prompt -> --group-size; the 48 (64) in num_batches_per_epoch = 48 / (gpus x batch / images
  per prompt) -> --prompts-per-step; sample.train_batch_size / train.batch_size -> --sample-batch-size /
  --train-batch-size; gradient_accumulation_steps = num_batches_per_epoch // 2, i.e. two optimizer steps per
  epoch -> --minibatches 2; num_inner_epochs -> --updates-per-batch; noise_level -> --eta; train.cfg ->
  --train-cfg; train.beta -> --kl-beta (Flow-GRPO's form, --kl-form flow-grpo); sample.global_std -> --global-std;
  train.ema with EMAModuleWrapper(decay=0.9, update_step_interval=8) in train_sd3.py -> --ema-decay 0.9
  --ema-every 8, and since train_sd3.py steps it after every micro-batch, each due update is applied once per
  accumulated micro-batch: gradient_accumulation_steps = 2 on general_ocr_sd3's 32 GPUs, 4 on GRPO-Guard's 16
  -> --ema-repeat 2 / 4; sample.same_latent / MixGRPO --init_same_noise -> --same-noise-per-group;
  rationorm -> --loss guard;
  sde_window_size / sde_window_range -> --window-size / --window-range (sde_type "cps" -> --sde cps).
  MixGRPO: --num_generations -> --group-size; 32 GPUs x --train_batch_size 1 -> --prompts-per-step 32;
  12 images per GPU / --gradient_accumulation_steps 3 = 4 optimizer steps -> --minibatches 4 of per-GPU micro-batches
  of 1; --group_size (window) / --prog_overlap_step / --iters_per_group -> --window-size / --window-stride /
  --iters-per-window; --use_group -> --no-global-std; FSDP over the fp32 transformer -> --lora-rank 0 --fsdp;
  --dpm_post_compress_ratio -> --flash-ratio; --max_train_steps / --checkpointing_steps -> --steps / --save-every.
  DiffusionNFT: config.beta -> --nft-beta; decay_type 1 / 2 -> --old-decay nft / nft-ocr; sample.solver "dpm2" ->
  --sampler dpm2; train.beta -> --kl-beta (velocity space); gradient_step_per_epoch -> --minibatches; its
  EMAModuleWrapper(decay 0.9, interval 1) stepped after each optimizer step -> --ema-decay 0.9 --ema-every 1
  --ema-repeat 1; the per-GPU batch of 9 (the bsz search of _get_config on 8 GPUs) -> --sample-batch-size 9.
  AWM: train.weighting / ghuber_power -> --awm-weighting / --ghuber-power; train_timesteps / time_type /
  timestep_fraction -> --train-timesteps / --awm-timesteps / --timestep-fraction; train.beta / ema_beta ->
  --kl-beta / --ema-kl-beta; kl_ema_decay 0.3 'linear' -> --old-decay awm; ema_decay 0.99 stepped once per epoch (one
  optimizer step) -> --ema-decay 0.99 --ema-every 1 --ema-repeat 1; its SA-Solver -> --sampler dpm2 (a departure).
  UniRL (FlowDPPO): batch_size (prompts_per_rollout) -> --prompts-per-step; samples_per_prompt -> --group-size;
  forward_batch_size / stack.micro_batch_size -> --sample-batch-size / --train-batch-size; num_updates_per_batch,
  which splits the batch into that many disjoint mini-batches of one optimizer step each (stack.py L91-108) ->
  --minibatches; kl_mask_threshold -> --kl-mask-threshold; adv_use_global_std -> --global-std; eta -> --eta;
  AllSDEScheduler num_sde_steps / timestep_fraction [0, 0.5] -> --window-size 3 --window-range 0 5.
  Text: train_sd3.py encodes with max_sequence_length=128; MixGRPO's preprocess_flux_embedding.py with FluxPipeline's
  default 512. Schedule: SD3.5-M's scheduler shift 3 (the pipeline's own, both authors); MixGRPO samples FLUX with
  a static shift 3 on linspace(1, 0, 26) (sd3_time_shift in train_grpo_flux.py), which --shift 3 gives in place
  of FluxPipeline's resolution-dependent shift (exp(mu) = 2.22 at 720 px).
"""
import glob
import os
import shlex

import pytest

import losses
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "recipes", "*.args")))

# flow_grpo config/grpo.py general_ocr_sd3 over config/base.py get_config, as scripts/train_sd3.py runs it.
FLOW_GRPO_OCR = dict(
    model="sd3", resolution=512, shift=3.0, max_sequence_length=128, num_steps=10, eval_steps=40, guidance_scale=4.5,
    train_cfg=True, sde="flow", eta=0.7,
    timestep_fraction=0.99, sde_window="all", group_size=24, prompts_per_step=48, sample_batch_size=9,
    train_batch_size=9, minibatches=2, updates_per_batch=1, loss="grpo", clip_range=1e-4, adv_clip=5.0, kl_beta=0.04,
    kl_form="flow-grpo", global_std=True, same_noise_per_group=False, lora_rank=32, lora_alpha=64.0, lr=3e-4,
    weight_decay=1e-4, max_grad_norm=1.0, mixed_precision="fp16", ema_decay=0.9, ema_every=8, ema_repeat=2,
    eval_every=60,
    save_every=60, reward="ocr")
# flow_grpo config/grpo_guard.py general_ocr_sd3_rationorm (scripts/train_sd3_GRPO_Guard.py).
GUARD_OCR = dict(FLOW_GRPO_OCR, loss="guard", clip_range=2e-6, lr=1e-4, kl_beta=0.0, global_std=False, eval_every=30,
                 save_every=30, ema_repeat=4)  # 16 GPUs: 8 rollout batches, gradient accumulation 4
GUARD_OCR.pop("kl_form")  # no KL term
# MixGRPO scripts/finetune/finetune_flux_grpo_MixGRPO.sh (fastvideo/train_grpo_flux.py, utils/sampling_utils.py).
MIXGRPO = dict(
    model="flux", resolution=720, max_sequence_length=512, num_steps=25, shift=3.0, guidance_scale=3.5,
    train_cfg=False,
    sde="flow", eta=0.7,
    sde_window="mix", window_size=4, window_stride=1, iters_per_window=25, roll_back=True, flash=False, group_size=12,
    prompts_per_step=32, same_noise_per_group=True, global_std=False, train_batch_size=1, minibatches=4,
    updates_per_batch=1, loss="grpo", clip_range=1e-4, adv_clip=5.0, kl_beta=0.0, lora_rank=0, fsdp=True,
    gradient_checkpointing=True, lr=1e-5, weight_decay=1e-4, max_grad_norm=1.0, mixed_precision="bf16", steps=300,
    save_every=50, reward="hps=1,imagereward=1,pickscore=1", reward_combine="advantage", hps_version="v2.1")
# (reward: its reward_model "multi_reward" with hps_weight, image_reward_weight, pick_score_weight 1.0 and
# multi_reward_mix "advantage_aggr", finetune_flux_grpo_MixGRPO.sh L45-64.)
# DiffusionNFT config/nft.py sd3_geneval over _get_config and config/base.py (scripts/train_nft_sd3.py).
NFT_GENEVAL = dict(
    model="sd3", resolution=512, shift=3.0, max_sequence_length=128, num_steps=10, eval_steps=40, guidance_scale=1.0,
    sampler="dpm2", timestep_fraction=0.99, group_size=24, prompts_per_step=48, sample_batch_size=9,
    train_batch_size=9, minibatches=1, updates_per_batch=1, loss="nft", nft_beta=1.0, nft_adaptive=True,
    old_decay="nft", adv_clip=5.0, kl_beta=1e-4, global_std=True, same_noise_per_group=False, lora_rank=32,
    lora_alpha=64.0, lr=3e-4, weight_decay=1e-4, max_grad_norm=1.0, mixed_precision="fp16", ema_decay=0.9,
    ema_every=1, ema_repeat=1, eval_every=10, save_every=30, reward="geneval")
# AWM config/dgx_awm.py geneval_sd3_no_cfg_1node over config/base_awm.py (scripts/train_sd3_awm.py).
AWM_GENEVAL = dict(
    model="sd3", resolution=512, shift=3.0, max_sequence_length=128, num_steps=14, eval_steps=40, guidance_scale=1.0,
    sampler="dpm2", timestep_fraction=0.9, group_size=24, prompts_per_step=72, sample_batch_size=6,
    train_batch_size=3, minibatches=1, updates_per_batch=1, loss="awm", awm_weighting="ghuber", ghuber_power=0.25,
    train_timesteps=6, awm_timesteps="discrete_wo_init", clip_range=1.0, adv_clip=5.0, kl_beta=1e-3, ema_kl_beta=1.0,
    old_decay="awm", global_std=True, same_noise_per_group=False, lora_rank=32, lora_alpha=64.0, lr=3e-4,
    weight_decay=1e-4, max_grad_norm=1.0, mixed_precision="fp16", ema_decay=0.99, ema_every=1, ema_repeat=1,
    eval_every=50, save_every=50, reward="geneval")

# flow_grpo config/grpo.py counting_flux_kontext (scripts/train_flux_kontext.py): 28 GPUs x 12 rollout batches of 3
# for 48 prompts x 21; gradient accumulation 6, so two optimizer steps and an EMA repeat of 6; LoRA r64 / alpha 128;
# its compute_text_embeddings encodes 128 T5 tokens; no KL (beta 0). Reward: 0.5 GenEval (on JPEG-compressed samples,
# flow_grpo/rewards.py L241-245) + 0.5 image_similarity (config/grpo.py L686).
KONTEXT_COUNTING = dict(
    model="flux-kontext", resolution=512, max_sequence_length=128, num_steps=6, eval_steps=28, guidance_scale=2.5,
    train_cfg=False, sde="flow", eta=0.9, sde_window="all", timestep_fraction=0.99, group_size=21, prompts_per_step=48,
    same_noise_per_group=False, sample_batch_size=3, train_batch_size=3, minibatches=2, updates_per_batch=1,
    loss="grpo", clip_range=1e-4, adv_clip=5.0, kl_beta=0.0, global_std=True, lora_rank=64, lora_alpha=128.0, lr=3e-4,
    weight_decay=1e-4, max_grad_norm=1.0, mixed_precision="bf16", ema_decay=0.9, ema_every=8, ema_repeat=6,
    eval_every=30, save_every=30, reward="geneval=0.5,image_similarity=0.5", geneval_jpeg=True)
# flow_grpo config/grpo.py counting_qwenimage_edit (scripts/train_qwenimage_edit.py): 32 GPUs x 4 rollout batches of 4
# for 32 prompts x 16; true CFG 4 in rollout and training with the negative prompt " "; sde_window_size 0 trains
# num_steps - 1 = 9 steps; EMA off; LoRA r64 / alpha 128; activation checkpointing. Reward: 0.8 GenEval (on
# JPEG-compressed samples) + 0.2 image_similarity (config/grpo.py L818, L860 for the Fast one).
QWEN_EDIT_COUNTING = dict(
    model="qwen-image-edit", resolution=512, num_steps=10, eval_steps=50, guidance_scale=4.0, train_cfg=True,
    negative_prompt=" ", sde="flow", eta=1.0, sde_window="all", timestep_fraction=1.0, group_size=16,
    prompts_per_step=32, same_noise_per_group=False, sample_batch_size=4, train_batch_size=4, minibatches=2,
    updates_per_batch=1, loss="grpo", clip_range=1e-4, adv_clip=5.0, kl_beta=0.0, global_std=True, lora_rank=64,
    lora_alpha=128.0, lr=3e-4, weight_decay=1e-4, max_grad_norm=1.0, mixed_precision="bf16", ema_decay=0.0,
    gradient_checkpointing=True, eval_every=30, save_every=60, reward="geneval=0.8,image_similarity=0.2",
    geneval_jpeg=True)

TABLE = {
    "sd3_ocr_grpo.args": ("flow_grpo config/grpo.py general_ocr_sd3", FLOW_GRPO_OCR),
    "sd3_pickscore_grpo.args": ("flow_grpo config/grpo.py pickscore_sd3",
                                dict(FLOW_GRPO_OCR, kl_beta=0.01, reward="pickscore")),
    "sd3_fast_nocfg_cps.args": ("flow_grpo config/grpo.py pickscore_sd3_fast_nocfg (scripts/train_sd3_fast.py)",
                                {**{k: v for k, v in FLOW_GRPO_OCR.items()
                                    if k not in ("timestep_fraction", "kl_form")},
                                 **dict(guidance_scale=1.0, train_cfg=False, sde="cps", eta=0.8, sde_window="fast",
                                        window_size=3, window_range=[0, 5], group_size=18, prompts_per_step=64,
                                        clip_range=1e-5, kl_beta=0.0, reward="pickscore")}),
    "sd3_guard_ocr.args": ("flow_grpo config/grpo_guard.py general_ocr_sd3_rationorm", GUARD_OCR),
    "sd3_guard_pickscore.args": ("flow_grpo config/grpo_guard.py pickscore_hps_sd3_ratio_norm",
                                 dict(GUARD_OCR, clip_range=4e-6, reward="pickscore")),
    "flux_mixgrpo.args": ("MixGRPO scripts/finetune/finetune_flux_grpo_MixGRPO.sh", MIXGRPO),
    "flux_mixgrpo_flash.args": ("MixGRPO scripts/finetune/finetune_flux_grpo_MixGRPO_Flash.sh",
                                dict(MIXGRPO, iters_per_window=20, flash=True, flash_ratio=0.4)),
    # scripts/train_wan2_1.py: one GPU, 2 batches of 8 videos, an optimizer step after each (accumulation 1); its KL
    # divides by the transition std itself (wan_pipeline_with_logprob.py returns std_dev_t and sqrt(-dt)): exact.
    "wan_ocr_grpo.args": ("flow_grpo config/grpo.py general_ocr_wan2_1 (scripts/train_wan2_1.py)", dict(
        model="wan", resolution=[240, 416], num_frames=33, num_steps=20, eval_steps=50, guidance_scale=4.5,
        train_cfg=True, timestep_fraction=0.99, sde_window="all", group_size=4, prompts_per_step=4,
        sample_batch_size=8, train_batch_size=8, minibatches=2, updates_per_batch=1, loss="grpo", clip_range=1e-3,
        adv_clip=5.0, kl_beta=0.004, kl_form="exact", global_std=False, same_noise_per_group=False, lora_rank=32,
        lora_alpha=64.0, lr=1e-4, weight_decay=1e-4, max_grad_norm=1.0, mixed_precision="bf16", ema_decay=0.9,
        ema_every=8, ema_repeat=1, eval_every=30, save_every=60, max_sequence_length=512, reward="ocr",
        step_loss_weight="wan")),
    # scripts/train_qwenimage.py (LoraConfig r=64, alpha 128); EMA off (train.ema False). The window: sde_window_range
    # (0, 5) in the config, but qwenimage_pipeline_with_logprob.py seeds its draw with random.seed(process_index)
    # (L138) and train_qwenimage.py never passes it (L657-670; default 0, L32): random.seed(0); randint(0, 3) = 3, so
    # steps 3-4 on every batch, which --window-range 3 5 (a start drawn from 3 .. 3) reproduces.
    "qwen_image_pickscore_grpo.args": ("flow_grpo config/grpo.py pickscore_qwenimage (train_qwenimage.py)", dict(
        model="qwen-image", resolution=512, num_steps=10, eval_steps=50, guidance_scale=4.0, train_cfg=True,
        sde="flow", eta=1.2, sde_window="fast", window_size=2, window_range=[3, 5], group_size=16,
        prompts_per_step=32, same_noise_per_group=False, sample_batch_size=4, train_batch_size=4, minibatches=2,
        updates_per_batch=1, loss="grpo", clip_range=1e-4, adv_clip=5.0, kl_beta=0.0, global_std=True, lora_rank=64,
        lora_alpha=128.0, lr=3e-4, weight_decay=1e-4, max_grad_norm=1.0, mixed_precision="bf16", ema_decay=0.0,
        gradient_checkpointing=True, eval_every=30, save_every=30, reward="pickscore")),
    "flux_kontext_counting_grpo.args": ("flow_grpo config/grpo.py counting_flux_kontext (train_flux_kontext.py)",
                                        KONTEXT_COUNTING),
    "qwen_image_edit_counting_grpo.args": ("flow_grpo config/grpo.py counting_qwenimage_edit (train_qwenimage_edit.py)",
                                           QWEN_EDIT_COUNTING),
    "qwen_image_edit_counting_fast.args": ("flow_grpo config/grpo.py counting_qwenimage_edit_fast",
                                           {**{k: v for k, v in QWEN_EDIT_COUNTING.items() if k != "timestep_fraction"},
                                            **dict(eta=1.5, sde_window="fast", window_size=4, window_range=[0, 5])}),
    # Not published runs, but built on a published config whose every other setting they keep.
    # The GenEval rewards: DiffusionNFT's detects on the raw pixels (flow_grpo/rewards.py geneval_score L113-139), AWM's
    # on each image after a JPEG round trip at PIL's default quality (its flow_grpo/rewards.py L189-196).
    "sd3_nft_geneval.args": ("DiffusionNFT config/nft.py sd3_geneval", dict(NFT_GENEVAL, geneval_jpeg=False)),
    "sd3_nft_pickscore.args": ("DiffusionNFT config/nft.py sd3_pickscore", dict(NFT_GENEVAL, reward="pickscore")),
    "sd3_nft_ocr.args": ("DiffusionNFT config/nft.py sd3_ocr",
                         dict(NFT_GENEVAL, reward="ocr", nft_beta=0.1, old_decay="nft-ocr", minibatches=2)),
    "sd3_awm_geneval.args": ("AWM config/dgx_awm.py geneval_sd3_no_cfg_1node", dict(AWM_GENEVAL, geneval_jpeg=True)),
    "sd3_awm_ocr.args": ("AWM config/dgx_awm.py ocr_sd3_no_cfg_1node",
                         dict(AWM_GENEVAL, reward="ocr", kl_beta=0.003, eval_every=20, save_every=20)),
    "sd3_awm_pickscore.args": ("AWM config/dgx_awm.py pickscore_sd3_no_cfg_1node",
                               dict(AWM_GENEVAL, reward="pickscore", kl_beta=1e-4, prompts_per_step=24,
                                    train_batch_size=2, awm_timesteps="discrete")),
    "sd3_hps_grpo.args": ("flow_grpo config/grpo.py pickscore_sd3, HPSv2.1 reward",
                          dict(FLOW_GRPO_OCR, kl_beta=0.01, reward="hps")),
    "sd3_ocr_pickscore_mix.args": ("flow_grpo config/grpo.py general_ocr_sd3, OCR 0.8 + PickScore 0.2 reward",
                                   dict(FLOW_GRPO_OCR, reward="ocr=0.8,pickscore=0.2")),
}
# UniRL examples/diffusion/sd3_flowdppo.yaml (1a7b501): L19-20 8 GPUs, 48 prompts; L27 adv_use_global_std; L38
# shift 3; L46-47 FlowSDEStrategy; L64-68 lr 3e-4, weight_decay 0; L76-89 LoRA r32 / alpha 64, the 8 attention
# projections; L94 forward_batch_size 8; L103 PickScore batch 8; L116-117 kl_mask_threshold 1e-5, add_kl_coefficient;
# L121-123 micro-batches of 8, max_grad_norm 1, num_updates_per_batch 2; L137-152 10 steps, guidance 1.0, 512 px,
# eta 0.7, 16 per prompt, init_same_noise false, 3 SDE steps in timestep_fraction [0, 0.5]; L14-16 no EMA; no KL to
# the base (flowdppo.py has none); unirl/models/sd3/text_embed.py L44 T5 max_sequence_length 256.
TABLE["sd3_flowdppo_pickscore.args"] = ("UniRL examples/diffusion/sd3_flowdppo.yaml (algorithms/flowdppo.py)", dict(
    model="sd3", resolution=512, shift=3.0, max_sequence_length=256, num_steps=10, guidance_scale=1.0, sde="flow",
    eta=0.7, sde_window="sparse", window_size=3, window_range=[0, 5], same_noise_per_group=False, group_size=16,
    prompts_per_step=48, sample_batch_size=8, train_batch_size=8, minibatches=2, updates_per_batch=1,
    loss="flowdppo", kl_mask_threshold=1e-5, kl_beta=0.0, global_std=True, lora_rank=32, lora_alpha=64.0, lr=3e-4,
    weight_decay=0.0, max_grad_norm=1.0, mixed_precision="bf16", ema_decay=0.0, reward="pickscore",
    pickscore_batch_size=8))
# flow_grpo config/sft.py and config/dpo.py geneval_sd3 over config/base.py (scripts/train_sd3_sft.py, train_sd3_dpo.py,
# launched on one GPU by scripts/single_node/dpo.sh): 24 images of one prompt per step, one micro-batch and one
# optimizer step (gradient_accumulation_steps 1 x the 39 timesteps), int(40 x 0.99) = 39 training draws per sample,
# the "ref" snapshot never refreshed (ref_update_step 10000000), its EMA (0.9, interval 8) stepped once per optimizer
# step, the training forward without CFG (L906-912), train_sd3_*.py's compute_text_embeddings at 128 tokens; DPO's
# beta 100 (train.beta, which SFT's loss does not read). Departure: dpm2 rollouts for its SDE at noise level 0.7.
FLOW_GRPO_SFT = dict(
    model="sd3", resolution=512, shift=3.0, max_sequence_length=128, num_steps=40, eval_steps=40, guidance_scale=4.5,
    train_cfg=False, sampler="dpm2", timestep_fraction=0.99, group_size=24, prompts_per_step=1, sample_batch_size=24,
    train_batch_size=24, minibatches=1, updates_per_batch=1, loss="sft", old_decay="copy", ref_update_every=10000000,
    kl_beta=0.0, lora_rank=32, lora_alpha=64.0, lr=3e-4, weight_decay=1e-4, max_grad_norm=1.0, mixed_precision="fp16",
    ema_decay=0.9, ema_every=8, ema_repeat=1, eval_every=40, save_every=40, reward="geneval", geneval_jpeg=True)
TABLE["sd3_sft_geneval.args"] = ("flow_grpo config/sft.py geneval_sd3 (scripts/train_sd3_sft.py)", FLOW_GRPO_SFT)
TABLE["sd3_dpo_geneval.args"] = ("flow_grpo config/dpo.py geneval_sd3 (scripts/train_sd3_dpo.py)",
                                 dict(FLOW_GRPO_SFT, loss="dpo", dpo_beta=100.0))
# Flow-Factory examples/dgpo/lora/sd3_5/default.yaml (a0b2bc5; src/flow_factory/trainers/dgpo.py, hparams/
# training_args.py DGPOTrainingArguments): 4 GPUs (num_processes), per_device_batch_size 12, group_size 24,
# unique_sample_num_per_epoch 24, gradient_step_per_epoch 1; dpo_beta 10, use_ema_ref false (the base), clip_dsm with
# clip_range 5e-2 (symmetric), switch_ema_ref 200, ema_ref decay min(0.3, 0.001 k); 'discrete' times, 4 strata of
# timestep_range 0.6, the timesteps >= 400 (noise_schedule.py L185-259): SD3's 10-step indices 0 .. 7, which
# --timestep-fraction reads as 0.7 (a fraction of the indices; tests/test_fidelity5.py draws both alike); kl_beta 1e-3
# v-based; adv_clip_range 5; global_std; time_shift 3; ODE dynamics; training forward
# at guidance 1 (dgpo.py L609); LoRA r64 / alpha 128 (so the reference is the base model by default:
# tests/test_new_losses.py); bf16; sampling EMA 0.9 every 8 epochs; eval 14 steps every 60.
DGPO_PICKSCORE = dict(
    model="sd3", resolution=512, shift=3.0, num_steps=10, eval_steps=14, guidance_scale=4.5, train_cfg=False,
    sampler="euler", timestep_fraction=0.7, train_timesteps=4, same_noise_per_group=False, group_size=24,
    prompts_per_step=24, sample_batch_size=12, train_batch_size=24, minibatches=1, updates_per_batch=1, loss="dgpo",
    dpo_beta=10.0, dgpo_clip=True, clip_range=0.05, old_decay="dgpo", dgpo_switch_step=200,
    kl_beta=1e-3, adv_clip=5.0, global_std=True, lora_rank=64, lora_alpha=128.0, lr=3e-4, weight_decay=1e-4,
    max_grad_norm=1.0, mixed_precision="bf16", ema_decay=0.9, ema_every=8, ema_repeat=1, eval_every=60, save_every=60,
    reward="pickscore")
TABLE["sd3_dgpo_pickscore.args"] = ("Flow-Factory examples/dgpo/lora/sd3_5/default.yaml (trainers/dgpo.py)",
                                    DGPO_PICKSCORE)
# Flow-Factory examples/crd/lora/sd3_5/default.yaml (Y, a0b2bc5), over hparams/training_args.py CRDTrainingArguments (H)
# and TrainingArguments (T), trainers/crd.py (C): 8 GPUs (Y L6), per_device_batch_size 8 (Y L81, sampling and
# training), group_size 24 (Y L82), unique_sample_num_per_epoch 48 (Y L84), gradient_step_per_epoch 2 (Y L85; T
# L324-336: half the micro-batches per optimizer step); crd_beta 1, crd_loss_type mse, use_old_for_loss, adaptive_logp,
# weight_temp -1 (Y L47-51); old_model_decay "0-0.25-0.005-0.999", sampling_model_decay "75-0.0-0.0075-0.999" (Y L55-56,
# C L67-102); num_train_timesteps 20, 'discrete', timestep_range 0.99 (Y L60-63); kl_beta 0.1 v-based, kl_cfg 4.5,
# reward_adaptive_kl (Y L66-69); adv_clip_range 5 (Y L73); global_std (Y L83); resolution 512, 10 steps, guidance 1
# (Y L76-78), the training forward at it too (C L480-507); ODE dynamics (Y L103); LoRA r32 / alpha 64 on SD3.5-M
# (Y L22-26); lr 3e-4, weight decay 1e-4, max_grad_norm 1 (Y L89-93); bf16 (Y L8); no ema_* in Y: T's ema_decay
# 0.995 every ema_update_interval 10 epochs (T L227-234; C L374: stepped once per epoch, 2 optimizer steps); eval 40
# steps every 20 epochs, save every 20 (Y L110-111, L37); reward ocr (Y L116-118); shift 3: SD3.5-M's scheduler.
CRD_OCR = dict(
    model="sd3", resolution=512, shift=3.0, num_steps=10, eval_steps=40, guidance_scale=1.0, train_cfg=False,
    sampler="euler", timestep_fraction=0.99, train_timesteps=20, same_noise_per_group=False, group_size=24,
    prompts_per_step=48, sample_batch_size=8, train_batch_size=8, minibatches=2, updates_per_batch=1, loss="crd",
    crd_beta=1.0, crd_loss_type="mse", crd_temperature=-1.0, crd_old=True, crd_adaptive=True, old_decay="crd",
    sampling_decay="nft-ocr", kl_beta=0.1, crd_kl_cfg=4.5, crd_adaptive_kl=True, adv_clip=5.0, global_std=True,
    lora_rank=32, lora_alpha=64.0, lr=3e-4, weight_decay=1e-4, max_grad_norm=1.0, mixed_precision="bf16",
    ema_decay=0.995, ema_every=20, ema_repeat=1, eval_every=20, save_every=20, reward="ocr")
TABLE["sd3_crd_ocr.args"] = ("Flow-Factory examples/crd/lora/sd3_5/default.yaml (trainers/crd.py)", CRD_OCR)
# Recipes with no authors' configuration to check against, and why.
UNCHECKED = {
    "sd3_bench.args": "the throughput anchor of bench.py, not a training recipe",
    "shapes_long.args": "this project's long run on the shapes world, measured in docs/long_run.md, no paper's setup",
}
# What each published run's optimizer sees: (optimizer steps per sampled batch, samples per optimizer step).
OPTIMIZER = {
    "sd3_ocr_grpo.args": (2, 576), "sd3_pickscore_grpo.args": (2, 576), "sd3_fast_nocfg_cps.args": (2, 576),
    "sd3_guard_ocr.args": (2, 576), "sd3_guard_pickscore.args": (2, 576),
    "flux_mixgrpo.args": (4, 96), "flux_mixgrpo_flash.args": (4, 96),  # 32 GPUs x 3 images per optimizer step
    "wan_ocr_grpo.args": (2, 8), "qwen_image_pickscore_grpo.args": (2, 256),
    "sd3_nft_geneval.args": (1, 1152), "sd3_nft_pickscore.args": (1, 1152), "sd3_nft_ocr.args": (2, 576),
    "sd3_awm_geneval.args": (1, 1728), "sd3_awm_ocr.args": (1, 1728), "sd3_awm_pickscore.args": (1, 576),
    "sd3_flowdppo_pickscore.args": (2, 384),  # 768 samples in 2 disjoint mini-batches
    "flux_kontext_counting_grpo.args": (2, 504), "qwen_image_edit_counting_grpo.args": (2, 256),
    "qwen_image_edit_counting_fast.args": (2, 256),
    "sd3_sft_geneval.args": (1, 24), "sd3_dpo_geneval.args": (1, 24),  # one GPU, one prompt's group
    "sd3_dgpo_pickscore.args": (1, 576), "sd3_crd_ocr.args": (2, 576),
}
GPUS = {"wan_ocr_grpo.args": (1,), "sd3_sft_geneval.args": (1,), "sd3_dpo_geneval.args": (1,), "sd3_dgpo_pickscore.args": (4,), "sd3_crd_ocr.args": (8,), "sd3_flowdppo_pickscore.args": (8,), "flux_kontext_counting_grpo.args": (28,),
        **{f"sd3_{loss}_{task}.args": (8,) for loss in ("nft", "awm")
                                       for task in ("geneval", "pickscore", "ocr")}}  # where not 8, 16 and 32

# GARDO tinnerhrhe/GARDO at 1cc77fb, config/gardo.py general_ocr_sd3 (C) over compressibility and config/base.py (B),
# as scripts/train_sd3_grpo_gardo.py (G) runs it. Flow-GRPO's general_ocr_sd3 with: C L138 timestep_fraction 0.89
# (int(10 x 0.89) = 8 trained steps, G L367, L945); C L136 gradient accumulation 16 // 2 = 8 of C L132's 16 rollout
# batches (48 prompts at C L118 gpu_number 8), and G L1050-1051 steps the EMA (G L471: decay 0.9, interval 8) after
# each micro-batch -> --ema-repeat 8; C L159-167 reward_fn ocr 0.8, aesthetic 0.1, imagereward 0.1, of which G
# L800-802 trains C L157's main_reward 'ocr' alone and L827-834 ranks the other two for the gate; C L100 reset_freq
# 15, C L107 kl_thres 3e-4 (G L789, L1042); C L93 algorithm 'gardo' (G L825: the diversity-aware advantage, DINOv3
# features at G L625-631, here DINOv2's). Kept from Flow-GRPO's: C L115-117 10 steps, 40 at eval, CFG 4.5; C L129-131
# 512 px, batch 9, 24 per prompt; C L140 beta 0.04 in Flow-GRPO's form (sd3_sde_with_logprob.py L50, G L984-985); C
# L148-149 global std, EMA; C L155-156 save and eval every 60; B L24 fp16, L61 noise level 0.7, L76 lr 3e-4, L82
# weight decay 1e-4, L89 max grad norm 1, L95 CFG in training, L97 adv clip 5, L99 clip range 1e-4 (G L976-977 reads
# train.clip_range: C L153-154's clip_range_low / high are unused); G L451-453 LoRA r32 / alpha 64; G L566 128 tokens.
TABLE["sd3_gardo_grpo_ocr.args"] = ("GARDO config/gardo.py general_ocr_sd3 (scripts/train_sd3_grpo_gardo.py)", dict(
    FLOW_GRPO_OCR, timestep_fraction=0.89, ema_repeat=8, reward="ocr=0.8,aesthetic=0.1,imagereward=0.1",
    reward_key="ocr", gardo_gate=["aesthetic", "imagereward"], gardo_reference=True, gardo_reset_freq=15,
    gardo_kl_thres=3e-4, gardo_diversity=True, diversity="dinov2"))
OPTIMIZER["sd3_gardo_grpo_ocr.args"] = (2, 576)
GPUS["sd3_gardo_grpo_ocr.args"] = (8, 16)  # C L118; scripts/multi_node/sd3_grpo_gardo.sh L14 runs 16

# Flow-Factory examples/grpo/lora/wan22/t2v.yaml (Y, 5f6cda1; the same knobs as at a0b2bc5), run by the code read at
# a0b2bc5: hparams/training_args.py (T), hparams/args.py (A), trainers/grpo.py (G), scheduler/unipc_multistep.py (U),
# models/wan/wan2_t2v.py (W), advantage/advantage_processor.py (P), ema/ema.py (E). Y num_processes 8,
# per_device_batch_size 1, group_size 16, unique_sample_num_per_epoch 48: 768 videos a step, T L295-299 96 rollout
# micro-batches per GPU (A L157-175: 48 % 8 == 0, so group_contiguous, 6 whole groups per GPU, nothing realigned),
# T L336 gradient accumulation 96 // gradient_step_per_epoch 2 = 48 (x num_sde_steps 1, A L402-404, T L451-452): two
# optimizer steps of 384. Flow-SDE noise_level 0.9: U L326-343 is sde.py's flow step (3)-(5). num_sde_steps 1 of
# sde_steps [1, 2, 3]: U L115-124 takes torch.randperm(3)[:1] under the seed G L63 sets to epoch + train.seed each
# epoch (scheduler.seed 42 is overwritten), one step per step on every rank and batch: --sde-window sparse
# --window-size 1 --window-range 1 4 (seeded by seed and step). clip_range 1e-4, adv_clip_range 5 (G L266-276);
# kl_beta 0. advantage_aggregation gdpo (P L451-470) ignores global_std: one reward's per-group z-score over its
# population std, renormalised by the batch std (1 unless a group is constant) -> --no-global-std. guidance_scale 4,
# guidance_scale_2 3 (W L474-485: transformer for t >= 875, transformer_2 below), and G L242-250 hands both and the
# stored negative embeddings to the training forward (W L487-496, L518-528) -> --train-cfg. ema_decay 0.9 stepped by
# G L89 at epochs e with (e + 1) % ema_update_interval 4 == 0 (E L103-113), i.e. after optimizer steps n with
# (n + 1) % 8 == 0 -> --ema-every 8 --ema-repeat 1. W L148 encodes 512 tokens, W L189 the negative prompt "". LoRA
# r64 / alpha 128 on target_components transformer and transformer_2; optimizers lr 1e-4, weight decay 1e-4,
# max_grad_norm 1; bf16; resolution 480 (T L267-268: 480x480), num_frames 5, 10 steps; eval 28 steps every 20
# epochs, save_freq 20; PickScore (rewards/pick_score.py L86-138: the frame mean / 26) in batches of 16. No flow_shift
# in Y: the hub scheduler's (3, diffusers' convert_wan_to_diffusers.py for the T2V A14B).
WAN22_PICKSCORE = dict(
    model="wan2.2", resolution=480, num_frames=5, num_steps=10, eval_steps=28, guidance_scale=4.0,
    guidance_scale_2=3.0, train_cfg=True, max_sequence_length=512, sde="flow", eta=0.9, sde_window="sparse",
    window_size=1, window_range=[1, 4], same_noise_per_group=False, group_size=16, prompts_per_step=48,
    sample_batch_size=1, train_batch_size=1, minibatches=2, updates_per_batch=1, loss="grpo", clip_range=1e-4,
    adv_clip=5.0, kl_beta=0.0, global_std=False, lora_rank=64, lora_alpha=128.0, lr=1e-4, weight_decay=1e-4,
    max_grad_norm=1.0, mixed_precision="bf16", ema_decay=0.9, ema_every=8, ema_repeat=1, eval_every=20,
    save_every=20, reward="pickscore", pickscore_batch_size=16)
TABLE["wan22_pickscore_grpo.args"] = (
    "Flow-Factory examples/grpo/lora/wan22/t2v.yaml (5f6cda1; trainers/grpo.py)", WAN22_PICKSCORE)
OPTIMIZER["wan22_pickscore_grpo.args"] = (2, 384)  # 8 GPUs x 48 micro-batches of 1 per optimizer step
GPUS["wan22_pickscore_grpo.args"] = (8,)  # Y num_processes

# UniRL examples/diffusion/hunyuan_video15_t2v_dancegrpo_trainside.yaml (H, 1a7b501), run by unirl/algorithms/flowgrpo.py
# (no KL term; clip_range H L119), unirl/sde/kernels.py L185-230 (FlowSDEStrategy: sde.py's flow step), unirl/utils/
# scheduler_utils.py L86-124 (AllSDEScheduler) and unirl/sde/runtime.py L92-96 (the static shift). H L18-20 8 GPUs,
# 48 prompts, adv_use_global_std; H L38/42 shift 5; L62 activation checkpointing; L67-71 lr 1e-5, weight decay 1e-4;
# L79-80 LoRA r64 / alpha 64, L84-96 the 12 projections of families/hunyuan_video.py LORA_TARGETS; L102
# forward_batch_size 1; L111-114 PickScore of the first frame (reward/local/video_pickscore.py) in batches of 8; L128-
# 136 micro-batches of 1, max_grad_norm 1, num_updates_per_batch 2 (two mini-batch optimizer steps of 72 per GPU);
# L155-163 16 steps, guidance 0 (no CFG), 480x480, 5 frames, eta 0.25, 24 per prompt, seed 42, init_same_noise false;
# L175-176 timestep_fraction [0, 0.6] and num_sde_steps 8: 8 of steps 0-8 each step (int(16 x 0.6) = 9). bf16
# (L34-35); unirl/models/hunyuan_video15/text_embed.py L100 1000 text tokens. No EMA section.
TABLE["hunyuan_video15_pickscore_grpo.args"] = (
    "UniRL examples/diffusion/hunyuan_video15_t2v_dancegrpo_trainside.yaml (algorithms/flowgrpo.py)", dict(
        model="hunyuan-video-1.5", resolution=480, num_frames=5, num_steps=16, shift=5.0, max_sequence_length=1000,
        guidance_scale=1.0, sde="flow", eta=0.25, sde_window="sparse", window_size=8, window_range=[0, 9],
        same_noise_per_group=False, group_size=24, prompts_per_step=48, sample_batch_size=1, train_batch_size=1,
        minibatches=2, updates_per_batch=1, loss="grpo", clip_range=1e-4, kl_beta=0.0, global_std=True,
        lora_rank=64, lora_alpha=64.0, lr=1e-5, weight_decay=1e-4, max_grad_norm=1.0, mixed_precision="bf16",
        gradient_checkpointing=True, ema_decay=0.0, seed=42, reward="pickscore", pickscore_num_frames=1,
        pickscore_batch_size=8))
OPTIMIZER["hunyuan_video15_pickscore_grpo.args"] = (2, 576)  # 8 GPUs x 72 micro-batches of 1 per optimizer step
GPUS["hunyuan_video15_pickscore_grpo.args"] = (8,)  # H num_devices

# Flow-Factory examples/grpo/lora/qwen_image_2_1/default.yaml (Q, 5f6cda1), run by the GRPO trainer of the wan22 row
# (the same mapping of its knobs): num_processes 8, per_device_batch_size 1, group_size 16, unique_sample_num_per_epoch
# 48, gradient_step_per_epoch 2 (two optimizer steps of 384); Flow-SDE noise_level 1.0, num_sde_steps 1 of sde_steps
# [1, 2, 3]; clip_range 1e-4, adv_clip_range 5, kl_beta 0, advantage_aggregation gdpo (--no-global-std); resolution
# 384, num_inference_steps 10, guidance_scale 1.0; ema_decay 0.9, ema_update_interval 4 (--ema-every 8); gradient
# checkpointing; LoRA r64 / alpha 128, target_modules default (models/qwen_image_21/qwen_image_21.py
# default_target_modules: families/qwen_image21.py LORA_TARGETS); lr 3e-4, weight decay 1e-4, max_grad_norm 1; bf16;
# eval 40 steps every 20, save_freq 20; PickScore in batches of 16; seed 42. Its data (an edit set) is a difference.
TABLE["qwen_image21_pickscore_grpo.args"] = (
    "Flow-Factory examples/grpo/lora/qwen_image_2_1/default.yaml (5f6cda1; trainers/grpo.py)", dict(
        model="qwen-image-2.1", resolution=384, num_steps=10, eval_steps=40, guidance_scale=1.0, sde="flow", eta=1.0,
        sde_window="sparse", window_size=1, window_range=[1, 4], same_noise_per_group=False, group_size=16,
        prompts_per_step=48, sample_batch_size=1, train_batch_size=1, minibatches=2, updates_per_batch=1,
        loss="grpo", clip_range=1e-4, adv_clip=5.0, kl_beta=0.0, global_std=False, lora_rank=64, lora_alpha=128.0,
        lr=3e-4, weight_decay=1e-4, max_grad_norm=1.0, mixed_precision="bf16", gradient_checkpointing=True,
        ema_decay=0.9, ema_every=8, ema_repeat=1, eval_every=20, save_every=20, seed=42, reward="pickscore",
        pickscore_batch_size=16))
OPTIMIZER["qwen_image21_pickscore_grpo.args"] = (2, 384)
GPUS["qwen_image21_pickscore_grpo.args"] = (8,)  # Q num_processes

# VeRL-Omni (github.com/verl-project/verl-omni) examples/dancegrpo_trainer/wan22/run_wan22_5b_t2v_hpsv3_v1.sh
# (V, 04eaf00), run by verl_omni.trainer.main_diffusion_v1 over config/diffusion_trainer.yaml; the defaults and the
# code read at a1139ba (2026-08-22, where the script's v0 twin run_wan22_5b_t2v_hpsv3_auto.sh sets the same values):
# trainer/config/_generated_diffusion_trainer.yaml (Y), pipelines/wan22_dance_grpo/vllm_omni_rollout_adapter.py (R)
# and diffusers_training_adapter.py (T), pipelines/schedulers/flow_match_sde.py (S), trainer/diffusion/diffusion_algos.py
# (D), trainer/diffusion/v1/trainer_base.py (B), utils/reward_score/hpsv3_reward.py (H). V L96-97 8 GPUs, one node;
# V L48 (L37: 64) 64 prompts, V L65 rollout.n 8 -> --group-size 8: 512 videos a step; V L56 ppo_mini_batch_size 16
# x n 8 (B L889-890) = 128 videos per optimizer step, 4 a step -> --minibatches 4; V L57 (L23) micro-batches of 4 per
# GPU; Y L98 ppo_epochs 1; a rollout request is one video (R L374-378) -> --sample-batch-size 1. V L43-45 dance_grpo
# estimator and loss: D L190-265 Flow-GRPO's advantage at its defaults (D L195-197: epsilon 1e-4, the batch std;
# ray_diffusion_trainer.py L126-128 hands Y L481 global_std to flow_grpo only) -> --global-std; D L308-321 and
# Y L75-76 ratio clip 1e-4, advantages clipped at 5; Y L78 ref_kl_coef 0, L93 use_kl_loss false -> --kl-beta 0. V L80-83
# noise_level 1.2, dance_sde (S L271-310: sde.py's dance step (6)), sde_window_size 2 in sde_window_range [0, 5]:
# R L611-622 start = randint(0, 5 - 2 + 1) per video, R L161-170 the SDE on the window, ODE elsewhere -> --sde-window
# fast --window-size 2 --window-range 0 5. R L340, L483-487 init_same_noise (default True, never passed) ->
# --same-noise-per-group. V L71, L77 true_cfg_scale and guidance_scale 5: the rollout guides with guidance_scale (R
# L415-429), the training forward with true_cfg_scale (T L220-229) -> --guidance-scale 5 --train-cfg; the negative
# prompt " " (examples/dancegrpo_trainer/data_process/wan22_hpsv3.py L72). V L72-74 704x1280, num_frames 8 -> 9 (R
# L463-466); V L76 10 steps; T L104 and R L450 shift 5 on linspace(1, 0, 11) (T L62-66, R L521-524) -> --shift 5;
# V L78 1024 tokens (R L305-313: zero-padded). Y L301 lora_rank 0: the whole transformer, under FSDP (V L58-61) ->
# --lora-rank 0 --fsdp; V L60 model_dtype bfloat16 -> --mixed-precision bf16; V L54-55 lr 1e-5, weight decay 1e-4;
# Y L10-23 AdamW (0.9, 0.999), clip_grad 1, constant lr; Y L297 gradient checkpointing. V L90 compute_score_hpsv3:
# H L426-435 0.1 x HPSv3's mu averaged over frames [::4] (0, 4, 8 of 9) -> --reward hpsv3=0.1 --hpsv3-num-frames 3,
# each video's frames one batch (H L431) -> --hpsv3-batch-size 3, at 256 x 28 x 28 px (H L332). V L50, L66 seed 42;
# V L98-99, L101 save and test every 30, 120 steps; V L84-85 evaluation with 50 ODE steps. No EMA in Y or B.
TABLE["wan22_5b_hpsv3_dancegrpo.args"] = (
    "VeRL-Omni examples/dancegrpo_trainer/wan22/run_wan22_5b_t2v_hpsv3_v1.sh (04eaf00; trainer/main_diffusion_v1.py)",
    dict(model="wan2.2-5b", resolution=[704, 1280], num_frames=9, num_steps=10, shift=5.0, max_sequence_length=1024,
         guidance_scale=5.0, train_cfg=True, negative_prompt=" ", sde="dance", eta=1.2, sde_window="fast",
         window_size=2, window_range=[0, 5], same_noise_per_group=True, group_size=8, prompts_per_step=64,
         sample_batch_size=1, train_batch_size=4, minibatches=4, updates_per_batch=1, loss="grpo", clip_range=1e-4,
         adv_clip=5.0, kl_beta=0.0, global_std=True, lora_rank=0, fsdp=True, lr=1e-5, weight_decay=1e-4,
         max_grad_norm=1.0, mixed_precision="bf16", gradient_checkpointing=True, ema_decay=0.0, seed=42, steps=120,
         save_every=30, eval_every=30, eval_steps=50, reward="hpsv3=0.1", hpsv3_num_frames=3, hpsv3_batch_size=3))
OPTIMIZER["wan22_5b_hpsv3_dancegrpo.args"] = (4, 128)  # 8 GPUs x 4 micro-batches of 4 per optimizer step
GPUS["wan22_5b_hpsv3_dancegrpo.args"] = (8,)  # V n_gpus_per_node


# Flow-Factory examples/grpo/lora/ltx2/t2av.yaml (L, 5f6cda1), run by the GRPO trainer of the wan22 row (the same
# mapping): num_processes 8, per_device_batch_size 1, group_size 16, unique_sample_num_per_epoch 48,
# gradient_step_per_epoch 2 (two optimizer steps of 384), global_std true; scheduler dynamics_type CPS, noise_level
# 0.8, num_sde_steps 3 of sde_steps [0 .. 9]; clip_range 1e-4, adv_clip_range 5, kl_beta 0; resolution [512, 768],
# num_frames 121, num_inference_steps 24, guidance_scale 1.0 (stg 0, modality 1, rescale 0); ema_decay 0.9,
# ema_update_interval 4 (--ema-every 8); gradient checkpointing; LoRA r64 / alpha 128; lr 3e-4, weight decay 1e-4,
# max_grad_norm 1; bf16; save_freq and eval_freq 60, eval 50 steps; rewards clap (laion/larger_clap_general, batch 4)
# and imagebind (not shipped: a difference); seed 42.
TABLE["ltx2_clap_grpo.args"] = (
    "Flow-Factory examples/grpo/lora/ltx2/t2av.yaml (5f6cda1; trainers/grpo.py)", dict(
        model="ltx2", resolution=[512, 768], num_frames=121, num_steps=24, eval_steps=50, guidance_scale=1.0,
        sde="cps", eta=0.8, sde_window="sparse", window_size=3, window_range=[0, 10], same_noise_per_group=False,
        group_size=16, prompts_per_step=48, sample_batch_size=1, train_batch_size=1, minibatches=2,
        updates_per_batch=1, loss="grpo", clip_range=1e-4, adv_clip=5.0, kl_beta=0.0, global_std=True, lora_rank=64,
        lora_alpha=128.0, lr=3e-4, weight_decay=1e-4, max_grad_norm=1.0, mixed_precision="bf16",
        gradient_checkpointing=True, ema_decay=0.9, ema_every=8, ema_repeat=1, eval_every=60, save_every=60, seed=42,
        reward="clap", clap_model_path="laion/larger_clap_general", clap_batch_size=4))
OPTIMIZER["ltx2_clap_grpo.args"] = (2, 384)
GPUS["ltx2_clap_grpo.args"] = (8,)  # L num_processes

def stated_flags(recipe):
    """The flag names a recipe file sets itself (not inherited from a preset), as argparse dests."""
    with open(os.path.join(ROOT, "recipes", recipe)) as f:
        tokens = [t for line in f for t in shlex.split(line, comments=True)]
    return {t[2:].replace("-", "_").removeprefix("no_") for t in tokens if t.startswith("--")}


def test_every_recipe_is_in_the_table_or_says_why_not():
    assert set(TABLE) | set(UNCHECKED) == set(RECIPES)
    assert not set(TABLE) & set(UNCHECKED)


@pytest.mark.parametrize("recipe", sorted(TABLE))
def test_recipe_matches_the_authors_settings(recipe, monkeypatch):
    monkeypatch.chdir(ROOT)
    source, expected = TABLE[recipe]
    _, args = train.parse_args([f"@recipes/{recipe}"])
    stated = stated_flags(recipe)
    for key, value in expected.items():
        got = getattr(args, key)
        got = list(got) if isinstance(got, tuple) else got
        assert got == (pytest.approx(value) if isinstance(value, float) else value), f"{recipe}: {key} vs {source}"
        # Stated in the file: a change of train.py's presets or defaults cannot move it.
        assert key in stated or key == "model", f"{recipe} must state --{key.replace('_', '-')} ({source})"
    if recipe in OPTIMIZER:
        samples = args.prompts_per_step * args.group_size
        steps = args.minibatches * args.updates_per_batch
        assert (steps, samples // args.minibatches) == OPTIMIZER[recipe], source
    # A beta means nothing without its KL's scale: the row names it (the forward-process losses have one form, the
    # mean squared velocity difference).
    if args.kl_beta > 0 and losses.LOSSES[args.loss].process == "reverse":
        assert "kl_form" in expected, f"{recipe}: which KL form did {source} use?"


@pytest.mark.parametrize("recipe", sorted(TABLE))
def test_recipe_divides_over_the_authors_gpu_counts(recipe):
    """Flow-GRPO's configs name 32 GPUs (16 for GRPO-Guard, 4 and 8 in variants; Wan one), MixGRPO's 4 nodes x 8."""
    _, args = train.parse_args([f"@recipes/{recipe}"])
    samples = args.prompts_per_step * args.group_size
    for gpus in GPUS.get(recipe, (8, 16, 32)):
        per_gpu = samples // gpus
        assert samples % gpus == 0 and per_gpu % args.sample_batch_size == 0, gpus
        assert per_gpu % (args.train_batch_size * args.minibatches) == 0, gpus
