"""Fleet accounting: counters that add up across ranks, goodput, the hang watchdog, stragglers,
checkpoint timing, the `job` label and the validation of the fleet settings."""
