"""hedgepub._hedging."""
