"""lowvram's Triton kernels, installed as ``lowvram.kernels``.

Run from the checkout's root, Python also finds this folder as a top-level ``kernels``, a name
that belongs to Hugging Face's ``kernels`` package (which transformers imports). Imported under
that name it hands the import on to the ``kernels`` elsewhere on ``sys.path``, or, where there is
none, stays an empty namespace module without ``__file__``, as transformers expects of a stray
folder.
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
