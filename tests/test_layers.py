"""The modules stand in strict layers (docs/design.md): each imports only modules of lower layers, every project
import sits at the top of its module, and nothing imports in a circle. A new module must be given a layer here. A
package (families/, shapes/) is one module of its layer: each of its files imports only lower layers and its own files,
and those in no circle; a package's sub-folders are its files too, so nothing inside a package points up. The scripts
(scripts/) import project modules at their top."""
import ast
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = [
    ("flags", "sde", "advantages", "data", "distributed", "geneval"),  # the math and the plumbing below everything:
    # torch only
    ("losses", "checkpoints", "prompt_store", "shapes", "services", "reward_models"),  # losses and their registry; run
    # folders; the prompt-embedding store's files; the shapes world (the world, the edit world, the learned proxy of its
    # GenEval judge); reward-service HTTP; the neural reward models
    ("families", "reward_services"),  # the model families, a file each, and their registry (above the shapes world,
    # whose models two are); the rewards that ask a service
    ("models", "rewards", "diversity"),  # the model interface over every family; REWARDS; diversity
    ("policy", "eval", "regularizers", "roles"),  # the trained weights, their optimizer and copies; ODE evaluation,
    # grids, curves; what acts on every loss (GARDO's rules, the adaptive KL weight) and where train.py calls it; the
    # distillation losses' terms and their roles' updates
    ("run",),  # the life of a run: resume, logs, the reward wait, checkpoints, signals
    ("config",),  # the flags, their presets per model and loss, where each value comes from, the refusals
    ("train",),  # the algorithm
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def modules():
    """The root's .py files and its packages (a folder with an __init__.py)."""
    return sorted([f[:-3] for f in os.listdir(ROOT) if f.endswith(".py") and f != "conftest.py"] +
                  [d for d in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, d, "__init__.py"))])


def files(name):
    """[(path, what the layer messages call it)] of a module: its file, or every file of its package."""
    folder = os.path.join(ROOT, name)
    if not os.path.isdir(folder):
        return [(os.path.join(ROOT, f"{name}.py"), f"{name}.py")]
    return [(os.path.join(where, f), os.path.relpath(os.path.join(where, f), ROOT)) for where, _, names
            in sorted(os.walk(folder)) for f in sorted(names) if f.endswith(".py")]


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
        for path, shown in files(name):
            for line, imported, at_top in project_imports(path):
                if not at_top:
                    problems.append(f"{shown}:{line} imports {imported} inside a function or block")
                elif imported != name and LAYER[imported] >= LAYER[name]:  # a package's own files: below
                    problems.append(f"{shown}:{line} imports {imported} (layer {LAYER[imported]}) from layer "
                                    f"{LAYER[name]}: only lower layers")
    assert not problems, "\n".join(problems)


def package_imports(path, package):
    """The files of `package` that one of its files imports ("__init__" for the package itself)."""
    here = {f[:-3] for f in os.listdir(os.path.dirname(path)) if f.endswith(".py")}
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found |= {(a.name.split(".") + ["__init__"])[1] for a in node.names if a.name.split(".")[0] == package}
        elif isinstance(node, ast.ImportFrom) and (node.level == 1 or (node.module or "").split(".")[0] == package):
            parts = ([package] if node.level else []) + (node.module or "").split(".")
            parts = [p for p in parts if p]
            if len(parts) > 1:
                found.add(parts[1])  # from families.common import x
            else:
                found |= {a.name if a.name in here else "__init__" for a in node.names}  # from families import common
    return found


def circle(graph):
    """A list of nodes that import each other in a circle, or None."""
    done, path = set(), []

    def visit(node):
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        path.append(node)
        for other in sorted(graph.get(node, ())):
            found = visit(other)
            if found:
                return found
        path.pop()
        done.add(node)
        return None

    return next((c for c in (visit(n) for n in sorted(graph)) if c), None)


def test_a_package_imports_its_own_files_in_no_circle():
    packages = [name for name in modules() if os.path.isdir(os.path.join(ROOT, name))]
    assert {"families", "shapes"} <= set(packages)
    for name in packages:
        graph = {os.path.basename(path)[:-3]: package_imports(path, name) for path, _ in files(name)}
        assert not circle(graph), f"{name}/ imports in a circle: {' -> '.join(circle(graph))}"


def test_scripts_import_project_modules_at_the_top():
    problems = [f"{where}/{f}:{line} imports {imported} inside a function or block"
                for where in ("scripts",) for f in sorted(os.listdir(os.path.join(ROOT, where)))
                if f.endswith(".py")
                for line, imported, at_top in project_imports(os.path.join(ROOT, where, f)) if not at_top]
    assert not problems, "\n".join(problems)


def test_the_check_catches_an_upward_and_a_nested_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nimport train\n\ndef f():\n    import sde\n")
    found = project_imports(str(bad))
    assert (2, "train", True) in found and (5, "sde", False) in found
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from pkg import a\n")
    (package / "a.py").write_text("from pkg.b import f\n")
    (package / "b.py").write_text("import pkg\n")  # b needs the package, which imports a, which imports b
    graph = {f[:-3]: package_imports(str(package / f), "pkg") for f in ("__init__.py", "a.py", "b.py")}
    assert graph == {"__init__": {"a"}, "a": {"b"}, "b": {"__init__"}}
    assert circle(graph) == ["__init__", "a", "b", "__init__"] and circle(dict(graph, b=set())) is None


def test_no_function_of_the_root_modules_is_longer_than_80_lines():
    """A function reads in one screen: none of the root modules' over 80 lines, but the flag declaration lists
    (add_arguments), which read as tables."""
    import ast
    import glob

    long = []
    for path in sorted(glob.glob(os.path.join(ROOT, "*.py"))):
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name != "add_arguments":
                if node.end_lineno - node.lineno + 1 > 80:
                    long.append(f"{os.path.basename(path)}:{node.lineno} {node.name}")
    assert not long, long


def test_a_package_sub_folder_is_checked(tmp_path, monkeypatch):
    """A script in a package's sub-folder (shapes/scripts/ once held seven that import train.py) is one of the
    package's files, so an upward import there is found."""
    (tmp_path / "shapes" / "scripts").mkdir(parents=True)
    (tmp_path / "shapes" / "__init__.py").write_text("")
    (tmp_path / "shapes" / "scripts" / "league.py").write_text("import train\n")
    (tmp_path / "train.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    assert [shown for _, shown in files("shapes")] == ["shapes/__init__.py", "shapes/scripts/league.py"]
    with pytest.raises(AssertionError, match=r"shapes/scripts/league.py:1 imports train \(layer \d+\) from layer 1"):
        test_imports_point_down_and_sit_at_the_top()
