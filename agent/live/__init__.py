"""The agent's live parts: the exporter's HTTP server, preemption (signal) handling and fork safety."""
