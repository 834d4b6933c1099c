"""aiacc.torch: not written yet (see the issue tracker)."""
