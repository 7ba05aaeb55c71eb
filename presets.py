"""Flag defaults per model, and per model and loss: what `--model` (and `--loss`) fill in where the command line is
silent. The command line wins over LOSS_PRESETS, which wins over the loss's own defaults (losses.LOSSES), which win over
the model's preset (train.parse_args). A model's preset is its record's (families.MODELS, a file per family)."""

import families

# Settings measured for one model and one loss: they win over the loss's defaults (losses.LOSSES), which win over
# the model's preset. DiffusionNFT on the shapes world: 6-step rollouts, 3 of their sigmas trained per sample
# (docs/shapes.md: as fast a rise per sample as 10 steps with 3 sigmas, at 83 % of the time per step).
LOSS_PRESETS = {("shapes", "nft"): dict(num_steps=6, timestep_fraction=0.5),
                ("shapes-edit", "nft"): dict(num_steps=6, timestep_fraction=0.5)}
# By name, as train.py reads them: the presets of the CPU models and "hub", the preset every full-size model starts
# from (a model not in PRESETS gets the losses' hub defaults); the models whose guidance scale is an embedding.
PRESETS = dict({name: f.preset for name, f in families.MODELS.items() if not f.hub}, hub=families.common.HUB)
GUIDANCE_EMBEDDED = tuple(name for name, f in families.MODELS.items() if f.guidance_embedded)


def preset(model):
    """The defaults --model fills in: its record's preset."""
    if model not in families.MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(families.MODELS)}")
    return dict(families.MODELS[model].preset)
