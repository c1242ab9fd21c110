"""The loop as components: program, fit and eval loops, reporter, stop policy, hooks."""
