"""lowvram's Triton kernels, installed as ``lowvram.kernels``.

This folder sits at the repository's top level, so wherever the checkout's root is on
``sys.path`` (``python -m pytest`` or ``python -m lowvram`` run there, a notebook started
there) Python would also find it as a top-level ``kernels`` package, and that name belongs
to Hugging Face's ``kernels`` package, which transformers imports. Imported under that
name, this module hands the import on to the ``kernels`` the rest of ``sys.path`` holds.
Where there is none, it stays what Python makes of a folder without an ``__init__.py``:
an empty namespace module with no ``__file__``, which is how transformers tells a stray
folder on ``sys.path`` from an installed package. Nothing of this repository is
importable as ``kernels``.
"""

if __name__ != "lowvram.kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _checkout = os.path.realpath(os.path.join(os.path.dirname(__file__), os.pardir))
    _elsewhere = [p for p in sys.path if os.path.realpath(p or os.curdir) != _checkout]
    _spec = importlib.machinery.PathFinder.find_spec(__name__, _elsewhere)
    if _spec is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules[__name__] = _module  # the import statement returns what sys.modules holds
        _spec.loader.exec_module(_module)
    else:
        __path__ = []
        __doc__ = None
        del __file__, __cached__
    del importlib, os, sys, _checkout, _elsewhere, _spec
