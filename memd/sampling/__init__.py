"""What the machine looks like now. Knows nothing of sessions or policy; every platform
difference and every read error is contained here and becomes a value in a Snapshot."""
