"""mfuwatch's bootstrap, put on ``PYTHONPATH`` by ``mfuwatch run`` (and by the Slurm/Kubernetes snippets).

Python imports ``sitecustomize`` once at start-up, from the first directory of ``sys.path``
that holds one; this directory holds only this file. It does two things and imports nothing
heavy:

1. unless ``MFUWATCH_DISABLE`` is set (``1``/``true``/``yes``/``on``), it waits for ``torch`` to
   be imported (a one-shot finder at the head of ``sys.meta_path``; a process that never imports
   torch never runs anything else of mfuwatch), appends ``$MFUWATCH_PYTHONPATH`` (where mfuwatch
   was installed apart from the job's Python) to the end of ``sys.path``, and then hands over to
   :func:`mfuwatch.agent.attach.attacher.install`, which registers torch's global optimizer
   step post-hook (the agent attaches at the first optimizer step);
2. it imports the ``sitecustomize`` this one shadows (the next one on ``sys.path``, e.g.
   Debian's ``/usr/lib/python3.X/sitecustomize.py`` or a virtual environment's), so whatever
   the job's Python did at start-up it still does.

Nothing here may stop the job: every failure of mfuwatch's part is one warning on stderr.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_OFF = ("1", "true", "yes", "on")


def _warn(what):
    try:
        sys.stderr.write(f"mfuwatch: {what}; this process runs unmonitored\n")
    except Exception:  # noqa: BLE001
        pass


def _add_fallback_path():
    """Append ``$MFUWATCH_PYTHONPATH``'s directories to ``sys.path``, after site-packages: where mfuwatch and its
    dependencies were installed apart from the job's Python (``pip install --target``, the Kubernetes
    initContainer). Put on ``PYTHONPATH`` instead they would come first and shadow the job's own versions
    of the packages they share (pyyaml, requests, rich, ...); appended, the job's own win."""
    for d in os.environ.get("MFUWATCH_PYTHONPATH", "").split(os.pathsep):
        if d and d not in sys.path:
            sys.path.append(d)


def _torch_imported():
    _add_fallback_path()
    try:
        from mfuwatch.agent.attach.attacher import install
    except Exception as exc:  # noqa: BLE001 - e.g. another interpreter that has no mfuwatch
        _warn(f"cannot import mfuwatch in {sys.executable} ({type(exc).__name__}: {exc})")
        return
    try:
        install()
    except Exception as exc:  # noqa: BLE001
        _warn(f"attach set-up failed ({type(exc).__name__}: {exc})")


class _TorchFinder:
    """A meta-path finder that finds nothing itself: for ``torch`` it lets the other finders find it and
    wraps the loader's ``exec_module`` so that :func:`_torch_imported` runs once torch's module has run.

    It leaves ``sys.meta_path`` only when torch is really imported: ``importlib.util.find_spec("torch")``
    alone (libraries probe for torch that way, transformers among them) executes nothing.
    """

    _busy = False

    def find_spec(self, name, path=None, target=None):
        if name != "torch" or self._busy:
            return None
        import importlib.util

        self._busy = True
        try:
            spec = importlib.util.find_spec("torch")
        except Exception:  # noqa: BLE001 - let the real import report it
            return None
        finally:
            self._busy = False
        loader = getattr(spec, "loader", None)
        run = getattr(loader, "exec_module", None)
        if run is None:
            return spec
        finder = self

        def exec_module(module):
            try:
                sys.meta_path.remove(finder)
            except ValueError:
                pass
            run(module)
            _torch_imported()

        try:
            loader.exec_module = exec_module
        except Exception:  # noqa: BLE001
            return spec
        return spec


def _install():
    if os.environ.get("MFUWATCH_DISABLE", "").strip().lower() in _OFF:
        return
    if "torch" in sys.modules:
        _torch_imported()
    else:
        sys.meta_path.insert(0, _TorchFinder())


def _chain():
    """Import the ``sitecustomize`` this file shadows; ours stays ``sys.modules['sitecustomize']``."""
    ours = sys.modules.get(__name__)
    saved = list(sys.path)
    try:
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
        sys.modules.pop(__name__, None)
        import importlib

        try:
            importlib.import_module("sitecustomize")
        except ImportError as exc:
            if exc.name != "sitecustomize":
                raise
    finally:
        sys.path[:] = saved
        if ours is not None:
            sys.modules[__name__] = ours


try:
    _install()
except Exception as _exc:  # noqa: BLE001
    _warn(f"bootstrap failed ({type(_exc).__name__}: {_exc})")
_chain()
