"""Distilled router estimators (`moespec train-estimator`) and the per-layer hybrid choice.

collect (states to disk in shards), train (KL distillation), hybrid (the per-layer choice by recall,
margin and cost), run (the pipeline the command drives). The network, the estimator file and where
it lives are below every reader: ``moespec.predict.estimator_net``, ``moespec.predict.estimator_file``
and ``moespec.artifacts``; the runtime side is ``moespec.predict.estimator``.
"""
