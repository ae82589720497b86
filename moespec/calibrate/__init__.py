"""Offline calibration: default vectors d_{l,e}, expert frequencies and per-layer predictor recall.

data.py reads text and cuts it into token chunks; collect.py accumulates default vectors and
frequencies from the runtime's observer hook; recall.py measures predictors on held-out tokens;
file.py reads and writes the calibration file; locate.py says where it lives; run.py ties them
together through the offloading runtime (exact mode, chunks as prefill passes).
"""
