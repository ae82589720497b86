"""lm-evaluation-harness's side of moespec: the lm-eval model ``moespec`` (model.py) and the
``moespec-lm-eval`` command (main.py).

It sits above the command line (it builds its runtime options with moespec/cli's own parsers), and
nothing in moespec imports it; lm-eval is an optional dependency (``pip install "moespec[eval]"``),
so importing this package imports no lm-eval: ``import moespec.harness.model`` registers the model.
"""
