"""lowvram's Triton kernels, installed as ``lowvram.kernels``.

This folder sits at the repository's top level, so wherever the checkout's root
is on ``sys.path`` (``python -m pytest`` or ``python -m lowvram`` run there, a
notebook started there) Python would also find it as a top-level ``kernels``
package, and that name belongs to Hugging Face's ``kernels`` package, which
transformers imports. Imported under that name, this module hands the import on
to whatever ``kernels`` the rest of ``sys.path`` holds, or fails as if this
folder were not there: nothing of this repository is importable as ``kernels``.
"""

if __name__ != "lowvram.kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _checkout = os.path.realpath(os.path.join(os.path.dirname(__file__), os.pardir))
    _elsewhere = [p for p in sys.path if os.path.realpath(p or os.curdir) != _checkout]
    _spec = importlib.machinery.PathFinder.find_spec(__name__, _elsewhere)
    if _spec is None:
        raise ModuleNotFoundError(f"No module named {__name__!r}", name=__name__)
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[__name__] = _module  # the import statement returns what sys.modules holds
    _spec.loader.exec_module(_module)
