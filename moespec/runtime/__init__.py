"""The offloading runtime, laid out along an expert's bytes. Read it in this order:

1. host/      where experts live on the host: the packed store (one row per expert), pinned memory,
              the checkpoint read tensor by tensor, the quantised store kept on disk.
2. transfer/  host -> device copies of one row: the interface, the CPU thread engine, the CUDA engine.
3. stats.py   what each layer of each step did (hits, misses, bytes, stall), and a no-op recorder.
4. cache/     the device slots holding rows (a prefetch takes slots as a miss would), eviction rules,
              the replay of a routing trace through the same cache.
5. misses/    where a miss runs: fetched into a slot, or computed on the host pool from its row.
6. layer/     one MoE layer of a forward pass: the runner, the guard, the expert sums.
7. model.py   OffloadedModel: the model instance with its MoE blocks swapped, and what jobs may set.
8. load.py    load_offloaded: a checkpoint folder into an OffloadedModel.
9. engine.py  prefill and decode with a KV cache (kv.py), token ids only; chunks.py runs the
              independent prefill chunks the calibration jobs need.

Each part imports only the parts before it in this list (import-linter checks it). Nothing here
imports Rich or the CLI; only transfer/ touches CUDA streams and events.
"""
