"""Studies of one topic: see README.md here."""
