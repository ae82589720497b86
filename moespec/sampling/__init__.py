"""Logits processing between the model and the sampler: what OpenAI-style requests ask for.

Shapes: V vocabulary (the model's logits length).

The Engine samples each token from float32 logits [V]; a ``TokenControls`` (controls.py) is the
optional processor it applies first: presence/frequency penalties and logit_bias as OpenAI
defines them, then a grammar's token mask (grammar.py, llguidance), and it records each sampled
token's log-probabilities (logprobs.py) from the very logits it returned. Nothing here knows
about HTTP; `moespec serve` builds one per generation.
"""
