"""Architecture adapters: one small file per family, stating only how it differs.

Adapters never import the runtime; the runtime asks them how routing is computed, which layers
are MoE, what the shared (resident) parts are, and how experts are named on disk.
"""

from moespec.models.registry import adapter_for, supported_model_types

__all__ = ["adapter_for", "supported_model_types"]
