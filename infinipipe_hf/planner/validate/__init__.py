"""Plans checked before they run: coverage, order, pairing, memory, SP sub-group rounds."""
