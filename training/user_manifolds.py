"""--manifold-module: a researcher's own manifolds in the trainer's processes.

A manifold is a class and a `register_manifold` call (README, "Adding a manifold"). The trainer
knows it by name only once the module that registers it has been imported, and that must happen
in every process (torchrun starts fresh interpreters) before --assign is read. So each
--manifold-module MODULE_OR_FILE is imported by validate_args; a file is recorded by its absolute
path, and config.json keeps the list, so that `--resume auto` (or --resume PATH) imports the
same modules again without the flag. A module that is missing, raises, or registers no manifold
is one UserError naming it.
"""
import importlib
import importlib.util
import json
import os
import sys
import traceback

from errors import UserError
from manifolds.geometry import MANIFOLDS

_LOADED = set()  # the entries this process imported (a second import is a no-op)


def is_file(entry):
    """A path to a Python file (imported from there), not a dotted module name."""
    return entry.endswith(".py") or os.sep in entry or bool(os.altsep and os.altsep in entry)


def normalised(entry):
    """A file as its absolute path (a resume from another folder finds it again), a module name as given."""
    return os.path.abspath(entry) if is_file(entry) else entry


def import_manifold_modules(entries):
    """Import each --manifold-module entry (normalised) once; returns the normalised list."""
    done = []
    for entry in entries:
        entry = normalised(entry)
        if entry not in _LOADED:
            before, imported_before = set(MANIFOLDS), not is_file(entry) and entry in sys.modules
            load(entry)
            _LOADED.add(entry)
            if set(MANIFOLDS) == before and not imported_before:
                raise UserError(f"--manifold-module {entry}: importing it registered no manifold "
                                "(call manifolds.register_manifold(MyManifold()) at its top level)")
        if entry not in done:
            done.append(entry)
    return done


def load(entry):
    """Import one entry (a file by its path, else a module by its name); a UserError names a missing
    or broken one."""
    if is_file(entry):
        if not os.path.isfile(entry):
            raise UserError(f"--manifold-module {entry}: no such file")
        # a name of its own per path, so that two files called manifolds.py do not collide
        name = "user_manifold_" + "".join(c if c.isalnum() else "_" for c in entry)
        spec = importlib.util.spec_from_file_location(name, entry)
        module = sys.modules[name] = importlib.util.module_from_spec(spec)
        run = lambda: spec.loader.exec_module(module)  # noqa: E731
    else:
        if importlib.util.find_spec(entry.split(".")[0]) is None:
            raise UserError(f"--manifold-module {entry}: no module of that name on the Python path "
                            "(pass a file path such as ./my_manifold.py, or set PYTHONPATH)")
        name, run = None, lambda: importlib.import_module(entry)  # noqa: E731
    try:
        run()
    except UserError:
        raise
    except Exception as err:  # its own error, with the line in its file that raised it
        frame = traceback.extract_tb(err.__traceback__)[-1]
        sys.modules.pop(name, None)
        raise UserError(f"--manifold-module {entry} failed to import: {type(err).__name__}: {err} "
                        f"({frame.filename}, line {frame.lineno})") from None


def saved_manifold_modules(args):
    """The --manifold-module list of the run that --resume continues (its folder's config.json),
    or [] when there is none to read."""
    if not args.resume:
        return []
    if args.resume == "auto":
        folder = args.out_dir
    else:  # a checkpoint file or a ckpt_<step>.dcp folder inside its run's folder
        folder = os.path.dirname(os.path.abspath(args.resume.rstrip("/" + (os.altsep or ""))))
    try:
        with open(os.path.join(folder, "config.json")) as f:
            saved = json.load(f).get("manifold_module") or []
    except (OSError, ValueError, AttributeError):
        return []  # no config.json (or not ours): the checkpoint's own checks say what is wrong
    return [entry for entry in saved if isinstance(entry, str)]
