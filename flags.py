"""Command-line plumbing shared by the scripts: @recipe files and flag types that refuse bad values in one line.

    RecipeParser                          argparse with @recipe files (shell quoting, several flags a line, # comments);
                                          .given(): where each option named came from (command line, recipe:line)
    bounded(cast, low, high, ...)         a flag type: an int, or a float within an interval and float32's range
    POSITIVE_INT, NONNEG_INT, POSITIVE, NONNEG, FRACTION, SEED
    resolution_arg                        --resolution: a side, or HEIGHTxWIDTH
    unwritable(path, example)             why a file could not be written at path at the end of a run, or None
    shipped(path)                         a relative path that is not here, taken from the repository (weights/, prompts/)
    preset_help(shown, keys)              --help showing each preset's value of a flag whose default is a preset's

Every refusal is argparse's own one-line `error:`, before anything is loaded. The same checks for options passed as
keywords (rewards.build_reward, whose options may come from code rather than the command line):

    integer(value, low, name), real(value, name, minimum=, positive=), show(value)   one-line ValueErrors
    import_object(path, flag)             what a flag names as module.name (the working folder first) or file.py:name
                                          (runs that code, and prints the file's path)
"""
import argparse
import math
import os
import reprlib
import shlex

import numpy as np


MAX_RECIPE_BYTES = 1 << 20  # a file of flags; anything larger is not a recipe


class RecipeParser(argparse.ArgumentParser):
    """argparse with @recipe files: shell-quoted flags, several per line, '#' starts a comment."""

    def convert_arg_line_to_args(self, line):
        try:
            return shlex.split(line, comments=True)
        except ValueError as e:  # unbalanced quotes
            self.error(f"recipe line {line.strip()!r}: {e}")

    def _read_args_from_files(self, arg_strings, origins=None):
        """argparse's reader of @files, each checked before it is read whole, that also keeps where each argument came
        from ("command line", or "<recipe>:<line>") for `given`."""
        origins = origins or ["command line"] * len(arg_strings)
        out, out_origins = [], []
        for arg, origin in zip(arg_strings, origins):
            if not arg or arg[0] not in (self.fromfile_prefix_chars or ""):
                out.append(arg)
                out_origins.append(origin)
                continue
            if os.path.exists(arg[1:]):
                self._check_recipe(arg[1:])
            try:
                with open(arg[1:], encoding="utf-8") as f:  # UTF-8, less the byte-order mark some editors write, at
                    lines = [line.lstrip("\ufeff") for line in f.read().splitlines()]  # a line's start (cat a b)
            except OSError as err:
                self.error(str(err))
            tokens = [(token, f"{arg[1:]}:{n}") for n, line in enumerate(lines, 1)
                      for token in self.convert_arg_line_to_args(line)]
            out += self._read_args_from_files([t for t, _ in tokens], [o for _, o in tokens])
            out_origins += self._origins
        self._arguments, self._origins = out, out_origins
        return out

    def given(self):
        """{dest: where its value came from} for every option the last parse named: "command line" or "<recipe>:<line>"
        of its last occurrence (the one argparse keeps)."""
        out = {}
        for token, origin in zip(getattr(self, "_arguments", []), getattr(self, "_origins", [])):
            if not token.startswith("--"):
                continue
            name = token.split("=", 1)[0]
            actions = {id(a): a for s, a in self._option_string_actions.items() if s == name} or \
                {id(a): a for s, a in self._option_string_actions.items() if s.startswith(name)}  # an abbreviation
            if len(actions) == 1:
                out[next(iter(actions.values())).dest] = origin
        return out

    def _check_recipe(self, path):
        """A recipe is a small text file: a device, a pipe, a huge or binary file is refused before it is read."""
        if not os.path.isfile(path):
            self.error(f"recipe @{path} is not a regular file; pass a text file of flags")
        if os.path.getsize(path) > MAX_RECIPE_BYTES:
            self.error(f"recipe @{path} has {os.path.getsize(path)} bytes, more than the {MAX_RECIPE_BYTES >> 10} KiB "
                       "of a file of flags; pass a text file of flags")
        with open(path, "rb") as f:
            if b"\x00" in f.read():
                self.error(f"recipe @{path} holds NUL bytes (a binary or UTF-16 file), not UTF-8 text; re-save it "
                           "as UTF-8")

    def parse_args(self, args=None, namespace=None):
        try:
            return super().parse_args(args, namespace)
        except UnicodeDecodeError as e:
            self.error(f"a recipe file is not UTF-8 text ({e.reason} at byte {e.start}); re-save it as UTF-8")
        except RecursionError:
            self.error("a recipe file includes itself (an @file line that leads back to it)")


FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max: a flag's float beyond it is inf in a loss


def bounded(cast, low=None, high=None, *, low_open=False, high_open=False):
    """An argparse type: int or finite float within [low, high] (either end open or absent), with a one-line error."""
    what = "an integer" if cast is int else "a number"
    interval = ("(" if low_open else "[") + ("-inf" if low is None else str(low)) + ", " + \
               ("inf" if high is None else str(high)) + (")" if high_open or high is None else "]")

    def parse(text):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value) or (low is not None and (value < low or (low_open and value == low))) or \
                (high is not None and (value > high or (high_open and value == high))):
            raise argparse.ArgumentTypeError(f"must be {what} in {interval}, got {text}")
        if cast is float and abs(value) > FLOAT32_MAX:  # --kl-beta 1e300: inf in the loss, every gradient NaN
            raise argparse.ArgumentTypeError(f"must be {what} in {interval} that float32 holds (at most "
                                             f"{FLOAT32_MAX:.3g}: the losses and rewards compute in it), got {text}")
        return value
    return parse


POSITIVE_INT, NONNEG_INT = bounded(int, 1), bounded(int, 0)
POSITIVE, NONNEG = bounded(float, 0, low_open=True), bounded(float, 0)
FRACTION = bounded(float, 0, 1, low_open=True)  # (0, 1]
SEED = bounded(int, 0, 2**32 - 1)  # numpy's seed range


def resolution_arg(text):
    """--resolution: a side in pixels, or HEIGHTxWIDTH (for models with unpacked latents: sd3, wan, z-image)."""
    try:
        sides = [int(v) for v in text.lower().split("x")]
    except ValueError:
        sides = []
    if len(sides) not in (1, 2) or min(sides) <= 0:
        raise argparse.ArgumentTypeError(f"--resolution takes a side or HEIGHTxWIDTH in pixels, e.g. 512 or 240x416, "
                                         f"got {text!r}")
    return sides[0] if len(sides) == 1 else tuple(sides)


def shipped(path):
    """`path`, or the repository's file of that relative name when the path does not exist from the working directory:
    the weights and prompt files the repository ships are found from any folder."""
    if os.path.isabs(path) or os.path.exists(path):
        return path
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), path)


def unwritable(path, example):
    """Why a file could not be written at `path` at the end of a run (checked before the work it holds), or None.
    Missing folders are made then. example: a file name suggested when path is a folder."""
    if os.path.isdir(path):
        return "is a folder; name a file in it, e.g. " + os.path.join(path, example)
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):  # the nearest folder that exists: the rest is made at the end
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        return f"cannot be made: {folder} is not a folder; pick another path"
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        return f"cannot be written (no write permission in {folder}); pick another path"
    return None


def preset_help(shown, keys):
    """An argparse formatter: a flag whose default is None and whose dest is in `keys` (the flags a preset fills) shows
    the value each of `shown` ({name: {dest: value}}) gives it; one whose help says what unset means, only the help."""
    class PresetHelp(argparse.ArgumentDefaultsHelpFormatter):
        def _get_help_string(self, action):
            if action.default is None and action.dest in keys:
                values = ", ".join(f"{name} {values.get(action.dest, 'unset')}" for name, values in shown.items())
                return f"{action.help} (default by --model: {values})"
            if action.default is None and "default" in (action.help or ""):  # the help says what unset means
                return action.help
            return super()._get_help_string(action)
    return PresetHelp


# ----------------------------------------------------------------------------- options given as keywords
def show(value):
    """A short one-line picture of what a user function or config gave, for error messages."""
    return f"{type(value).__name__} {' '.join(reprlib.repr(value).split())}"


