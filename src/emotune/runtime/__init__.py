"""Where the work runs: device and precision, out-of-memory detection, telemetry, several processes."""
