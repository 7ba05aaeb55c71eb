"""The prompts with sound that LTX-2's CLAP recipe trains on (prompts/sound_*.txt, scripts/sound_prompts.py)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import sound_prompts  # noqa: E402

import data  # noqa: E402


def shipped(name):
    return data.load_prompts(os.path.join(ROOT, "prompts", name))[0]


def test_the_shipped_files_are_what_the_script_writes_and_share_no_scene():
    train, test = sound_prompts.prompts()
    assert shipped("sound_train.txt") == train and shipped("sound_test.txt") == test
    assert len(test) == 100 and len(train) == len(sound_prompts.SOURCES) * len(sound_prompts.PLACES) - 100
    assert not set(train) & set(test) and len(set(train)) == len(train)


def test_every_prompt_names_a_source_its_sound_and_a_place():
    sounds = {f"{who} {sound} " for who, sound in sound_prompts.SOURCES}
    for prompt in shipped("sound_train.txt") + shipped("sound_test.txt"):
        heard = [s for s in sounds if prompt.startswith(s)]
        assert len(heard) == 1, prompt
        assert prompt[len(heard[0]):] in sound_prompts.PLACES, prompt


def test_the_ltx2_clap_recipe_trains_and_evaluates_on_them():
    with open(os.path.join(ROOT, "recipes", "ltx2_clap_grpo.args")) as f:
        words = " ".join(line for line in f if not line.startswith("#")).split()
    assert words[words.index("--prompts") + 1] == "prompts/sound_train.txt"
    assert words[words.index("--eval-prompts") + 1] == "prompts/sound_test.txt"
    assert words[words.index("--reward") + 1] == "clap"