def integer(value, low, name):
    """`value` if it is an integer >= low, else a one-line error naming `name` (True and 1.5 are refused, not cast)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {show(value)}")
    return int(value)


def real(value, name, *, minimum=None, positive=False):
    """`value` as a float if it is a finite number (> 0 with `positive`, >= `minimum` if given), else an error
    naming `name`."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float, np.number)) and math.isfinite(value)
    if not ok or (positive and value <= 0) or (minimum is not None and value < minimum):
        bound = " > 0" if positive else f" >= {minimum:g}" if minimum is not None else ""
        raise ValueError(f"{name} must be a finite number{bound}, got {show(value)}")
    return float(value)


def import_object(path, flag):
    """`package.module.name`, searched in the working directory first, or `path/to/file.py:name`. Imports (so runs)
    that code, and says which file it came from. What cannot be imported, or fails as it is (a syntax error, an
    exception the module raises), is one ValueError line naming the flag and the file."""
    import importlib
    import importlib.util

    usage = "give module.name importable from the working directory, or path/to/file.py:name"
    if ":" not in path and "." not in path.strip("."):
        raise ValueError(f"{flag} {path!r} names no function in a module: {usage}")
    try:
        if ":" in path:
            file, name = path.rsplit(":", 1)
            if not os.path.isfile(file) or not file.endswith(".py"):
                what = "a folder" if os.path.isdir(file) else "not a Python file (.py)" if os.path.exists(file) \
                    else "not found"
                raise ValueError(f"{flag} {path!r}: {file or 'the part before the colon'} is {what}: {usage}")
            spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(file))[0], file)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module_name, name = path.rsplit(".", 1)
            module = _import_here_first(module_name, flag, path)
        found = getattr(module, name)
    except SyntaxError as err:  # IndentationError too: the file is not Python as written
        raise ValueError(f"{flag} {path!r}: {err.filename} line {err.lineno} is not valid Python "
                         f"({type(err).__name__}: {err.msg}); fix the file") from None
    except (ImportError, AttributeError, ValueError, OSError) as err:
        if str(err).startswith(flag):  # already one line naming the flag
            raise
        raise ValueError(f"{flag} {path!r}: cannot import it ({type(err).__name__}: {err}); {usage}") from err
    except SystemExit as err:  # the module calls sys.exit when imported: the run would end there, with its code
        if isinstance(err.code, str):  # an exit with its own message (run.py's one line for a Ctrl-C meanwhile)
            raise
        raise ValueError(f"{flag} {path!r}: importing it called sys.exit({err.code!r}); remove that call (or put it "
                         "under `if __name__ == '__main__':`)") from None
    except Exception as err:  # the module's own code raised as it was imported
        raise ValueError(f"{flag} {path!r}: importing it raised {type(err).__name__}: "
                         f"{' '.join(str(err).split())[:300]}; fix the module") from None
    if os.environ.get("RANK", "0") == "0":  # the run's log names the code it runs
        print(f"{flag} {path}: {os.path.abspath(getattr(module, '__file__', None) or module.__name__)}", flush=True)
    return found


def _import_here_first(module_name, flag, path):
    """import_module(module_name) with the working directory searched first: `python train.py` puts the script's
    folder, not the working directory, at the head of sys.path, so a file there of the same name would win. A
    module of that name that this program imported already (one of its own, say data.py) cannot be replaced: refused."""
    import importlib
    import sys

    here, top = os.getcwd(), module_name.split(".")[0]
    local = [f for f in (os.path.join(here, top + ".py"), os.path.join(here, top, "__init__.py")) if os.path.isfile(f)]
    loaded = getattr(sys.modules.get(top), "__file__", None)
    if local and loaded and os.path.dirname(os.path.abspath(loaded)) not in (here, os.path.join(here, top)):
        raise ValueError(f"{flag} {path!r}: {local[0]} has the name of a module already imported from {loaded}; "
                         f"rename your file")
    sys.path.insert(0, here)
    importlib.invalidate_caches()  # a file written since the start of the program
    try:
        return importlib.import_module(module_name)
    finally:
        sys.path.remove(here)  # the first occurrence: ours
