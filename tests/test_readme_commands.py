"""Every command the README and train.py's Launch section show parses and passes its script's own checks.

Commands are read from README.md (its bash blocks, and backticked commands in its prose) and from the Launch
sections of train.py's and scripts/bench.py's docstrings, then run in this process through the script's own parser and
checks (train.py: parse_args and check_args at the launch's world size; scripts/bench.py: its parse_args, then train.py's on
the argv it would run; eval.py, `python -m shapes` and scripts without a parse_args: their parser, stopped as it
returns).
Nothing loads a model. Stand-ins: `@recipes/...` is every recipe (but those shown launched on one GPU), HOST is
localhost, R and N are 0, `$s` is 0, a lone `...` (the flags of the line above) is dropped, and a --model-path is a
folder name that is never opened.

A second test runs every recipe with each tail of flags that the commands add after a recipe (`--resume auto`,
`--lora-rank 0 --kl-beta 0 --mixed-precision bf16 --fsdp`, ...), so that a flag added to a recipe later cannot break
a command the README shows with another recipe.
"""
import argparse
import contextlib
import glob
import importlib
import importlib.util
import io
import os
import re
import shlex

import pytest

import bench
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "recipes", "*.args")))
SCRIPTS = ("train.py", "eval.py")  # and scripts/*.py
MODULES = {"shapes": "shapes.__main__"}  # `python -m <name>`: the module whose main parses
PLACEHOLDERS = {"N": "0", "R": "0", "$s": "0"}  # --seed N, --node-rank R, the seed loop's $s
# Commands shown for something other than running as written, each with the reason; every one must still be found.
NOT_RUN = {
    "python train.py --loss reinforce": "the README's example of adding a loss, defined in its text "
                                        "(tests/test_registry.py defines and runs it)",
}


def readme_text():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def launch_section(doc):
    """The Launch lines of a script's docstring (train.py's, bench.py's), as a bash block."""
    return doc[doc.index("Launch\n------"):doc.index("\n\n", doc.index("Launch\n------"))]


def shell_lines(text):
    """Shell lines of a bash block: continuations joined, comments dropped, `&&` and `;` split, `do` dropped."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        for piece in re.split(r"&&|;", line):
            words = shlex.split(piece, comments=True)
            if words and words[0] == "do":
                words = words[1:]
            if words:
                out.append(words)
    return out


def prose_commands(text):
    """Backticked commands in the README's prose (code blocks removed), joined across line breaks."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S).replace("\n", " ")
    spans = [s for s in re.findall(r"`([^`]+)`", prose) if re.search(r"(^|\s)(python|torchrun)\s|^[\w/]+\.py\s", s)]
    return [words for span in spans for words in shell_lines(span)]


def script_of(words):
    """(index of the script's word, its path) for a python / torchrun command of this project, or None."""
    for i, w in enumerate(words):
        if w in SCRIPTS or re.fullmatch(r"scripts/\w+\.py", w):
            return i, w
        if w == "-m" and words[i + 1:i + 2] and words[i + 1] in MODULES:
            return i + 1, f"-m {words[i + 1]}"
        if w not in ("python", "python3", "torchrun") and not w.startswith("-") and i == 0:
            return None  # pip, a for loop's head, ...
    return None


def world_size(launcher):
    """Processes of a torchrun launch: --nnodes x --nproc_per_node (1 for python)."""
    sizes = {"nnodes": 1, "nproc_per_node": 1}
    for i, w in enumerate(launcher):
        key, _, value = w.lstrip("-").replace("-", "_").partition("=")
        if key in sizes:
            sizes[key] = int(value or launcher[i + 1])
    return sizes["nnodes"] * sizes["nproc_per_node"]


def shown_commands():
    """(source, words) of every command line shown."""
    found = [("README.md", w) for block in re.findall(r"```bash\n(.*?)```", readme_text(), re.S)
             for w in shell_lines(block)]
    found += [("README.md prose", w) for w in prose_commands(readme_text())]
    found += [(f"{name} Launch", w) for name, module in (("train.py", train), ("scripts/bench.py", bench))
              for w in shell_lines(launch_section(module.__doc__))]
    return found


# Recipes shown launched by `python train.py @recipes/X` (sized for one GPU, as their authors ran them): a
# `torchrun ... @recipes/...` line means the others.
ONE_GPU = {w[2][1:] for _, w in shown_commands() if w[:2] == ["python", "train.py"] and len(w) > 2
           and w[2].startswith("@recipes/") and w[2] != "@recipes/..."}


def commands():
    """(label, script, argv, world size) for every command shown, `@recipes/...` expanded to every recipe."""
    out = []
    for source, words in shown_commands():
        hit = script_of(words)
        if hit is None:
            continue
        i, script = hit
        shown = " ".join(words)
        if shown in NOT_RUN:
            out.append((f"{source}: {shown}", script, None, 0))
            continue
        argv = [PLACEHOLDERS.get(w, w.replace("HOST", "localhost")) for w in words[i + 1:] if w != "..."]
        argv = [("stand-in/model" if argv[j - 1] == "--model-path" else a) if j else a for j, a in enumerate(argv)]
        recipes = [r for r in RECIPES if r not in ONE_GPU] \
            if "@recipes/..." in argv else [None]
        for recipe in recipes:
            full = [("@" + recipe if a == "@recipes/..." else a) for a in argv]
            label = f"{source}: {shown}" + (f" [{recipe}]" if recipe else "")
            out.append((label, script, full, world_size(words[:i])))
    return out


COMMANDS = commands()


