"""aiacc.keras: not written yet."""
