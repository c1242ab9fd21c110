"""The compiled programs and the state they run on: `Program` (a fit's train
step, one batch or a group per dispatch), `CompiledSteps` (init, train, group,
evaluation and predict programs, their cost), `HeldState` (the placed train
state, metric accumulators, steps in flight, every edit of the state) and
`multistep` (several steps, or a resident dataset's gather, in one dispatch).
The loops drive them; nothing here knows a loop, a callback or the Trainer."""
