"""Distilled router estimators (`moespec train-estimator`) and the per-layer hybrid choice.

model (the network), collect (states to disk in shards), train (KL distillation), hybrid (the per-layer
choice by recall, margin and cost), file (the estimator file), run (the pipeline the command drives).
The runtime side is ``moespec.predict.estimator``.
"""
