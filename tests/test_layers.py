"""The modules stand in strict layers (DESIGN.md, "Layout"): each imports only modules of lower layers, every project
import sits at the top of its module, and nothing imports in a circle. A new module must be given a layer here."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = [
    ("flags", "sde", "data", "distributed", "geneval", "presets"),  # the math and the plumbing below
    # everything: torch only; the flag defaults per model and loss
    ("losses", "checkpoints", "families", "shapes", "services", "reward_models", "proxy"),  # losses and their
    # registry; run folders; the model-family adapters; the shapes world; reward-service HTTP; the neural reward models;
    # the learned proxy of the GenEval judge
    ("models", "rewards", "diversity"),  # the model interface over every family; REWARDS; diversity
    ("policy", "eval", "regularizers"),  # the trained weights, their optimizer and copies; ODE evaluation, grids,
    # curves; what acts on every loss (GARDO's rules, the adaptive KL weight) and where train.py calls it
    ("run",),  # the life of a run: resume, logs, the reward wait, checkpoints, signals
    ("train",),  # the algorithm
    ("bench",),  # tools on top of train.main (and scripts/, which may import anything)
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def modules():
    return sorted(f[:-3] for f in os.listdir(ROOT) if f.endswith(".py") and f != "conftest.py")


def project_imports(path):
    """[(line, imported project module, at the top level?)] of one file."""
    tree = ast.parse(open(path).read())
    top = {id(node) for node in tree.body}
    names = set(modules())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported = [node.module.split(".")[0]]
        else:
            continue
        found += [(node.lineno, name, id(node) in top) for name in imported if name in names]
    return found


def test_every_module_has_a_layer():
    assert set(modules()) <= set(LAYER), f"give these modules a layer in tests/test_layers.py: " \
                                         f"{sorted(set(modules()) - set(LAYER))}"


def test_imports_point_down_and_sit_at_the_top():
    problems = []
    for name in modules():
        for line, imported, at_top in project_imports(os.path.join(ROOT, f"{name}.py")):
            if not at_top:
                problems.append(f"{name}.py:{line} imports {imported} inside a function or block")
            elif LAYER[imported] >= LAYER[name]:
                problems.append(f"{name}.py:{line} imports {imported} (layer {LAYER[imported]}) from layer "
                                f"{LAYER[name]}: only lower layers")
    assert not problems, "\n".join(problems)


def test_scripts_import_project_modules_at_the_top():
    folder = os.path.join(ROOT, "scripts")
    problems = [f"scripts/{f}:{line} imports {imported} inside a function or block"
                for f in sorted(os.listdir(folder)) if f.endswith(".py")
                for line, imported, at_top in project_imports(os.path.join(folder, f)) if not at_top]
    assert not problems, "\n".join(problems)


def test_the_check_catches_an_upward_and_a_nested_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nimport train\n\ndef f():\n    import sde\n")
    found = project_imports(str(bad))
    assert (2, "train", True) in found and (5, "sde", False) in found
