"""moespec: run Mixture-of-Experts language models with experts offloaded to host memory.

Experts live in a packed host store; a bounded device-side expert cache holds what the running
and the next layer need; the next layer's experts are predicted from the current layer's state
(arXiv 2603.19289) and copied ahead on a separate stream so that transfers overlap compute.
"""

__version__ = "0.1.0"
