"""The documents say what is so: the design is in the repository and cited where the code points at it; the README's
counts and tables are the registries'; the call lines of policy.py's and run.py's manuals bind to the methods they
name; --print-config says which of its values the chosen loss does not read; and the suite runs with pytest-xdist and
without it. Imports of the project stay inside the tests: `-p no:xdist` collects this file in a second."""
import ast
import inspect
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUMBERS = {word: n for n, word in enumerate("zero one two three four five six seven eight nine ten eleven twelve "
                                            "thirteen fourteen fifteen sixteen seventeen eighteen nineteen "
                                            "twenty".split())}


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def section(text, heading):
    """The text under a `## heading` of a markdown file, up to the next heading of that level."""
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def sources():
    """(path, text) of every .py and .md file of the repository, run logs and hidden folders left out."""
    for where, folders, names in os.walk(ROOT):
        folders[:] = [f for f in folders if not f.startswith(".") and f != "__pycache__" and
                      os.path.relpath(os.path.join(where, f), ROOT) != os.path.join("docs", "runs")]
        for name in names:
            if name.endswith((".py", ".md")):
                path = os.path.relpath(os.path.join(where, name), ROOT)
                yield path, read(path)


# ----------------------------------------------------------------------------- the design

def test_the_design_is_in_the_repository_and_cited():
    """DESIGN.md was an internal note, never in the repository: nothing (but this test) may send a reader there."""
    assert not [path for path, text in sources() if "DESIGN.md" in text and path != "tests/test_docs.py"]
    assert os.path.isfile(os.path.join(ROOT, "docs", "design.md"))
    for path in ("train.py", "tests/test_layers.py", "README.md", "families/__init__.py"):
        assert "docs/design.md" in read(path), path


def test_the_design_puts_every_module_in_its_layer():
    """docs/design.md's table of layers is tests/test_layers.py's LAYERS: each module of LAYERS in the row of its
    layer, and no row naming a module at another layer."""
    from test_layers import LAYER, LAYERS

    rows = re.findall(r"^\| (\d+) \| (`.*?`) \|", section(read("docs/design.md"), "The layers"), re.M)
    table = {module: int(layer) for layer, modules in rows for module in re.findall(r"`(\w+)`", modules)}
    assert [int(layer) for layer, _ in rows] == list(range(len(LAYERS)))
    assert {module: table.get(module) for module in LAYER} == LAYER
    assert all(LAYER[module] == layer for module, layer in table.items() if module in LAYER)


# ----------------------------------------------------------------------------- the README's counts and tables

def test_the_readme_counts_are_the_registries():
    import argparse

    import config
    import losses

    opening = read("README.md").split("\n\n")[1]
    said = {what: NUMBERS[re.search(rf"(\w+) {what}", opening).group(1)]
            for what in ("losses", "SDE steps", "model families")}
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    sde_steps = next(a.choices for a in parser._actions if "--sde" in a.option_strings)
    family_files = [f for f in os.listdir(os.path.join(ROOT, "families"))
                    if f.endswith(".py") and f not in ("__init__.py", "common.py")]
    assert said == {"losses": len(losses.LOSSES), "SDE steps": len(sde_steps), "model families": len(family_files)}


def test_the_readme_names_every_loss_model_and_reward():
    import losses
    import models
    import rewards

    readme = read("README.md")
    algorithms = re.findall(r"^\| `(\w+)` \|", section(readme, "Algorithms"), re.M)
    assert algorithms == list(losses.LOSSES)  # a row per loss, in the registry's order
    shown = set(re.findall(r"`([\w.-]+)`", section(readme, "Models")))
    assert [name for name in models.MODELS if not name.startswith("tiny-") and name not in shown] == []
    shown = set(re.findall(r"`(\w+)`", section(readme, "Rewards")))
    assert [name for name in rewards.REWARDS if re.sub(r"_\d+$", "", name) not in shown] == []  # shapes_proxy_N


# ----------------------------------------------------------------------------- the modules' manuals

