"""hora for tensorflow (being built; see the issue)."""
