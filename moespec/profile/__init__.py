"""`moespec profile`: strategies side by side on one deterministic token trace.

trace.py (the token trace and the exact run) → run.py (cold starts, warm-up, repeats) with
probes.py (layer timer, copy log) → bounds.py (on-demand and overlap floor) → report.py (JSON,
schema.py) → render.py (Rich tables), plot.py (PNG), chrome_trace.py (one decode step).
"""
