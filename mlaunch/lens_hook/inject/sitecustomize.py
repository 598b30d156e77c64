"""mlaunch's live-capture hook for nemo-lens workers (see ``mlaunch/lens_hook/__init__.py``).

``mlaunch train --script/--module`` puts this folder first on the workers' ``PYTHONPATH``, so
Python's ``site`` imports this file at every interpreter start. It loads ``../capture.py`` by path
(the worker's interpreter may have no mlaunch), starts its watcher thread in a process that is a
rank of an mlaunch run, then runs the ``sitecustomize`` this one shadows, if any, as ``site`` would
have. Nothing here may stop the worker: a failure is one line on stderr.
"""


def _mlaunch_installed() -> None:
    # Python puts the script's directory (``python script.py``) or the current directory
    # (``python -m``) first on sys.path after this file ran. A folder named ``mlaunch`` there (the
    # folder holding a clone) would shadow the installed package, and the worker's
    # ``mlaunch.telemetry`` would fail to set up: then bind ``mlaunch`` to the installed package
    # now (its ``__init__`` imports only ``time``). The script still imports its own modules from
    # its directory. Without such a folder nothing is imported; an interpreter without mlaunch
    # (or with only such a folder) is left as it is.
    import os
    import sys

    try:
        first = sys.argv[0] if getattr(sys, "argv", None) else ""
        if sys.flags.safe_path:
            return
        path0 = (
            os.getcwd() if first in ("", "-c", "-m") else os.path.dirname(os.path.abspath(first))
        )
        if not os.path.isdir(os.path.join(path0, "mlaunch")):
            return
        import importlib
        import importlib.util

        spec = importlib.util.find_spec("mlaunch")
        if spec is not None and spec.origin is not None and spec.origin != "namespace":
            importlib.import_module("mlaunch")
    except Exception:  # never stops the worker: at worst the shadowing stays as Python has it
        pass


def _mlaunch_lens_hook() -> None:
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        import importlib.util

        path = os.path.join(os.path.dirname(here), "capture.py")
        spec = importlib.util.spec_from_file_location("_mlaunch_lens_capture", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        module.install()
    except Exception as exc:
        sys.stderr.write(
            f"mlaunch lens capture: hook not installed ({type(exc).__name__}: {exc})\n"
        )
    # Chain to the sitecustomize further along sys.path (a distribution's, a user's).
    try:
        from importlib.machinery import PathFinder

        rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
        spec = PathFinder.find_spec("sitecustomize", rest)
        if spec is not None and spec.loader is not None:
            import importlib.util

            chained = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(chained)
    except Exception as exc:  # what site.py does with a failing sitecustomize
        sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{exc!r}\n")


_mlaunch_installed()
_mlaunch_lens_hook()
del _mlaunch_installed, _mlaunch_lens_hook
