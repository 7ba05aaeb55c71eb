"""Flag defaults per model, and per model and loss: what `--model` (and `--loss`) fill in where the command line is
silent. The command line wins over LOSS_PRESETS, which wins over the loss's own defaults (losses.LOSSES), which win over
the model's preset (train.parse_args)."""


# Settings that differ between the CPU model and hub models; anything given on the command line wins.
# Hub settings are Flow-GRPO's SD3.5-M setup (arXiv:2505.05470, Sec. 5.1 and its config/grpo.py).
PRESETS = {
    "tiny": dict(loss="grpo", resolution=64, num_steps=10, guidance_scale=1.0, eta=0.7, group_size=8,
                 prompts_per_step=4, sample_batch_size=16, train_batch_size=16, minibatches=1, lora_rank=0, lr=3e-3,
                 clip_range=0.2, kl_beta=0.0, steps=60, mixed_precision="no", prompts="prompts/tiny.txt",
                 reward="jpeg_compressibility", global_std=False, log_images_every=20, input_key="input",
                 eval_every=0, eval_steps=40, eval_samples_per_prompt=1, sde="flow", ema_decay=0.0),
    "hub": dict(loss="grpo", resolution=512, num_steps=10, guidance_scale=4.5, eta=0.7, group_size=24,
                prompts_per_step=48, sample_batch_size=8, train_batch_size=8, minibatches=2, lora_rank=32,
                lora_alpha=64, lr=3e-4, clip_range=1e-4, kl_beta=0.04, steps=10000, mixed_precision="bf16",
                prompts="prompts/ocr_train.txt", reward="ocr", global_std=True, log_images_every=50,
                input_key="input", eval_every=0, eval_steps=40, eval_samples_per_prompt=1, sde="flow",
                ema_decay=0.0),
}
# The shapes world (shapes.py): its pretrained 32 px model learns to follow GenEval-style prompts in minutes on a CPU.
# DiffusionNFT, chosen by measurement: at the same 12,800 samples it rose about twice as far as GRPO (docs/shapes.md).
# 128 samples per step (the GRPO gradient's noise scale is ~15,000 samples: 32 per step is almost all noise), full
# fine-tune at lr 2e-4 and an evaluated EMA. The reverse-process losses sample with coefficient-preserving steps
# (their rollouts score near the ODE's, Flow-GRPO's step at eta 0.7 well below).
PRESETS["shapes"] = dict(PRESETS["tiny"], loss="nft", resolution=32, prompts="prompts/shapes_train.jsonl",
                         eval_prompts="prompts/shapes_test.jsonl", input_key="prompt", reward="geneval",
                         geneval_detector="shapes", sde="cps", prompts_per_step=16, sample_batch_size=32,
                         train_batch_size=32, lr=2e-4, ema_decay=0.95, steps=100, eval_every=25, eval_steps=10,
                         log_images_every=25)
# Settings measured for one model and one loss: they win over the loss's defaults (losses.LOSSES), which win over
# the model's preset. DiffusionNFT on the shapes world: 6-step rollouts, 3 of their sigmas trained per sample
# (docs/shapes.md: as fast a rise per sample as 10 steps with 3 sigmas, at 83 % of the time per step).
LOSS_PRESETS = {("shapes", "nft"): dict(num_steps=6, timestep_fraction=0.5),
                ("shapes-edit", "nft"): dict(num_steps=6, timestep_fraction=0.5)}
# Its editing task (shapes.py, "editing"): the same recipe on the edit prompts, judged by the exact edit judge (0/1),
# with groups of 16 (8 edits a step): an "add" or "count" edit succeeds about 1 time in 10, so a group of 8 often
# holds no success and teaches nothing (docs/shapes.md, "editing": +0.07 in 40 steps on seed 2, against +0.045
# with 16 edits x 8), and 100 steps: the rise builds over all of them (+0.115 to +0.148 on 3 seeds, +0.055 to +0.090
# at step 60). 2 images per held-out edit (200 of them: one image each would leave a standard error of 0.035).
PRESETS["shapes-edit"] = dict(PRESETS["shapes"], prompts="prompts/shapes_edit_train.jsonl",
                              eval_prompts="prompts/shapes_edit_test.jsonl", reward="shapes_edit", group_size=16,
                              prompts_per_step=8, steps=100, eval_every=10, eval_samples_per_prompt=2,
                              log_images_every=10)
PRESETS["tiny-flux"] = dict(PRESETS["tiny"], guidance_scale=3.5)
PRESETS["tiny-wan"] = dict(PRESETS["tiny"], num_frames=5)  # 5 frames: 2 latent frames
PRESETS["tiny-qwen-image"] = PRESETS["tiny-flux2-klein"] = PRESETS["tiny-z-image"] = PRESETS["tiny"]
PRESETS["tiny-qwen-image-edit"] = PRESETS["tiny-qwen-image-edit-plus"] = PRESETS["tiny"]
PRESETS["tiny-flux-kontext"] = PRESETS["tiny-flux"]
FLUX_HUB = dict(guidance_scale=3.5, num_steps=16)  # FLUX.1-dev: distilled guidance, no CFG (MixGRPO uses 16 steps)
GUIDANCE_EMBEDDED = ("flux", "tiny-flux", "flux-kontext", "tiny-flux-kontext")  # FLUX.1-dev and Kontext take their
# guidance scale through an embedding, not CFG


def preset(model):
    """The defaults --model fills in: its own preset, else the hub preset (with FLUX's guidance and steps)."""
    return PRESETS.get(model, dict(PRESETS["hub"], **(FLUX_HUB if model == "flux" else {})))
