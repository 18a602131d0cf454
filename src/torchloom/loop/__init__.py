"""`torchloom loop` (issue 76): the controller that turns what a served fleet sees into a better model, and never
into a worse one without a verdict. It watches the fleet (its /v1/monitor, its prediction log), and on a trigger
retrains the champion's recorded recipe on a pinned snapshot, then takes the candidate through its gates, a
shadow and a canary ramp, and promotes it or rolls it back; every step is an event in the log's `tl_events`.

    triggers.py    when to retrain: labels, drift, the estimated accuracy, a schedule, an alert (cooldown, limit)
    snapshot.py    the pinned data: the champion's prepared splits plus the labels fed back up to a watermark
    candidate.py   the champion's recipe (its run's config) run on the snapshot
    gates.py       the statistics: paired non-inferiority, per-class harm, agreement, the canary's verdict
    server.py      the fleet's admin route, as the loop uses it
    controller.py  the state machine, one step at a time, its state read back from the events
    history.py     the events as a table (`torchloom loop history`)
"""
