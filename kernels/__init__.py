"""lowvram's Triton kernels, installed as ``lowvram.kernels``.

Found from the checkout's root as a top-level ``kernels`` (Hugging Face's package name, which
transformers imports), it hands the import on to the ``kernels`` elsewhere on ``sys.path``, or
else stays an empty namespace module without ``__file__``, as transformers expects.
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
