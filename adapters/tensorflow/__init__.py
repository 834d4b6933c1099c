"""aiacc.tensorflow: not written yet (see the issue tracker)."""
