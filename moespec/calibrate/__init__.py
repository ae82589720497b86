"""Offline calibration (`moespec calibrate`): default vectors d_{l,e}, expert frequencies and per-layer
predictor recall.

data.py reads text and cuts it into token chunks; collect.py accumulates default vectors and
frequencies from the runtime's observer hook; policy_report.py replays the held-out routing through
the expert cache per policy; run.py ties them together through the offloading runtime (exact mode,
chunks as prefill passes: moespec.runtime.chunks). The file it writes and where it lives are below
every reader: moespec.predict.calibration_file and moespec.artifacts; recall scoring is
moespec.predict.recall.
"""
