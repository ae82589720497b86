"""`moespec eval`: task accuracy per execution mode and predictor (the paper's quality table, any model).

tasks.py / data.py: which tasks exist and their request files; score.py: choice log-likelihoods through
the decode path; metrics.py: lm-eval's per-item metrics; arms.py: execution mode × predictor and switching
a loaded model between them; run.py: every arm on the same items; results.py: resumable per-arm files;
stats.py / report.py / table.py: intervals, paired tests, JSON and the table. The lm-evaluation-harness
model ``moespec`` is moespec/harness/ (it stands above the command line).
"""
