"""Watching a served model: the reference profile an export writes (`profile`), the drift arithmetic (`drift`: the
signals, their distances, thresholds and the accuracy estimate; numpy and the standard library only) and the
sequential verdict between two models (`ab`, likewise), the server's live window (`live`), the batch monitor of a
file (`batch`: `torchloom monitor`), the comparison of two models on a labelled file (`compare`) and the
Prometheus rules with the Grafana dashboard (`alerting`: `torchloom monitor rules`).

Nothing here imports serve/ (the server imports the live window), train/ or etl/.
"""
