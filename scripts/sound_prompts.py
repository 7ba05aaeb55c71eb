"""Writes prompts/sound_train.txt and prompts/sound_test.txt: text-to-video prompts whose soundtrack is named, for
rewards that score the sound against the prompt (CLAP, `--reward clap`). Image captions (the PickScore prompts) name
nothing a listener could check; each prompt here names a source, the sound it makes and a place whose acoustics or
ambience the sound sits in, e.g. "a dog barking loudly in an empty parking garage, the sound echoing off concrete".

    python scripts/sound_prompts.py            # rewrites both files (deterministic; the seed fixes the draw)

Every (source, place) pair is used once at most and the two files share none, so the held-out prompts are scenes
the training prompts never combined.
"""
import argparse
import os
import random

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SOURCES = [  # what makes the sound, and the sound
    ("a dog", "barking loudly"), ("a cat", "meowing softly"), ("a rooster", "crowing at dawn"),
    ("a kettle", "whistling as it boils"), ("an old clock", "ticking and then chiming"),
    ("a church bell", "ringing slowly"), ("a violinist", "playing a slow melody"),
    ("a drummer", "playing a fast rhythm on a snare drum"), ("a crowd", "cheering and clapping"),
    ("a baby", "laughing"), ("a man", "whistling a tune"), ("a woman", "singing a lullaby"),
    ("a steam train", "blowing its whistle"), ("a motorcycle", "revving its engine"),
    ("a helicopter", "flying low overhead, rotor thumping"), ("a typewriter", "clacking rapidly"),
    ("a fire", "crackling and popping"), ("heavy rain", "drumming on a tin roof"),
    ("thunder", "rumbling in the distance"), ("waves", "crashing against rocks"),
    ("a waterfall", "roaring"), ("wind", "howling through the trees"), ("a flock of birds", "chirping"),
    ("a frog chorus", "croaking"), ("an owl", "hooting"), ("a horse", "galloping on cobblestones"),
    ("a blacksmith", "hammering hot metal on an anvil"), ("a chainsaw", "cutting through a log"),
    ("a car alarm", "blaring"), ("a siren", "wailing as an ambulance passes"), ("a pianist", "playing soft chords"),
    ("a guitarist", "strumming an acoustic guitar"), ("a saxophonist", "playing a jazz solo"),
    ("children", "shouting and laughing while they play"), ("a referee", "blowing a whistle"),
    ("glass", "shattering on a stone floor"), ("a door", "creaking open slowly"),
    ("footsteps", "echoing on a wooden floor"), ("a vacuum cleaner", "humming"),
    ("a bouncing basketball", "thudding on a court"), ("a lion", "roaring"), ("an elephant", "trumpeting"),
    ("bees", "buzzing around flowers"), ("a cello", "playing a deep, sustained note"),
    ("fireworks", "bursting with loud bangs"), ("a frying pan", "sizzling with bacon"),
    ("a phone", "ringing insistently"), ("a jackhammer", "pounding the pavement"),
]

PLACES = [  # where it sounds, and what that does to it
    "in an empty parking garage, the sound echoing off concrete", "in a quiet kitchen",
    "on a busy city street with traffic noise behind it", "in a large stone cathedral with long reverberation",
    "in a small carpeted room, the sound muffled", "in a forest at night with crickets in the background",
    "on a windy beach with surf in the background", "in a crowded train station with announcements",
    "in a snowy field, otherwise silent", "in a tiled bathroom with a bright echo",
    "on a rainy street, rain pattering around it", "inside a moving car with the engine humming",
    "in a concert hall with an attentive audience", "at a farm with distant cows mooing",
    "in a library where everything else is silent", "in a busy market with people talking",
    "in a long tunnel, the sound bouncing back", "on a mountain top with the wind blowing",
    "in a sports stadium full of people", "beside a calm lake with gentle lapping water",
]


def prompts(seed=0, test=100):
    """(train, test): every (source, place) pair once, shuffled by `seed`; the first `test` are held out."""
    pairs = [f"{who} {sound} {place}" for who, sound in SOURCES for place in PLACES]
    random.Random(seed).shuffle(pairs)
    return pairs[test:], pairs[:test]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0, help="the draw of the held-out pairs")
    p.add_argument("--test", type=int, default=100, help="how many prompts are held out")
    args = p.parse_args(argv)
    if not 0 < args.test < len(SOURCES) * len(PLACES):
        p.error(f"--test must be between 1 and {len(SOURCES) * len(PLACES) - 1}")
    train, test = prompts(args.seed, args.test)
    for name, rows in (("sound_train.txt", train), ("sound_test.txt", test)):
        with open(os.path.join(ROOT, "prompts", name), "w") as f:
            f.write("\n".join(rows) + "\n")
    print(f"prompts/sound_train.txt: {len(train)} prompts, prompts/sound_test.txt: {len(test)}")


if __name__ == "__main__":
    main()
