"""What a job should do: pure functions of a Snapshot, a session's history and the Config."""