def signatures(path, cls):
    """{method: inspect.Signature without self} of a class, and the attributes its methods set, from its source."""
    node = next(n for n in ast.parse(read(path)).body if isinstance(n, ast.ClassDef) and n.name == cls)
    methods, attributes = {}, set()
    for f in node.body:
        if isinstance(f, ast.FunctionDef):
            a = f.args
            positional = a.posonlyargs + a.args
            defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
            kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
            params = [inspect.Parameter(p.arg, kind, **({} if d is None else {"default": d}))
                      for p, d in zip(positional, defaults)][1:]
            params += [inspect.Parameter(p.arg, inspect.Parameter.KEYWORD_ONLY, **({} if d is None else {"default": d}))
                       for p, d in zip(a.kwonlyargs, a.kw_defaults)]
            methods[f.name] = inspect.Signature(params)
            attributes |= {t.attr for n in ast.walk(f) for t in getattr(n, "targets", [])
                           if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return methods, attributes


def calls(text, name):
    """[(attribute or None, the call's argument text or None)] of `name.attr(...)`, `name.attr` and `Name(...)`."""
    found = []
    for m in re.finditer(rf"\b{name}(?:\.(\w+))?(\()?", text, re.I):
        if m.group(1) is None and not m.group(2):
            continue
        args = None
        if m.group(2):  # the balanced parentheses
            depth, end = 0, m.end() - 1
            for end in range(m.end() - 1, len(text)):
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                if depth == 0:
                    break
            args = text[m.end() - 1:end + 1]
        found.append((m.group(1), args))
    return found


@pytest.mark.parametrize("path, cls, name", [("policy.py", "Policy", "policy"), ("run.py", "Run", "run")])
def test_a_modules_manual_calls_what_its_class_takes(path, cls, name):
    """Every `policy.method(...)` line of policy.py's docstring (run.py's likewise) binds to the method's signature,
    the constructor line to __init__'s, and every attribute it names exists."""
    methods, attributes = signatures(path, cls)
    manual = ast.get_docstring(ast.parse(read(path)))
    problems = []
    for attr, args in calls(manual, name):
        method = "__init__" if attr is None else attr
        if args is None:
            if attr not in methods and attr not in attributes:
                problems.append(f"{name}.{attr}: no such method or attribute")
            continue
        call = ast.parse(f"f{args}", mode="eval").body
        try:
            methods[method].bind(*call.args, **{k.arg: k.value for k in call.keywords})
        except (KeyError, TypeError) as e:
            problems.append(f"{name}.{attr or cls}{args}: {e!r}")
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------- --print-config

def test_print_config_marks_what_the_loss_does_not_read():
    """The default run (DiffusionNFT) samples with --sampler: the report still lists the model preset's --sde and
    --eta, saying that this loss ignores them; under --loss grpo they are read, and not marked."""
    out = subprocess.run([sys.executable, "train.py", "--print-config"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.startswith("--")}
    assert lines["--loss"].split("#")[0].split() == ["--loss", "nft"]
    for flag in ("--sde", "--eta", "--sde-window"):
        assert lines[flag].endswith(", unused by --loss nft"), lines[flag]
    assert lines["--sampler"].split("#")[1].strip() == "loss default (nft)"  # what it samples with instead

    import config

    p, args = config.parse_args(["--loss", "grpo"])
    marked = [line for line in config.report(p, args).splitlines() if "unused" in line]
    assert marked == []


# ----------------------------------------------------------------------------- the test runner

PROBE = '''
import json, os

def pytest_configure(config):
    o = config.option
    with open(os.environ["PROBE_OUT"], "w") as f:
        json.dump({"xdist": config.pluginmanager.hasplugin("xdist"), "numprocesses": getattr(o, "numprocesses", None),
                   "dist": getattr(o, "dist", None), "reorder": getattr(o, "loadscopereorder", None)}, f)
'''


def test_the_suite_runs_with_xdist_by_default_and_without_it(tmp_path):
    """pytest.ini holds no xdist flag (under -p no:xdist pytest would refuse `-n auto` as unknown); tests/conftest.py
    adds them where xdist is loaded. A plugin written here reads the options pytest settled on."""
    (tmp_path / "probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "FLOW_RL_TEST"))}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               PROBE_OUT=str(tmp_path / "options.json"))

    def pytest(*flags):
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "probe", *flags, "tests/test_docs.py", "-k",
                              "puts_every_module"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        return out, json.loads((tmp_path / "options.json").read_text())

    out, options = pytest("-p", "no:xdist")
    assert out.returncode == 0 and re.search(r"^1 passed", out.stdout, re.M), out.stdout + out.stderr
    assert options == {"xdist": False, "numprocesses": None, "dist": None, "reorder": None}
    out, options = pytest("--collect-only")  # the default command's settings, without starting workers
    assert out.returncode == 0, out.stdout + out.stderr
    assert options == {"xdist": True, "numprocesses": min(8, (os.cpu_count() or 1) + 1), "dist": "loadfile",
                       "reorder": False}
    out, options = pytest("--collect-only", "-n", "0")  # a -n given is kept
    assert options["numprocesses"] == 0 and options["dist"] == "no"
