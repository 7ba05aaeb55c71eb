"""The shapes world: coloured shapes on a grey background, where prompt following can be measured exactly
(docs/shapes.md). A package of the second layer (tests/test_layers.py): its files import only the layer below and
each other, world <- edit, and proxy on its own.

    world.py     prompts and their held-out split, scenes (layout, draw, render), the exact GenEval-style detector,
                 the pretrained model's architecture and weight file
    edit.py      the edit world: edit tasks, judge_edit, the `shapes_edit` reward, the edit prompt files
    proxy.py     a learned proxy of the GenEval judge (the `shapes_proxy` rewards; docs/hacking.md); it loads torch,
                 so `import shapes` leaves it out: `from shapes import proxy`
    __main__.py  python -m shapes --write-prompts | --write-edit-prompts

The scripts that train in this world (pretrain_shapes.py, pretrain_shapes_edit.py, train_shapes_proxy.py, league.py,
long_runs.py, hacking.py, loopholes.py) drive train.py, so they live above it, in scripts/.

The models (`shapes`, `shapes-edit`) are built in families/shapes.py, their family record. The names of world.py and
edit.py are re-exported here (`shapes.detect`, `shapes.judge_edit`); a module's state (the detection record,
shapes.world._DETECTED) lives in its file, and is patched there.
"""
from shapes import edit, world  # noqa: F401  (shapes.world, shapes.edit; the names below are theirs)
from shapes.edit import (  # noqa: F401
    EDIT_PLACE_IOU, EDIT_RELATIONS, EDIT_ROWS, EDIT_SCORES, EDIT_THRESHOLD, EDIT_TRANSFORMER, EDIT_WEIGHTS, EDITS,
    UNSEEN_EDITS, edit_example, edit_reward, edit_row_check, judge_edit, write_edit_prompts)
from shapes.world import (  # noqa: F401
    ASPECT_RANGE, BACKGROUND, BLURS, COLORS, COUNTING_THRESHOLD, DETECTIONS_KEPT, GAP, IOU_RANGE, MARGIN, MARGIN_FULL,
    MIN_AREA, RESOLUTION, ROWS_PER_TAG, SHAPES, SIZE_RANGE, SPECK_AREA, SUPERSAMPLE, TAGS, TEST_FRACTION, TEXT_ENCODER,
    TOKENS, TRANSFORMER, UNEXPLAINED, UNKNOWN, WEIGHTS, apart, classify, coverage, detect, draw, fit_templates,
    hard_rows, layout, object_box, prompt_rows, render, split, template, unmix, write_prompts)
