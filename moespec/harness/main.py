"""`moespec-lm-eval`: lm-evaluation-harness's command line with the ``moespec`` model registered.

Released lm-eval looks models up only in its own package, so ``lm_eval --model moespec`` cannot
find an outside model; this entry point registers it first and then hands every argument to lm-eval
unchanged (``moespec-lm-eval --model moespec --model_args pretrained=...,execute=guarded --tasks ...``).
"""

from __future__ import annotations

import sys


def main() -> None:
    """Console entry point (`moespec-lm-eval`)."""
    try:
        import lm_eval  # noqa: F401
    except ModuleNotFoundError:
        sys.stderr.write("error: moespec-lm-eval needs lm-evaluation-harness\n"
                         "hint: pip install \"moespec[eval]\"\n")
        raise SystemExit(2) from None
    import moespec.harness.model  # noqa: F401  (registers the model "moespec")
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
