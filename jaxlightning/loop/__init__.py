"""The order of events and how the parts are put together: `TrainerArgs`
(``args``) and `wire` (``wiring``), `FitRun`, `FitLoop`, `EvalLoop`, the
state points and their subscribers, hooks, stages, the stop policy and
signals, validation timing, resume, and the `StateEditor` callbacks edit a
running fit through."""
