"""Token start: the new token's first MoE layer predicted and prefetched before its first layer runs.

Shapes: T tokens, H hidden, K top-k.

Prediction inside the layers is from layer l for l+1 (prefetcher.py), so the first MoE layer of
every token was never predicted: its copies started only when its router ran, after the embedding
and the first attention, and the link (or the disk) idled across the token boundary. The new token
is known when its forward starts (issue 29): its quasi-hidden state at the first MoE layer is

    q = e_t + a        (e_t the token's embedding row; a the default vector of what runs before
                        that layer's MoE: the mean of r_first - e over every token run so far)

and ``predictor.predict_first(q)`` (the first layer's router on LN(q); predict/base.py) is the
prediction, prefetched through the ledger as any other (the prefetch takes the slot its demand miss
would take: slots.py's rule) under the per-layer prediction gate, keyed ``TOKEN_START`` (gate.py),
so it stops where it does not pay (every expert resident: nothing to copy) and probes back.

On the default model's generated text (scripts/next_token_recall.py, 128 greedy tokens) the recall@4
of this state is 0.875 (teacher-forced text 0.939), against 0.625 for the embedding alone, 0.631
for the first router on the previous token's final hidden state and 0.248 for the previous token's
own first-layer set. ``a`` needs no calibration file: the prefill measures it (the mean over the
prompt's tokens) and every later token adds to it.
"""

from __future__ import annotations

import torch

TOKEN_START = -1  # the gate's key for the token-start prediction (it is no layer's l -> l+1)


class TokenStart:
    """The default vector ``a`` of the first MoE layer (module docstring) and the token's embedding.

    Args:
        first: the first MoE layer's decoder index.
    """

    def __init__(self, first: int) -> None:
        self.first = first
        self._sum: torch.Tensor | None = None  # [H] float32, sum over tokens of r_first - e
        self._n = 0
        self._embedded: torch.Tensor | None = None  # [T, H], the running forward's embedding rows

    def started(self, embedded: torch.Tensor) -> None:
        """A forward starts with the tokens whose embedding rows are ``embedded`` [T, H]."""
        self._embedded = embedded

    def clear(self) -> None:
        """Forget the running forward's embedding rows (a forward ended or was abandoned)."""
        self._embedded = None

    def reset(self) -> None:
        """Forget the measured default vector too (eval's cold start: a guarded score depends on what
        is resident, so on what the token start prefetched, so on ``a``: an item's score must not
        depend on the items before it)."""
        self._sum, self._n, self._embedded = None, 0, None

    def state(self) -> torch.Tensor | None:
        """q = e + a [T, H] in the embedding's dtype (e alone before any token ran; None: not started)."""
        e = self._embedded
        if e is None or self._sum is None:
            return e
        return (e.float() + self._sum / self._n).to(e.dtype)

    def observe(self, layer: int, residual: torch.Tensor | None) -> None:
        """``layer`` runs with residual r [.., H]: at the first MoE layer, r - e joins the average."""
        e = self._embedded
        if layer != self.first or residual is None or e is None:
            return
        r = residual.reshape(-1, residual.shape[-1])  # [T, H]
        if r.shape != e.shape:  # a forward whose rows are not the started tokens': not measured
            return
        d = (r.float() - e.float()).sum(dim=0)  # [H]
        self._sum = d if self._sum is None else self._sum + d
        self._n += r.shape[0]
        self._embedded = None  # measured once per forward
