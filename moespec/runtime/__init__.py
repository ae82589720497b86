"""The offloading runtime: expert store, expert cache, transfer engine, MoE block, engine, stats.

Nothing here imports Rich or the CLI; only `transfer.py` touches CUDA streams and events.
"""