@pytest.fixture(autouse=True)
def at_the_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the commands name recipes and prompt files relative to the repository


class Parsed(Exception):
    """Raised in place of returning from ArgumentParser.parse_args: the parse is done, nothing after it runs."""

    def __init__(self, args):
        super().__init__()
        self.parsed = args


def parse_only(main, argv, monkeypatch):
    """Run a script's main up to the return of its parser: argparse's own types, choices and errors, no work."""
    parse = argparse.ArgumentParser.parse_args

    def stop(self, args=None, namespace=None):
        raise Parsed(parse(self, args, namespace))
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    with pytest.raises(Parsed):
        main(argv)


def load_script(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_train(argv, world):
    p, args = train.parse_args(argv)
    train.check_args(p, args, world)
    return args


def check(script, argv, world, monkeypatch):
    if script == "train.py":
        check_train(argv, world)
    elif script == "scripts/bench.py":
        args = bench.parse_args(argv)
        if not (args.rewards or args.windows or args.losses):  # the argv bench.run gives train.main
            check_train(args.train_args + ["--model", args.model, "--reward", args.reward,
                                           "--steps", str(args.warmup + args.steps), "--out", "runs/bench"], 1)
    else:
        if script.startswith("-m "):
            module = importlib.import_module(MODULES[script[3:]])
        else:
            module = __import__(script[:-3]) if "/" not in script else load_script(script)
        if hasattr(module, "parse_args"):
            module.parse_args(argv)
        else:
            parse_only(module.main, argv, monkeypatch)


def run_checked(script, argv, world, monkeypatch):
    """None when the command passes, else the script's `error:` line."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            check(script, argv, world, monkeypatch)
    except SystemExit as e:
        return (err.getvalue().strip().splitlines() or [f"exit {e.code}"])[-1]
    return None


def test_commands_are_found():
    """The extraction finds the commands it should, so that a change of the README's layout cannot empty the test."""
    labels = [label for label, *_ in COMMANDS]
    for shown in ["python train.py --loss grpo", "python eval.py --plot runs/default",
                  "python scripts/league.py", "train.py @recipes/sd3_pickscore_grpo.args --lora-rank 0",
                  "train.py --seed $s --out runs/seed$s",
                  "--rdzv-endpoint HOST:29500 train.py @recipes/sd3_pickscore_grpo.args"]:
        assert any(shown in label for label in labels), shown
    for shown in NOT_RUN:
        assert any(label.endswith(": " + shown) for label in labels), f"{shown!r} is no longer in the README: drop it"
    assert {s for _, s, *_ in COMMANDS} >= {"train.py", "eval.py", "scripts/bench.py", "scripts/league.py"}
    worlds = {label: w for label, _, argv, w in COMMANDS if argv is not None}
    assert max(worlds.values()) == 16 and min(worlds.values()) == 1  # two nodes of 8; python
    # the Launch section's two @recipes/... lines, each on every recipe but the one-GPU ones
    assert sum("[recipes/" in label for label in labels) >= 2 * (len(RECIPES) - len(ONE_GPU))


def test_a_module_command_is_checked_by_its_parser(monkeypatch):
    """`python -m shapes ...` (docs/shapes.md shows it) is found and checked as a script is: its parser, stopped."""
    assert script_of(["python", "-m", "shapes", "--write-prompts"]) == (2, "-m shapes")
    assert run_checked("-m shapes", ["--write-prompts"], 1, monkeypatch) is None
    assert run_checked("-m shapes", ["--write-all"], 1, monkeypatch).endswith("unrecognized arguments: --write-all")


@pytest.mark.parametrize("label,script,argv,world", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_command_parses(label, script, argv, world, monkeypatch):
    if argv is None:
        pytest.skip(NOT_RUN[label.split(": ", 1)[1]])
    assert run_checked(script, argv, world, monkeypatch) is None, label


def recipe_tails():
    """The flags any train.py command adds after a recipe, and the world sizes of the `@recipes/...` launches."""
    tails, worlds = set(), set()
    for label, script, argv, world in COMMANDS:
        if script == "train.py" and argv and any(a.startswith("@recipes/") for a in argv):
            at = max(i for i, a in enumerate(argv) if a.startswith("@recipes/"))
            tails.add(tuple(argv[at + 1:]))
            if "@recipes/..." in label:
                worlds.add(world)
    return sorted(tails), worlds


TAILS, WORLDS = recipe_tails()


def test_recipe_tails_found():
    flat = [" ".join(t) for t in TAILS]
    assert "--resume auto" in flat and "" in flat
    assert "--lora-rank 0 --kl-beta 0 --mixed-precision bf16 --fsdp" in flat
    assert WORLDS == {8} and ONE_GPU == {"recipes/wan_ocr_grpo.args", "recipes/sd3_sft_geneval.args",
                                         "recipes/sd3_dpo_geneval.args", "recipes/shapes_long.args"}


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_with_every_tail(recipe, monkeypatch):
    """Each recipe with every tail of flags a command adds to one, on the GPUs of the `@recipes/...` launches (8), or
    on one for a one-GPU recipe, where the FSDP tails do not apply (they shard over several processes)."""
    world = 1 if recipe in ONE_GPU else max(WORLDS)
    failures = [f"{' '.join(tail) or '(none)'} on {world} GPUs: {error}" for tail in TAILS
                if not (world == 1 and "--fsdp" in tail)
                and (error := run_checked("train.py", ["@" + recipe, *tail], world, monkeypatch))]
    assert not failures, "\n".join(failures)
